"""Multi-head latent attention's decoding against multi-head attention's: cache size and ms per token at a long context.

    PYTHONPATH=src python scripts/bench_mla_decode.py [--context 16384] [--dim 1024] [--heads 16] [--head-dim 64]
        [--latent-dim 256] [--rope-dim 32] [--tokens 32] [--threads 1] [--output docs/results/mla-decode.json]

Two layers with the same query heads and head width, one ``MultiHeadAttention`` with the softmax mechanism (its KV
cache holds every head's keys and values) and one ``MultiHeadLatentAttention`` (its cache holds ``[c ; k_R]``,
latent_dim + rope_dim numbers per position; its steps absorb the up-projections). Each ``prefill``s the same
``context`` random positions (batch 1), then ``step``s ``tokens`` more, the two layers taking turns token by token
in one process so that machine noise falls on both: the median ms per token of each, and the bytes of each cache
after the steps (the positions in use; the caches also keep room for more, in blocks, alike). Writes JSON with the
command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnzoo import MultiHeadAttention, MultiHeadLatentAttention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--latent-dim", type=int, default=None, help="4 * head_dim by default")
    parser.add_argument("--rope-dim", type=int, default=None, help="head_dim / 2 by default")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = {
        "mha": MultiHeadAttention(args.dim, args.heads, head_dim=args.head_dim, bias=False),
        "mla": MultiHeadLatentAttention(args.dim, args.heads, head_dim=args.head_dim, latent_dim=args.latent_dim,
                                        rope_dim=args.rope_dim),
    }
    mla = layers["mla"]
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, args.context, args.dim, generator=generator)
    states, times = {}, {name: [] for name in layers}
    with torch.no_grad():
        for name, layer in layers.items():
            started = time.perf_counter()
            _, states[name] = layer.prefill(prompt)
            print(f"{name}: prefill of {args.context} positions in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        for _ in range(args.tokens):
            x_t = torch.randn(1, 1, args.dim, generator=generator)
            for name, layer in layers.items():
                started = time.perf_counter()
                _, states[name] = layer.step(x_t, states[name])
                times[name].append(1000 * (time.perf_counter() - started))
    length = args.context + args.tokens
    mha_cache = states["mha"].mechanism.tensors
    mha_numbers = sum(t[:, :, :length].numel() for name, t in mha_cache.items() if t.dim() > 1)
    mla_numbers = states["mla"].rows.numel()
    rows = {
        "mha": {"numbers_per_token": mha_numbers // length, "cache_mib": mha_numbers * 4 / 2**20,
                "ms_per_token": statistics.median(times["mha"])},
        "mla": {"numbers_per_token": mla_numbers // length, "cache_mib": mla_numbers * 4 / 2**20,
                "ms_per_token": statistics.median(times["mla"])},
    }
    result = {"command": " ".join(["python", *sys.argv]), "context": args.context, "dim": args.dim,
              "heads": args.heads, "head_dim": args.head_dim, "latent_dim": mla.latent_dim, "rope_dim": mla.rope_dim,
              "tokens": args.tokens, "threads": args.threads, "torch": torch.__version__, "rows": rows,
              "cache_ratio": rows["mha"]["numbers_per_token"] / rows["mla"]["numbers_per_token"],
              "time_ratio": rows["mla"]["ms_per_token"] / rows["mha"]["ms_per_token"]}
    print(json.dumps(result, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grouped-query decoding against full multi-head attention: KV cache size and ms per token at a long context.

    PYTHONPATH=src python scripts/bench_gqa_decode.py [--context 16384] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--tokens 32] [--threads 2] [--output docs/results/gqa-decode.json]

Builds the softmax mechanism's KV cache by ``prefill`` over ``context`` random positions (batch 1), once with as
many key/value heads as query heads (MHA) and once with ``kv_heads`` (GQA; the cache holds only those, the
queries of a group read their key/value head without a copy), then times ``step`` for ``tokens`` more
positions: the median ms per token over the steps, and the bytes of the cache after them. One process, the
two layouts taking turns token by token so that machine noise falls on both. Writes JSON with the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import attnzoo


def cache_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    mechanism = attnzoo.build_mechanism("softmax", args.heads, args.head_dim)

    def draw(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, args.head_dim, generator=generator)

    layouts = {"mha": args.heads, "gqa": args.kv_heads}
    states, times = {}, {name: [] for name in layouts}
    with torch.no_grad():
        for name, kv in layouts.items():
            started = time.perf_counter()
            _, states[name] = mechanism.prefill(draw(args.heads, args.context), draw(kv, args.context),
                                                draw(kv, args.context))
            print(f"{name}: prefill of {args.context} positions in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        for _ in range(args.tokens):
            for name, kv in layouts.items():
                q_t, k_t, v_t = draw(args.heads, 1), draw(kv, 1), draw(kv, 1)
                started = time.perf_counter()
                _, states[name] = mechanism.step(q_t, k_t, v_t, states[name])
                times[name].append(1000 * (time.perf_counter() - started))
    rows = {name: {"kv_heads": kv, "cache_mib": cache_bytes(states[name]) / 2**20,
                   "filled_positions": states[name].length, "ms_per_token": statistics.median(times[name])}
            for name, kv in layouts.items()}
    result = {"command": " ".join(["python", *sys.argv]), "context": args.context, "heads": args.heads,
              "head_dim": args.head_dim, "tokens": args.tokens, "threads": args.threads, "rows": rows,
              "cache_ratio": rows["gqa"]["cache_mib"] / rows["mha"]["cache_mib"],
              "time_ratio": rows["gqa"]["ms_per_token"] / rows["mha"]["ms_per_token"]}
    print(json.dumps(result, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

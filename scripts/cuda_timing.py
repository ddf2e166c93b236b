"""Causal forward+backward time of the recurrent-family rows on a CUDA device beside SDPA-causal, printed one by one
as measured (so a slow Triton compile still leaves the earlier numbers): docs/gpu.md's 16,384-token figures.

    python scripts/cuda_timing.py [--length 16384] [--dtype bfloat16]

Rows are built by :func:`attnzoo.bench.targets.build_target`, as ``attnzoo compare`` builds them (fla's Triton
rows only where fla-core is installed); each is the mean of 5 calls after 2 warm-ups, timed by CUDA events.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from attnzoo.bench.targets import build_target, mechanism_entry, peer_entry

MECHANISMS = ("linear", "ssd", "delta", "gated_delta")
PEERS = ("fla-triton-simple_gla", "fla-triton-delta_rule", "fla-triton-gated_delta_rule", "fla-triton-linear_attn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype, length = getattr(torch, args.dtype), args.length
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 4, length, 64, generator=generator).to("cuda", dtype) for _ in range(4))

    def bench(name, fn) -> None:
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        started = time.time()
        for _ in range(2):
            fn(*inputs, True).backward(grad)
        torch.cuda.synchronize()
        warm_up = time.time() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn(*inputs, True).backward(grad)
        end.record()
        torch.cuda.synchronize()
        print(f"N={length} {name:30s} fwd+bwd {start.elapsed_time(end) / 5:8.2f} ms (warm-up {warm_up:.1f} s)",
              flush=True)

    bench("softmax (SDPA causal)", lambda a, b, c, causal: F.scaled_dot_product_attention(a, b, c, is_causal=True))
    for entry in [mechanism_entry(name) for name in MECHANISMS] + [peer_entry(name) for name in PEERS]:
        try:
            fn = build_target(entry, 4, 64, length, True, "cuda", dtype)
            if isinstance(fn, str):
                print(f"{entry['name']}: {fn}", flush=True)
            else:
                bench(entry["name"], fn)
        except Exception as error:  # a peer refusing itself is a row, not the end of the run
            print(f"{entry['name']}: {type(error).__name__}: {str(error)[:200]}", flush=True)


if __name__ == "__main__":
    main()

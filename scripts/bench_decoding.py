"""Time per decoding step against context length, for every mechanism with a recurrent step.

A constant-size recurrent state (the linear family) should give a flat line; a KV cache (softmax) grows
with the context. Batch 1, 8 heads, head dim 64, float32; the median over timed steps after a prefill.
``--through mha`` times ``MultiHeadAttention(dim=heads*head_dim).step`` instead of the bare mechanism, with
its projections, as a decoder layer calls it.

Usage:
    python scripts/bench_decoding.py --output docs/results/decoding.json [--contexts 1024,4096,16384]
    python scripts/bench_decoding.py --through mha --mechanisms softmax
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import attnzoo


def time_steps(name: str, context: int, steps: int, heads: int, head_dim: int) -> float:
    generator = torch.Generator().manual_seed(0)
    mechanism = attnzoo.build_mechanism(name, heads=heads, head_dim=head_dim).eval()
    q, k, v = (torch.randn(1, heads, context + steps, head_dim, generator=generator) for _ in range(3))
    with torch.no_grad():
        _, state = mechanism.prefill(q[:, :, :context], k[:, :, :context], v[:, :, :context])
        samples = []
        for t in range(context, context + steps):
            start = time.perf_counter()
            _, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[5:]) * 1e3


def time_mha_steps(name: str, context: int, steps: int, heads: int, head_dim: int) -> float:
    torch.manual_seed(0)
    dim = heads * head_dim
    attention = attnzoo.MultiHeadAttention(dim, heads, name).eval()
    x = torch.randn(1, context + steps, dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, state = attention.prefill(x[:, :context])
        samples = []
        for t in range(context, context + steps):
            start = time.perf_counter()
            _, state = attention.step(x[:, t : t + 1], state)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[5:]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--through", choices=["mechanism", "mha"], default="mechanism",
                        help="time the bare mechanism's step (default) or MultiHeadAttention.step")
    parser.add_argument("--mechanisms", help="comma-separated names (default: every one with a recurrent step)")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    contexts = [int(n) for n in args.contexts.split(",")]
    names = [n for n in attnzoo.available() if attnzoo.capabilities(n).recurrent_step]
    if args.mechanisms:
        names = [n for n in args.mechanisms.split(",") if n]
    timer = time_mha_steps if args.through == "mha" else time_steps
    results = {}
    print(f"{'mechanism':<12}" + "".join(f"{f'ms/token @{n}':>16}" for n in contexts), flush=True)
    for name in names:
        results[name] = {n: timer(name, n, args.steps, args.heads, args.head_dim) for n in contexts}
        print(f"{name:<12}" + "".join(f"{results[name][n]:>16.3f}" for n in contexts), flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "through": args.through, "ms_per_token": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Causal forward+backward of `kda` beside `gated_delta`, side by side in one process (docs/kda.md, "Speed").

    PYTHONPATH=src python scripts/bench_kda.py --length 16384 --heads 4 --head-dim 64 --repeats 5

Rows: ``gated_delta``, ``kda`` and ``kda@C`` for each ``--kda-chunk-sizes`` entry (chunk size C). Each row is
the mechanism built at its defaults on the same q, k, v (batch 1); the rows take turns, round after round
(the first round warms up), and each reports the median of its rounds, wall time and the thread's CPU time
(on a machine shared with other work the CPU time is the steadier of the two), and its ratio to
``gated_delta`` by CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from attnzoo.mechanisms import build_mechanism


def _row(name: str, heads: int, head_dim: int) -> Callable:
    mechanism, _, chunk = name.partition("@")
    module = build_mechanism(mechanism, heads, head_dim, **({"chunk_size": int(chunk)} if chunk else {}))
    return lambda q, k, v: module(q, k, v, causal=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kda-chunk-sizes", default="", help="comma-separated extra kda chunk sizes, e.g. 16,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = ["gated_delta", "kda"] + [f"kda@{c}" for c in args.kda_chunk_sizes.split(",") if c]
    rows = {name: _row(name, args.heads, args.head_dim) for name in names}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.length, args.head_dim, generator=g) for _ in range(3))
    wall: Dict[str, List[float]] = {name: [] for name in names}
    cpu: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(args.repeats + 1):
        for name, fn in rows.items():
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            fn(*leaves).sum().backward()
            if round_:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.thread_time() - start_cpu)
    print(f"causal forward+backward, N={args.length}, batch 1, {args.heads} heads, head dim {args.head_dim}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'row':<14} {'wall ms':>9} {'cpu ms':>9}  vs gated_delta (cpu)")
    base = statistics.median(cpu["gated_delta"])
    for name in names:
        median_cpu = statistics.median(cpu[name])
        print(f"{name:<14} {1000 * statistics.median(wall[name]):9.1f} {1000 * median_cpu:9.1f}  "
              f"{median_cpu / base:.2f}x")


if __name__ == "__main__":
    main()

"""Causal forward+backward of `rwkv7` beside `gated_delta`, side by side in one process (docs/rwkv7.md, "Speed").

    PYTHONPATH=src python scripts/bench_rwkv7.py --length 16384 --threads 1 --repeats 5

Batch 1, 4 heads, head dim 64, float32 by default. The rows take turns, round after round (a burst of load
elsewhere slows both alike), after one warm-up round; each row reports the median of its rounds, wall time
and the thread's CPU time (the steadier of the two on a shared machine), and the ratio of the medians.
``--chunk-sizes 16,64`` adds ``rwkv7@16`` etc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

from attnzoo.mechanisms import build_mechanism


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-sizes", default="", help="also time rwkv7 at these chunk sizes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows: Dict[str, Callable] = {}
    for name in ["gated_delta", "rwkv7"] + [f"rwkv7@{c}" for c in args.chunk_sizes.split(",") if c]:
        mechanism, _, chunk = name.partition("@")
        rows[name] = build_mechanism(mechanism, args.heads, args.head_dim,
                                     **({"chunk_size": int(chunk)} if chunk else {}))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, args.length, args.head_dim, generator=g) for _ in range(3))
    wall: Dict[str, List[float]] = {name: [] for name in rows}
    cpu: Dict[str, List[float]] = {name: [] for name in rows}
    for round_ in range(args.repeats + 1):  # the first round warms up
        for name, module in rows.items():
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            module(*leaves, causal=True).sum().backward()
            if round_:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.thread_time() - start_cpu)
    print(f"N = {args.length}, batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, float32, causal, "
          f"forward+backward, {args.threads} thread(s), median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    base = statistics.median(cpu["gated_delta"])
    print(f"{'row':<14} {'wall ms':>9} {'cpu ms':>9}  cpu / gated_delta")
    for name in rows:
        median_cpu = statistics.median(cpu[name])
        print(f"{name:<14} {1000 * statistics.median(wall[name]):9.1f} {1000 * median_cpu:9.1f}  "
              f"{median_cpu / base:.2f}x")


if __name__ == "__main__":
    main()

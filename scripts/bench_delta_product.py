"""Causal forward+backward of `delta_product` beside `gated_delta`, side by side in one process
(docs/delta_product.md, "Speed").

    PYTHONPATH=src python scripts/bench_delta_product.py --length 16384 --threads 1 --rounds 5

Each row is a mechanism built with its defaults (plus the options the row names) on the same q, k, v
(batch 1, 4 heads, head dim 64 by default): ``m(q, k, v, causal=True).sum().backward()``. The rows take turns,
round after round (a first round warms up), so a burst of load elsewhere slows every row alike; each row
reports its median wall and thread CPU time over the rounds and its ratio to `gated_delta`'s median CPU time
(the steadier of the two on a shared machine). ``--chunk-sizes 16,64`` adds `delta_product` rows at other
chunk sizes; ``--steps 3`` adds rows at other numbers of Householder steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from attnzoo.mechanisms import build_mechanism


def _rows(args: argparse.Namespace) -> Dict[str, Callable]:
    rows = {"gated_delta": build_mechanism("gated_delta", args.heads, args.head_dim),
            "delta_product": build_mechanism("delta_product", args.heads, args.head_dim)}
    for chunk in args.chunk_sizes:
        rows[f"delta_product chunk_size={chunk}"] = build_mechanism("delta_product", args.heads, args.head_dim,
                                                                    chunk_size=chunk)
    for steps in args.steps:
        rows[f"delta_product householder_steps={steps}"] = build_mechanism(
            "delta_product", args.heads, args.head_dim, householder_steps=steps)
    return rows


def _measure(args: argparse.Namespace) -> List[str]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, args.length, args.head_dim, generator=g) for _ in range(3))
    rows = _rows(args)
    wall: Dict[str, List[float]] = {name: [] for name in rows}
    cpu: Dict[str, List[float]] = {name: [] for name in rows}
    for round_ in range(args.rounds + 1):
        for name, module in rows.items():
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            module(*leaves, causal=True).sum().backward()
            if round_:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.thread_time() - start_cpu)
    baseline = statistics.median(cpu["gated_delta"])
    lines = [f"{'row':<40} {'wall ms':>9} {'cpu ms':>9}  cpu / gated_delta"]
    for name in rows:
        median_cpu = statistics.median(cpu[name])
        lines.append(f"{name:<40} {1000 * statistics.median(wall[name]):9.1f} {1000 * median_cpu:9.1f}  "
                     f"{median_cpu / baseline:.2f}x")
    return lines


def _integers(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (medians); one more warms up")
    parser.add_argument("--chunk-sizes", type=_integers, default=[], help="extra delta_product chunk sizes")
    parser.add_argument("--steps", type=_integers, default=[], help="extra delta_product householder_steps")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)
    print(f"N={args.length} batch={args.batch} heads={args.heads} head_dim={args.head_dim} "
          f"threads={torch.get_num_threads()} rounds={args.rounds} (medians), causal forward+backward, float32")
    for line in _measure(args):
        print(line)


if __name__ == "__main__":
    main()

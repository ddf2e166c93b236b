"""Causal forward+backward of delta-rule relatives beside `gated_delta`, side by side in one process (docs/kda.md,
docs/rwkv7.md and docs/delta_product.md, "Speed").

    PYTHONPATH=src python scripts/bench_beside_gated_delta.py --rows "kda,rwkv7,delta_product" \\
        --length 16384 --threads 1 --rounds 5 --output runs/bench-beside-gated-delta.json

Each row is a mechanism built with its defaults plus the options it names, in the schedule syntax of
``attnzoo train --layers`` (e.g. ``kda(chunk_size=16)``, ``delta_product(householder_steps=3)``), run as
``m(q, k, v, causal=True).sum().backward()`` on the same q, k, v (batch 1, 4 heads, head dim 64 by default,
float32). `gated_delta` at its defaults is always the first row and the base of the ratios. The rows take
turns, round after round (a first round warms up), so a burst of load elsewhere slows every row alike; each
row reports its median wall and thread CPU time over the rounds, and its ratio to `gated_delta`'s median CPU
time (the steadier of the two on a shared machine).

``--allocator keep`` (the default) runs with :func:`attnzoo._malloc.keep_freed_memory`, as ``attnzoo train``
does: every tensor comes from the heap and freed memory is reused by the next round. ``--allocator default``
leaves glibc as it is, which maps a large tensor afresh and faults its pages in again depending on what was
freed before (a block of 32 MiB or more unless the heap holds a free chunk that large): the mechanisms that
allocate more large temporaries pay more for that, by an amount that varies from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from attnzoo._malloc import keep_freed_memory
from attnzoo.mechanisms import build_mechanism
from attnzoo.models.schedule import format_item, parse_schedule


def _rows(args: argparse.Namespace) -> Dict[str, torch.nn.Module]:
    rows = {"gated_delta": build_mechanism("gated_delta", args.heads, args.head_dim)}
    for spec in parse_schedule(args.rows, blocks=(), name="--rows"):
        rows[format_item(spec)] = build_mechanism(spec.mechanism, args.heads, args.head_dim, **(spec.options or {}))
    return rows


def _measure(args: argparse.Namespace, rows: Dict[str, torch.nn.Module]) -> List[dict]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, args.length, args.head_dim, generator=g) for _ in range(3))
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
    base = statistics.median(cpu["gated_delta"])
    return [{"row": name, "wall_ms": 1000 * statistics.median(wall[name]),
             "cpu_ms": 1000 * statistics.median(cpu[name]), "cpu_vs_gated_delta": statistics.median(cpu[name]) / base}
            for name in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="kda,rwkv7,delta_product",
                        help="mechanisms to time beside gated_delta, e.g. 'kda,kda(chunk_size=16)'")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (medians); one more warms up")
    parser.add_argument("--allocator", choices=("keep", "default"), default="keep",
                        help="keep: freed memory stays in the heap, as in attnzoo train; default: glibc's own")
    parser.add_argument("--output", type=Path, help="also write the rows, the settings and the command as JSON")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        rows = _rows(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    if args.allocator == "keep" and not keep_freed_memory():
        parser.error("--allocator keep needs glibc's mallopt, which this platform lacks")
    load = os.getloadavg()[0]
    results = _measure(args, rows)
    print(f"N={args.length} batch={args.batch} heads={args.heads} head_dim={args.head_dim} threads={args.threads} "
          f"rounds={args.rounds} (medians) allocator={args.allocator} load average={load:.1f}; causal "
          f"forward+backward, float32")
    print(f"{'row':<40} {'wall ms':>9} {'cpu ms':>9}  cpu / gated_delta")
    for row in results:
        print(f"{row['row']:<40} {row['wall_ms']:9.1f} {row['cpu_ms']:9.1f}  {row['cpu_vs_gated_delta']:.2f}x")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
        record = {"command": shlex.join(["python"] + sys.argv), "settings": settings, "load_average": load,
                  "rows": results}
        args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Causal forward+backward of `delta` and `gated_delta` beside `linear` and flash-linear-attention's
pure-PyTorch chunked references, side by side in one process (docs/delta.md, "Speed").

    PYTHONPATH=src python scripts/bench_delta.py --lengths 4096,16384 --threads 1

``--chunk-sizes 16,64`` adds rows ``delta@16`` etc. at other chunk sizes than the default.
Each row is the attnzoo mechanism (or the fla peer of `attnzoo compare --peers`, whose gates are computed
the same way) on the same q, k, v; the rows take turns, round after round, and each keeps its fastest
round, so a burst of load elsewhere slows every row alike or none. Both the wall time and the thread's
CPU time are reported: on a machine shared with other work the CPU time is the steadier of the two.
The fla rows need the `peers` extra (scripts/install-peers.sh); without it they are listed as missing.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Dict, List, Tuple

import torch

from attnzoo.bench.peers import build_peer, peer_installed
from attnzoo.mechanisms import build_mechanism

ROWS = [("linear", None), ("delta", None), ("gated_delta", None),
        ("fla-delta_rule", "delta"), ("fla-gated_delta_rule", "gated_delta")]


def _callable(name: str, heads: int, head_dim: int, length: int) -> Callable | str:
    """A row's forward: ``NAME`` or ``NAME@C`` (an attnzoo mechanism, at chunk size C) or an fla peer."""
    if name.startswith("fla-"):
        if not peer_installed(name):
            return "not installed (scripts/install-peers.sh)"
        return build_peer(name, heads, head_dim, length, True)
    mechanism, _, chunk = name.partition("@")
    module = build_mechanism(mechanism, heads, head_dim, **({"chunk_size": int(chunk)} if chunk else {}))
    return lambda q, k, v, causal: module(q, k, v, causal=causal)


def _time_rows(length: int, args: argparse.Namespace) -> List[Tuple[str, str]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, length, args.head_dim, generator=g) for _ in range(3))
    fns: Dict[str, Callable] = {}
    lines = []
    rows = ROWS + [(f"{name}@{chunk}", None) for chunk in args.chunk_sizes for name in ("delta", "gated_delta")]
    for name, _ in rows:
        fn = _callable(name, args.heads, args.head_dim, length)
        if isinstance(fn, str):
            lines.append((name, fn))
        else:
            fns[name] = fn

    def run(fn: Callable) -> None:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves, True).sum().backward()

    wall: Dict[str, List[float]] = {name: [] for name in fns}
    cpu: Dict[str, List[float]] = {name: [] for name in fns}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, fn in fns.items():
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            run(fn)
            if round_:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.thread_time() - start_cpu)
    linear = min(cpu["linear"]) if "linear" in cpu else None
    for name, counterpart in rows:
        if name not in fns:
            continue
        best_wall, best_cpu = 1000 * min(wall[name]), 1000 * min(cpu[name])
        notes = []
        if linear and name != "linear":
            notes.append(f"{min(cpu[name]) / linear:.2f}x linear")
        if counterpart in cpu:
            notes.append(f"attnzoo {counterpart} is {min(cpu[counterpart]) / min(cpu[name]):.2f}x of this")
        lines.append((name, f"{best_wall:9.1f} {best_cpu:9.1f}  {'; '.join(notes)}"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-sizes", default="", help="also time delta and gated_delta at these chunk sizes")
    args = parser.parse_args()
    args.chunk_sizes = [int(x) for x in args.chunk_sizes.split(",") if x]
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, float32, causal, forward+backward, "
          f"{args.threads} thread(s), best of {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    for length in (int(x) for x in args.lengths.split(",")):
        print(f"\nN = {length}\n{'row':<22} {'wall ms':>9} {'cpu ms':>9}")
        for name, text in _time_rows(length, args):
            print(f"{name:<22} {text}")


if __name__ == "__main__":
    main()

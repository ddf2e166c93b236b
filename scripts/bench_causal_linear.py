"""Causal linear attention (elu + 1) against an earlier version of ``attnzoo/functional/linear.py`` and,
with ``--peer``, against pytorch-fast-transformers' causal linear attention (from ``./run.sh peers``).

Times forward+backward of all of them side by side in one process (taking turns, median of the repeats) and
measures each one's peak memory in a fresh process, the way ``attnzoo compare`` does (resident high-water
mark above the state just before the call, glibc's mmap threshold fixed, one untimed pass first).

    git show 49d351f:src/attnzoo/functional/linear.py > /tmp/linear_before.py   # before the grouped path
    .venv/bin/python scripts/bench_causal_linear.py --baseline /tmp/linear_before.py --lengths 4096,16384

Without ``--baseline`` only the current version (and the peer) is measured.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from types import ModuleType
from typing import Callable, Dict, List, Optional

import torch

import attnzoo.functional.linear as current
from attnzoo.bench.measure import PeakMemory, fix_malloc_threshold, make_inputs

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=None)
def load_baseline(path: str) -> ModuleType:
    """Import a copy of linear.py as a sibling module, so that its relative imports resolve."""
    name = "attnzoo.functional._baseline_linear"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


PEER = "pytorch-fast-transformers"


def implementations(args: argparse.Namespace, length: int) -> Dict[str, Attention]:
    """name -> forward of causal linear attention on (batch, heads, length, head_dim) q, k, v."""
    modules = {"current": current}
    if args.baseline:
        modules["baseline"] = load_baseline(args.baseline)
    found: Dict[str, Attention] = {
        name: (lambda module: lambda q, k, v: module.linear_attention(q, k, v, "elu", causal=True))(module)
        for name, module in modules.items()
    }
    if args.peer:
        from attnzoo.bench.targets import build_target, peer_entry

        peer = build_target(peer_entry(PEER), args.heads, args.head_dim, length, True, "cpu", torch.float32)
        if isinstance(peer, str):
            raise SystemExit(f"{PEER}: {peer}")
        found[PEER] = lambda q, k, v: peer(q, k, v, True)
    return found


def forward_backward(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
    """As ``attnzoo.bench.measure.run_forward_backward``: fresh leaves, the output's gradient given."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    fn(q, k, v).backward(grad)


def peak_memory_mib(args: argparse.Namespace, name: str, length: int) -> float:
    """Forward+backward peak of one implementation, in a fresh process."""
    command = [sys.executable, __file__, "--memory-of", name, "--lengths", str(length), "--batch", str(args.batch),
               "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--threads", str(args.threads)]
    if args.baseline:
        command += ["--baseline", args.baseline]
    if args.peer:
        command += ["--peer"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(json.loads(result.stdout)["peak_mib"])


def memory_child(args: argparse.Namespace) -> None:
    fix_malloc_threshold()
    fn = implementations(args, int(args.lengths))[args.memory_of]
    inputs = make_inputs(args.batch, args.heads, int(args.lengths), args.head_dim, torch.float32, "cpu", seed=0)
    forward_backward(fn, inputs.q, inputs.k, inputs.v, inputs.grad_out)  # lazily created kernels and caches
    with PeakMemory("cpu") as peak:
        forward_backward(fn, inputs.q, inputs.k, inputs.v, inputs.grad_out)
    print(json.dumps({"peak_mib": (peak.peak_bytes or 0) / 2**20}))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="path of an earlier linear.py to compare against")
    parser.add_argument("--lengths", default="16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", action="store_true", help=f"also measure {PEER}")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        memory_child(args)
        return 0

    for length in (int(n) for n in args.lengths.split(",")):
        inputs = make_inputs(args.batch, args.heads, length, args.head_dim, torch.float32, "cpu", seed=0)
        fns = implementations(args, length)
        for fn in fns.values():  # warm-up
            forward_backward(fn, inputs.q, inputs.k, inputs.v, inputs.grad_out)
        samples: Dict[str, List[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                forward_backward(fn, inputs.q, inputs.k, inputs.v, inputs.grad_out)
                samples[name].append(1e3 * (time.perf_counter() - start))
        for name in fns:
            ms = statistics.median(samples[name])
            spread = (max(samples[name]) - min(samples[name])) / ms
            line = f"N={length:6d} {name:25s} forward+backward {ms:8.1f} ms (spread {spread:.0%})"
            if not args.no_memory:
                line += f", peak {peak_memory_mib(args, name, length):6.1f} MiB"
            print(line, flush=True)
        for other in fns:
            if other != "current":
                ratio = statistics.median(samples["current"]) / statistics.median(samples[other])
                print(f"N={length:6d} time of current / {other}: {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

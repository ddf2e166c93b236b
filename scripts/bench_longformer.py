"""Longformer's global positions against SDPA: forward and forward+backward time (medians of repeats, every
configuration timed round-robin in one process) and peak memory (each configuration in a fresh process), batch
1, 4 heads, head dim 64, float32, non-causal by default (docs/benchmarks.md).

Configurations: exact softmax by ``torch.nn.functional.scaled_dot_product_attention``; ``longformer`` at
``--window`` with one leading global token (``global_tokens=1``), with ``--globals`` positions given by
``global_indices``, and with the same positions given per call by ``global_mask``; and, for comparison, the
fixed block pattern with one leading global token on the generic blockwise core (``LongformerPattern``).

Usage: python scripts/bench_longformer.py [--length 8192] [--window 256] [--globals 16] [--repeats 5]
    [--causal] [--output docs/results/longformer-global/results.json]  (results-causal.json with --causal)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F

from attnzoo import build_mechanism
from attnzoo.bench.measure import (
    PeakMemory,
    calibrate,
    fix_malloc_threshold,
    make_inputs,
    run_forward_backward,
    time_interleaved,
)
from attnzoo.functional.blocksparse import LongformerPattern, blocksparse_attention_unchecked

CONFIGS = ("sdpa", "longformer-1-global", "longformer-indices", "longformer-mask", "block-pattern-1-global")


def global_positions(length: int, count: int) -> list:
    """``count`` seeded, distinct positions spread over the sequence (the first included)."""
    rest = torch.randperm(length - 1, generator=torch.Generator().manual_seed(0))[: count - 1] + 1
    return sorted([0] + rest.tolist())


def attention(name: str, args: argparse.Namespace) -> Callable:
    """The callable ``fn(q, k, v, causal) -> out`` of one configuration."""
    heads, dim, window, length = args.heads, args.head_dim, args.window, args.length
    positions = global_positions(length, args.globals)
    if name == "sdpa":
        return lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "longformer-1-global":
        return build_mechanism("longformer", heads, dim, window=window, global_tokens=1)
    if name == "longformer-indices":
        return build_mechanism("longformer", heads, dim, window=window, global_tokens=0,
                               global_indices=tuple(positions))
    if name == "longformer-mask":
        mechanism = build_mechanism("longformer", heads, dim, window=window, global_tokens=0)
        mask = torch.zeros(args.batch, length, dtype=torch.bool)
        mask[:, positions] = True
        return lambda q, k, v, causal: mechanism(q, k, v, causal, global_mask=mask)
    if name == "block-pattern-1-global":
        pattern = LongformerPattern(window, 1, min(window, 64))
        return lambda q, k, v, causal: blocksparse_attention_unchecked(q, k, v, pattern, causal, None, None)
    raise ValueError(f"unknown configuration {name!r}")


def peak_mib(name: str, args: argparse.Namespace) -> float:
    """Peak MiB of one forward+backward above the state before it, after a warm-up call (this process)."""
    fix_malloc_threshold()
    fn = attention(name, args)
    inputs = make_inputs(args.batch, args.heads, args.length, args.head_dim, torch.float32, "cpu")
    run_forward_backward(fn, inputs, args.causal)
    with PeakMemory("cpu") as peak:
        run_forward_backward(fn, inputs, args.causal)
    return peak.peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--globals", type=int, default=16, help="global positions by index and by mask")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    parser.add_argument("--memory-of", choices=CONFIGS, help=argparse.SUPPRESS)  # the child: one peak
    args = parser.parse_args()
    if args.memory_of:
        print(f"{peak_mib(args.memory_of, args):.1f}")
        return

    load_at_start = os.getloadavg()[0]
    torch.manual_seed(0)
    inputs = make_inputs(args.batch, args.heads, args.length, args.head_dim, torch.float32, "cpu")
    fns: Dict[str, Callable] = {name: attention(name, args) for name in CONFIGS}
    inner = {name: calibrate(fn, inputs, args.causal, "cpu", 0.2)[0] for name, fn in fns.items()}
    timings, failures = time_interleaved(fns, inputs, args.causal, "cpu", {n: args.repeats for n in fns}, inner)
    if failures:
        raise SystemExit(f"failed: {failures}")
    rows = {}
    for name in CONFIGS:
        forward, train = timings[name].medians_ms()
        child = [sys.executable, __file__, "--memory-of", name] + [
            f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
            if key in ("length", "window", "globals", "batch", "heads", "head_dim")
        ] + (["--causal"] if args.causal else [])
        memory = float(subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip())
        rows[name] = {"forward_ms": forward, "forward_backward_ms": train, "peak_mib": memory}
    sdpa = rows["sdpa"]["forward_backward_ms"]
    print(f"N={args.length} window={args.window} globals={args.globals} batch={args.batch} heads={args.heads} "
          f"head_dim={args.head_dim} float32 causal={args.causal}, medians of {args.repeats} repeats; load average "
          f"{load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)")
    print(f"{'configuration':<24} {'fwd ms':>8} {'fwd+bwd ms':>11} {'/ SDPA':>7} {'peak MiB':>9}")
    for name, row in rows.items():
        print(f"{name:<24} {row['forward_ms']:8.1f} {row['forward_backward_ms']:11.1f} "
              f"{row['forward_backward_ms'] / sdpa:7.3f} {row['peak_mib']:9.1f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        setting = {key: value for key, value in vars(args).items() if key not in ("output", "memory_of")}
        machine = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                   "platform": platform.platform(), "cores": os.cpu_count(),
                   "load_average": [round(load_at_start, 2), round(os.getloadavg()[0], 2)]}
        args.output.write_text(json.dumps({"setting": setting, "machine": machine, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

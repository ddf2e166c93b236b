"""Peak memory of one training step of a 12-layer, dim-256, 4-head LanguageModel at 4096 tokens (batch 1),
with and without reversible layers, each in a fresh process (docs/benchmarks.md, "Reversible layers").

Usage: python scripts/bench_reversible.py [--mechanisms softmax,linear]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import torch.nn.functional as F

from attnzoo import LanguageModel
from attnzoo.bench.measure import PeakMemory, fix_malloc_threshold


def measure(mechanism: str, reversible: bool, ff_chunks: int) -> float:
    """Peak MiB above the state before the step, after one warm-up step (gradients allocated once)."""
    fix_malloc_threshold()
    torch.manual_seed(0)
    model = LanguageModel(256, 256, 4, 12, self_attention=mechanism, reversible=reversible, ff_chunks=ff_chunks,
                          positional="rotary")
    tokens = torch.randint(0, 256, (1, 4097))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:]).backward()

    step()
    with PeakMemory("cpu") as peak:
        step()
    return peak.peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", default="softmax,linear")
    parser.add_argument("--one", nargs=3, metavar=("MECHANISM", "REVERSIBLE", "FF_CHUNKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child process: one configuration
        mechanism, reversible, chunks = args.one
        print(f"{measure(mechanism, reversible == '1', int(chunks)):.1f}")
        return
    for mechanism in args.mechanisms.split(","):
        peaks = {}
        for reversible in ("0", "1"):
            out = subprocess.run([sys.executable, __file__, "--one", mechanism, reversible, "1"],
                                 capture_output=True, text=True, check=True)
            peaks[reversible] = float(out.stdout.strip())
        print(f"{mechanism}: plain {peaks['0']:.1f} MiB, reversible {peaks['1']:.1f} MiB "
              f"({peaks['1'] / peaks['0']:.2f}x)")


if __name__ == "__main__":
    main()

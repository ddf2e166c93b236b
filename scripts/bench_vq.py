"""``vq`` causal forward+backward against SDPA-causal, side by side in one process (docs/gated.md, "Against
the goals"): per codebook size, in eval mode (no gradient to the keys) and in training mode (the
straight-through estimator, a window of two blocks).

Batch 1, float32, standard-normal q, k, v of shape (1, heads, N, head_dim) and output gradient; each candidate
is timed in turns (median of the repeats after one warm-up call).

    PYTHONPATH=src .venv/bin/python scripts/bench_vq.py --threads 1 --output docs/results/gated/vq.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from attnzoo.mechanisms.vq import VQAttention


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--codebook-sizes", default="256,512")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.length, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=generator) for _ in range(4))

    def timed(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            attend(*leaves).backward(grad)
        return run

    candidates: Dict[str, Callable[[], None]] = {
        "sdpa-causal": timed(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))}
    for size in (int(s) for s in args.codebook_sizes.split(",")):
        for mode in ("eval", "train"):
            mechanism = VQAttention(args.heads, args.head_dim, codebook_size=size, block_size=args.block_size,
                                    seed=0).train(mode == "train")
            candidates[f"vq S={size} {mode}"] = timed(
                lambda a, b, c, m=mechanism: m(a, b, c, causal=True))
    for run in candidates.values():  # warm-up
        run()
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for index in range(args.repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(1e3 * (time.perf_counter() - start))
    baseline = statistics.median(samples["sdpa-causal"])
    rows = []
    for name in names:
        ms = statistics.median(samples[name])
        rows.append({"candidate": name, "ms": ms, "spread": (max(samples[name]) - min(samples[name])) / ms,
                     "time_over_sdpa_causal": ms / baseline})
        print(json.dumps(rows[-1]), flush=True)
    if args.output:
        report = {"command": " ".join(sys.argv), "settings": vars(args), "torch": torch.__version__,
                  "machine": platform.processor() or platform.machine(), "rows": rows}
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

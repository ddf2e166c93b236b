"""``vq`` causal forward+backward against SDPA-causal, side by side in one process (docs/gated.md, "Against
the goals"): per codebook size, in eval mode (no gradient to the keys) and in training mode (the
straight-through estimator, a window of two blocks).

Batch 1, float32, standard-normal q, k, v of shape (1, heads, N, head_dim) and output gradient; the candidates
are timed round-robin as ``attnzoo compare`` times them (median of the repeats after one warm-up call).

    PYTHONPATH=src .venv/bin/python scripts/bench_vq.py --threads 1 --output docs/results/gated/vq.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from attnzoo.bench.measure import AttentionFn, make_inputs, run_forward_backward, time_interleaved
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
    inputs = make_inputs(1, args.heads, args.length, args.head_dim, torch.float32, "cpu")
    fns: Dict[str, AttentionFn] = {
        "sdpa-causal": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for size in (int(s) for s in args.codebook_sizes.split(",")):
        for mode in ("eval", "train"):
            mechanism = VQAttention(args.heads, args.head_dim, codebook_size=size, block_size=args.block_size,
                                    seed=0).train(mode == "train")
            fns[f"vq S={size} {mode}"] = lambda q, k, v, causal, m=mechanism: m(q, k, v, causal=causal)
    for fn in fns.values():  # warm-up
        run_forward_backward(fn, inputs, True)
    timings, failures = time_interleaved(fns, inputs, True, "cpu", {name: args.repeats for name in fns},
                                         {name: 1 for name in fns})
    if failures:
        raise RuntimeError(f"failed: {failures}")
    baseline = timings["sdpa-causal"].medians_ms()[1]
    rows = []
    for name, timing in timings.items():
        forward_ms, ms = timing.medians_ms()
        rows.append({"candidate": name, "forward_ms": forward_ms, "ms": ms, "time_over_sdpa_causal": ms / baseline})
        print(json.dumps(rows[-1]), flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "settings": vars(args), "torch": torch.__version__,
                       "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

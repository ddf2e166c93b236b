"""A PyTorch ``nn.TransformerEncoder`` swapped to other mechanisms with :func:`attnzoo.swap.swap_attention`:
forward+backward time of the whole encoder, side by side in one process.

Builds one encoder (default: 6 layers, dim 512, 8 heads, feed-forward 2048, batch_first, no dropout), deep
copies it once per mechanism and swaps each copy, then times forward+backward of one batch of ``--length``
positions, the models taking turns (one untimed pass each first; the median of ``--repeats`` rounds), so that
load from other processes falls on all of them alike. Writes a JSON of the figures and the machine.

    .venv/bin/python scripts/bench_swap.py --length 8192 --repeats 3 --output docs/results/swap-encoder.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

import torch
from torch import nn

from attnzoo.swap import swap_attention

MECHANISMS = {"softmax": {}, "performer": {"seed": 0}, "linear": {}}


def forward_backward(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).sum().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--feedforward", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS),
                        help="comma-separated; softmax is the unswapped encoder")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.dim, args.heads, args.feedforward, dropout=0.0, batch_first=True)
    base = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
    models: Dict[str, nn.Module] = {}
    for name in args.mechanisms.split(","):
        model = copy.deepcopy(base)
        if name != "softmax":
            swap_attention(model, name, **MECHANISMS.get(name, {}))
        else:
            name = "softmax (torch, unswapped)"
        models[name] = model.train()
    x = torch.randn(args.batch, args.length, args.dim, generator=torch.Generator().manual_seed(1))
    for name, model in models.items():
        print(f"warm-up {name} ...", flush=True)
        forward_backward(model, x)
    samples: Dict[str, List[float]] = {name: [] for name in models}
    for round_ in range(args.repeats):
        for name, model in models.items():
            samples[name].append(forward_backward(model, x))
            print(f"round {round_ + 1}: {name} {samples[name][-1]:.2f} s", flush=True)
    baseline = statistics.median(next(iter(samples.values())))
    rows = []
    for name, times in samples.items():
        median = statistics.median(times)
        rows.append({"model": name, "median_s": round(median, 3), "samples_s": [round(t, 3) for t in times],
                     "speedup_vs_softmax": round(baseline / median, 2)})
    print(f"\nnn.TransformerEncoder {args.layers} layers, dim {args.dim}, {args.heads} heads, feed-forward "
          f"{args.feedforward}, batch {args.batch}, N={args.length}: forward+backward")
    for row in rows:
        print(f"  {row['model']:28s} {row['median_s']:8.2f} s   {row['speedup_vs_softmax']:5.2f}x   "
              f"(rounds: {', '.join(f'{t:.2f}' for t in row['samples_s'])})")
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "load_average_after": os.getloadavg()},
        "rows": rows,
    }
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

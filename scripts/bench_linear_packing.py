"""The causal kernelized path on a packed row against the unpacked path on a row of the same length.

    PYTHONPATH=src python scripts/bench_linear_packing.py [--mechanisms linear rfa] [--lengths 8192 16384]
        [--heads 4] [--head-dim 16] [--repeats 11] [--threads 1] [--output docs/results/linear-packing.json]

Per mechanism and length: forward and backward (the sum of squared outputs) of one row of ``length``
positions, packed (documents of lengths drawn uniformly between 50 and 3000, seeded, the last cut at the row's
end, ``cu_seqlens``) and unpacked (the same row as one sequence), the two taking turns call by call so that
machine noise falls on both; median seconds over ``repeats`` calls after one warm-up call each. Writes JSON with
the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

import attnzoo


def document_offsets(length: int, seed: int) -> torch.Tensor:
    """int64 offsets [0, ..., length] of documents of 50..3000 positions, the last cut at ``length``."""
    generator = torch.Generator().manual_seed(seed)
    offsets = [0]
    while offsets[-1] < length:
        offsets.append(min(length, offsets[-1] + int(torch.randint(50, 3000, (1,), generator=generator))))
    return torch.tensor(offsets, dtype=torch.int64)


def measure(name: str, length: int, heads: int, head_dim: int, repeats: int, seed: int) -> Dict[str, object]:
    """Median seconds of a forward and backward, packed and unpacked, for one mechanism and row length."""
    torch.manual_seed(seed)
    mechanism = attnzoo.build_mechanism(name, heads, head_dim)
    q, k, v = (torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3))
    cu_seqlens = document_offsets(length, seed)
    calls = {
        "packed": lambda: mechanism(q, k, v, True, cu_seqlens=cu_seqlens),
        "unpacked": lambda: mechanism(q, k, v, True),
    }
    times: Dict[str, List[float]] = {layout: [] for layout in calls}
    for repeat in range(repeats + 1):
        for layout, call in calls.items():
            start = time.perf_counter()
            call().square().sum().backward()
            if repeat:  # the first call of each is a warm-up
                times[layout].append(time.perf_counter() - start)
    medians = {layout: round(statistics.median(values), 4) for layout, values in times.items()}
    return {"mechanism": name, "length": length, "documents": len(cu_seqlens) - 1, "seconds": medians,
            "packed_over_unpacked": round(medians["packed"] / medians["unpacked"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", nargs="+", default=["linear", "rfa"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.mechanisms:
        for length in args.lengths:
            result = measure(name, length, args.heads, args.head_dim, args.repeats, args.seed)
            print(json.dumps(result))
            results.append(result)
    report = {"command": "python " + " ".join(sys.argv), "threads": args.threads, "heads": args.heads,
              "head_dim": args.head_dim, "results": results}
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

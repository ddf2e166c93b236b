"""The fixed sparse patterns on a packed row against the same documents split and padded.

    PYTHONPATH=src python scripts/bench_sparse_packing.py [--mechanism local] [--documents 16] [--heads 4]
        [--head-dim 64] [--repeats 5] [--threads 1] [--set window=128]

Documents of lengths drawn between 50 and 2000 (seeded) are attended three ways, forward and backward, causal
(non-causal for bigbird), float32: packed (one row, ``cu_seqlens``, the mechanism's native path: one plan of
the whole row), split (each document alone, equal lengths batched: what a ``"split"`` mechanism does) and
padded (one row per document, padded to the longest, ``key_padding_mask``). Prints the median ms of each over
``repeats`` runs, the three taking turns so that machine noise falls on all, and their tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict

import torch

import attnzoo
from attnzoo.functional.packing import attend_per_document


def timed(run: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    run().square().sum().backward()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanism", default="local")
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=INT")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {key: int(value) for key, value in (item.split("=", 1) for item in args.set)}
    mechanism = attnzoo.build_mechanism(args.mechanism, args.heads, args.head_dim, **options)
    causal = mechanism.capabilities.causal
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 2001, (args.documents,), generator=generator)
    total, longest = int(lengths.sum()), int(lengths.max())
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    spans = list(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist()))
    q, k, v = (torch.randn(1, args.heads, total, args.head_dim, generator=generator).requires_grad_()
               for _ in range(3))
    padded = [torch.zeros(args.documents, args.heads, longest, args.head_dim) for _ in range(3)]
    for row, (start, end) in enumerate(spans):
        for target, source in zip(padded, (q, k, v)):
            target[row, :, : end - start] = source[0, :, start:end].detach()
    padded = [x.requires_grad_() for x in padded]
    mask = torch.arange(longest)[None, :] >= lengths[:, None]

    def split() -> torch.Tensor:
        per_document = lambda *qkv: mechanism.attend(*qkv, causal, None, False)  # noqa: E731
        return attend_per_document(per_document, q, k, v, spans)

    runs: Dict[str, Callable[[], torch.Tensor]] = {
        "packed": lambda: mechanism(q, k, v, causal, cu_seqlens=cu_seqlens),
        "split": split,
        "padded": lambda: mechanism(*padded, causal, mask),
    }
    times: Dict[str, list] = {name: [] for name in runs}
    for name, run in runs.items():  # warm-up (plans made and kept)
        timed(run)
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(timed(run))
    print(f"{args.mechanism} {options} causal={causal}: {args.documents} documents, {total} tokens "
          f"(padded to {args.documents} x {longest} = {args.documents * longest}), heads {args.heads}, "
          f"head_dim {args.head_dim}, {args.threads} thread(s), forward + backward")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:7s} {ms:9.1f} ms   {total / ms * 1e3:10.0f} real tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

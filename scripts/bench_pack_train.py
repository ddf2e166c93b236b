"""Training on packed batches against padded ones: real tokens per second on ``bytes``, and the loss they reach.

    PYTHONPATH=src python scripts/bench_pack_train.py [--lengths 4096 16384] [--rows 2] [--steps 12]
        [--warmup 2] [--mechanisms softmax linear] [--unmasked] [--threads 1] [--output docs/results/pack-train.json]

The documents are the ``bytes`` task's files (the Python standard library's ``.py`` files), with their real
lengths. Each step trains on ``rows`` rows of ``length`` positions, in both layouts (equal tokens per step):

* padded: every file cut into pieces of at most ``length`` bytes, one piece per row, padded to ``length``
  (``padding_mask``);
* unmasked (with ``--unmasked``): the padded rows without their ``padding_mask``, which a causal model on
  right-padded rows can do without (no real position reads a later one; the loss leaves the padding out);
* packed: the files back to back in rows of ``length`` (:meth:`attnzoo.tasks.Bytes.packed_split`), the batch
  one packed row of ``rows * length`` tokens with its ``cu_seqlens`` (:mod:`attnzoo.training.packing`).

In both, each position predicts the next byte of its own file, never the first byte of the next one. A step is
the forward pass, the loss, the backward pass and an AdamW step; the two layouts take turns step by step (each
its own model, from the same initial weights) so that machine noise falls on both. Reported per mechanism and
length: the median seconds per step over the steps after ``warmup``, the real (non-padding) tokens per step and
per second, their ratio, and after ``steps`` steps the mean training loss of the last five steps and the bits
per byte of the validation split's files (evaluated packed, which is each file alone). Writes JSON with the
command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from attnzoo.tasks import IGNORE_INDEX, load
from attnzoo.training import TrainConfig, build_model
from attnzoo.training.evaluation import LN2, loss_and_tally
from attnzoo.training.packing import take_packed


def padded_rows(task, length: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The train files cut into pieces of at most ``length``, one a row: inputs, targets, padding mask."""
    stream = task.stream("train")
    document = torch.repeat_interleave(torch.arange(len(task.file_lengths["train"])),
                                       torch.tensor(task.file_lengths["train"]))
    targets = torch.full_like(stream, IGNORE_INDEX)
    same = document[1:] == document[:-1]
    targets[:-1] = torch.where(same, stream[1:], IGNORE_INDEX)
    pieces, start = [], 0
    for file_length in task.file_lengths["train"]:
        for offset in range(0, file_length, length):
            pieces.append((start + offset, start + min(offset + length, file_length)))
        start += file_length
    inputs = torch.zeros(len(pieces), length, dtype=torch.int64)
    row_targets = torch.full((len(pieces), length), IGNORE_INDEX, dtype=torch.int64)
    mask = torch.ones(len(pieces), length, dtype=torch.bool)
    for row, (begin, end) in enumerate(pieces):
        inputs[row, : end - begin] = stream[begin:end]
        row_targets[row, : end - begin] = targets[begin:end]
        mask[row, : end - begin] = False
    return inputs, row_targets, mask


def timed_step(model, optimizer, batch) -> Tuple[float, float, int]:
    """One training step: (seconds, the batch's mean loss, its real tokens)."""
    inputs, targets, extra = batch
    real = extra.pop("real", None)  # the real tokens of unmasked padded rows (the model is not told)
    started = time.perf_counter()
    logits = model(inputs, **extra)
    loss, tally = loss_and_tally("lm", logits, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    if real is None:
        real = inputs.numel() if "padding_mask" not in extra else int((~extra["padding_mask"]).sum())
    return seconds, float(loss.detach()), real


@torch.no_grad()
def validation_bits_per_byte(model, task, rows: int) -> float:
    split = task.packed_split("validation")
    total, scored = 0.0, 0
    for start in range(0, len(split), rows):
        inputs, targets, offsets = take_packed(split, torch.arange(start, min(start + rows, len(split))))
        tally = loss_and_tally("lm", model(inputs, cu_seqlens=offsets), targets)[1]
        total, scored = total + tally.loss_sum, scored + tally.scored
    return total / scored / LN2


def measure(task, mechanism: str, length: int, args) -> Dict[str, object]:
    config = TrainConfig("bytes", mechanism=mechanism, dim=args.dim, depth=args.depth, heads=args.heads,
                         task_options={"seq_len": length}, pack=True)
    packed = task.packed_split("train")
    padded = padded_rows(task, length)
    order = {name: torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))
             for name, n in (("packed", len(packed)), ("padded", len(padded[0])))}
    layouts = ("packed", "padded", "unmasked") if args.unmasked else ("packed", "padded")
    models, optimizers = {}, {}
    for name in layouts:
        torch.manual_seed(args.seed)
        models[name] = build_model(config, task).train()
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=args.lr)

    def batch(name: str, step: int):
        index = order["padded" if name == "unmasked" else name][step * args.rows: (step + 1) * args.rows]
        if name == "packed":
            inputs, targets, offsets = take_packed(packed, index)
            return inputs, targets, {"cu_seqlens": offsets}
        inputs, targets, mask = (x[index] for x in padded)
        return inputs, targets, ({"padding_mask": mask} if name == "padded" else {"real": int((~mask).sum())})

    seconds: Dict[str, List[float]] = {name: [] for name in layouts}
    losses: Dict[str, List[float]] = {name: [] for name in layouts}
    real: Dict[str, List[int]] = {name: [] for name in layouts}
    for step in range(args.steps):
        for name in layouts:
            took, loss, tokens = timed_step(models[name], optimizers[name], batch(name, step))
            losses[name].append(loss)
            real[name].append(tokens)
            if step >= args.warmup:
                seconds[name].append(took)
        print(f"{mechanism} {length} step {step}: packed {losses['packed'][-1]:.3f}, padded "
              f"{losses['padded'][-1]:.3f}", file=sys.stderr)
    result: Dict[str, object] = {"mechanism": mechanism, "length": length, "rows": args.rows,
                                 "slots_per_step": args.rows * length}
    for name in layouts:
        median = statistics.median(seconds[name])
        tokens = statistics.mean(real[name])
        result[name] = {
            "seconds_per_step": round(median, 4), "seconds_all": [round(s, 4) for s in seconds[name]],
            "real_tokens_per_step": round(tokens, 1), "real_tokens_per_second": round(tokens / median, 1),
            "final_train_loss": round(statistics.mean(losses[name][-5:]), 4),
            "validation_bits_per_byte": round(validation_bits_per_byte(models[name].eval(), task, args.rows), 4),
        }
    result["throughput_ratio"] = round(result["packed"]["real_tokens_per_second"]
                                       / result["padded"]["real_tokens_per_second"], 2)
    if args.unmasked:
        result["throughput_ratio_unmasked"] = round(result["packed"]["real_tokens_per_second"]
                                                    / result["unmasked"]["real_tokens_per_second"], 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rows", type=int, default=2, help="rows of LENGTH positions per step, both layouts")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--mechanisms", nargs="+", default=["softmax", "linear"])
    parser.add_argument("--unmasked", action="store_true",
                        help="also time the padded rows without their padding mask (causal models only need it "
                             "for the loss)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-bytes", type=int, default=4 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    results = []
    for length in args.lengths:
        task = load("bytes", seq_len=length, train_bytes=args.train_bytes, validation_bytes=1 << 17,
                    test_bytes=length + 1)
        for mechanism in args.mechanisms:
            results.append(measure(task, mechanism, length, args))
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {"command": " ".join(["python", *sys.argv]), "threads": args.threads,
              "model": {"dim": args.dim, "depth": args.depth, "heads": args.heads}, "results": results}
    print(json.dumps(report, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

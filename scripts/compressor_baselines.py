"""Bits per byte of general-purpose compressors on the `bytes` task's splits: the baselines a byte-level
language model must beat.

    PYTHONPATH=src python scripts/compressor_baselines.py --output docs/results/bytes/compressor-baselines.json
    PYTHONPATH=src python scripts/compressor_baselines.py --task-options train_bytes=9000000,seq_len=512

Each split is its files concatenated in order, the bytes the task cuts its windows from. Every compressor
(gzip -9, bz2 -9, xz -9, container bytes included) is measured on the split alone and, charged only for what
the split adds, after the training split (what a model has learnt from). The unigram entropy is beside them."""

import argparse
import json
import sys

import numpy as np

from attnzoo.cli.common import parse_options
from attnzoo.tasks import load
from attnzoo.tasks.byte_lm import compression_baselines


def split_bytes(task, split: str) -> bytes:
    """The files of ``split`` concatenated in order, as bytes."""
    return task.stream(split).numpy().astype(np.uint8).tobytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task-options", type=parse_options, default={}, help="options of the bytes task as KEY=VALUE,...")
    parser.add_argument("--splits", nargs="+", default=["validation", "test"], choices=["validation", "test"])
    parser.add_argument("--output", help="write the figures and this command line to this JSON file")
    args = parser.parse_args()

    try:
        task = load("bytes", **args.task_options)
    except (TypeError, ValueError) as error:
        parser.error(f"--task-options: {error}")
    train = split_bytes(task, "train")
    rows = {}
    for split in args.splits:
        data = split_bytes(task, split)
        rows[split] = {"bytes": len(data), **compression_baselines(data, context=train)}
        print(f"{split} ({len(data):,} bytes; after context = after the {len(train):,} training bytes)")
        for name, value in rows[split].items():
            if name != "bytes":
                print(f"  {name:<24} {value:.3f} bits per byte")
    if args.output:
        record = {"command": " ".join(["python"] + sys.argv), "task": task.describe(), "splits": rows}
        with open(args.output, "w") as handle:
            json.dump(record, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

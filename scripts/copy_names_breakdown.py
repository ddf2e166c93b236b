"""Names and numbers apart: the share of each that a model trained on ``copy-names`` reproduces (docs/seq2seq.md,
"Copy mechanism"). ``attnzoo eval`` reports both together as ``rare_token_recall``; this splits them, because
the held-out names never occur in a training target while every number does.

    PYTHONPATH=src python scripts/copy_names_breakdown.py runs/copy-names-copy runs/copy-names-nocopy
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional

import torch

from attnzoo.training import load_trained
from attnzoo.training.seq2seq import greedy_outputs, rare_token_recall, strip_output


def breakdown(path: str, split: str, batch_size: int) -> dict:
    """{"names": share, "numbers": share, "rare": share} of the run at ``path`` on ``split``."""
    model, task, config = load_trained(path)
    data = task.split(split)
    predictions: List[List[int]] = []
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            index = torch.arange(start, min(start + batch_size, len(data)))
            predictions += greedy_outputs(model, task, data.inputs[index], data.padding_mask[index])
    references = [strip_output(row.tolist(), task.eos_id) for row in data.targets]
    return {"run": path, "copy_mechanism": config.copy_mechanism, "steps": config.steps, "split": split,
            **{kind: round(rare_token_recall(predictions, references, ids), 4)
               for kind, ids in (("names", task.name_ids), ("numbers", task.number_ids), ("rare", task.rare_ids))}}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories written by attnzoo train copy-names")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for path in args.runs:
        print(json.dumps(breakdown(path, args.split, args.batch_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Names and numbers apart: the share of each that a model trained on ``copy-names`` reproduces (docs/seq2seq.md,
"Copy mechanism"; :func:`attnzoo.experiments.seq2seq_eval.copy_breakdown`). ``attnzoo eval`` reports both together
as ``rare_token_recall``; this splits them, because the held-out names never occur in a training target while
every number does.

    PYTHONPATH=src python scripts/copy_names_breakdown.py runs/copy-names-copy runs/copy-names-nocopy
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional

import torch

from attnzoo.experiments.seq2seq_eval import copy_breakdown


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories written by attnzoo train copy-names")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for path in args.runs:
        print(json.dumps(copy_breakdown(path, args.split, args.batch_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Redraw the figures of saved `attnzoo compare` runs from their results.json, with the current figure code
(nothing is measured again).

    .venv/bin/python scripts/replot_compare.py docs/results/kernelized-noncausal docs/results/sparse-causal ...

Each directory's results.json is read as it is (older schemas included); time.png, memory.png, error.png and
bubble.png are rewritten beside it. report.md is left as the run wrote it: its text describes that run's
method. The accuracy a run was given (``--accuracy``) is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnzoo.bench.plots import write_plots


def replot(directory: Path) -> None:
    data = json.loads((directory / "results.json").read_text())
    write_plots(data, directory, data.get("accuracy"))


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path, help="output directories of attnzoo compare")
    args = parser.parse_args(argv)
    for directory in args.directories:
        if not (directory / "results.json").is_file():
            print(f"replot_compare: {directory} has no results.json", file=sys.stderr)
            return 2
        replot(directory)
        print(f"replot_compare: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

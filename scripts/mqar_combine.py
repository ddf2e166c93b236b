"""One MQAR table from several `attnzoo mqar` runs of the same preset that tried different learning rates or
schedules: per (schedule, width), the learning rate with the best validation accuracy over every run's cells and
its test accuracy, as the sweep itself reports it (docs/hybrids.md, "Six more pure mechanisms").

    python scripts/mqar_combine.py docs/results/mqar/medium-linear-based docs/results/mqar/medium-lr1e-3 ... \\
        [--output combined.json]

Each argument is a folder holding the ``mqar.json`` of a run (or the file itself). Runs of another preset or task
setting than the first are refused, as are two cells of the same (schedule, width, learning rate). Prints a
Markdown table (test accuracy % at the best learning rate, the learning rates tried, the accuracy at each) and,
with ``--output``, writes it with the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def _read(path: str) -> dict:
    file = Path(path) / "mqar.json" if Path(path).is_dir() else Path(path)
    return json.loads(file.read_text())


def combine(runs: List[dict]) -> List[dict]:
    """The rows: per (schedule, width) in the order first met, the best learning rate on validation."""
    cells: Dict[Tuple[str, int], Dict[float, dict]] = {}
    for run in runs:
        if run["task_options"] != runs[0]["task_options"] or run["preset"] != runs[0]["preset"]:
            raise ValueError(f"run {run['command']} has another preset or task setting than {runs[0]['command']}")
        for cell in run["cells"]:
            if cell["status"] != "ok":
                continue
            by_lr = cells.setdefault((cell["schedule"], cell["width"]), {})
            if cell["lr"] in by_lr:
                raise ValueError(f"two cells of {cell['schedule']} width {cell['width']} at lr {cell['lr']}")
            by_lr[cell["lr"]] = cell
    rows = []
    for (schedule, width), by_lr in cells.items():
        best = max(by_lr.values(), key=lambda cell: cell["validation"]["accuracy"])
        rows.append({"schedule": schedule, "width": width, "best_lr": best["lr"],
                     "validation_accuracy": best["validation"]["accuracy"], "test_accuracy": best["test"]["accuracy"],
                     "test_accuracy_by_lr": {str(lr): cell["test"]["accuracy"] for lr, cell in sorted(by_lr.items())}})
    return rows


def markdown(rows: List[dict]) -> str:
    lines = ["| schedule | width | best lr | test acc % | lrs tried | test acc % at each lr |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        each = ", ".join(f"{float(lr):.2g}: {100 * acc:.1f}" for lr, acc in row["test_accuracy_by_lr"].items())
        best = f"{row['best_lr']:.2g} | {100 * row['test_accuracy']:.1f}"
        lines.append(f"| {row['schedule']} | {row['width']} | {best} | {len(row['test_accuracy_by_lr'])} | {each} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="folders holding mqar.json (or the files)")
    parser.add_argument("--output", help="also write the table and rows as JSON here")
    args = parser.parse_args(argv)
    runs = [_read(path) for path in args.runs]
    rows = combine(runs)
    table = markdown(rows)
    print(table)
    if args.output:
        given = sys.argv[1:] if argv is None else argv
        Path(args.output).write_text(json.dumps({"command": ["python", "scripts/mqar_combine.py", *given],
                                                 "runs": [run["command"] for run in runs], "rows": rows,
                                                 "markdown": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

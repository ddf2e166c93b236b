"""A new training experiment in one file: which positional encoding lets a small model learn recall.

Everything it needs comes from :mod:`attnzoo.experiments`: the cell runner (each cell one ``attnzoo train``
run in a fresh process, finished cells kept, interrupted ones resumed) and the checks every experiment shares.
Imported by tests/experiments/test_adding_an_experiment.py; nothing else in the library knows about it.

    python tests/experiments/toy_new_experiment.py OUTPUT [--steps N] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from attnzoo.experiments import train_cells
from attnzoo.experiments.settings import check_cell_settings, keep_settings
from attnzoo.training import TrainConfig

ENCODINGS = ("sinusoidal", "rotary")
# The budget every cell trains with; only the positional encoding differs.
BUDGET: Dict[str, Any] = dict(task="recall", dim=16, depth=1, heads=2, batch_size=8, steps=20, lr=3e-3,
                              task_options=dict(train_size=64, validation_size=16, test_size=16, num_pairs=4,
                                                num_keys=8, num_values=4))


def cell_configs(steps: Optional[int] = None) -> Dict[str, TrainConfig]:
    """One TrainConfig per positional encoding, alike in everything else."""
    overrides = {} if steps is None else {"steps": steps, "eval_interval": steps}
    return {name: TrainConfig(**{**BUDGET, **overrides, "positional": name}) for name in ENCODINGS}


def run(output: Path, steps: Optional[int] = None, jobs: int = 1, threads: Optional[int] = None) -> Dict[str, Any]:
    """Train (or continue) every cell and write ``positional.json`` and ``positional.md``; returns the rows."""
    check_cell_settings(jobs, threads, None)
    configs = cell_configs(steps)
    keep_settings(output / "positional-settings.json", {name: c.as_dict() for name, c in configs.items()},
                  "a positional-encoding experiment")
    cells = [(name, config, output / "cells" / name) for name, config in configs.items()]
    rows = train_cells(cells, timeout_s=600, threads=threads, jobs=jobs)
    lines = ["| positional | test accuracy |", "|---|---|"]
    lines += [f"| {name} | {row['test']['accuracy']:.3f} |" if row["status"] == "ok" else
              f"| {name} | {row['status']}: {row.get('reason', '')} |" for name, row in rows.items()]
    (output / "positional.json").write_text(json.dumps(rows, indent=2))
    (output / "positional.md").write_text("\n".join(lines) + "\n")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Which positional encoding lets a small model learn recall.")
    parser.add_argument("output", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    rows = run(args.output, args.steps, args.jobs)
    return 0 if all(row["status"] == "ok" for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

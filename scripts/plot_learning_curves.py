"""Validation metric against training time for `attnzoo train` runs, one line per run, with optional
horizontal baselines: the picture of "which is better at equal time".

    python scripts/plot_learning_curves.py docs/results/bytes/softmax docs/results/bytes/gated_delta \
        --metric bits_per_byte --baselines docs/results/bytes/compressor-baselines-9mb.json \
        --output docs/results/bytes/learning-curves.png

Each run directory holds `metrics.csv` (written by `attnzoo train`); a validation row's time is the elapsed
training seconds of the train row logged at the same step. `--baselines` reads the `validation` figures of
`scripts/compressor_baselines.py`'s JSON (the curves are validation figures too).

`--x budget` puts each run's step over its total steps on the x axis instead: for runs whose step counts were
set to equal time from a side-by-side speed trial, but which ran on machines or at loads of different speed
(so that their recorded minutes do not compare)."""

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curve(run: Path, metric: str, x: str) -> tuple:
    """(minutes or share of the run's steps, values) of ``metric`` on the validation rows of
    ``run``/metrics.csv."""
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    elapsed = {row["step"]: float(row["elapsed_s"]) for row in rows if row["split"] == "train" and row["elapsed_s"]}
    if x == "budget":
        steps = json.load(open(run / "results.json"))["config"]["steps"]
        position = {step: int(step) / steps for step in elapsed}
    else:
        position = {step: seconds / 60 for step, seconds in elapsed.items()}
    points = [(position[row["step"]], float(row[metric])) for row in rows
              if row["split"] == "validation" and row.get(metric) and row["step"] in position]
    if not points:
        raise SystemExit(f"{run}: no validation rows with {metric} and a time")
    return tuple(zip(*points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (with metrics.csv)")
    parser.add_argument("--metric", default="bits_per_byte")
    parser.add_argument("--baselines", type=Path, help="compressor_baselines.py JSON: its validation figures")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--title", default=None)
    parser.add_argument("--x", choices=("time", "budget"), default="time",
                        help="time: training minutes (default); budget: step over the run's total steps")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        positions, values = curve(run, args.metric, args.x)
        config = json.load(open(run / "results.json"))["config"] if (run / "results.json").exists() else {}
        label = config.get("layers") or config.get("mechanism") or run.name
        ax.plot(positions, values, marker="o", label=label)
    if args.baselines:
        figures = json.load(open(args.baselines))["splits"]["validation"]
        for name in ("gzip -9", "bz2 -9", "xz -9, after context"):
            ax.axhline(figures[name], linestyle="--", linewidth=1, color="grey")
            ax.text(0, figures[name], f" {name}", va="bottom", fontsize=8, color="dimgrey")
    against = "training time" if args.x == "time" else "share of the training budget"
    ax.set_xlabel("training time (minutes)" if args.x == "time" else "share of the run's steps (equal-time budgets)")
    ax.set_ylabel(f"validation {args.metric}")
    ax.set_title(args.title or f"validation {args.metric} against {against}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

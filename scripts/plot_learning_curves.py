"""Validation metric against training time for `attnzoo train` runs, one line per run, with optional
horizontal baselines: the picture of "which is better at equal time".

    python scripts/plot_learning_curves.py docs/results/bytes/softmax docs/results/bytes/gated_delta \
        --metric bits_per_byte --baselines docs/results/bytes/compressor-baselines-9mb.json \
        --output docs/results/bytes/learning-curves.png

Each run directory holds `metrics.csv` (written by `attnzoo train`); a validation row's time is the elapsed
training seconds of the train row logged at the same step. `--baselines` reads the `validation` figures of
`scripts/compressor_baselines.py`'s JSON (the curves are validation figures too)."""

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curve(run: Path, metric: str) -> tuple:
    """(minutes, values) of ``metric`` on the validation rows of ``run``/metrics.csv."""
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    elapsed = {row["step"]: float(row["elapsed_s"]) for row in rows if row["split"] == "train" and row["elapsed_s"]}
    points = [(elapsed[row["step"]] / 60, float(row[metric])) for row in rows
              if row["split"] == "validation" and row.get(metric) and row["step"] in elapsed]
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
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        minutes, values = curve(run, args.metric)
        label = json.load(open(run / "results.json"))["config"].get("mechanism", run.name) \
            if (run / "results.json").exists() else run.name
        ax.plot(minutes, values, marker="o", label=label)
    if args.baselines:
        figures = json.load(open(args.baselines))["splits"]["validation"]
        for name in ("gzip -9", "bz2 -9", "xz -9, after context"):
            ax.axhline(figures[name], linestyle="--", linewidth=1, color="grey")
            ax.text(0, figures[name], f" {name}", va="bottom", fontsize=8, color="dimgrey")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel(f"validation {args.metric}")
    ax.set_title(args.title or f"validation {args.metric} against training time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

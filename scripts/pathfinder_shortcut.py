"""How much of Pathfinder's label cheap features give away, per setting: the markers' distance, and others.

    PYTHONPATH=src python scripts/pathfinder_shortcut.py
    PYTHONPATH=src python scripts/pathfinder_shortcut.py --images 4000 \
        --options size=16,contour_length=3,segment_length=2,num_distractors=4

For each setting (by default every Pathfinder setting of every `attnzoo lra` preset, then a small 12 x 12 one),
prints the best accuracy of a threshold, either way round, on each feature of
`attnzoo.tasks.pathfinder.shortcut_accuracies` (0.5: the feature gives nothing away).
`tests/tasks/test_tasks_pathfinder.py` holds the marker distance below 55% at every preset's setting."""

import argparse

import numpy as np

from attnzoo.cli.common import parse_value
from attnzoo.experiments.lra import BUDGETS
from attnzoo.tasks.pathfinder import generate_pathfinder, shortcut_accuracies

DEFAULTS = dict(size=32, contour_length=9, segment_length=3, num_distractors=6, distractor_length=2)
EXTRA_SETTINGS = [dict(size=12, contour_length=2, segment_length=2, num_distractors=3)]


def lra_settings() -> list:
    """The task options of Pathfinder in every `attnzoo lra` preset, each once."""
    settings: list = []
    for budget in BUDGETS.values():
        options = budget.get("pathfinder", {}).get("task_options")
        if options is not None and options not in settings:
            settings.append(dict(options))
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", action="append", default=[],
                        help="generator options as KEY=VALUE,... (repeatable: one setting each)")
    args = parser.parse_args()
    settings = ([dict(pair.split("=", 1) for pair in text.split(",")) for text in args.options]
                or lra_settings() + EXTRA_SETTINGS)
    for changes in settings:
        options = {**DEFAULTS, **{key: parse_value(str(value)) for key, value in changes.items()}}
        made = generate_pathfinder(args.images, rng=np.random.default_rng(args.seed), **options)
        print(", ".join(f"{key}={value}" for key, value in options.items()) + f" ({args.images} images):")
        for feature, accuracy in shortcut_accuracies(made).items():
            print(f"  {feature:45s} {accuracy:.3f}")


if __name__ == "__main__":
    main()

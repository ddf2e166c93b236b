"""How much of Pathfinder's label the marker distance alone gives away, per setting.

    PYTHONPATH=src python scripts/pathfinder_shortcut.py
    PYTHONPATH=src python scripts/pathfinder_shortcut.py --images 4000 --options size=16,contour_length=3,segment_length=2,num_distractors=4

Prints the best accuracy of a threshold on the two markers' distance (0.5: no shortcut)."""

import argparse

import numpy as np

from attnzoo.cli.common import parse_value
from attnzoo.tasks.pathfinder import generate_pathfinder, marker_distance_accuracy

DEFAULTS = dict(size=32, contour_length=9, segment_length=3, num_distractors=6, distractor_length=2)
SETTINGS = [
    {},
    dict(size=16, contour_length=3, segment_length=2, num_distractors=4),
    dict(size=12, contour_length=2, segment_length=2, num_distractors=3),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", action="append", default=[],
                        help="generator options as KEY=VALUE,... (repeatable: one setting each)")
    args = parser.parse_args()
    settings = [dict(pair.split("=", 1) for pair in text.split(",")) for text in args.options] or SETTINGS
    for changes in settings:
        options = {**DEFAULTS, **{key: parse_value(str(value)) for key, value in changes.items()}}
        made = generate_pathfinder(args.images, rng=np.random.default_rng(args.seed), **options)
        described = ", ".join(f"{key}={value}" for key, value in options.items())
        print(f"{described}: marker-distance threshold accuracy {marker_distance_accuracy(made):.3f}")


if __name__ == "__main__":
    main()

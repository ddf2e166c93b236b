"""How far apart two `attnzoo compare` runs are: the gap between their speed ratios against softmax.

For each (mechanism, length) measured in both runs, prints the forward+backward and forward-only speed ratios
of each run and their gap ``max / min - 1``, then the largest gaps. Two back-to-back runs on an idle machine
should agree within 15%.

Usage:
    python scripts/compare_runs.py RUN_A/results.json RUN_B/results.json
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Tuple

COLUMNS = (("speed_vs_softmax", "fwd+bwd"), ("forward_speed_vs_softmax", "fwd"))


def gap(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if not a or not b:
        return None
    return max(a, b) / min(a, b) - 1.0


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    runs = []
    for path in argv:
        with open(path) as handle:
            rows = json.load(handle)["rows"]
        runs.append({(row["mechanism"], row["length"]): row for row in rows if row.get("mechanism") != "softmax"})
    shared = sorted(set(runs[0]) & set(runs[1]))
    worst: Dict[str, Tuple[float, Tuple[str, int]]] = {}
    print(f"{'mechanism':<32}{'N':>7}" + "".join(f"{label + ' A':>11}{label + ' B':>11}{'gap':>7}" for _, label in COLUMNS))
    for key in shared:
        cells = ""
        for column, label in COLUMNS:
            a, b = runs[0][key].get(column), runs[1][key].get(column)
            g = gap(a, b)
            cells += f"{a or float('nan'):>11.3f}{b or float('nan'):>11.3f}" + (f"{g:>7.1%}" if g is not None else f"{'-':>7}")
            if g is not None and g > worst.get(label, (-1.0, key))[0]:
                worst[label] = (g, key)
        print(f"{key[0]:<32}{key[1]:>7}{cells}")
    for label, (g, (name, length)) in worst.items():
        print(f"largest {label} gap: {g:.1%} ({name} at N={length})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

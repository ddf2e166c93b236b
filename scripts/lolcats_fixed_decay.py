"""A copy of a converted ``lolcats`` model with a fixed decay on every layer's linear part: each layer's options
gain ``decay`` and its weights a ``decay_logit`` of ``logit(decay)`` for every head, nothing else changed. It asks
whether a model trained without a decay holds past its training length once the linear part sums a bounded number
of keys (docs/conversion.md), without converting again.

    PYTHONPATH=src python scripts/lolcats_fixed_decay.py runs/lolcats-2k runs/lolcats-2k-decay0.97 --decay 0.97
    attnzoo lm-eval --converted runs/lolcats-2k --converted runs/lolcats-2k-decay0.97 --parts perplexity \\
        --lengths 2048,4096,8192

The copy is a conversion folder (``model/`` with ``model.json`` and ``weights.safetensors``) that ``attnzoo
lm-eval --converted`` and :func:`attnzoo.conversion.load_converted` read; refused: a layer that is not ``lolcats``
or that has a decay already, a decay outside (0, 1), an output folder that exists.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import List, Optional

import torch
from safetensors.torch import load_file, save_file

from attnzoo.conversion.saved import MODEL_JSON, WEIGHTS, read_converted

FACTOR = ".attention.mechanism.window_factor"


def with_fixed_decay(source: Path, output: Path, decay: float) -> Path:
    """Write the copy to ``output`` (its ``model/``); returns that folder."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"--decay must be in (0, 1), got {decay}")
    folder, description = read_converted(source)
    if output.exists():
        raise FileExistsError(f"{output} exists: choose a new folder")
    for index, (name, options) in enumerate(description["layer_mechanisms"]):
        if name != "lolcats" or "decay" in options:
            raise ValueError(f"layer {index} is {name!r} with options {options}: only lolcats without a decay")
        options["decay"] = decay
    weights = load_file(str(folder / WEIGHTS))
    for factor_name in [n for n in weights if n.endswith(FACTOR)]:
        heads = weights[factor_name].shape[0]
        logit_name = factor_name[: -len("window_factor")] + "decay_logit"
        weights[logit_name] = torch.full((heads,), math.log(decay / (1.0 - decay)), dtype=weights[factor_name].dtype)
    made = output / "model"
    made.mkdir(parents=True)
    (made / MODEL_JSON).write_text(json.dumps(description, indent=2))
    save_file(weights, str(made / WEIGHTS))
    return made


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a lolcats conversion's folder (or its model/)")
    parser.add_argument("output", type=Path, help="the new folder")
    parser.add_argument("--decay", type=float, required=True, help="lambda in (0, 1), the same for every head")
    args = parser.parse_args(argv)
    try:
        made = with_fixed_decay(args.source, args.output, args.decay)
    except (OSError, ValueError) as error:
        print(f"lolcats_fixed_decay: {error}", file=sys.stderr)
        return 2
    print(f"wrote {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

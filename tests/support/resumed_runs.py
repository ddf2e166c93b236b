"""A training run done whole, and the same run interrupted and resumed: the pair resume tests compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.training import find_checkpoint, train


def whole_and_resumed(config: Any, folder: Path, stop_at: int) -> Tuple[Any, Any]:
    """``config`` trained whole into ``folder/whole``, and into ``folder/cut`` stopped (KeyboardInterrupt)
    after step ``stop_at`` then resumed: (whole result, resumed result)."""
    whole = train(config, folder / "whole", progress=False)

    def stop(step: int, metrics: Dict[str, float]) -> None:
        if step == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config, folder / "cut", progress=False, on_step=stop)
    return whole, train(None, folder / "cut", resume=True, progress=False)


def same_weights(folder: Path) -> bool:
    """Whether the whole and the resumed run of :func:`whole_and_resumed` in ``folder`` end with equal tensors."""
    a, b = (load_file(str(find_checkpoint(folder / run) / "model.safetensors")) for run in ("whole", "cut"))
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)

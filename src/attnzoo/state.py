"""Helpers over decoding states: trees (dict, list, tuple) of tensors whose first dim is the batch."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import Tensor


def map_tensors(state: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a state tree, keeping everything else as it is."""
    if isinstance(state, Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {key: map_tensors(value, fn) for key, value in state.items()}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {f.name: map_tensors(getattr(state, f.name), fn) for f in dataclasses.fields(state)}
        return dataclasses.replace(state, **changes)
    if isinstance(state, (list, tuple)):
        return type(state)(map_tensors(value, fn) for value in state)
    return state


def select_batch(state: Any, index: Tensor) -> Any:
    """Reorder (or repeat) the batch entries of a state: used by beam search to follow surviving beams."""
    return map_tensors(state, lambda t: t.index_select(0, index))

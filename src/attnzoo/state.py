"""Decoding states: what a mechanism's ``step`` carries from one position to the next, and helpers over them.

A state is passed in and returned explicitly, never stored on a module. Every mechanism's state is a
:class:`DecodingState` that says which mechanism made it and how many positions it has seen, so that ``step``
can refuse a state that belongs elsewhere (another mechanism, batch size, head count or width) with an error
naming ``state`` instead of broadcasting it silently. Its tensors all have the batch as their first dim, so
beam search can reorder and repeat sequences with :func:`select_batch`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict

from torch import Tensor


@dataclass(frozen=True)
class DecodingState:
    """The state of one mechanism after ``length`` positions.

    Attributes:
        mechanism: registered name of the mechanism that made it.
        length: positions decoded so far.
        tensors: the mechanism's tensors by name, each (batch, heads, ...); what they hold is the
            mechanism's business (a KV cache, a running sum), their names and shapes its declared layout.
    """

    mechanism: str
    length: int
    tensors: Dict[str, Tensor]


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

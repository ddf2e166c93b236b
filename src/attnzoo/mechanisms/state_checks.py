"""The checks of a decoding state a mechanism is asked to continue from (:meth:`Mechanism.check_state
<attnzoo.mechanisms.base.Mechanism.check_state>`): made by this mechanism, for this batch, laid out as the
mechanism declares. Errors name ``state``."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..state import DecodingState

StateLayout = Dict[str, Tuple[Tuple[Optional[int], ...], torch.dtype]]
"""Name -> (shape after the batch dim, None where the size varies; dtype) of every tensor of a state."""


def check_state_made_here(state: object, name: str) -> None:
    """A :class:`DecodingState` that mechanism ``name`` made, with a positive length."""
    where = f"{name}.step"
    if not isinstance(state, DecodingState):
        raise TypeError(
            f"{where}: state must be None (to start) or the DecodingState that {name}'s prefill or step "
            f"returned, got {type(state).__name__}"
        )
    if state.mechanism != name:
        raise ValueError(f"{where}: state was made by mechanism {state.mechanism!r}, not {name!r}")
    if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 1:
        raise ValueError(f"{where}: state.length must be a positive int, got {state.length!r}")


def check_state_tensors(
    state: DecodingState, name: str, layout: StateLayout, q_t: Tensor, heads: int, kv_heads: int, head_dim: int,
    value_width: int,
) -> None:
    """Every tensor of ``state`` laid out as ``layout`` declares, for the step input ``q_t``'s batch, dtype and
    device (so heads, widths and feature counts match)."""
    where = f"{name}.step"
    if not isinstance(state.tensors, dict) or set(state.tensors) != set(layout):
        got = sorted(state.tensors) if isinstance(state.tensors, dict) else type(state.tensors).__name__
        raise ValueError(f"{where}: state holds tensors {got}, expected {sorted(layout)}")
    batch = q_t.shape[0]
    for key, (shape, dtype) in layout.items():
        tensor = state.tensors[key]
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{where}: state tensor {key!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() != len(shape) + 1 or tensor.shape[0] != batch:
            raise ValueError(
                f"{where}: state tensor {key!r} has shape {tuple(tensor.shape)}; this step's batch is {batch} "
                f"(a state keeps the batch it was made for: reorder it with attnzoo.state.select_batch)"
            )
        if any(want is not None and got != want for got, want in zip(tensor.shape[1:], shape)):
            expected = "(" + ", ".join("*" if size is None else str(size) for size in (batch, *shape)) + ")"
            raise ValueError(
                f"{where}: state tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected} for "
                f"heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}, value width {value_width}: it was made "
                f"by a mechanism of another shape or for keys/values of another number of heads or width"
            )
        if tensor.dtype != dtype:
            raise TypeError(f"{where}: state tensor {key!r} is {tensor.dtype}, expected {dtype} for {q_t.dtype} inputs")
        if tensor.device != q_t.device:
            raise ValueError(f"{where}: state tensor {key!r} is on {tensor.device}, the inputs on {q_t.device}")


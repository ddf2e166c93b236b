"""Constant-memory decoding of a sliding window with attention sinks (Xiao et al. 2023, StreamingLLM): the
state keeps the first ``sinks`` keys and values for good, and the last ``window`` in a ring buffer, so a step
reads ``sinks + window`` positions however long the sequence. A step equals the parallel causal form of
:class:`~.patterns.SinkLocalPattern` at that position.

State tensors (batch first), keys and values with their own heads (``kv_heads`` of grouped-query inputs, shared by
the query heads of each group): ``k``, ``v`` (batch, kv_heads, window, dim): the ring, position t in slot ``t %
window``; ``positions`` (batch, window) long: the position in each slot, -1 while empty; ``sink_k``,
``sink_v`` (batch, kv_heads, sinks, dim): positions 0 .. sinks-1 (zeros until written)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..._validation import check_number
from .core import grouped_sdpa


def check_sink_tokens(sink_tokens: object, window: int) -> int:
    """``sink_tokens`` checked (errors name it): an int, ``0 <= sink_tokens <= window`` (more sinks than the
    window would make the sinks, not the window, what a query mostly sees)."""
    sinks = check_number("sink_tokens", sink_tokens, integer=True, minimum=0)
    if sinks > window:
        raise ValueError(f"sink_tokens must be <= window ({window}), got {sinks}")
    return sinks


def window_cache_layout(
    heads: int, window: int, sinks: int, dim: int, dtype: torch.dtype, value_width: Optional[int] = None
) -> dict:
    """The state's tensors: name -> (shape after the batch dim, dtype), as a mechanism's ``state_layout``;
    values of ``value_width`` channels (``dim`` when None)."""
    value_width = dim if value_width is None else value_width
    return {
        "k": ((heads, window, dim), dtype),
        "v": ((heads, window, value_width), dtype),
        "positions": ((window,), torch.long),
        "sink_k": ((heads, sinks, dim), dtype),
        "sink_v": ((heads, sinks, value_width), dtype),
    }


def _ring_positions(length: int, window: int, device: torch.device) -> Tensor:
    """The position each slot holds after positions 0 .. length-1, (window,): the latest p < length with
    p % window == slot, or -1 (length >= 1)."""
    slots = torch.arange(window, device=device)
    latest = (length - 1) - torch.remainder(length - 1 - slots, window)
    return torch.where(latest >= 0, latest, torch.full_like(latest, -1))


def _in_slots(x: Tensor, positions: Tensor) -> Tensor:
    """x (batch, heads, length, dim) at the slots' positions (:func:`_ring_positions`), zeros where -1."""
    filled = (positions >= 0).view(1, 1, -1, 1)
    return torch.where(filled, x.index_select(2, positions.clamp_min(0)), torch.zeros_like(x[:, :, :1]))


def window_ring(x: Tensor, window: int) -> Tensor:
    """One tensor's ring after its positions (x (batch, heads, length, dim)): slot s holds x at the latest
    position p with p % window == s, zeros where there is none; the ``k`` or ``v`` of
    :func:`window_cache_prefill`, for a state that keeps another tensor in the same slots."""
    return _in_slots(x, _ring_positions(x.shape[2], window, x.device))


def _ring(k: Tensor, v: Tensor, length: int, window: int) -> Dict[str, Tensor]:
    """The ring after positions 0 .. length-1 of k, v (batch, heads, length, dim) (:func:`window_ring`), and
    the positions its slots hold."""
    positions = _ring_positions(length, window, k.device)
    return {"k": _in_slots(k, positions), "v": _in_slots(v, positions),
            "positions": positions.expand(k.shape[0], -1).clone()}


def _sinks(k: Tensor, v: Tensor, sinks: int) -> Dict[str, Tensor]:
    """The first ``sinks`` positions of k, v (batch, heads, length, dim), zero-padded to ``sinks`` slots."""
    batch, heads, length, _ = k.shape
    kept = min(sinks, length)
    sink_k = k.new_zeros(batch, heads, sinks, k.shape[3])
    sink_v = v.new_zeros(batch, heads, sinks, v.shape[3])
    sink_k[:, :, :kept] = k[:, :, :kept]
    sink_v[:, :, :kept] = v[:, :, :kept]
    return {"sink_k": sink_k, "sink_v": sink_v}


def window_cache_prefill(k: Tensor, v: Tensor, window: int, sinks: int) -> Dict[str, Tensor]:
    """The state after a prompt's keys and values k, v (batch, heads, length, dim) (see the module doc)."""
    state = _ring(k, v, k.shape[2], window)
    state.update(_sinks(k, v, sinks))
    return state


def window_cache_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[Dict[str, Tensor]], length: int, window: int,
    sinks: int, scale: Optional[float] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Attention of position ``length`` (q_t: (batch, heads, 1, dim); k_t, v_t: (batch, kv_heads, 1, dim)) over
    the sinks and the window up to itself, and the new state (None: the start). The previous state's tensors
    are never written (a state may be stepped from twice, to branch): the ring is copied (O(window), like the
    attention), the sinks only while they are being filled. Returns ((batch, heads, 1, dim_v), state)."""
    if state is None:
        batch, heads = k_t.shape[:2]
        state = {
            "k": k_t.new_zeros(batch, heads, window, k_t.shape[3]),
            "v": v_t.new_zeros(batch, heads, window, v_t.shape[3]),
            "positions": torch.full((batch, window), -1, dtype=torch.long, device=k_t.device),
            **_sinks(k_t[:, :, :0], v_t[:, :, :0], sinks),
        }
    slot = length % window
    k, v, positions = state["k"].clone(), state["v"].clone(), state["positions"].clone()
    k[:, :, slot] = k_t[:, :, 0]
    v[:, :, slot] = v_t[:, :, 0]
    positions[:, slot] = length
    sink_k, sink_v = state["sink_k"], state["sink_v"]
    if length < sinks:
        sink_k, sink_v = sink_k.clone(), sink_v.clone()
        sink_k[:, :, length] = k_t[:, :, 0]
        sink_v[:, :, length] = v_t[:, :, 0]
    # A sink still inside the window is in the ring too: only the older ones are read from the sink slots.
    sink_seen = torch.arange(sinks, device=q_t.device) <= length - window
    batch = q_t.shape[0]
    allowed = torch.cat([sink_seen.expand(batch, sinks), positions >= 0], dim=1).view(batch, 1, 1, -1)
    out = grouped_sdpa(q_t, torch.cat([sink_k, k], dim=2), torch.cat([sink_v, v], dim=2), allowed, scale)
    return out, {"k": k, "v": v, "positions": positions, "sink_k": sink_k, "sink_v": sink_v}

"""The DPLR delta rule one position at a time (decoding) and over a prompt (prefill): a constant-size state
(batch, heads, d_k, d_v) carried from one position to the next, in the working dtype."""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .._autocast import without_autocast

from ..._validation import check_qkv
from ..delta.checks import check_state
from .checks import check_call, check_chunk_size, check_vectors, prepared, resolve_scale
from .chunk import DEFAULT_CHUNK_SIZE, dplr_delta_rule_unchecked


@without_autocast  # its precision is the working dtype (functional/_autocast.py)
def dplr_delta_rule_step_unchecked(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    a_t: Tensor,
    b_t: Tensor,
    log_decay_t: Tensor,
    state: Optional[Tensor],
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One position on checked arguments: q_t, k_t, a_t, b_t, log_decay_t (B, H, 1, d_k), v_t (B, H, 1, d_v),
    state (B, H, d_k, d_v) or None for zeros. Returns (out_t (B, H, 1, d_v) in q_t's dtype, the new state in the
    working dtype)."""
    scale = resolve_scale(scale, q_t.shape[3])
    q, k, v, a, b, log_decay = prepared(q_t, k_t, v_t, a_t, b_t, log_decay_t, None, scale)
    if state is None:
        state = k.new_zeros(k.shape[0], k.shape[1], k.shape[3], v.shape[3])
    state = state.to(k.dtype)
    # (D + b a^T) S + k v^T: the read a^T S is taken from the state before it decays, as the transition says.
    read = a @ state
    state = state * log_decay.transpose(-1, -2).exp() + b.transpose(-1, -2) @ read + k.transpose(-1, -2) @ v
    return (q @ state).to(q_t.dtype), state


def dplr_delta_rule_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    a_t: Tensor,
    b_t: Tensor,
    log_decay_t: Tensor,
    state: Optional[Tensor],
    *,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One decoding step of :func:`attnzoo.functional.dplr_delta_rule`: (out_t (B, H, 1, d_v), new state
    (B, H, d_k, d_v)). ``state`` None starts from zeros; a_t, b_t, log_decay_t are (B, H, 1, d_k)."""
    check_qkv(q_t, k_t, v_t)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError(f"a step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, dim), got seq "
                         f"lengths {q_t.shape[2]} and {k_t.shape[2]}")
    check_vectors(k_t, a_t, b_t, log_decay_t, None)
    check_state("state", state, k_t, v_t)
    resolve_scale(scale, q_t.shape[3])
    return dplr_delta_rule_step_unchecked(q_t, k_t, v_t, a_t, b_t, log_decay_t, state, scale)


def dplr_delta_rule_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    *,
    scale: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The causal DPLR delta rule over a prompt, chunked, and the state after it: (out (B, H, N, d_v) in q's
    dtype, state (B, H, d_k, d_v) in the working dtype) for :func:`dplr_delta_rule_step` to continue from."""
    check_call(q, k, v, a, b, log_decay, None, initial_state, True, scale)
    check_chunk_size(chunk_size)
    return dplr_delta_rule_unchecked(q, k, v, a, b, log_decay, None, scale, True, chunk_size, initial_state)


__all__ = ["dplr_delta_rule_prefill", "dplr_delta_rule_step", "dplr_delta_rule_step_unchecked"]

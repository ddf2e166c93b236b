"""The delta rule one position at a time (decoding) and over a prompt (prefill): a constant-size state
(batch, heads, d_k, d_v) carried from one position to the next, in the working dtype."""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ..._validation import check_floating, check_qkv
from .checks import check_call, check_chunk_size, check_gates, check_state, prepared, resolve_scale
from .chunk import DEFAULT_CHUNK_SIZE, delta_rule_unchecked


def delta_rule_step_unchecked(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    beta_t: Tensor,
    log_decay_t: Optional[Tensor],
    state: Optional[Tensor],
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One position of the (gated) delta rule on checked arguments: q_t, k_t (B, H, 1, d_k), v_t (B, H, 1, d_v),
    beta_t (B, H, 1), log_decay_t (B, H, 1) or per channel (B, H, 1, d_k) (decay first, then the correction),
    state (B, H, d_k, d_v) or None for zeros. Returns (out_t (B, H, 1, d_v) in q_t's dtype, the new state in the
    working dtype)."""
    scale = resolve_scale(scale, q_t.shape[3])
    q, k, v, beta, log_decay = prepared(q_t, k_t, v_t, beta_t, log_decay_t, None, scale)
    state = written(start_state(state, k, v), k, v, beta, log_decay)
    return (q @ state).to(q_t.dtype), state


def start_state(state: Optional[Tensor], k: Tensor, v: Tensor) -> Tensor:
    """``state`` in the keys' (working) dtype, or zeros (B, H, d_k, d_v) for None."""
    if state is None:
        return k.new_zeros(k.shape[0], k.shape[1], k.shape[3], v.shape[3])
    return state.to(k.dtype)


def written(state: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor]) -> Tensor:
    """One position's update of prepared inputs, k (B, H, 1, d_k), v (B, H, 1, d_v), beta (B, H, 1) and
    log_decay (B, H, 1) or per channel (B, H, 1, d_k): ``(I - beta k k^T) Diag(a) S + beta k v^T``."""
    if log_decay is not None:  # (B, H, 1) scales the whole state, (B, H, 1, d_k) each key channel's row
        state = state * (log_decay.exp().unsqueeze(-1) if log_decay.dim() == 3 else log_decay.exp().transpose(-1, -2))
    # The pseudo-value: what the key reads from the decayed state is replaced by beta of the new value.
    pseudo_value = beta.unsqueeze(-1) * (v - k @ state)
    return state + k.transpose(-1, -2) @ pseudo_value


def _check_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, beta_t: Tensor, log_decay_t: Optional[Tensor],
                state: Optional[Tensor]) -> None:
    check_qkv(q_t, k_t, v_t)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError(f"a step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, dim), got seq "
                         f"lengths {q_t.shape[2]} and {k_t.shape[2]}")
    check_gates(k_t, beta_t, log_decay_t, None)
    check_state("state", state, k_t, v_t)


def delta_rule_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, beta_t: Tensor, state: Optional[Tensor], *, scale: Optional[float] = None
) -> Tuple[Tensor, Tensor]:
    """One decoding step of :func:`attnzoo.functional.delta_rule`: (out_t (B, H, 1, d_v), new state
    (B, H, d_k, d_v)). ``state`` None starts from zeros; ``beta_t`` is (B, H, 1)."""
    _check_step(q_t, k_t, v_t, beta_t, None, state)
    resolve_scale(scale, q_t.shape[3])
    return delta_rule_step_unchecked(q_t, k_t, v_t, beta_t, None, state, scale)


def gated_delta_rule_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    beta_t: Tensor,
    log_decay_t: Tensor,
    state: Optional[Tensor],
    *,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One decoding step of :func:`attnzoo.functional.gated_delta_rule`; ``log_decay_t`` is (B, H, 1), or
    (B, H, 1, d_k) for a decay per key channel (Kimi Delta Attention), <= 0."""
    check_floating("log_decay_t", log_decay_t)
    _check_step(q_t, k_t, v_t, beta_t, log_decay_t, state)
    resolve_scale(scale, q_t.shape[3])
    return delta_rule_step_unchecked(q_t, k_t, v_t, beta_t, log_decay_t, state, scale)


def delta_rule_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The causal (gated, where ``log_decay`` is given) delta rule over a prompt, chunked, and the state after
    it: (out (B, H, N, d_v) in q's dtype, state (B, H, d_k, d_v) in the working dtype) for
    :func:`delta_rule_step` to continue from."""
    check_call(q, k, v, beta, log_decay, None, initial_state, True, scale)
    check_chunk_size(chunk_size)
    return delta_rule_unchecked(q, k, v, beta, log_decay, None, scale, True, chunk_size, initial_state)


__all__ = ["delta_rule_prefill", "delta_rule_step", "delta_rule_step_unchecked", "gated_delta_rule_step"]

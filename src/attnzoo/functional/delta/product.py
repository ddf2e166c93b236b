"""Gated DeltaProduct (Siems et al. 2025): the gated delta rule with n_h Householder steps per position.

Each position t has n_h keys ``k_{t,1..n_h}``, values ``v_{t,j}`` and write strengths ``beta_{t,j}``; the state
is decayed once, then corrected n_h times in order, and the query reads it after the last step::

    S_{t,0} = a_t S_{t-1}
    S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T,   j = 1 .. n_h
    S_t = S_{t,n_h},   o_t = S_t^T q_t * scale

so the state transition of a position is ``a_t`` times a product of n_h generalised Householder matrices
(rank n_h instead of the delta rule's rank 1). This is exactly the gated delta rule (:mod:`.chunk`) on a
sequence n_h times longer, the steps of each position in order, with the decay on each position's first step
(none on the others) and the outputs read at each position's last: every form here runs the shared core
that way (the chunked form with its read positions, ``stride = n_h``; the step with the delta rule's own
update n_h times), and ``n_h = 1`` is the gated delta rule itself.

``log_decay`` None: no decay (DeltaProduct without the gate). A log decay per key channel, (B, H, N, d_k),
decays each key channel's row of the state, ``S_{t,0} = Diag(a_t) S_{t-1}`` (Kimi Delta Attention's decay with
n_h steps): the shared core takes it at any stride, though no mechanism here uses it. Non-causal
(``causal=False``): every query reads the state after the whole sequence, as the delta rule's non-causal form
does.
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .checks import (
    check_chunk_size,
    check_product_call,
    check_state,
    interleaved,
    prepared,
    resolve_scale,
)
from .chunk import DEFAULT_CHUNK_SIZE, delta_chunked
from .recurrent import start_state, written

DEFAULT_PRODUCT_CHUNK_SIZE = DEFAULT_CHUNK_SIZE // 2
"""Positions per chunk of the parallel form: 16, so that at the default two steps a chunk holds 32 steps, the
delta rule's own fastest chunk at head dim 64; 32 positions (64 steps) ran 7-8% slower (docs/delta_product.md)."""


def delta_product_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    chunk_size: int = DEFAULT_PRODUCT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`delta_product` on checked arguments. Returns (out in q's dtype, final state in the working
    dtype)."""
    scale = resolve_scale(scale, q.shape[3])
    k_steps, v_steps, beta_steps, decay_steps, mask_steps = interleaved(k, v, beta, log_decay, key_padding_mask)
    inputs = prepared(q, k_steps, v_steps, beta_steps, decay_steps, mask_steps, scale)
    out, state = delta_chunked(*inputs, causal, chunk_size, initial_state, stride=k.shape[3])
    return out.to(q.dtype), state


def delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_PRODUCT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """Gated DeltaProduct (see the module docstring), chunked: the gated delta rule's WY form on the n_h steps
    of every position, read after each position's last step.

    Keys and queries are used as given (the paper L2-normalises the keys of every step first;
    :class:`attnzoo.mechanisms.delta_product.DeltaProductAttention` does). A padded position writes nothing and
    does not decay the state, whatever it holds.

    Args:
        q: (batch, heads, seq, d_k).
        k: (batch, heads, seq, n_h, d_k), the n_h keys of each position in the order they are applied.
        v: (batch, heads, seq, n_h, d_v).
        beta: (batch, heads, seq, n_h), in [0, 2] ((0, 1) from a sigmoid; up to 2 gives the transition
            negative eigenvalues).
        log_decay: (batch, heads, seq), or (batch, heads, seq, d_k) for a decay per key channel, finite and
            <= 0, applied once per position before its first step; or None for no decay.
        scale: applied to the queries; ``d_k ** -0.5`` when None.
        causal: each query reads the state after its own position's last step; False: every query reads the
            final state.
        key_padding_mask: (batch, seq) bool, True marks padding.
        chunk_size: positions per chunk of the parallel form (``chunk_size * n_h`` steps).
        initial_state: (batch, heads, d_k, d_v) state before the first position, or None for zeros.

    Returns:
        (batch, heads, seq, d_v) in q's dtype.
    """
    check_product_call(q, k, v, beta, log_decay, key_padding_mask, initial_state, causal, scale)
    check_chunk_size(chunk_size)
    return delta_product_unchecked(q, k, v, beta, log_decay, key_padding_mask, scale, causal, chunk_size,
                                   initial_state)[0]


def delta_product_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    *,
    scale: Optional[float] = None,
    chunk_size: int = DEFAULT_PRODUCT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The causal :func:`delta_product` over a prompt and the state after it: (out (B, H, N, d_v) in q's dtype,
    state (B, H, d_k, d_v) in the working dtype) for :func:`delta_product_step` to continue from."""
    check_product_call(q, k, v, beta, log_decay, None, initial_state, True, scale)
    check_chunk_size(chunk_size)
    return delta_product_unchecked(q, k, v, beta, log_decay, None, scale, True, chunk_size, initial_state)


def delta_product_step_unchecked(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    beta_t: Tensor,
    log_decay_t: Optional[Tensor],
    state: Optional[Tensor],
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One position on checked arguments: q_t (B, H, 1, d_k), k_t (B, H, 1, n_h, d_k), v_t (B, H, 1, n_h, d_v),
    beta_t (B, H, 1, n_h), log_decay_t (B, H, 1), (B, H, 1, d_k) per key channel, or None, state (B, H, d_k,
    d_v) or None for zeros. The delta rule's update n_h times, the decay with the first. Returns (out_t
    (B, H, 1, d_v) in q_t's dtype, the new state in the working dtype)."""
    scale = resolve_scale(scale, q_t.shape[3])
    k_steps, v_steps, beta_steps, decay_steps, _ = interleaved(k_t, v_t, beta_t, log_decay_t, None)
    q, k, v, beta, log_decay = prepared(q_t, k_steps, v_steps, beta_steps, decay_steps, None, scale)
    state = start_state(state, k, v)
    for j in range(k.shape[2]):
        one = slice(j, j + 1)
        decay = None if log_decay is None or j else log_decay[:, :, one]
        state = written(state, k[:, :, one], v[:, :, one], beta[:, :, one], decay)
    return (q @ state).to(q_t.dtype), state


def delta_product_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    beta_t: Tensor,
    log_decay_t: Optional[Tensor],
    state: Optional[Tensor],
    *,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """One decoding step of :func:`delta_product`: (out_t (B, H, 1, d_v), new state (B, H, d_k, d_v)). Shapes as
    :func:`delta_product_step_unchecked`; ``state`` None starts from zeros."""
    check_product_call(q_t, k_t, v_t, beta_t, log_decay_t, None, None, True, scale)
    if q_t.shape[2] != 1:
        raise ValueError(f"a step takes one position: q_t of shape (batch, heads, 1, d_k) and k_t, v_t, beta_t "
                         f"with seq 1, got seq length {q_t.shape[2]}")
    check_state("state", state, k_t[:, :, :, 0], v_t[:, :, :, 0])
    return delta_product_step_unchecked(q_t, k_t, v_t, beta_t, log_decay_t, state, scale)


__all__ = ["DEFAULT_PRODUCT_CHUNK_SIZE", "delta_product", "delta_product_prefill", "delta_product_step",
           "delta_product_step_unchecked", "delta_product_unchecked"]

"""The chunked parallel form of the delta rule, plain and gated: no loop over tokens, one over chunks.

The recurrence (state ``S`` of shape (d_k, d_v), so that ``o_t = S_t^T q_t``)::

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   a_t = exp(log_decay_t)  (a_t = 1: plain)

Write ``S_t = a_t S_{t-1} + k_t u_t^T`` with the *pseudo-value* ``u_t = beta_t (v_t - a_t S_{t-1}^T k_t)``.
Inside a chunk of C positions starting from the state ``S_0``, with ``g_t`` the cumulative log decay from the
chunk's start (inclusive) and ``gamma_t = exp(g_t)``, unrolling gives

    u_t + beta_t sum_{j<t} exp(g_t - g_j) (k_t . k_j) u_j = beta_t (v_t - gamma_t S_0^T k_t)

a unit lower-triangular system ``(I + A) U = diag(beta) (V - diag(gamma) K S_0)`` with
``A = tril(diag(beta) (K K^T * Gamma), -1)``, ``Gamma_tj = exp(g_t - g_j)``. Its solution splits into parts
that do not depend on the state (the WY / UT representation of Yang et al. 2024):
``U_state_free = T V`` and ``W = T diag(gamma) K`` with ``T = (I + A)^{-1} diag(beta)``, so that
``U = U_state_free - W S_0``. One batched triangular solve gives both for every chunk at once. Then

    O     = diag(gamma) Q S_0 + (Q K^T * Gamma, lower incl. diagonal) U
          = (diag(gamma) Q - P W) S_0 + P U_state_free                       (P: the masked Q K^T * Gamma)
    S_end = gamma_C S_0 + K^T diag(exp(g_C - g)) U  = M S_0 + B,
    M     = gamma_C I - K^T diag(exp(g_C - g)) W,   B = K^T diag(exp(g_C - g)) U_state_free

Everything but ``S_{c+1} = M_c S_c + B_c`` is batched over chunks; the scan is one (d_k x d_k)(d_k x d_v)
product per chunk. Every decay factor is ``exp`` of a difference ``g_t - g_j <= 0`` (masked before ``exp``),
so no factor overflows however strong the decay. Cost: O(N C d + N d^2) time, O(N C + (N / C) d^2) memory.

Per-channel decay (Kimi Delta Attention, ``log_decay`` of shape (B, H, N, d_k)): the state decays first, then
is corrected, ``S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T`` (the scalar case is the same
maths, a scalar commuting with the correction). Everything above holds with ``g_t`` a vector: ``diag(gamma)
K`` scales each key's channels by ``exp(g_t)``, ``gamma_C I`` becomes ``Diag(exp(g_C))``, and the products
``K K^T * Gamma``, ``Q K^T * Gamma`` become ``sum_c k_tc k_jc exp(g_tc - g_jc)`` (resp. ``q_tc``), which
:mod:`.channels` computes without overflow (a factored form needs references inside the chunk).

Non-causal (``causal=False``): every query reads the state after the whole sequence, ``o_i = S_N^T q_i``,
which is what non-causal linear attention is (the sum over every key); the delta rule's writes still happen
in sequence order.

Read positions (``stride`` s, :func:`delta_chunked`): the keys, values and gates may hold s positions per
query, query t reading the state after position ``(t + 1) s - 1`` only. The output terms above then keep only
those rows of ``Q K^T * Gamma`` and ``gamma``; everything else is unchanged. Gated DeltaProduct is this form
(:mod:`.product`). Either decay takes any stride: per channel, the queries are spread over the chunk's C rows
(zeros between the read positions) for the products of :mod:`.channels`, and the read rows kept.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._validation import check_floating
from .checks import check_call, check_chunk_size, prepared, resolve_scale
from .channels import DecayedProducts
from .fused import ChunkedDeltaRule, read_positions, spread_reads

DEFAULT_CHUNK_SIZE = 32
"""Chunk length of the parallel form: the triangular solves are C x C, the scan has N / C steps. 32 is the
fastest at head dim 64 on CPUs (docs/delta.md): the C x C work per position halves from 64, while the d x d work
per position stays and the scan's steps double."""


def _in_chunks(x: Tensor, pad: int, chunk: int) -> Tensor:
    """(B, H, N, *rest) -> (B, H, n, C, *rest), zero-padded at the end to whole chunks."""
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def _pair_products(q: Tensor, k: Tensor, log_decay: Optional[Tensor], stride: int
                   ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """For chunked inputs (q with C / stride rows, at the read positions): (K K^T, Q K^T, g), the decay between
    positions inside both products where gated (g the cumulative log decay within each chunk, with a trailing
    d_k where it is per channel, or None). Only the causal part of either product is read."""
    chunk, reads = k.shape[3], read_positions(stride)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    if log_decay is None:
        kk, qk = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
        return kk, qk.masked_fill(~lower[reads], 0.0), None
    if log_decay.dim() == k.dim():  # per channel: the decay sits inside the sums (.channels), over all C rows
        g = log_decay.cumsum(-2)
        qk, kk = DecayedProducts.apply(torch.stack([spread_reads(q, stride), k], dim=-3), k, g).unbind(-3)
        return kk, qk[..., reads, :], g
    g = log_decay.cumsum(-1)
    within = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    return k @ k.transpose(-1, -2) * within, q @ k.transpose(-1, -2) * within[..., reads, :], g


def _chunk_terms(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor], causal: bool, stride: int
) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor, Tensor]:
    """For chunked (B, H, n, C, d) inputs (q (B, H, n, C / stride, d), read after every stride-th position): the
    output terms ``(diag(gamma) Q - P W, P U_state_free)`` (None when not causal) and the scan terms ``(M, B)``
    of the module docstring, all batched over chunks. With a decay per channel, gamma is a (d_k) vector per
    position, ``diag(gamma) Q`` scales each query channel by it."""
    kk, scores, g = _pair_products(q, k, log_decay, stride)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    if g is None:
        gamma_q, gamma_k, k_to_end, carry = q, k, k, eye
    else:
        g = g if g.dim() == k.dim() else g.unsqueeze(-1)  # (.., C, d_k) or (.., C, 1): rows' factors
        gamma, to_end = g.exp(), (g[..., -1:, :] - g).exp()
        gamma_q, gamma_k, k_to_end = q * gamma[..., read_positions(stride), :], k * gamma, k * to_end
        carry = g[..., -1, :].exp().unsqueeze(-1) * eye  # diag(gamma_C)
    strictly_lower = (kk * beta.unsqueeze(-1)).tril(-1)
    rhs = torch.cat([v, gamma_k], dim=-1) * beta.unsqueeze(-1)
    solved = torch.linalg.solve_triangular(strictly_lower, rhs, upper=False, unitriangular=True)
    u_free, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    transition = carry - k_to_end.transpose(-1, -2) @ w
    write = k_to_end.transpose(-1, -2) @ u_free
    if not causal:
        return None, None, transition, write
    return gamma_q - scores @ w, scores @ u_free, transition, write


def _fused(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor], state: Tensor, pad: int,
           chunk: int, stride: int) -> Tuple[Tensor, Tensor]:
    """The causal form through :class:`.fused.ChunkedDeltaRule`, in its (batch * heads, chunks, C, d) layout."""
    batch, heads, length, _ = q.shape

    def chunked(x: Tensor, pad: int = pad, chunk: int = chunk) -> Tensor:
        x = _in_chunks(x, pad, chunk)
        return x.reshape(batch * heads, *x.shape[2:]).contiguous()

    g = None if log_decay is None else chunked(log_decay).cumsum(2)  # within each chunk, along C
    out, state = ChunkedDeltaRule.apply(chunked(q, pad // stride, chunk // stride), chunked(k), chunked(v),
                                        chunked(beta), g, state.reshape(batch * heads, *state.shape[2:]))
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
    return out, state.reshape(batch, heads, *state.shape[1:])


def delta_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    causal: bool,
    chunk_size: int,
    initial_state: Optional[Tensor],
    stride: int = 1,
) -> Tuple[Tensor, Tensor]:
    """The chunked delta rule on prepared inputs (working dtype, scaled queries, inert padding; see
    :func:`attnzoo.functional.delta.checks.prepared`). Returns (out (B, H, N, d_v), final state
    (B, H, d_k, d_v)), both in the working dtype.

    ``stride`` s: k, v, beta and log_decay hold s positions per query (N s of them), query t reading the state
    after position ``(t + 1) s - 1`` (causal); ``chunk_size`` then counts queries, a chunk holding
    ``chunk_size * s`` positions."""
    batch, heads, length, d_k = q.shape
    d_v = v.shape[-1]
    chunk = min(chunk_size, length) * stride
    pad = -length % (chunk // stride) * stride
    state = initial_state.to(k.dtype) if initial_state is not None else k.new_zeros(batch, heads, d_k, d_v)
    if causal and not torch.compiler.is_compiling():
        # dynamo traces the plain operations below instead (a compiled graph plans its own memory).
        return _fused(q, k, v, beta, log_decay, state, pad, chunk, stride)
    chunked = [_in_chunks(q, pad // stride, chunk // stride)] + [_in_chunks(x, pad, chunk) for x in (k, v)]
    gates = [None if x is None else _in_chunks(x, pad, chunk) for x in (beta, log_decay)]
    out_state_term, out_free_term, transition, write = _chunk_terms(*chunked, *gates, causal, stride)
    starts = []
    # unbind: one backward node for every chunk's slice (indexing made one full-size gradient per chunk).
    for chunk_transition, chunk_write in zip(transition.unbind(2), write.unbind(2)):
        starts.append(state)
        state = chunk_transition @ state + chunk_write
    if not causal:
        return q @ state, state
    out = out_state_term @ torch.stack(starts, dim=2) + out_free_term
    return out.reshape(batch, heads, -1, d_v)[:, :, :length], state


def delta_rule_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`delta_rule` (``log_decay`` None) or :func:`gated_delta_rule` on checked arguments. Returns
    (out in q's dtype, final state in the working dtype)."""
    scale = resolve_scale(scale, q.shape[3])
    inputs = prepared(q, k, v, beta, log_decay, key_padding_mask, scale)
    out, state = delta_chunked(*inputs, causal, chunk_size, initial_state)
    return out.to(q.dtype), state


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """The delta rule (DeltaNet; Schlag et al. 2021, Yang et al. 2024), chunked (see the module docstring).

    ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t * scale``. Queries and keys
    are used as given (DeltaNet L2-normalises them first; :class:`attnzoo.mechanisms.delta.DeltaNetAttention`
    does). Padded positions write nothing, whatever they hold.

    Args:
        q, k: (batch, heads, seq, d_k); v: (batch, heads, seq, d_v).
        beta: (batch, heads, seq) write strengths, finite (in [0, 1] from a sigmoid, as DeltaNet has them;
            (0, 2) keeps ``I - beta k k^T`` contracting for unit keys).
        scale: applied to the queries; ``d_k ** -0.5`` when None.
        causal: each query reads the state after its own position; False: every query reads the final state.
        key_padding_mask: (batch, seq) bool, True marks padding.
        chunk_size: chunk length of the parallel form.
        initial_state: (batch, heads, d_k, d_v) state before the first position, or None for zeros.

    Returns:
        (batch, heads, seq, d_v) in q's dtype.
    """
    check_call(q, k, v, beta, None, key_padding_mask, initial_state, causal, scale)
    check_chunk_size(chunk_size)
    return delta_rule_unchecked(q, k, v, beta, None, key_padding_mask, scale, causal, chunk_size, initial_state)[0]


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """The gated delta rule (Gated DeltaNet, Yang et al. 2025), chunked (see the module docstring).

    ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` with ``a_t = exp(log_decay_t)``,
    ``o_t = S_t^T q_t * scale``. Arguments as :func:`delta_rule`, plus ``log_decay`` (batch, heads, seq),
    finite and <= 0; a padded position neither writes nor decays the state.

    ``log_decay`` of shape (batch, heads, seq, d_k) is a decay per key channel (Kimi Delta Attention, Kimi
    Team 2025): ``S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T``, the state decayed
    first, then corrected (for a scalar the two orders agree).

    Returns:
        (batch, heads, seq, d_v) in q's dtype.
    """
    check_floating("log_decay", log_decay)  # required here: None would silently be the plain delta rule
    check_call(q, k, v, beta, log_decay, key_padding_mask, initial_state, causal, scale)
    check_chunk_size(chunk_size)
    return delta_rule_unchecked(q, k, v, beta, log_decay, key_padding_mask, scale, causal, chunk_size,
                                initial_state)[0]


__all__ = ["DEFAULT_CHUNK_SIZE", "delta_chunked", "delta_rule", "delta_rule_unchecked", "gated_delta_rule"]

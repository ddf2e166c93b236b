"""The chunked parallel form of the DPLR delta rule: no loop over tokens, one over chunks.

The recurrence (state ``S`` of shape (d_k, d_v), so that ``o_t = S_t^T q_t``)::

    S_t = (D_t + b_t a_t^T) S_{t-1} + k_t v_t^T,    D_t = diag(exp(l_t)),  l_t = log_decay_t <= 0 per channel

Inside a chunk of C positions starting from the state ``S_0``, with ``g_t`` the cumulative log decay from the
chunk's start (inclusive, per channel) and ``u_t = S_{t-1}^T a_t`` what the read vector takes from the state
(a d_v row, the pseudo-value of the low-rank part), unrolling gives

    S_t = exp(g_t) * S_0 + sum_{j<=t} exp(g_t - g_j) * (k_j v_j^T + b_j u_j^T)      (* per key channel)
    u_t = S_0^T (a_t exp(g_{t-1})) + sum_{j<t} A_ak[t, j] v_j + A_ab[t, j] u_j
    o_t = S_0^T (q_t exp(g_t))     + sum_{j<=t} A_qk[t, j] v_j + A_qb[t, j] u_j

with ``A_xy[t, j] = sum_c x_tc exp(g'_tc - g_jc) y_jc`` (``g' = g`` for q, the exclusive ``g_{t-1}`` for a).
So ``(I - A_ab) U = A_ak V + A~ S_0`` (``A~`` the rows ``a_t exp(g_{t-1})``), a unit lower-triangular system
whose solution splits into ``U = U_free + W S_0`` (the WY form: ``W = T A~``, ``U_free = T A_ak V``,
``T = (I - A_ab)^{-1}``), one batched triangular solve for every chunk. Then

    U     = U_free + W S_0
    O     = Q~ S_0 + A_qk V + A_qb U                                  (Q~: rows q_t exp(g_t))
    S_end = diag(exp(g_C)) S_0 + K^^T V + B^^T U                     (K^, B^: rows x_j exp(g_C - g_j))

and only ``U_c = U_free,c + W_c S_c`` and ``S_{c+1} = diag(exp(g_C)) S_c + K^^T V + B^^T U_c`` run chunk after
chunk: two (C x d)(d x d)-sized products per chunk, as fla's ``chunk_h`` carries the state, instead of forming
a (d x d) transition ``diag(exp(g_C)) + B^^T W`` per chunk and multiplying states by it.

Numerics. The decay is per channel, so ``A_xy`` is not a plain product ``X Y^T``: it must be factorised as
``(x_t exp(g'_t - r)) . (y_j exp(r - g_j))`` about some reference ``r``. With one reference per chunk one of the
factors is ``exp`` of a positive number as large as the chunk's whole decay: it overflows (inf, then NaN
through ``0 * inf`` in the masked entries and their gradients) once a channel decays by more than ~e^-88 over
a chunk in float32, which a strongly forgetting channel reaches within a few positions. So the products come
from :mod:`..delta.channels`, shared with Kimi Delta Attention: one reference per block at the middle of its
range where the decay spans less than the dtype allows, and where it spans more the block split in halves, the
pairs across the split taking the split as reference (both factors ``exp`` of a number <= 0), each half a block
again. ``A_ak`` and ``A_ab``, whose rows read the exclusive ``g_{t-1}``, are the products of the rows ``a_{s+1}``
at ``g_s``, moved down one row. The other factors here are ``exp`` of a difference <= 0 (``exp(g_t)``,
``exp(g_C - g_j)``), so the form is exact to rounding for any decays, however strong. Cost: O(N C d) elementwise
where the decay is gentle, up to O(N C d log C) where every block splits, beside the O(N C d + N d^2) of the
products; O(N C + (N / C) d^2) memory.

Non-causal (``causal=False``): every query reads the state after the whole sequence, ``o_i = S_N^T q_i``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import without_autocast

from ..delta.channels import DecayedProducts
from .checks import check_call, check_chunk_size, prepared, resolve_scale
from .fused import ChunkedDPLR, rows_down, rows_up

DEFAULT_CHUNK_SIZE = 32
"""Chunk length of the parallel form (a power of two: the within-chunk products halve it level by level). For
``rwkv7`` at head dim 64, 16 ran 1 to 3% faster than 32 on one CPU thread and 4% slower on two; 64 was slower on
one (docs/rwkv7.md)."""


def _in_chunks(x: Tensor, pad: int, chunk: int) -> Tensor:
    """(B, H, N, d) -> (B, H, n, C, d), zero-padded at the end to whole chunks (a zero log decay is no decay)."""
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, x.shape[-1])


def _chunk_products(q: Tensor, k: Tensor, a: Tensor, b: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four decayed products of a chunk (module docstring), each (..., C, C): A_qk and A_qb lower triangular
    with the diagonal, A_ak and A_ab strictly lower; g the inclusive cumulative log decay from the chunk's start.
    The rows of A_ak and A_ab read the exclusive ``g_{t-1}``: they are the products of the rows ``a_{s+1}`` at
    ``g_s``, moved down one row, so :class:`..delta.channels.DecayedProducts` serves all four, as in the fused
    form."""
    rows = torch.stack([q, rows_up(a)], dim=-3)
    with_k, with_b = DecayedProducts.apply(rows, k, g), DecayedProducts.apply(rows, b, g)
    return (with_k[..., 0, :, :], with_b[..., 0, :, :], rows_down(with_k[..., 1, :, :]),
            rows_down(with_b[..., 1, :, :]))


def _chunk_terms(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, log_decay: Tensor, causal: bool
) -> Tuple[Tuple[Tensor, Tensor, Tensor, Tensor, Tensor], Optional[Tuple[Tensor, Tensor, Tensor]]]:
    """For chunked (B, H, n, C, d) inputs: the scan terms ``(U_free, W, exp(g_C) (B, H, n, d_k, 1), B^^T,
    K^^T V)`` and the output terms ``(Q~, A_qk V, A_qb)`` (None when not causal) of the module docstring, all
    batched over chunks."""
    g = log_decay.cumsum(-2)
    g_prev = F.pad(g[..., :-1, :], (0, 0, 1, 0))  # exactly the previous position's g: 0 before the first
    a_qk, a_qb, a_ak, a_ab = _chunk_products(q, k, a, b, g)
    g_end = g[..., -1:, :]
    to_end = (g_end - g).exp()
    # unitriangular: the (zero) diagonal of -A_ab is read as ones, so this solves (I - A_ab) X = R.
    rhs = torch.cat([a_ak @ v, a * g_prev.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(-a_ab, rhs, upper=False, unitriangular=True)
    u_free, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scan = (u_free, w, g_end.transpose(-1, -2).exp(), (b * to_end).transpose(-1, -2),
            (k * to_end).transpose(-1, -2) @ v)
    if not causal:
        return scan, None
    return scan, (q * g.exp(), a_qk @ v, a_qb)


def _fused(inputs: Tuple[Tensor, ...], state: Tensor, pad: int, chunk: int) -> Tuple[Tensor, Tensor]:
    """The causal form through :class:`.fused.ChunkedDPLR` (hand-written backward), in its (batch * heads,
    chunks, C, d) layout. inputs: (q, k, v, a, b, log_decay) as :func:`dplr_chunked` takes them."""
    batch, heads, length, _ = inputs[0].shape

    def chunked(x: Tensor) -> Tensor:
        x = _in_chunks(x, pad, chunk)
        return x.reshape(batch * heads, *x.shape[2:]).contiguous()

    q, k, v, a, b, log_decay = (chunked(x) for x in inputs)
    out, state = ChunkedDPLR.apply(q, k, v, a, b, log_decay, state.reshape(batch * heads, *state.shape[2:]))
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
    return out, state.reshape(batch, heads, *state.shape[1:])


@without_autocast  # its precision is the working dtype (functional/_autocast.py)
def dplr_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    causal: bool,
    chunk_size: int,
    initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """The chunked DPLR delta rule on prepared inputs (working dtype, scaled queries, inert padding; see
    :func:`attnzoo.functional.dplr.checks.prepared`). Returns (out (B, H, N, d_v), final state (B, H, d_k, d_v)),
    both in the working dtype."""
    batch, heads, length, d_k = k.shape
    d_v = v.shape[-1]
    chunk = min(chunk_size, 1 << (int(length) - 1).bit_length())  # a power of two, no longer than needed
    pad = -length % chunk
    state = initial_state.to(k.dtype) if initial_state is not None else k.new_zeros(batch, heads, d_k, d_v)
    if causal and not torch.compiler.is_compiling():
        # dynamo traces the plain operations below instead (a compiled graph plans its own memory).
        return _fused((q, k, v, a, b, log_decay), state, pad, chunk)
    chunked = [_in_chunks(x, pad, chunk) for x in (q, k, v, a, b, log_decay)]
    scan, output = _chunk_terms(*chunked, causal)
    starts, pseudo_values = [], []
    # unbind: one backward node for every chunk's slice (indexing made one full-size gradient per chunk).
    for u_free, w, gamma_end, b_to_end, write in zip(*(x.unbind(2) for x in scan)):
        starts.append(state)
        u = u_free + w @ state
        pseudo_values.append(u)
        state = gamma_end * state + write + b_to_end @ u
    if not causal:
        return q @ state, state
    gamma_q, free, a_qb = output
    out = gamma_q @ torch.stack(starts, dim=2) + free + a_qb @ torch.stack(pseudo_values, dim=2)
    return out.reshape(batch, heads, -1, d_v)[:, :, :length], state


def dplr_delta_rule_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`dplr_delta_rule` on checked arguments. Returns (out in q's dtype, final state in the working dtype)."""
    scale = resolve_scale(scale, q.shape[3])
    inputs = prepared(q, k, v, a, b, log_decay, key_padding_mask, scale)
    out, state = dplr_chunked(*inputs, causal, chunk_size, initial_state)
    return out.to(q.dtype), state


def dplr_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """The generalized delta rule with a diagonal-plus-low-rank transition (RWKV-7's; fla's ``dplr``), chunked.

    ``S_t = (diag(exp(log_decay_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t * scale``. RWKV-7 is
    ``a = -kappa``, ``b = kappa * alpha`` (kappa the unit removal key, alpha its in-context learning rate), which
    makes the transition ``diag(w) - alpha kappa kappa^T``-like; here a and b are taken as given. A padded
    position writes nothing, does not decay the state and outputs 0, whatever it holds.

    Args:
        q, k, a, b: (batch, heads, seq, d_k); v: (batch, heads, seq, d_v).
        log_decay: (batch, heads, seq, d_k), finite and <= 0: the per-channel decay ``exp(log_decay)``.
        scale: applied to the queries; ``d_k ** -0.5`` when None.
        causal: False reads the state after the whole sequence at every position.
        key_padding_mask: (batch, seq) bool, True marks padding.
        chunk_size: chunk length, a power of two.
        initial_state: (batch, heads, d_k, d_v) to continue from, or None for zeros.

    Returns:
        (batch, heads, seq, d_v) in q's dtype.
    """
    check_call(q, k, v, a, b, log_decay, key_padding_mask, initial_state, causal, scale)
    check_chunk_size(chunk_size)
    return dplr_delta_rule_unchecked(q, k, v, a, b, log_decay, key_padding_mask, scale, causal, chunk_size,
                                     initial_state)[0]


__all__ = ["DEFAULT_CHUNK_SIZE", "dplr_chunked", "dplr_delta_rule", "dplr_delta_rule_unchecked"]

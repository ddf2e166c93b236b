"""The causal chunked delta rule with a hand-written backward (:class:`ChunkedDeltaRule`), the fast path behind
:func:`attnzoo.functional.delta_rule` and :func:`attnzoo.functional.gated_delta_rule`.

Same maths as :mod:`.chunk` (its docstring has the derivation), organised for speed on CPUs:

* ``T = (I + A)^{-1}`` is formed once per chunk (one batched unit-triangular solve against the identity), so
  the forward's ``[U_free, W] = T diag(beta) [V, diag(gamma) K]`` and the backward's ``T^T dX`` are plain
  matmuls; autograd through ``solve_triangular`` would solve again in the backward, and a triangular solve
  with many right-hand sides runs at a fraction of a matmul's speed.
* The scan carries the state as fla's chunk form does, ``U_c = U_free,c - W_c S_c``,
  ``S_{c+1} = gamma_C S_c + K~_c^T U_c``: two (C x d)(d x d)-sized products per chunk, instead of forming a
  (d x d) transition per chunk and multiplying states by it.
* The backward walks the chunks in reverse with the same two products per chunk; everything else in either
  direction is batched over every chunk. Nothing is differentiated twice (``gradcheck`` covers first order).
* ``stride`` s: queries read the state only after every s-th position (the last of each group of s), so a chunk
  of C positions has C / s queries. Gated DeltaProduct is this rule on a sequence of n_h sub-steps per token
  read at each token's last (:mod:`.product`); the output terms then have C / s rows, and their gradients
  reach the log decay at the read positions only. s = 1 is the plain rule. With a decay per key channel the
  decayed products (:mod:`.channels`) take the queries spread over all C rows (zeros between the read
  positions) and keep the read rows: any stride works with either decay.

Layout inside: (batch * heads, chunks, C, d), the inputs' own memory order (no copy to enter or leave).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import outside_autocast
from ..exp_floor import exp_floor, exp_nonpositive, exp_nonpositive_
from ..norms import row_dots
from .channels import ChunkFactors, chunk_factors, decay_factors, decayed_products_backward_many, decayed_products_many

Saved = Tuple[Tensor, ...]


def _flat(x: Tensor) -> Tensor:
    """(Z, n, r, c) -> (Z * n, r, c), a view, for the batched matmuls that accumulate (baddbmm)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _gate_terms(g: Tensor, factors: Optional[ChunkFactors]) -> Tuple[Tensor, Tensor, Tensor]:
    """From the within-chunk cumulative log decay g, (Z, n, C) or per channel (Z, n, C, d_k) with its
    ``factors`` (:func:`.channels.chunk_factors`; None for a scalar decay): gamma = exp(g) and to_end =
    exp(g_C - g), each (Z, n, C, 1) or (Z, n, C, d_k) to scale q and k rows, and gamma_C, (Z, n, 1, 1) or
    (Z, n, d_k, 1) to scale a chunk's (d_k, d_v) state."""
    if factors is None:
        g = g.unsqueeze(-1)
        return exp_nonpositive(g), exp_nonpositive_(g[..., -1:, :] - g), exp_nonpositive(g[..., -1, :]).unsqueeze(-1)
    return (*decay_factors(factors), exp_nonpositive(g[..., -1, :]).unsqueeze(-1))


def _factors(g: Optional[Tensor], k: Tensor) -> Optional[ChunkFactors]:
    """g's :class:`.channels.ChunkFactors` where the decay is per channel, else None."""
    return chunk_factors(g) if g is not None and g.dim() == k.dim() else None


def _within(g: Tensor) -> Tensor:
    """Gamma (Z, n, C, C) = exp(g_t - g_j) on and below the diagonal, 0 above. Every exponent is clamped into
    [floor, 0] before exp (the entries above the diagonal, whose differences are >= 0, are then 1 until the mask
    zeroes them), so nothing overflows however strong the decay, and nothing takes exp's slow subnormal path
    (:mod:`..exp_floor`)."""
    return (g.unsqueeze(-1) - g.unsqueeze(-2)).clamp_(exp_floor(g.dtype), 0.0).exp_().tril_()


def read_positions(stride: int) -> slice:
    """The positions of a chunk that queries read after: the last of each group of ``stride``."""
    return slice(stride - 1, None, stride)


def spread_reads(x: Tensor, stride: int) -> Tensor:
    """(.., C / stride, c) -> (.., C, c): row i at position ``(i + 1) stride - 1`` (a read position), zero rows
    between; x itself at stride 1. Lets the per-channel products, which pair every position with every
    position, serve queries at read positions only."""
    if stride == 1:
        return x
    return F.pad(x.unsqueeze(-2), (0, 0, stride - 1, 0)).flatten(-3, -2)


def _causal_rows(scores: Tensor, stride: int) -> Tensor:
    """Zero, in place, what a query may not see in (.., C / stride, C) scores: position j is seen by query i
    when ``j <= (i + 1) stride - 1``."""
    if stride == 1:
        return scores.tril_()
    chunk = scores.shape[-1]
    seen = torch.ones(chunk, chunk, dtype=torch.bool, device=scores.device).tril()[read_positions(stride)]
    return scores.masked_fill_(~seen, 0.0)


def _pair_terms(q: Tensor, k: Tensor, g: Optional[Tensor], stride: int, factors: Optional[ChunkFactors]
                ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(K K^T, the causal Q K^T with q's C / stride rows, Gamma or None), the decay between positions inside
    both products where gated: a scalar decay multiplies them by Gamma (its read rows for Q K^T); a per-channel
    one sits inside the sums (:mod:`.channels`), and K K^T is then 0 above the diagonal (only its strictly lower
    part is read)."""
    reads = read_positions(stride)
    if factors is not None:
        qk, kk = decayed_products_many((spread_reads(q, stride), k), (k,), g, factors)[0].unbind(-3)
        return kk, qk[..., reads, :], None
    kk = k @ k.transpose(-1, -2)
    qk = q @ k.transpose(-1, -2)
    if g is None:
        return kk, _causal_rows(qk, stride), None
    within = _within(g)
    return kk.mul_(within), qk.mul_(within[..., reads, :]), within  # Gamma is 0 above the diagonal: causal


def _forward(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], state: Tensor, stride: int
             ) -> Tuple[Tensor, Tensor, Saved]:
    """Chunked inputs (Z, n, C, d), q (Z, n, C / stride, d_k), gates (Z, n, C) (g also (Z, n, C, d_k), per
    channel), state (Z, d_k, d_v). Returns (out (Z, n, C / stride, d_v), final state, what the backward
    needs)."""
    chunk = k.shape[-2]
    factors = _factors(g, k)
    kk, p, within = _pair_terms(q, k, g, stride, factors)
    if g is None:
        gamma_q, gamma_k, k_to_end, gamma_end = q, k, k, None
    else:
        gamma, to_end, gamma_end = _gate_terms(g, factors)
        gamma_q, gamma_k, k_to_end = q * gamma[..., read_positions(stride), :], k * gamma, k * to_end
    a = (kk * beta.unsqueeze(-1)).tril_(-1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    # unitriangular: the (zero) diagonal of a is read as ones, so this is (I + A)^{-1}.
    t = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
    # Two products, not one with [V, K] side by side: a 2d-wide right-hand side runs slower than two d-wide.
    u_free, w = t @ (v * beta.unsqueeze(-1)), t @ (gamma_k * beta.unsqueeze(-1))
    states = k.new_empty(k.shape[0], k.shape[1], *state.shape[1:])
    u = torch.empty_like(u_free)
    # The state is updated in place (it is contiguous; a chunk's slice of u is not, and an in-place product
    # into a strided slice runs one matrix at a time). The caller's state is not touched.
    state = state.clone()
    for c in range(k.shape[1]):
        states[:, c] = state
        u_c = torch.baddbmm(u_free[:, c], w[:, c], state, alpha=-1.0)
        u[:, c] = u_c
        if gamma_end is not None:
            state.mul_(gamma_end[:, c])
        state.baddbmm_(k_to_end[:, c].transpose(-1, -2), u_c)
    out = torch.baddbmm(_flat(gamma_q @ states), _flat(p), _flat(u)).view(*q.shape[:-1], v.shape[-1])
    # kk is K K^T with the decay between positions where gated; p the causal Q K^T with it.
    gates = () if g is None else (g,) if within is None else (g, within)
    return out, state, (q, k, v, beta, kk, p, t, u_free, w, u, states) + gates


def _scan_backward(grad_out: Tensor, grad_final: Tensor, p: Tensor, gamma_q: Tensor, k_to_end: Tensor, w: Tensor,
                   gamma_end: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """The reverse walk over chunks: (dU (Z, n, C, d_v), dS_{c+1} per chunk (Z, n, d_k, d_v), dS_0). grad_out,
    p and gamma_q have one row per query (C / stride)."""
    grad_u_local = p.transpose(-1, -2) @ grad_out
    grad_state_local = gamma_q.transpose(-1, -2) @ grad_out
    grad_u = torch.empty_like(grad_u_local)
    grad_next = grad_out.new_empty(grad_out.shape[0], grad_out.shape[1], *grad_final.shape[1:])
    grad_state = grad_final.clone()  # updated in place, as the state in the forward
    for c in reversed(range(grad_out.shape[1])):
        grad_next[:, c] = grad_state
        grad_u_c = torch.baddbmm(grad_u_local[:, c], k_to_end[:, c], grad_state)
        grad_u[:, c] = grad_u_c
        if gamma_end is not None:
            grad_state.mul_(gamma_end[:, c])
        grad_state.add_(grad_state_local[:, c]).baddbmm_(w[:, c].transpose(-1, -2), grad_u_c, alpha=-1.0)
    return grad_u, grad_next, grad_state


def _pair_backward(saved: Saved, stride: int, grad_p: Tensor, grad_kk: Tensor, factors: Optional[ChunkFactors]
                   ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Gradients of (q, k, g) through K K^T and Q K^T with their decays (:func:`_pair_terms`), from those of
    the two products (grad_kk strictly lower, grad_p (C / stride rows) unmasked); g's is None when not gated."""
    q, k, kk, p = saved[0], saved[1], saved[4], saved[5]
    g = saved[11] if len(saved) > 11 else None
    reads = read_positions(stride)
    if g is not None and factors is not None:
        q_spread = spread_reads(q, stride)
        grad_rows = torch.stack([spread_reads(grad_p, stride).tril_(), grad_kk], dim=-3)
        grad_x, (grad_k,) = decayed_products_backward_many((grad_rows,), (q_spread, k), (k,), g, factors)
        grad_q, grad_k_rows = grad_x.unbind(-3)
        # d/dg of sum_c x_tc y_jc exp(g_tc - g_jc): x * dx at the row, - y * dy at the column (q's zero rows
        # between the read positions add nothing).
        grad_g = (q_spread * grad_q).add_(k * (grad_k_rows - grad_k))
        return grad_q[..., reads, :], grad_k.add_(grad_k_rows), grad_g
    if g is None:
        grad_qk, grad_kk_plain = _causal_rows(grad_p, stride), grad_kk
    else:
        within = saved[12]
        # Gamma's zeros above the diagonal mask grad_p.
        grad_qk, grad_kk_plain = grad_p * within[..., reads, :], grad_kk * within
    grad_q = grad_qk @ k
    grad_k = torch.baddbmm(_flat(grad_kk_plain @ k), _flat(grad_kk_plain).transpose(-1, -2), _flat(k))
    grad_k = torch.baddbmm(grad_k, _flat(grad_qk).transpose(-1, -2), _flat(q)).view_as(k)
    if g is None:
        return grad_q, grad_k, None
    # The gradient reaching Gamma, times Gamma: Q K^T's rows are those of the read positions.
    through_within = grad_kk * kk
    through_within[..., reads, :].addcmul_(grad_p, p)
    return grad_q, grad_k, through_within.sum(-1) - through_within.sum(-2)


def _to_gate(grad: Tensor, x: Tensor, factor: Tensor, per_channel: bool) -> Tensor:
    """``grad . x * factor`` per position (a scalar decay, factor (..., C, 1)) or per channel (factor
    (..., C, d_k)): the gradient reaching g through ``x * factor`` with ``factor = exp(+-g)``."""
    if not per_channel:
        return row_dots(grad, x).mul_(factor.squeeze(-1))
    return (grad * x).mul_(factor)


def _backward(saved: Saved, stride: int, grad_out: Tensor, grad_final: Tensor
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Tensor]:
    """Gradients of (q, k, v, beta, g, initial state) from those of the outputs and the final state."""
    q, k, v, beta, kk, p, t, u_free, w, u, states = saved[:11]
    g = saved[11] if len(saved) > 11 else None
    factors = _factors(g, k)
    per_channel = factors is not None
    reads = read_positions(stride)
    if g is not None:
        gamma, to_end, gamma_end = _gate_terms(g, factors)
        gamma_read = gamma[..., reads, :]
        gamma_q, gamma_k, k_to_end = q * gamma_read, k * gamma, k * to_end
    else:
        gamma_q, gamma_k, k_to_end, gamma_end = q, k, k, None
    grad_u, grad_next, grad_initial = _scan_backward(grad_out, grad_final, p, gamma_q, k_to_end, w, gamma_end)
    grad_k_to_end = u @ grad_next.transpose(-1, -2)
    grad_gamma_q = grad_out @ states.transpose(-1, -2)
    grad_p = grad_out @ u.transpose(-1, -2)
    # [U_free, W] = T R solves (I + A) [U_free, W] = R: dR = T^T d[U_free, W], dA = -dR [U_free, W]^T, strictly
    # lower as A is.
    t_transposed = t.transpose(-1, -2)
    grad_r_v = t_transposed @ grad_u
    grad_r_k = (grad_r_v @ states.transpose(-1, -2)).neg_()  # T^T (dU S^T) = (T^T dU) S^T: one product fewer
    grad_a = _flat(grad_r_v @ u_free.transpose(-1, -2))
    grad_a = torch.baddbmm(grad_a, _flat(grad_r_k), _flat(w).transpose(-1, -2)).view_as(t).tril_(-1).neg_()
    grad_beta = row_dots(grad_r_v, v).add_(row_dots(grad_r_k, gamma_k)).add_(row_dots(grad_a, kk))
    grad_v, grad_gamma_k = grad_r_v.mul_(beta.unsqueeze(-1)), grad_r_k.mul_(beta.unsqueeze(-1))
    grad_q, grad_k, grad_g = _pair_backward(saved, stride, grad_p, grad_a.mul_(beta.unsqueeze(-1)), factors)
    if g is None:
        return grad_q.add_(grad_gamma_q), grad_k.add_(grad_gamma_k).add_(grad_k_to_end), grad_v, grad_beta, None, \
            grad_initial
    grad_q.addcmul_(grad_gamma_q, gamma_read)
    grad_k.addcmul_(grad_gamma_k, gamma).addcmul_(grad_k_to_end, to_end)
    # d/dg through gamma_t = exp(g_t) (for the queries, at the read positions t), to_end_t = exp(g_C - g_t),
    # gamma_C = exp(g_C).
    grad_g += _to_gate(grad_gamma_k, k, gamma, per_channel)
    (grad_g[..., reads, :] if per_channel else grad_g[..., reads]).add_(
        _to_gate(grad_gamma_q, q, gamma_read, per_channel))
    through_to_end = _to_gate(grad_k_to_end, k, to_end, per_channel)
    grad_g -= through_to_end
    through_end = (states * grad_next).sum(-1) * gamma_end.squeeze(-1)  # (Z, n, d_k), or (Z, n, 1) scalar
    if per_channel:
        grad_g[..., -1, :] += through_to_end.sum(-2) + through_end
    else:
        grad_g[..., -1] += through_to_end.sum(-1) + through_end.sum(-1)
    return grad_q, grad_k, grad_v, grad_beta, grad_g, grad_initial


class ChunkedDeltaRule(torch.autograd.Function):
    """The causal (gated) delta rule on chunked inputs, with a hand-written backward (module docstring).

    Shapes: k (Z, n, C, d_k); v (Z, n, C, d_v); beta (Z, n, C); g (Z, n, C), or (Z, n, C, d_k) for a decay per
    key channel, the cumulative log decay from each chunk's start, inclusive, or None; initial (Z, d_k, d_v);
    q (scaled) (Z, n, C / stride, d_k), its query i reading the state after position ``(i + 1) stride - 1`` of
    its chunk (the stride is C over q's rows; any stride with either decay). Returns (out (Z, n, C / stride,
    d_v), state after the last chunk (Z, d_k, d_v)).
    """

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],  # type: ignore[override]
                initial: Tensor) -> Tuple[Tensor, Tensor]:
        # The stride from the shapes, not an argument: torch.jit.trace refuses a non-tensor argument made from
        # a traced size (int(): under trace a size is a tensor; the chunk length is a constant of the graph).
        stride = int(k.shape[-2]) // int(q.shape[-2])
        out, state, saved = _forward(q, k, v, beta, g, initial, stride)
        ctx.save_for_backward(*saved)
        ctx.stride = stride
        return out, state

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Tensor, grad_final: Tensor):  # type: ignore[override]
        return _backward(ctx.saved_tensors, ctx.stride, grad_out.contiguous(), grad_final)


__all__ = ["ChunkedDeltaRule", "read_positions", "spread_reads"]

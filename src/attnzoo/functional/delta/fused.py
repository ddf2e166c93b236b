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
  reach the log decay at the read positions only. s = 1 is the plain rule.

Layout inside: (batch * heads, chunks, C, d), the inputs' own memory order (no copy to enter or leave).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._autocast import outside_autocast

Saved = Tuple[Tensor, ...]


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` as one batched matmul: no product tensor of a's size is made."""
    return (a.reshape(-1, 1, a.shape[-1]) @ b.reshape(-1, b.shape[-1], 1)).view(a.shape[:-1])


def _flat(x: Tensor) -> Tensor:
    """(Z, n, r, c) -> (Z * n, r, c), a view, for the batched matmuls that accumulate (baddbmm)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _gate_terms(g: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """From the within-chunk cumulative log decay g (Z, n, C): (gamma = exp(g) (Z, n, C), to_end = exp(g_C - g)
    (Z, n, C), gamma_C (Z, n))."""
    return g.exp(), (g[..., -1:] - g).exp(), g[..., -1].exp()


def _within(g: Tensor) -> Tensor:
    """Gamma (Z, n, C, C) = exp(g_t - g_j) on and below the diagonal, 0 above. Every exponent is a difference
    <= 0 (masked before exp), so nothing overflows however strong the decay."""
    chunk = g.shape[-1]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).triu(1)
    return (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()


def _reads(stride: int) -> slice:
    """The positions of a chunk that queries read after: the last of each group of ``stride``."""
    return slice(stride - 1, None, stride)


def _causal_rows(scores: Tensor, stride: int) -> Tensor:
    """Zero, in place, what a query may not see in (.., C / stride, C) scores: position j is seen by query i
    when ``j <= (i + 1) stride - 1``."""
    if stride == 1:
        return scores.tril_()
    chunk = scores.shape[-1]
    seen = torch.ones(chunk, chunk, dtype=torch.bool, device=scores.device).tril()[_reads(stride)]
    return scores.masked_fill_(~seen, 0.0)


def _forward(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], state: Tensor, stride: int
             ) -> Tuple[Tensor, Tensor, Saved]:
    """Chunked inputs (Z, n, C, d), q (Z, n, C / stride, d_k), gates (Z, n, C), state (Z, d_k, d_v). Returns
    (out (Z, n, C / stride, d_v), final state, what the backward needs)."""
    chunk = k.shape[-2]
    kk = k @ k.transpose(-1, -2)
    qk = q @ k.transpose(-1, -2)
    if g is None:
        p = _causal_rows(qk, stride)
        gamma_q, gamma_k, k_to_end, gamma_end = q, k, k, None
    else:
        within = _within(g)
        gamma, to_end, gamma_end = _gate_terms(g)
        reads = _reads(stride)
        kk, p = kk.mul_(within), qk.mul_(within[..., reads, :])  # Gamma is 0 above the diagonal: p is causal
        gamma_q = q * gamma[..., reads].unsqueeze(-1)
        gamma_k, k_to_end = k * gamma.unsqueeze(-1), k * to_end.unsqueeze(-1)
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
            state.mul_(gamma_end[:, c, None, None])
        state.baddbmm_(k_to_end[:, c].transpose(-1, -2), u_c)
    out = torch.baddbmm(_flat(gamma_q @ states), _flat(p), _flat(u)).view(*q.shape[:-1], v.shape[-1])
    # kk is K K^T * Gamma where gated; p the causal Q K^T * Gamma.
    saved = (q, k, v, beta, kk, p, t, u_free, w, u, states) + (() if g is None else (g, within))
    return out, state, saved


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
            grad_state.mul_(gamma_end[:, c, None, None])
        grad_state.add_(grad_state_local[:, c]).baddbmm_(w[:, c].transpose(-1, -2), grad_u_c, alpha=-1.0)
    return grad_u, grad_next, grad_state


def _backward(saved: Saved, gated: bool, stride: int, grad_out: Tensor, grad_final: Tensor
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Tensor]:
    """Gradients of (q, k, v, beta, g, initial state) from those of the outputs and the final state."""
    q, k, v, beta, kk, p, t, u_free, w, u, states = saved[:11]
    reads = _reads(stride)
    if gated:
        g, within = saved[11:]
        gamma, to_end, gamma_end = _gate_terms(g)
        gamma_q = q * gamma[..., reads].unsqueeze(-1)
        gamma_k, k_to_end = k * gamma.unsqueeze(-1), k * to_end.unsqueeze(-1)
    else:
        gamma_q, gamma_k, k_to_end, gamma_end = q, k, k, None
    grad_u, grad_next, grad_initial = _scan_backward(grad_out, grad_final, p, gamma_q, k_to_end, w, gamma_end)
    grad_k_to_end = u @ grad_next.transpose(-1, -2)
    grad_gamma_q = grad_out @ states.transpose(-1, -2)
    grad_p = grad_out @ u.transpose(-1, -2)
    if not gated:  # gated, Gamma's zeros above the diagonal mask it below
        _causal_rows(grad_p, stride)
    # [U_free, W] = T R solves (I + A) [U_free, W] = R: dR = T^T d[U_free, W], dA = -dR [U_free, W]^T, strictly
    # lower as A is.
    t_transposed = t.transpose(-1, -2)
    grad_r_v = t_transposed @ grad_u
    grad_r_k = t_transposed @ (grad_u @ states.transpose(-1, -2)).neg_()
    grad_a = _flat(grad_r_v @ u_free.transpose(-1, -2))
    grad_a = torch.baddbmm(grad_a, _flat(grad_r_k), _flat(w).transpose(-1, -2)).view_as(t).tril_(-1).neg_()
    grad_beta = _row_dot(grad_r_v, v).add_(_row_dot(grad_r_k, gamma_k)).add_(_row_dot(grad_a, kk))
    grad_v, grad_gamma_k = grad_r_v.mul_(beta.unsqueeze(-1)), grad_r_k.mul_(beta.unsqueeze(-1))
    grad_kk_within = grad_a.mul_(beta.unsqueeze(-1))
    grad_kk, grad_qk = (grad_kk_within, grad_p) if not gated else (grad_kk_within * within,
                                                                    grad_p * within[..., reads, :])
    grad_q = grad_qk @ k
    grad_k = torch.baddbmm(_flat(grad_kk @ k), _flat(grad_kk).transpose(-1, -2), _flat(k))
    grad_k = torch.baddbmm(grad_k, _flat(grad_qk).transpose(-1, -2), _flat(q)).view_as(k)
    if not gated:
        return grad_q.add_(grad_gamma_q), grad_k.add_(grad_gamma_k).add_(grad_k_to_end), grad_v, grad_beta, None, \
            grad_initial
    grad_q.addcmul_(grad_gamma_q, gamma[..., reads].unsqueeze(-1))
    grad_k.addcmul_(grad_gamma_k, gamma.unsqueeze(-1)).addcmul_(grad_k_to_end, to_end.unsqueeze(-1))
    # d/dg through Gamma_tj = exp(g_t - g_j), gamma_t = exp(g_t), to_end_t = exp(g_C - g_t), gamma_C = exp(g_C);
    # the query rows' t are the read positions.
    through_kk, through_p = grad_kk_within * kk, grad_p * p  # the gradients reaching Gamma, times Gamma
    grad_g = through_kk.sum(-1) - through_kk.sum(-2) - through_p.sum(-2)
    grad_g[..., reads] += through_p.sum(-1) + _row_dot(grad_gamma_q, q) * gamma[..., reads]
    grad_g += _row_dot(grad_gamma_k, k).mul_(gamma)
    through_to_end = _row_dot(grad_k_to_end, k).mul_(to_end)
    grad_g -= through_to_end
    grad_g[..., -1] += through_to_end.sum(-1) + _row_dot(states.flatten(-2), grad_next.flatten(-2)) * gamma_end
    return grad_q, grad_k, grad_v, grad_beta, grad_g, grad_initial


class ChunkedDeltaRule(torch.autograd.Function):
    """The causal (gated) delta rule on chunked inputs, with a hand-written backward (module docstring).

    Shapes: k (Z, n, C, d_k); v (Z, n, C, d_v); beta (Z, n, C); g (Z, n, C) the cumulative log decay from each
    chunk's start, inclusive, or None; initial (Z, d_k, d_v); q (scaled) (Z, n, C / stride, d_k), its query i
    reading the state after position ``(i + 1) stride - 1`` of its chunk (the stride is C over q's rows). Returns (out (Z, n, C / stride,
    d_v), state after the last chunk (Z, d_k, d_v)).
    """

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],  # type: ignore[override]
                initial: Tensor) -> Tuple[Tensor, Tensor]:
        # The stride from the shapes, not an argument: torch.jit.trace refuses a non-tensor argument made from
        # a traced size.
        stride = k.shape[-2] // q.shape[-2]
        out, state, saved = _forward(q, k, v, beta, g, initial, stride)
        ctx.save_for_backward(*saved)
        ctx.gated, ctx.stride = g is not None, stride
        return out, state

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Tensor, grad_final: Tensor):  # type: ignore[override]
        return _backward(ctx.saved_tensors, ctx.gated, ctx.stride, grad_out.contiguous(), grad_final)


__all__ = ["ChunkedDeltaRule"]

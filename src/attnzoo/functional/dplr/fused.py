"""The causal chunked DPLR delta rule with a hand-written backward (:class:`ChunkedDPLR`), the fast path behind
:func:`attnzoo.functional.dplr_delta_rule` when not compiled.

Same maths as :mod:`.chunk` (its docstring has the derivation and the notation), organised for speed on CPUs as
:mod:`attnzoo.functional.delta.fused` organises the delta rule's:

* The four decayed products come from :mod:`attnzoo.functional.delta.channels` (the per-channel decay inside
  the sums, factored level by level about references between row and column), with its backward. The rows of
  ``A_ak`` and ``A_ab`` read the exclusive ``g_{t-1}``: they are the products of the rows ``a_{s+1}`` at
  ``g_s`` (inclusive), moved down one row, so one ``g`` serves all four.
* ``T = (I - A_ab)^{-1}`` is formed once per chunk, so the forward's ``[U_free, W] = T [A_ak V, A~]`` and the
  backward's ``T^T dX`` are plain matmuls.
* The scan carries the state, ``U_c = U_free,c + W_c S_c``, ``S_{c+1} = exp(g_C) S_c + K^^T V + B^^T U_c``,
  in place; the backward walks the chunks in reverse with the same two products per chunk. Everything else in
  either direction is batched over every chunk. Nothing is differentiated twice.

That is the general form, right for any decays. Where every chunk's decay spans at most a quarter of the dtype's
exponent range (RWKV-7's does at chunks of up to 32 positions), :class:`ChunkedDPLR` runs :mod:`.gentle`
instead: the same maths with every factor about the chunk's start, so that the products and the state terms
share their scaled operands.

Layout inside: (batch * heads, chunks, C, d), the inputs' own memory order.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._autocast import outside_autocast
from ..exp_floor import exp_nonpositive
from .gentle import fits_gentle, gentle_backward, gentle_forward
from ..delta.channels import ChunkFactors, chunk_factors, decay_factors, decayed_products_backward_many, \
    decayed_products_many

Saved = Tuple[Tensor, ...]


def rows_down(x: Tensor) -> Tensor:
    """Rows moved down one position along C (the first row zero): row t takes row t - 1. (Written into an
    empty tensor, not padded: a pad fills the whole output with zeros first.)"""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out[..., 1:, :] = x[..., :-1, :]
    out[..., 0, :] = 0.0
    return out


def rows_up(x: Tensor) -> Tensor:
    """Rows moved up one position along C (the last row zero): row s takes row s + 1."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out[..., :-1, :] = x[..., 1:, :]
    out[..., -1, :] = 0.0
    return out


def _decays(factors: ChunkFactors) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """From the factors of g (Z, n, C, d_k), the inclusive cumulative log decay: exp(g), exp(g_{t-1}),
    exp(g_C - g) (each (Z, n, C, d_k)) and exp(g_C) as a column (Z, n, d_k, 1) to scale a chunk's state. Every
    exponent <= 0."""
    g = factors.g
    gamma, to_end = decay_factors(factors)
    return gamma, rows_down(gamma).index_fill_(-2, g.new_zeros(1, dtype=torch.long), 1.0), to_end, \
        exp_nonpositive(g[..., -1, :]).unsqueeze(-1)


def _products(q: Tensor, k: Tensor, a: Tensor, b: Tensor, factors: ChunkFactors) -> Tuple[Tensor, Tensor]:
    """(products of the rows [q, a moved up] against k, against b, each (Z, n, 2, C, C)): [A_qk, A_ak moved up]
    and [A_qb, A_ab moved up], lower triangular with the diagonal."""
    # the factors and scaled rows shared
    with_k, with_b = decayed_products_many((q, rows_up(a)), (k, b), factors.g, factors)
    return with_k, with_b


def _forward(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor, state: Tensor
             ) -> Tuple[Tensor, Tensor, Saved]:
    """Chunked inputs (Z, n, C, d), g the inclusive cumulative log decay, state (Z, d_k, d_v). Returns (out
    (Z, n, C, d_v), final state, what the backward needs)."""
    chunk = k.shape[-2]
    factors = chunk_factors(g)
    gamma, gamma_prev, to_end, gamma_end = _decays(factors)
    with_k, with_b = _products(q, k, a, b, factors)
    a_qk, a_qb, a_ak, a_ab = with_k[..., 0, :, :], with_b[..., 0, :, :], rows_down(with_k[..., 1, :, :]), \
        rows_down(with_b[..., 1, :, :])
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    # unitriangular: the (zero) diagonal of -A_ab is read as ones, so this is (I - A_ab)^{-1}.
    t = torch.linalg.solve_triangular(a_ab.neg(), eye.expand_as(a_ab), upper=False, unitriangular=True)
    u_free, w = (t @ a_ak) @ v, t @ (a * gamma_prev)  # (T A_ak) V: the (C x C)(C x C) product first
    b_to_end_t = (b * to_end).transpose(-1, -2)
    write = (k * to_end).transpose(-1, -2) @ v
    states = k.new_empty(k.shape[0], k.shape[1], *state.shape[1:])
    u = torch.empty_like(u_free)
    state = state.clone()  # updated in place; the caller's state is not touched
    for c in range(k.shape[1]):
        states[:, c] = state
        u_c = torch.baddbmm(u_free[:, c], w[:, c], state)
        u[:, c] = u_c
        state.mul_(gamma_end[:, c]).add_(write[:, c]).baddbmm_(b_to_end_t[:, c], u_c)
    out = (q * gamma) @ states + a_qk @ v
    out = torch.baddbmm(out.view(-1, chunk, v.shape[-1]), a_qb.reshape(-1, chunk, chunk),
                        u.view(-1, chunk, v.shape[-1])).view_as(v)
    return out, state, (q, k, v, a, b, g, a_qk, a_qb, a_ak, t, u_free, w, u, states)


def _scan_backward(grad_out: Tensor, grad_final: Tensor, a_qb: Tensor, gamma_q: Tensor, b_to_end: Tensor,
                   w: Tensor, gamma_end: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The reverse walk over chunks: (dU (Z, n, C, d_v), dS_{c+1} per chunk (Z, n, d_k, d_v), dS_0)."""
    grad_u_local = a_qb.transpose(-1, -2) @ grad_out
    grad_state_local = gamma_q.transpose(-1, -2) @ grad_out
    grad_u = torch.empty_like(grad_u_local)
    grad_next = grad_out.new_empty(grad_out.shape[0], grad_out.shape[1], *grad_final.shape[1:])
    grad_state = grad_final.clone()  # updated in place, as the state in the forward
    for c in reversed(range(grad_out.shape[1])):
        grad_next[:, c] = grad_state
        grad_u_c = torch.baddbmm(grad_u_local[:, c], b_to_end[:, c], grad_state)
        grad_u[:, c] = grad_u_c
        grad_state.mul_(gamma_end[:, c]).add_(grad_state_local[:, c]).baddbmm_(w[:, c].transpose(-1, -2), grad_u_c)
    return grad_u, grad_next, grad_state


def _solve_backward(saved: Saved, grad_u: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Through ``[U_free, W] = T [A_ak V, A~]``, ``T = (I - A_ab)^{-1}``, from dU (= dU_free; dW = dU S^T):
    (dA_ak, dA_ab, both strictly lower, dV's share A_ak^T dR, dA~)."""
    v, a_ak, t, u_free, w, states = saved[2], saved[8], saved[9], saved[10], saved[11], saved[13]
    t_transposed = t.transpose(-1, -2)
    grad_r_v = t_transposed @ grad_u
    grad_a_tilde = grad_r_v @ states.transpose(-1, -2)  # T^T (dU S^T), dW = dU S^T
    # X = T R solves (I - A) X = R: dR = T^T dX, dA = dR X^T.
    grad_a_ab = (grad_r_v @ u_free.transpose(-1, -2)).add_(grad_a_tilde @ w.transpose(-1, -2))
    grad_a_ak = grad_r_v @ v.transpose(-1, -2)
    return grad_a_ak.tril_(-1), grad_a_ab.tril_(-1), a_ak.transpose(-1, -2) @ grad_r_v, grad_a_tilde


def _products_backward(saved: Saved, grads: Tuple[Tensor, Tensor, Tensor, Tensor], factors: ChunkFactors
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Through the four decayed products, from (dA_qk, dA_qb lower; dA_ak, dA_ab strictly lower): the
    gradients of (q, k, a, b, g)."""
    q, k, a, b, g = saved[0], saved[1], saved[3], saved[4], saved[5]
    grad_qk, grad_qb, grad_ak, grad_ab = grads
    a_up = rows_up(a)
    grad_rows, (grad_k, grad_b) = decayed_products_backward_many(
        (torch.stack([grad_qk, rows_up(grad_ak)], dim=-3), torch.stack([grad_qb, rows_up(grad_ab)], dim=-3)),
        (q, a_up), (k, b), g, factors)
    # d/dg of sum_c x_tc y_jc exp(g_tc - g_jc): x * dx at the row, - y * dy at the column.
    grad_g = (q * grad_rows[..., 0, :, :]).addcmul_(a_up, grad_rows[..., 1, :, :]).addcmul_(k, grad_k, value=-1.0) \
        .addcmul_(b, grad_b, value=-1.0)
    return grad_rows[..., 0, :, :], grad_k, rows_down(grad_rows[..., 1, :, :]), grad_b, grad_g


def _backward(saved: Saved, grad_out: Tensor, grad_final: Tensor) -> Tuple[Tensor, ...]:
    """Gradients of (q, k, v, a, b, g, initial state) from those of the outputs and the final state."""
    q, k, v, a, b, g, a_qk, a_qb, a_ak, t, u_free, w, u, states = saved
    factors = chunk_factors(g)
    gamma, gamma_prev, to_end, gamma_end = _decays(factors)
    gamma_q, k_to_end, b_to_end = q * gamma, k * to_end, b * to_end
    grad_u, grad_next, grad_initial = _scan_backward(grad_out, grad_final, a_qb, gamma_q, b_to_end, w, gamma_end)
    grad_a_ak, grad_a_ab, grad_v, grad_a_tilde = _solve_backward(saved, grad_u)
    grad_v.add_(a_qk.transpose(-1, -2) @ grad_out).add_(k_to_end @ grad_next)
    grad_gamma_q = grad_out @ states.transpose(-1, -2)
    grad_k_to_end = v @ grad_next.transpose(-1, -2)
    grad_b_to_end = u @ grad_next.transpose(-1, -2)
    products = (grad_out @ v.transpose(-1, -2), grad_out @ u.transpose(-1, -2), grad_a_ak, grad_a_ab)
    grad_q, grad_k, grad_a, grad_b, grad_g = _products_backward(saved, (products[0].tril_(), products[1].tril_(),
                                                                        products[2], products[3]), factors)
    grad_q.addcmul_(grad_gamma_q, gamma)
    grad_k.addcmul_(grad_k_to_end, to_end)
    grad_b.addcmul_(grad_b_to_end, to_end)
    grad_a.addcmul_(grad_a_tilde, gamma_prev)
    # d/dg through exp(g_t) (q rows), exp(g_{t-1}) (a rows, the gradient moved up to position t - 1),
    # exp(g_C - g_t) (k and b rows) and exp(g_C) (the carried state).
    grad_g.addcmul_(grad_gamma_q, gamma_q)
    grad_g[..., :-1, :].addcmul_(grad_a_tilde[..., 1:, :] * a[..., 1:, :], gamma_prev[..., 1:, :])  # moved up
    through_to_end = torch.mul(grad_k_to_end, k_to_end).addcmul_(grad_b_to_end, b_to_end)
    grad_g.sub_(through_to_end)
    grad_g[..., -1, :] += through_to_end.sum(-2) + (states * grad_next).sum(-1) * gamma_end.squeeze(-1)
    return grad_q, grad_k, grad_v, grad_a, grad_b, grad_g, grad_initial


def _sums_to_chunk_end_(x: Tensor) -> Tensor:
    """x (Z, n, C, d) -> at each position the sum from it to its chunk's end, in place: the backward of the
    cumulative sum along C."""
    for position in reversed(range(x.shape[2] - 1)):
        x[:, :, position].add_(x[:, :, position + 1])
    return x


class ChunkedDPLR(torch.autograd.Function):
    """The causal DPLR delta rule on chunked inputs, with a hand-written backward (module docstring).

    Shapes: q (scaled), k, a, b (Z, n, C, d_k); v (Z, n, C, d_v); log_decay (Z, n, C, d_k); initial (Z, d_k, d_v).
    Returns (out (Z, n, C, d_v), state after the last chunk (Z, d_k, d_v)). The cumulative log decay within each
    chunk is taken here, and its backward (a sum from each position to the chunk's end) in place on the
    gradient, where autograd's backward of ``cumsum`` would flip the gradient twice.

    Where no chunk's decay spans more than a quarter of the dtype's exponent range (:func:`.gentle.fits_gentle`),
    the form of :mod:`.gentle` runs instead, forward and backward: the same maths with every factor about the
    chunk's start.

    It takes the log decay of every step, not its cumulative sum (as :class:`..delta.fused.ChunkedDeltaRule`
    does): the same shape, a different argument.
    """

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,  # type: ignore[override]
                log_decay: Tensor, initial: Tensor) -> Tuple[Tensor, Tensor]:
        g = log_decay.cumsum(2)
        ctx.gentle = fits_gentle(g)
        out, state, saved = (gentle_forward if ctx.gentle else _forward)(q, k, v, a, b, g, initial)
        ctx.save_for_backward(*saved)
        return out, state

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Tensor, grad_final: Tensor):  # type: ignore[override]
        grads = (gentle_backward if ctx.gentle else _backward)(ctx.saved_tensors, grad_out.contiguous(), grad_final)
        return (*grads[:5], _sums_to_chunk_end_(grads[5]), grads[6])


__all__ = ["ChunkedDPLR", "rows_down", "rows_up"]

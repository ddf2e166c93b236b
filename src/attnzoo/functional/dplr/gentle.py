"""The causal chunked DPLR delta rule where no chunk's decay spans much: every factor taken about the chunk's
start, forward and hand-written backward. :class:`.fused.ChunkedDPLR` takes this form when it applies.

Same maths and notation as :mod:`.chunk`. In general the four decayed products need factors about a reference
inside each chunk (:mod:`attnzoo.functional.delta.channels`), and the state terms need their own,
``exp(g_t)``, ``exp(g_{t-1})`` and ``exp(g_C - g_j)``: two sets of scaled operands. Where every channel of every
chunk falls by at most ``log(max) / 4`` of the dtype (22 in float32, 177 in float64; RWKV-7's decay, at most
0.607 a step, falls by at most 19.4 over a chunk of 32, its default), the chunk's start serves as the reference
for all of them, with every factor within e^22 in float32:

* the rows ``Q~ = Q exp(g)`` and ``A~ = A exp(g_{t-1})``, which the state terms read, are the products' rows
  (``A~``'s factor is the exclusive decay the rows of ``A_ak`` and ``A_ab`` need, so nothing is shifted);
* the columns are ``K' = K exp(-g)`` and ``B' = B exp(-g)`` (divided by ``exp(g)``), and the ends'
  ``K^ = K' exp(g_C)``: the chunk's state update becomes ``S_{c+1} = diag(exp(g_C)) (S_c + [K'; B']^T [V; U_c])``,
  its decay applied once to the (d_k x d_v) sum instead of to every row of K and B, both writes in one product.

So a chunk's decays cost one ``exp`` and four scalings, where the general form takes a dozen passes; the
products are the same matmuls. Each product's term is a product of two rounded factors whose exponents sum to
``g_t - g_j`` <= 0, and the entries above the diagonal (exponent up to +22) are masked; but some intermediate
sums are larger than what they become: the state's sum before its decay, and the gradients of the scaled rows
before their scaling back, hold terms up to e^22 times their final size. They round to the dtype's precision
relative to their largest term, as every sum here does, and the quarter of the range leaves them e^22 (about
4e9) of headroom below overflow that half of it would not: with half, inputs of size 1e8 already overflowed.

Layout: (Z, n, C, d), Z = batch * heads, n chunks of C positions, as :mod:`.fused`.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from ..delta.channels import graph_fixed, log_max
from ..norms import row_dots



class Saved(NamedTuple):
    """What :func:`gentle_forward` keeps for :func:`gentle_backward`: the scaled operands and decays, the
    within-chunk products, the solve and the scan's values, each chunk's starting state and the final one."""

    rows: Tensor  # (Z, n, 2, C, d_k): [Q exp(g), A exp(g_{t-1})]
    columns: Tensor  # (Z, n, 2, C, d_k): [K exp(-g), B exp(-g)]
    gamma: Tensor  # (Z, n, C, d_k): exp(g)
    v: Tensor
    a_qk: Tensor  # (Z, n, C, C), and the next two
    a_qb: Tensor
    a_ak: Tensor
    t: Tensor  # (I - A_ab)^{-1}
    u_free: Tensor
    w: Tensor
    u: Tensor  # (Z, n, C, d_v)
    states: Tensor  # (Z, n, d_k, d_v)
    final: Tensor  # (Z, d_k, d_v)


def fits_gentle(g: Tensor) -> bool:
    """Whether every chunk of g (Z, n, C, d), the inclusive cumulative log decay from each chunk's start, falls
    by at most ``log(max) / 4`` of its dtype (then this form applies). g must be non-increasing along C (every
    step's log decay <= 0, as :func:`attnzoo.functional.dplr_delta_rule` checks), so that its last position is
    its lowest. False in a traced or compiled graph, which must hold one path right for any input."""
    if graph_fixed() or g.numel() == 0:
        return False
    return bool(g[..., -1, :].amin() >= -log_max(g.dtype) / 4)


def _scaled_operands(q: Tensor, k: Tensor, a: Tensor, b: Tensor, gamma: Tensor) -> Tuple[Tensor, Tensor]:
    """(rows (Z, n, 2, C, d): ``[Q exp(g), A exp(g_{t-1})]``, columns (Z, n, 2, C, d): ``[K exp(-g),
    B exp(-g)]``), each pair side by side in one tensor so that one matmul meets both rows with a column."""
    rows = q.new_empty(*q.shape[:2], 2, *q.shape[2:])
    torch.mul(q, gamma, out=rows[:, :, 0])
    rows[:, :, 1, 0] = a[:, :, 0]  # exp(g_{-1}) = 1: nothing decays before the chunk's first position
    torch.mul(a[:, :, 1:], gamma[:, :, :-1], out=rows[:, :, 1, 1:])
    columns = torch.empty_like(rows)
    torch.div(k, gamma, out=columns[:, :, 0])
    torch.div(b, gamma, out=columns[:, :, 1])
    return rows, columns


def _flat(x: Tensor) -> Tensor:
    """(Z, n, ..., r, c) -> (Z * n, ..., r, c), a view."""
    return x.flatten(0, 1)


def _products(rows: Tensor, columns: Tensor) -> Tuple[Tensor, Tensor]:
    """The rows [Q~; A~] against K' and against B', each (Z, n, 2C, C), unmasked: [A_qk; A_ak] and
    [A_qb; A_ab] before their masks."""
    flat_rows = rows.flatten(2, 3)
    return flat_rows @ columns[:, :, 0].transpose(-1, -2), flat_rows @ columns[:, :, 1].transpose(-1, -2)


def gentle_forward(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor, state: Tensor
                   ) -> Tuple[Tensor, Tensor, Saved]:
    """Chunked inputs (Z, n, C, d) whose g passes :func:`fits_gentle`, state (Z, d_k, d_v). Returns (out
    (Z, n, C, d_v), final state, what :func:`gentle_backward` needs)."""
    chunks, chunk = k.shape[1], k.shape[2]
    gamma = g.exp()
    rows, columns = _scaled_operands(q, k, a, b, gamma)
    with_k, with_b = _products(rows, columns)
    a_qk, a_ak = with_k[:, :, :chunk].tril_(), with_k[:, :, chunk:].tril_(-1)
    a_qb, a_ab = with_b[:, :, :chunk].tril_(), with_b[:, :, chunk:].tril_(-1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    # unitriangular: the (zero) diagonal of -A_ab is read as ones, so this is (I - A_ab)^{-1}.
    t = torch.linalg.solve_triangular(a_ab.neg(), eye.expand_as(a_ab), upper=False, unitriangular=True)
    # (T A_ak) V: a (C x C)(C x C) product first, cheaper than T (A_ak V) while C < d_v.
    u_free, w = (t @ a_ak) @ v, t @ rows[:, :, 1]
    # [V; U] side by side, so that one product per chunk adds both writes K'^T V + B'^T U_c to the state.
    values = v.new_empty(*v.shape[:2], 2, *v.shape[2:])
    values[:, :, 0] = v
    u = values[:, :, 1]
    columns_t = columns.flatten(2, 3).transpose(-1, -2)
    gamma_end = gamma[:, :, -1, :].unsqueeze(-1)
    states = k.new_empty(k.shape[0], chunks, *state.shape[1:])  # every chunk's starting state
    # The running state is contiguous (a product written into a strided slice runs one matrix at a time);
    # the caller's state is not touched.
    state = state.clone()
    for c in range(chunks):
        states[:, c] = state
        u[:, c] = torch.baddbmm(u_free[:, c], w[:, c], state)
        # S_{c+1} = diag(exp(g_C)) (S_c + [K'; B']^T [V; U_c])
        state.baddbmm_(columns_t[:, c], values[:, c].flatten(1, 2)).mul_(gamma_end[:, c])
    out = torch.baddbmm(_flat(rows[:, :, 0] @ states), _flat(a_qk), _flat(v))
    out = out.baddbmm_(_flat(a_qb), _flat(u)).view_as(v)
    return out, state, Saved(rows, columns, gamma, v, a_qk, a_qb, a_ak, t, u_free, w, u, states, state.clone())


def _scan_backward(grad_out: Tensor, grad_final: Tensor, saved: Saved) -> Tuple[Tensor, Tensor, Tensor]:
    """The reverse walk over chunks: (dU (Z, n, C, d_v); dX per chunk (Z, n, d_k, d_v), the gradient of the sum
    ``S_c + K'^T V + B'^T U_c`` before its decay; dS_0)."""
    rows, columns, gamma, a_qb, w = saved.rows, saved.columns, saved.gamma, saved.a_qb, saved.w
    grad_u_local = a_qb.transpose(-1, -2) @ grad_out
    grad_state_local = rows[:, :, 0].transpose(-1, -2) @ grad_out
    gamma_end = gamma[:, :, -1, :].unsqueeze(-1)
    grad_u = torch.empty_like(grad_u_local)
    grad_sums = grad_out.new_empty(grad_out.shape[0], grad_out.shape[1], *grad_final.shape[1:])
    grad_state = grad_final.clone()  # updated in place
    for c in reversed(range(grad_out.shape[1])):
        grad_sum = torch.mul(grad_state, gamma_end[:, c], out=grad_sums[:, c])
        grad_u_c = torch.baddbmm(grad_u_local[:, c], columns[:, c, 1], grad_sum)
        grad_u[:, c] = grad_u_c
        torch.add(grad_sum, grad_state_local[:, c], out=grad_state).baddbmm_(w[:, c].transpose(-1, -2), grad_u_c)
    return grad_u, grad_sums, grad_state


def _solve_backward(saved: Saved, grad_u: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Through ``[U_free, W] = T [A_ak V, A~]``, ``T = (I - A_ab)^{-1}``, from dU (= dU_free; dW = dU S^T):
    (dA_ak, dA_ab, both strictly lower, dV's share ``A_ak^T dR``, dA~)."""
    v, a_ak, t, u_free, w, states = saved.v, saved.a_ak, saved.t, saved.u_free, saved.w, saved.states
    t_transposed = t.transpose(-1, -2)
    grad_r_v = t_transposed @ grad_u
    grad_a_tilde = grad_r_v @ states.transpose(-1, -2)  # T^T (dU S^T), dW = dU S^T
    # X = T R solves (I - A) X = R: dR = T^T dX, dA = dR X^T.
    grad_a_ab = torch.baddbmm(_flat(grad_r_v @ u_free.transpose(-1, -2)), _flat(grad_a_tilde),
                              _flat(w).transpose(-1, -2)).view_as(t)
    grad_a_ak = grad_r_v @ v.transpose(-1, -2)
    return grad_a_ak.tril_(-1), grad_a_ab.tril_(-1), a_ak.transpose(-1, -2) @ grad_r_v, grad_a_tilde


def _through_products(rows: Tensor, columns: Tensor, grads: Tuple[Tensor, Tensor, Tensor, Tensor],
                      into: Tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    """Adds the gradients through the four products (from dA_qk, dA_ak against K', dA_qb, dA_ab against B', each
    (Z, n, C, C), masked) to those of the rows Q~, A~ and the columns K', B' (``into``, each (Z, n, C, d),
    contiguous)."""
    grad_qk, grad_ak, grad_qb, grad_ab = (_flat(grad) for grad in grads)
    q_rows, a_rows, k_columns, b_columns = (_flat(x) for x in (rows[:, :, 0], rows[:, :, 1], columns[:, :, 0],
                                                                columns[:, :, 1]))
    grad_q_rows, grad_a_rows, grad_k_columns, grad_b_columns = (_flat(x) for x in into)
    grad_q_rows.baddbmm_(grad_qk, k_columns).baddbmm_(grad_qb, b_columns)
    grad_a_rows.baddbmm_(grad_ak, k_columns).baddbmm_(grad_ab, b_columns)
    grad_k_columns.baddbmm_(grad_qk.transpose(-1, -2), q_rows).baddbmm_(grad_ak.transpose(-1, -2), a_rows)
    grad_b_columns.baddbmm_(grad_qb.transpose(-1, -2), q_rows).baddbmm_(grad_ab.transpose(-1, -2), a_rows)


def gentle_backward(saved: Tuple[Tensor, ...], grad_out: Tensor, grad_final: Tensor) -> Tuple[Tensor, ...]:
    """Gradients of (q, k, v, a, b, g, initial state) from those of the outputs and the final state."""
    saved = Saved(*saved)
    rows, columns, v, a_qk, u, states = saved.rows, saved.columns, saved.v, saved.a_qk, saved.u, saved.states
    grad_u, grad_sums, grad_initial = _scan_backward(grad_out, grad_final, saved)
    grad_a_ak, grad_a_ab, grad_v, grad_a_tilde = _solve_backward(saved, grad_u)
    flat_grad_v = _flat(grad_v).baddbmm_(_flat(a_qk).transpose(-1, -2), _flat(grad_out))
    flat_grad_v.baddbmm_(_flat(columns[:, :, 0]), _flat(grad_sums))
    # The direct terms first: Q~ reads the state, A~ makes W = T A~, K' and B' write into the state's sum.
    into = (grad_out @ states.transpose(-1, -2), grad_a_tilde, v @ grad_sums.transpose(-1, -2),
            u @ grad_sums.transpose(-1, -2))
    products = ((grad_out @ v.transpose(-1, -2)).tril_(), grad_a_ak, (grad_out @ u.transpose(-1, -2)).tril_(),
                grad_a_ab)
    _through_products(rows, columns, products, into)
    grad_q, grad_k, grad_a, grad_b, grad_g = _to_inputs(saved, *into, grad_sums)
    return grad_q, grad_k, grad_v, grad_a, grad_b, grad_g, grad_initial


def _to_inputs(saved: Saved, grad_q_rows: Tensor, grad_a_rows: Tensor, grad_k_columns: Tensor,
               grad_b_columns: Tensor, grad_sums: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """From the gradients of the scaled operands to those of (q, k, a, b, g)."""
    rows, columns, gamma, states, final = saved.rows, saved.columns, saved.gamma, saved.states, saved.final
    grad_q = grad_q_rows * gamma
    grad_a = torch.empty_like(grad_a_rows)
    grad_a[:, :, 0] = grad_a_rows[:, :, 0]
    torch.mul(grad_a_rows[:, :, 1:], gamma[:, :, :-1], out=grad_a[:, :, 1:])
    grad_k, grad_b = grad_k_columns / gamma, grad_b_columns / gamma
    # d/dg: + x dx for the rows (exp(g_t); A~'s exp(g_{t-1}) at position t - 1), - y dy for the columns
    # (exp(-g)), and exp(g_C) of the state update.
    grad_g = torch.mul(rows[:, :, 0], grad_q_rows)
    grad_g[:, :, :-1].addcmul_(rows[:, :, 1, 1:], grad_a_rows[:, :, 1:])
    grad_g.addcmul_(columns[:, :, 0], grad_k_columns, value=-1.0).addcmul_(columns[:, :, 1], grad_b_columns,
                                                                           value=-1.0)
    # exp(g_C) X = S_{c+1}: d/dg_C = (S_{c+1} * dS_{c+1}).sum(-1), dS_{c+1} = dX / exp(g_C).
    # S_{c+1} is the next chunk's start: in the contiguous (Z * n * d_k, d_v) rows of the states, d_k rows on.
    # The last chunk of each head pairs with the next head's first there; it takes the final state instead.
    d_k, d_v = states.shape[-2:]
    through_end = grad_g.new_empty(states.shape[:-1])
    through_end.view(-1)[:-d_k] = row_dots(states.reshape(-1, d_v)[d_k:], grad_sums.reshape(-1, d_v)[:-d_k])
    through_end[:, -1] = row_dots(final, grad_sums[:, -1])
    grad_g[:, :, -1].addcdiv_(through_end, gamma[:, :, -1])
    return grad_q, grad_k, grad_a, grad_b, grad_g


__all__ = ["fits_gentle", "gentle_backward", "gentle_forward"]

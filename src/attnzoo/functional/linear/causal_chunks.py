"""Causal kernelized attention without decay, a group of chunks at a time, with a hand-written backward
(:class:`_CausalChunks`), the fast path behind :func:`attnzoo.functional.linear.kernel_attention`.

The chunks go a group of :data:`GROUP_ROWS` rows at a time (batched matmuls over the group's chunks), forward
in order and backward in reverse, and the backward recomputes a group's chunk scores and states from q, k, v
and the one state kept per group: training memory is the features, values, outputs and gradients plus one
group's working set, O(N (m + d) + GROUP_ROWS (chunk_size + m d / chunk_size)).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import outside_autocast
from .inputs import _with_ones


def _flat(x: Tensor) -> Tensor:
    """(..., r, c) -> (prod(...), r, c) view for bmm (leading dims of our chunked tensors are contiguous)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


GROUP_ROWS = 8192
"""Rows (positions times batch-heads) the undecayed causal path handles at a time: a span of whole chunks of
one (batch, head), or whole sequences of several. Only one group's chunk scores and chunk states exist at
once, each about as large as its slice of the features (2 MiB at head dim 64 in float32), where
whole-sequence ones would each be as large as the features. A group's temporaries are reused from group to
group and mostly stay in cache, and its slices of q, k, the outputs and the gradients are views, not copies.
Fewer rows save a little memory but make more, smaller operations, which lose most when other processes
keep the cores busy; more rows cost memory and, from 16384 on, cache (docs/benchmarks.md)."""


def _groups(batch_heads: int, n: int, chunk: int) -> List[Tuple[int, int, int, int, int]]:
    """The groups as (first head, end head, span index, first row, end row), in sequence order per head."""
    span = max(chunk, GROUP_ROWS // chunk * chunk)
    if n > span:
        return [
            (h, h + 1, i, start, min(start + span, n))
            for h in range(batch_heads)
            for i, start in enumerate(range(0, n, span))
        ]
    heads = max(1, GROUP_ROWS // (n + (-n % chunk)))
    return [(h, min(h + heads, batch_heads), 0, 0, n) for h in range(0, batch_heads, heads)]


def _group_rows(x: Tensor, heads: slice, rows: slice, chunk: int) -> Tensor:
    """Rows of x (B * H, N, c) as (G, chunk, c) chunks, the last chunk zero-padded (a zero key or value
    changes no sum, a zero query's row is discarded): a view of x unless padding is needed."""
    part = x[heads, rows]
    pad = -part.shape[1] % chunk
    if pad:
        part = F.pad(part, (0, 0, 0, pad))
    return part.reshape(-1, chunk, x.shape[-1])


class _GroupOutput:
    """Where a group's (G, chunk, c) result goes in a (B * H, N, c) tensor: straight into it when that slice
    is whole contiguous chunks, else into a buffer copied over by :meth:`finish`."""

    def __init__(self, dest: Tensor, heads: slice, rows: slice, chunk: int) -> None:
        self.target = dest[heads, rows]
        if self.target.shape[1] % chunk == 0 and self.target.is_contiguous():
            self.buffer, self.direct = self.target.view(-1, chunk, dest.shape[-1]), True
        else:
            n_heads, n_rows, c = self.target.shape
            self.buffer, self.direct = dest.new_empty(n_heads * -(-n_rows // chunk), chunk, c), False

    def finish(self) -> None:
        if not self.direct:
            n_heads, n_rows, c = self.target.shape
            self.target.copy_(self.buffer.view(n_heads, -1, c)[:, :n_rows])


def _values_with_ones(v: Tensor, heads: slice, rows: slice, chunk: int) -> Tensor:
    """``[v, 1]`` for a group of v (B * H, N, d), as (G, chunk, d + 1) zero-padded like :func:`_group_rows`:
    the ones column makes every matmul yield the normaliser beside the numerator, built a group at a time
    instead of as a whole-sequence copy of v."""
    part = v[heads, rows]
    n_heads, n_rows, d = part.shape
    values = v.new_empty(n_heads, n_rows + (-n_rows % chunk), d + 1)
    values[:, :n_rows, :d] = part
    values[:, :n_rows, d] = 1.0
    if values.shape[1] > n_rows:
        values[:, n_rows:] = 0.0
    return values.view(-1, chunk, d + 1)


def _chunk_terms(q: Tensor, k: Tensor, values: Tensor, state: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """One group's intra-chunk scores and chunk states.

    Args:
        q, k: (G_h * C, chunk, m); values: (G_h * C, chunk, d + 1); state: (G_h, m, d + 1) before the group's
            first chunk, for each of its G_h heads.

    Returns:
        (scores ``tril(Q_c K_c^T)`` (G_h * C, chunk, chunk), states before each chunk
        ``P_c = state + sum_{c' < c} K_c'^T V_c'`` (G_h, C, m, d + 1), state after the group (G_h, m, d + 1)).

    ``P_c`` is an exclusive sum proper, never ``inclusive - own term``: with features spanning many orders of
    magnitude, a chunk's own large term would wipe out the small prefix in rounding.
    """
    n_heads, m, d1 = state.shape
    scores = torch.bmm(q, k.transpose(1, 2)).tril_()
    local = torch.bmm(k.transpose(1, 2), values).view(n_heads, -1, m, d1)  # each chunk's own contribution
    previous = torch.empty_like(local)
    previous[:, 0] = state
    # The state joins the first chunk's term, so that one cumulative sum gives every P_c.
    local[:, 0] += state
    if local.shape[1] > 1:
        torch.cumsum(local[:, :-1], dim=1, out=previous[:, 1:])
        return scores, previous, previous[:, -1] + local[:, -1]
    return scores, previous, local[:, 0]


GroupTerms = Tuple[Tensor, Tensor, Tensor]
"""A group's ``[v, 1]`` chunks, chunk scores and chunk states, as :func:`_values_with_ones` and
:func:`_chunk_terms` give them."""


def _forward_group(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, state: Tensor, heads: slice, rows: slice, chunk: int
) -> GroupTerms:
    """Outputs of one group into ``out`` (B * H, N, d + 1); ``state`` (G_h, m, d + 1), the state before the
    group, becomes the state after it. q, k (B * H, N, m), v (B * H, N, d). Returns the group's terms. A
    function of its own so that the group's temporaries are freed before the next group's are made."""
    q_g, k_g, values = _group_rows(q, heads, rows, chunk), _group_rows(k, heads, rows, chunk), _values_with_ones(
        v, heads, rows, chunk
    )
    scores, previous, next_state = _chunk_terms(q_g, k_g, values, state)
    state.copy_(next_state)
    target = _GroupOutput(out, heads, rows, chunk)
    torch.bmm(q_g, _flat(previous), out=target.buffer).baddbmm_(scores, values)
    target.finish()
    return values, scores, previous


def _backward_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Optional[Tensor],
    state: Tensor,
    carry: Tensor,
    grads: Tuple[Tensor, Tensor, Tensor],
    heads: slice,
    rows: slice,
    chunk: int,
    terms: Optional[GroupTerms] = None,
) -> None:
    """Gradients of one group, written into ``grads`` (of q, k, v; (B * H, N, m), (B * H, N, m),
    (B * H, N, d)); ``carry`` (G_h, m, d + 1), the gradient that reaches the group's chunk states from
    everything after the group, gets the group's own part added. ``state``: (G_h, m, d + 1) before the group;
    grad_out: (B * H, N, d + 1) or None; terms: the group's terms if the forward kept them, else recomputed."""
    d = v.shape[-1]
    q_g, k_g = _group_rows(q, heads, rows, chunk), _group_rows(k, heads, rows, chunk)
    if terms is None:
        values = _values_with_ones(v, heads, rows, chunk)
        scores, previous, _ = _chunk_terms(q_g, k_g, values, state)
    else:
        values, scores, previous = terms
    grad_g = torch.zeros_like(values) if grad_out is None else _group_rows(grad_out, heads, rows, chunk)
    grad_scores = torch.bmm(grad_g, values.transpose(1, 2)).tril_()
    target = _GroupOutput(grads[0], heads, rows, chunk)
    torch.bmm(grad_g, _flat(previous).transpose(1, 2), out=target.buffer).baddbmm_(grad_scores, k_g)
    target.finish()
    grad_previous = torch.bmm(q_g.transpose(1, 2), grad_g).view_as(previous)
    # Chunk c's own contribution reaches every later chunk of the group (a reversed exclusive sum, from the
    # reversed inclusive ones) and, through the carry, every chunk after the group.
    after = grad_previous.flip(1).cumsum(1).flip(1)  # after[:, c] = sum_{c' >= c} grad_previous[:, c']
    grad_local = torch.empty_like(previous)
    grad_local[:, -1] = carry
    if previous.shape[1] > 1:
        torch.add(after[:, 1:], carry.unsqueeze(1), out=grad_local[:, :-1])
    carry += after[:, 0]
    grad_local = _flat(grad_local)
    target = _GroupOutput(grads[1], heads, rows, chunk)
    torch.bmm(grad_scores.transpose(1, 2), q_g, out=target.buffer).baddbmm_(values, grad_local.transpose(1, 2))
    target.finish()
    # v's gradient leaves out the ones column's: strided views, which the matmuls read in place.
    target = _GroupOutput(grads[2], heads, rows, chunk)
    torch.bmm(scores.transpose(1, 2), grad_g[..., :d], out=target.buffer).baddbmm_(k_g, grad_local[..., :d])
    target.finish()


class _CausalChunks(torch.autograd.Function):
    """Causal linear attention without decay, a group of chunks at a time, with a hand-written backward.

    Per chunk c (all chunks of a group in one batched matmul), with V = [v, 1]:
        S_c = tril(Q_c K_c^T),  L_c = K_c^T V_c,  P_c = S0 + sum_{c' < c} L_c',  O_c = S_c V_c + Q_c P_c,
    and the final state S0 + sum_c L_c. The forward walks the groups (:data:`GROUP_ROWS`) in sequence order,
    carrying the state; it keeps the state at the start of each group and the last group's S_c, P_c and V_c.
    The backward walks the groups in reverse. It recomputes every other group's S_c and P_c from q, k, v and
    the group's state (two more batched matmuls beside its eight) rather than keeping them for the whole
    sequence (each as large as the features); a sequence of one group recomputes nothing. It carries the
    gradient that reaches L_c from the outputs of every later chunk and from the final state (a reversed
    exclusive sum). Every matmul writes into its destination or accumulates into it (baddbmm) instead of
    allocating a sum; the gradient of v goes straight into one (B, H, N, d) buffer that autograd adopts as
    ``v.grad``.

    Both prefix sums are exclusive sums proper, never ``inclusive - own term``: with features spanning many
    orders of magnitude, a chunk's own large term would wipe out the small prefix in rounding.

    Shapes: q, k (B, H, N, m); v (B, H, N, d), without the ones column; initial (B, H, m, d + 1); chunks of
    ``min(chunk_size, N)`` positions. Returns ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state
    after position N - 1).
    """

    @staticmethod
    @outside_autocast
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, initial: Tensor, chunk_size: int
    ) -> Tuple[Tensor, Tensor]:
        batch, heads, n, m = q.shape
        d1 = v.shape[-1] + 1
        chunk = min(chunk_size, n)
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        groups = _groups(batch * heads, n, chunk)
        out3 = q.new_empty(batch * heads, n, d1)
        final3 = initial.reshape(batch * heads, m, d1).clone()
        # The state at the start of each span of each head: what the backward recomputes a group from.
        span_states = q.new_empty(batch * heads, groups[-1][2] + 1, m, d1)
        for h0, h1, span, r0, r1 in groups:
            span_states[h0:h1, span] = final3[h0:h1]
            last = _forward_group(q3, k3, v3, out3, final3[h0:h1], slice(h0, h1), slice(r0, r1), chunk)
        # The backward starts with the last group: its terms are at hand.
        ctx.save_for_backward(q, k, v, span_states, *last)
        ctx.chunk = chunk
        # An unused output (the state, or the outputs when only the state is used) gets no zero-filled
        # gradient of its full size.
        ctx.set_materialize_grads(False)
        return out3.view(batch, heads, n, d1), final3.view(batch, heads, m, d1)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Optional[Tensor], grad_final: Optional[Tensor]):  # type: ignore[override]
        q, k, v, span_states, *last = ctx.saved_tensors
        batch, heads, n, m = q.shape
        d1 = v.shape[-1] + 1
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        grad_out3 = None if grad_out is None else grad_out.reshape(batch * heads, n, d1)
        grads = (q3.new_empty(q3.shape), k3.new_empty(k3.shape), v3.new_empty(v3.shape))
        # The gradient reaching a chunk's own contribution L_c from every later chunk's outputs and from the
        # final state, carried from group to group; once every group is done, the initial state's gradient.
        if grad_final is None:
            carry = q.new_zeros(batch * heads, m, d1)
        else:
            carry = grad_final.reshape(batch * heads, m, d1).clone()
        terms: Optional[GroupTerms] = (last[0], last[1], last[2])
        for h0, h1, span, r0, r1 in reversed(_groups(batch * heads, n, ctx.chunk)):
            _backward_group(
                q3, k3, v3, grad_out3, span_states[h0:h1, span], carry[h0:h1], grads, slice(h0, h1), slice(r0, r1),
                ctx.chunk, terms,
            )
            terms = None
        grad_q, grad_k, grad_v = grads
        return grad_q.view_as(q), grad_k.view_as(k), grad_v.view_as(v), carry.view(batch, heads, m, d1), None


def causal_chunks_traceable(q: Tensor, k: Tensor, v: Tensor, initial: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor]:
    """:class:`_CausalChunks`'s maths in plain differentiable operations, for ``torch.compile``: dynamo does not
    trace the hand-written kernel's writes into non-contiguous ``out=`` slices, and a compiled graph fuses and
    plans memory itself. All chunks at once, so the chunk states take O((N / chunk_size) m d) memory.

    Shapes as :class:`_CausalChunks`: q, k (B, H, N, m); v (B, H, N, d); initial (B, H, m, d + 1). Returns
    ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state after position N - 1).
    """
    batch, heads, n, m = q.shape
    d1 = v.shape[-1] + 1
    chunk = min(chunk_size, n)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    # Zero-padded tail positions: a zero key or value changes no sum, a zero query's row is discarded.
    q_c = F.pad(q, (0, 0, 0, pad)).reshape(batch, heads, n_chunks, chunk, m)
    k_c = F.pad(k, (0, 0, 0, pad)).reshape(batch, heads, n_chunks, chunk, m)
    values = F.pad(_with_ones(v), (0, 0, 0, pad)).reshape(batch, heads, n_chunks, chunk, d1)
    # tril sets the future keys' scores to zero (never multiplies them): a non-finite future key stays out.
    scores = (q_c @ k_c.transpose(-1, -2)).tril()
    local = k_c.transpose(-1, -2) @ values
    # The state joins the first chunk's term, and P_c is an exclusive sum proper (see _chunk_terms).
    inclusive = torch.cat([local[:, :, :1] + initial.unsqueeze(2), local[:, :, 1:]], dim=2).cumsum(2)
    previous = torch.cat([initial.unsqueeze(2), inclusive[:, :, :-1]], dim=2)
    out = q_c @ previous + scores @ values
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n], inclusive[:, :, -1]

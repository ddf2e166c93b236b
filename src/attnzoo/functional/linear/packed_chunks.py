"""The states between chunks of a packed row (a segmented scan), and the undecayed packed causal path with a
hand-written backward (:class:`_PackedChunks`), behind :mod:`.packed`.

A document's state passes from chunk to chunk until the next document starts; the state before each chunk is
a segmented scan over the chunks' own contributions (:func:`segmented_scan`): Hillis-Steele, ``log2`` of the
longest document's chunk count vectorised steps, never a loop over chunks. Every step adds states of one
document only. Nothing is subtracted: a prefix of the whole row minus the prefix at a document start would lose
a short document after long ones to rounding (its sum is small beside the prefix).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import outside_autocast
from .causal_chunks import _GroupOutput, _group_rows, _groups, _values_with_ones

PackedMasks = Tuple[Tensor, Tensor, Tensor]
"""(hidden, reaches_end, carries) of a packed row's chunks, as :func:`.packed.packed_masks` gives them."""


def segmented_scan(x: Tensor, through: Tensor, decay: Optional[Tensor], steps: int) -> Tensor:
    """``y_c = x_c + [through_c] decay_c y_{c-1}`` along the chunk dim (-3) of x (..., C, m, d), for all c.

    After step s, ``y_c`` holds the chunks ``c - 2^s < c' <= c`` composed, ``through_c`` whether that window
    passes on what came before it, ``decay_c`` its total decay.

    Args:
        x: (..., C, m, d); through: (C,) bool; decay: broadcastable to (..., C, 1, 1), or None for none.
        steps: scan steps; ``2 ** steps`` must reach the longest run of chunks whose ``through`` is True, plus
            one (more are harmless, fewer leave chunks out).
    """
    for step in range(steps):
        shift = 1 << step
        if shift >= x.shape[-3]:
            break
        earlier = x[..., :-shift, :, :]
        if decay is not None:
            earlier = decay[..., shift:, :, :] * earlier
        # Set to zero, not multiplied by zero: a non-finite earlier document stays out.
        earlier = earlier.masked_fill(~through[shift:, None, None], 0.0)
        x = torch.cat([x[..., :shift, :, :], x[..., shift:, :, :] + earlier], dim=-3)
        if decay is not None:
            decay = torch.cat([decay[..., :shift, :, :], decay[..., shift:, :, :] * decay[..., :-shift, :, :]], dim=-3)
        through = torch.cat([through[:shift], through[shift:] & through[:-shift]])
    return x


def states_before(local: Tensor, through: Tensor, decay: Optional[Tensor], steps: int) -> Tensor:
    """(..., C, m, d) the state before each chunk (zero before the first), from each chunk's own contribution
    ``local`` (..., C, m, d): the state after chunk c is ``local_c + [through_c] decay_c (state after c - 1)``.
    Arguments as :func:`segmented_scan`."""
    after = segmented_scan(local, through, decay, steps)
    return F.pad(after[..., :-1, :, :], (0, 0, 0, 0, 1, 0))


def scan_steps(spans: List[Tuple[int, int]], chunk: int) -> int:
    """Scan steps enough for the longest document of ``spans``: it reaches over at most ``length // chunk + 2``
    chunks."""
    longest = max(end - start for start, end in spans) // chunk + 2
    return max(1, math.ceil(math.log2(longest)))


class _Group(NamedTuple):
    """A group of :func:`.causal_chunks._groups`: its heads and rows of the (B * H, N, c) tensors, its chunks,
    and (int64, on the inputs' device) which of them, counted from its first, hold a document start."""

    heads: slice
    rows: slice
    chunks: slice
    starts: Tensor


def _plan(batch_heads: int, n: int, chunk: int, start_chunks: List[int], device: torch.device) -> List[_Group]:
    """The groups of the unpacked path (:data:`.causal_chunks.GROUP_ROWS` rows at a time, so that a group's
    working set stays in cache), each with the chunks of ``start_chunks`` (where documents start) it holds."""
    groups = []
    for h0, h1, _, r0, r1 in _groups(batch_heads, n, chunk):
        c0, c1 = r0 // chunk, -(-r1 // chunk)
        starts = torch.tensor([c - c0 for c in start_chunks if c0 <= c < c1], dtype=torch.int64, device=device)
        groups.append(_Group(slice(h0, h1), slice(r0, r1), slice(c0, c1), starts))
    return groups


def _zero_at_starts(x: Tensor, group: _Group, zero: Tensor) -> Tensor:
    """``x`` (G_h * C_g, r, c), a group's chunks, with the entries ``zero`` (C, r, c) or (C, r, 1) (the whole
    row's chunks) set to zero, in place, in the chunks where a document starts: elsewhere the masks are the
    unpacked path's (``tril``, every key passed on, every query reading the state). A product over every chunk,
    then a fix of the few, and no mask pass over the whole row."""
    if group.starts.numel():
        grouped = x.view(-1, group.chunks.stop - group.chunks.start, x.shape[1], x.shape[2])
        grouped[:, group.starts] = grouped[:, group.starts].masked_fill_(zero[group.chunks][group.starts], 0.0)
    return x


def _product_at_starts(x: Tensor, y: Tensor, group: _Group, zero: Tensor, product: Tensor) -> Tensor:
    """``product`` (G_h * C_g, c, e) = ``x^T y`` per chunk of a group (x (G_h * C_g, r, c), y (G_h * C_g, r, e)),
    recomputed, in place, in the chunks where a document starts with x's rows ``zero`` (C, r, 1) set to zero."""
    if group.starts.numel():
        n_chunks = group.chunks.stop - group.chunks.start
        rows = x.view(-1, n_chunks, x.shape[1], x.shape[2])[:, group.starts]
        rows = rows.masked_fill(zero[group.chunks][group.starts], 0.0)
        grouped = product.view(-1, n_chunks, product.shape[1], product.shape[2])
        other = y.view(-1, n_chunks, y.shape[1], y.shape[2])[:, group.starts]
        grouped[:, group.starts] = rows.transpose(-1, -2) @ other
    return product


def _group_chunks(x: Tensor, group: _Group) -> Tensor:
    """A group's slice of a per-chunk tensor x (B * H, C, m, d) as (G_h * C_g, m, d)."""
    return x[group.heads, group.chunks].reshape(-1, x.shape[-2], x.shape[-1])


def _forward_group(q3: Tensor, k3: Tensor, v3: Tensor, previous: Tensor, out3: Tensor, masks: Tuple[Tensor, Tensor],
                   group: _Group, chunk: int) -> None:
    """One group's outputs into ``out3`` (B * H, N, d + 1), from q3, k3 (B * H, N, m), v3 (B * H, N, d), the
    states before each chunk ``previous`` (B * H, C, m, d + 1) and (hidden, carries)."""
    hidden, carries = masks
    q_g, k_g = _group_rows(q3, group.heads, group.rows, chunk), _group_rows(k3, group.heads, group.rows, chunk)
    values = _values_with_ones(v3, group.heads, group.rows, chunk)
    scores = _zero_at_starts(torch.bmm(q_g, k_g.transpose(1, 2)).tril_(), group, hidden)
    target = _GroupOutput(out3, group.heads, group.rows, chunk)
    torch.bmm(q_g, _group_chunks(previous, group), out=target.buffer)
    _zero_at_starts(target.buffer, group, ~carries[..., None]).baddbmm_(scores, values)
    target.finish()


def _backward_group(
    q3: Tensor, k3: Tensor, v3: Tensor, grad3: Tensor, previous: Tensor, grad_local: Tensor,
    grads: Tuple[Tensor, Tensor, Tensor], masks: PackedMasks, group: _Group, chunk: int,
) -> None:
    """One group's gradients of q, k, v into ``grads``; ``grad3`` (B * H, N, d + 1) the outputs' gradient,
    ``grad_local`` (B * H, C, m, d + 1) that of each chunk's contribution; the rest as :func:`_forward_group`."""
    hidden, reaches_end, carries = masks
    d = v3.shape[-1]
    q_g, k_g = _group_rows(q3, group.heads, group.rows, chunk), _group_rows(k3, group.heads, group.rows, chunk)
    values, grad_g = _values_with_ones(v3, group.heads, group.rows, chunk), _group_rows(grad3, group.heads, group.rows,
                                                                                          chunk)
    scores = _zero_at_starts(torch.bmm(q_g, k_g.transpose(1, 2)).tril_(), group, hidden)
    grad_scores = _zero_at_starts(torch.bmm(grad_g, values.transpose(1, 2)).tril_(), group, hidden)
    grad_local_g, not_passed = _group_chunks(grad_local, group), ~reaches_end[..., None]
    target = _GroupOutput(grads[0], group.heads, group.rows, chunk)
    torch.bmm(grad_g, _group_chunks(previous, group).transpose(1, 2), out=target.buffer)
    _zero_at_starts(target.buffer, group, ~carries[..., None]).baddbmm_(grad_scores, k_g)
    target.finish()
    target = _GroupOutput(grads[1], group.heads, group.rows, chunk)
    torch.bmm(values, grad_local_g.transpose(1, 2), out=target.buffer)
    _zero_at_starts(target.buffer, group, not_passed).baddbmm_(grad_scores.transpose(1, 2), q_g)
    target.finish()
    # v's gradient leaves out the ones column's: strided views, which the matmuls read in place.
    target = _GroupOutput(grads[2], group.heads, group.rows, chunk)
    torch.bmm(k_g, grad_local_g[..., :d], out=target.buffer)
    _zero_at_starts(target.buffer, group, not_passed).baddbmm_(scores.transpose(1, 2), grad_g[..., :d])
    target.finish()


def _per_chunk_products(x3: Tensor, y3: Tensor, with_ones: bool, zero: Tensor, groups: List[_Group],
                        n_chunks: int, chunk: int) -> Tensor:
    """(B * H, C, m, e): ``X_c^T Y_c`` for every chunk of x3 (B * H, N, m), y3 (B * H, N, e) (with a ones
    column if ``with_ones``), x's rows ``zero`` (C, chunk, 1) left out in the chunks where a document starts."""
    product = x3.new_empty(x3.shape[0], n_chunks, x3.shape[-1], y3.shape[-1] + with_ones)
    for group in groups:
        x_g = _group_rows(x3, group.heads, group.rows, chunk)
        y_g = (_values_with_ones if with_ones else _group_rows)(y3, group.heads, group.rows, chunk)
        part = torch.bmm(x_g.transpose(1, 2), y_g)
        product[group.heads, group.chunks] = _product_at_starts(x_g, y_g, group, zero, part).view(
            -1, group.chunks.stop - group.chunks.start, part.shape[1], part.shape[2])
    return product


class _PackedChunks(torch.autograd.Function):
    """Causal linear attention without decay over a packed row, a group of chunks at a time as the unpacked path
    (:class:`.causal_chunks._CausalChunks`), with a hand-written backward.

    Per chunk c, with V = [v, 1], ``hidden`` the future and other documents' keys, K' the keys of the chunk's last
    document (``reaches_end``), Q' the queries still in the document the chunk started in (``carries``):
        S_c = Q_c K_c^T (zero where hidden),  L_c = K'_c^T V_c,  P_c = (segmented scan of L)_c-1,
        O_c = S_c V_c + Q'_c P_c.
    First every L_c (a pass over the groups), then the scan over chunks, then the outputs (a second pass); the
    backward likewise, its scan running the other way, and recomputes S_c. Every product is computed over all
    chunks as in the unpacked path (``tril``), then fixed in place in the chunks where a document starts: a
    masked entry is set to zero, never multiplied by zero, so a non-finite input stays in its document.
    Saves q, k, v and P (O((N / chunk_size) m d)).

    Shapes: q, k (B, H, N, m); v (B, H, N, d) without the ones column; masks (hidden (C, chunk, chunk),
    reaches_end and carries (C, chunk) bool); start_chunks: the chunks where a document starts. Returns the
    (B, H, N, d + 1) unnormalised outputs.
    """

    @staticmethod
    @outside_autocast
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, reaches_end: Tensor, carries: Tensor,
        start_chunks: List[int], steps: int,
    ) -> Tensor:
        batch, heads, n, m = q.shape
        n_chunks, chunk = carries.shape
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        groups = _plan(batch * heads, n, chunk, start_chunks, q.device)
        local = _per_chunk_products(k3, v3, True, ~reaches_end[..., None], groups, n_chunks, chunk)
        previous = states_before(local, carries[:, -1], None, steps)
        out3 = q.new_empty(batch * heads, n, v.shape[-1] + 1)
        for group in groups:
            _forward_group(q3, k3, v3, previous, out3, (hidden, carries), group, chunk)
        ctx.save_for_backward(q, k, v, previous, hidden, reaches_end, carries)
        ctx.start_chunks, ctx.steps = start_chunks, steps
        return out3.view(batch, heads, n, -1)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        q, k, v, previous, hidden, reaches_end, carries = ctx.saved_tensors
        batch, heads, n, m = q.shape
        n_chunks, chunk = carries.shape
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        grad3 = grad_out.reshape(batch * heads, n, -1)
        groups = _plan(batch * heads, n, chunk, ctx.start_chunks, q.device)
        grad_previous = _per_chunk_products(q3, grad3, False, ~carries[..., None], groups, n_chunks, chunk)
        # The scan backwards: chunk c's contribution reaches the state before chunk c' > c through chunks
        # c + 1 .. c' - 1, each passing it on.
        grad_local = states_before(grad_previous.flip(-3), carries[:, -1].flip(0), None, ctx.steps).flip(-3)
        grads = (torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3))
        for group in groups:
            _backward_group(q3, k3, v3, grad3, previous, grad_local, grads, (hidden, reaches_end, carries), group,
                            chunk)
        return grads[0].view_as(q), grads[1].view_as(k), grads[2].view_as(v), None, None, None, None, None

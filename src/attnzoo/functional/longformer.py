"""Longformer attention (Beltagy et al. 2020): a sliding window plus global positions, which may differ between
the elements of a batch, optionally with separate projections for the global attention; on the blockwise core
of :mod:`attnzoo.functional.blocksparse`, with a dense float64 reference.

Definition, for one batch element with global positions ``g`` (a bool per position): query i may attend to key j
when ``|i - j| < window`` or ``g[j]`` or ``g[i]``, and, causally, ``j <= i``; a padded key is never attended,
whatever marks it (padding wins). So a global query attends to every key, and every query to every global
key.

Fast path, O(N (window + G)) for G global positions per element (the most over the batch):

* every query block reads its window keys (a band of blocks, as :class:`~.blocksparse.LocalPattern`) followed
  by the G global keys, in one softmax under one mask (:func:`longformer_block_mask`: a global key the window
  already holds is taken from the window alone, so each key counts once): (block_size x (window span + G))
  logits per block, never N x N;
* the G global queries' rows are a dense (G x N) pass written over their rows.

A packed row (``cu_seqlens``) gives every document what it gets alone (:func:`packed_longformer_attention_unchecked`):
its window stops at the document's ends, its global positions are its own (the first ``global_tokens`` of the
document, ``global_indices`` counted from its start and end), a global query sees the keys of its document
and every query the global keys of its document. Each query block of the packed window plan
(:mod:`.blocksparse.packed`) reads its document's global keys after its window; the global queries' dense
rows run per distinct document length, over their document's keys.

With ``projections`` (the paper's separate global projections Q_g, K_g, V_g, here per-head
(head_dim x head_dim) maps applied to the given q, k, v), only the global queries' rows change: they are
computed from ``q @ Wq`` at the global positions over ``k @ Wk`` and ``v @ Wv`` of every position. Every other
row attends with the plain q, k, v, to its window and to the global keys alike.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import (
    check_bool,
    check_key_padding_mask,
    check_number,
    check_position_mask,
    check_positive_int,
    check_qkv,
)
from .blocksparse import BlockPlan, LocalPattern, blocksparse_plan, default_block, grouped_sdpa, packed_blocksparse_plan
from .blocksparse.core import _gather_keys, _gather_queries, _to_positions, blockwise_rows
from .masks import zero_padded
from .packing import spans_by_length
from .softmax import masked_softmax_reference

Projections = Tuple[Tensor, Tensor, Tensor]
"""The global projections (Wq, Wk, Wv), each (heads, dim, dim): a row x of head h maps to ``x @ W[h]``."""


class GlobalPositions(NamedTuple):
    """The global positions of one call, gathered for the fast path. The leading dim is the batch, or 1 when
    every element has the same global positions.

    Attributes:
        mask: (batch, seq) bool, True where the position is global.
        positions: (batch, count) long: each element's global positions in ascending order, then 0 in the
            slots past its own count (``count`` is the most over the batch).
        valid: (batch, count) bool: the slot holds a global position of its element.
    """

    mask: Tensor
    positions: Tensor
    valid: Tensor

    @property
    def count(self) -> int:
        return self.positions.shape[1]


def gather_global_positions(mask: Tensor) -> GlobalPositions:
    """The :class:`GlobalPositions` of a (batch, seq) bool ``mask``. The number of slots is read from the mask
    (the most global positions of any element), so the shapes of the call that follows depend on its values:
    one host synchronisation, and a traced graph would freeze that count."""
    counts = mask.sum(1)
    count = int(counts.max()) if mask.numel() else 0
    # A stable sort puts each element's global positions first, in ascending order.
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :count]
    valid = torch.arange(count, device=mask.device)[None, :] < counts[:, None]
    positions = torch.where(valid, order, torch.zeros_like(order))
    return GlobalPositions(mask, positions, valid)


def static_global_mask(length: int, global_tokens: int, global_indices: Sequence[int],
                       device: Optional[torch.device] = None) -> Tensor:
    """(length,) bool: the first ``global_tokens`` positions and ``global_indices`` (negative ones counted from
    the end; each must lie in ``[-length, length)``: the caller checks it) are global."""
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    mask[: min(global_tokens, length)] = True
    if global_indices:
        mask[torch.tensor([i % length for i in global_indices], dtype=torch.long, device=device)] = True
    return mask


def out_of_range(global_indices: Sequence[int], length: int) -> Tuple[int, ...]:
    """The indices that name no position of a sequence of ``length`` (outside ``[-length, length)``)."""
    return tuple(i for i in global_indices if not -length <= i < length)


def window_plan(window: int, block_size: int, length: int, causal: bool, device: torch.device) -> BlockPlan:
    """The block plan of the window part (reusable while the arguments stay the same)."""
    return blocksparse_plan(LocalPattern(window, block_size), length, causal, device, dense_when_cheaper=False)


def _check_projections(projections: Optional[Projections], heads: int, dim: int, dim_v: int) -> None:
    if projections is None:
        return
    if not isinstance(projections, (tuple, list)) or len(projections) != 3:
        raise TypeError(f"global_projections must be a tuple of three tensors (Wq, Wk, Wv), got {projections!r}")
    for label, weight, width in zip(("Wq", "Wk", "Wv"), projections, (dim, dim, dim_v)):
        if not isinstance(weight, Tensor) or weight.shape != (heads, width, width):
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"global_projections: {label} must have shape (heads, {width}, {width}) = "
                             f"({heads}, {width}, {width}), got {shape}")


def longformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    global_mask: Optional[Tensor] = None,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    global_projections: Optional[Projections] = None,
    scale: Optional[float] = None,
    block_size: Optional[int] = None,
) -> Tensor:
    """Longformer attention: a sliding window plus the global positions of each batch element.

    Args:
        q: (batch, heads, seq, head_dim); k: (batch, kv_heads, seq, head_dim); v: (batch, kv_heads, seq,
            head_dim_v), ``kv_heads`` dividing ``heads`` (grouped-query attention, never repeated; with
            ``global_projections``, ``kv_heads == heads``). Self-attention: one sequence.
        window: query i sees keys with ``|i - j| < window`` (causally the ``window`` positions up to i), >= 1.
        global_mask: (batch, seq) bool, True marks a global position (attends to every key, seen by every
            query); None: none (plain sliding-window attention).
        causal: key j visible to query i only if j <= i (global rows and global keys included).
        key_padding_mask: (batch, seq) bool, True marks padding: never attended, even where marked global.
        global_projections: (Wq, Wk, Wv), each (heads, head_dim, head_dim) (Wv: head_dim_v): the global
            queries' rows are computed from ``q @ Wq`` over ``k @ Wk`` and ``v @ Wv``. None: the plain q, k, v.
        scale: logit scale (> 0), ``1/sqrt(head_dim)`` by default.
        block_size: positions per block of the window part (a speed knob). None: the blockwise family's default
            (:func:`attnzoo.functional.blocksparse.default_block`).

    Returns:
        (batch, heads, seq, head_dim_v); rows that may see no key are zeros.
    """
    check_bool("causal", causal)
    window = check_positive_int("window", window)
    block_size = check_number("block_size", block_size, integer=True, minimum=1, optional=True)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v, grouped=True)
    if global_projections is not None and k.shape[1] != q.shape[1]:
        raise ValueError(f"global_projections map each query head's keys: k and v need q's {q.shape[1]} heads, "
                         f"got kv_heads={k.shape[1]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"longformer attention pairs positions of one sequence: q seq={q.shape[2]} and "
                         f"k seq={k.shape[2]} must be equal")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_position_mask("global_mask", global_mask, q.shape[0], q.shape[2], q.device)
    _check_projections(global_projections, q.shape[1], q.shape[3], v.shape[3])
    globals_ = None if global_mask is None else gather_global_positions(global_mask)
    plan = window_plan(window, default_block(window, block_size), q.shape[2], causal, q.device)
    return longformer_attention_unchecked(q, k, v, window, plan, globals_, causal, key_padding_mask, scale,
                                          global_projections)


def longformer_block_mask(
    plan: BlockPlan, window: int, globals_: Optional[GlobalPositions], causal: bool,
    key_padding_mask: Optional[Tensor],
) -> Tensor:
    """(batch or 1, n_query_blocks, 1, block_size, width + count) bool: which of a query block's keys (its
    window span, then the ``count`` global keys) each of its queries may see: the window's keys but padding,
    and the global keys but padding, those the window already holds (each key counts once) and, causally,
    later ones. So the window's part depends on the padding alone. The leading dim is 1 when nothing in it
    differs between batch elements."""
    n_query_blocks, bs = plan.query_positions.shape
    width = plan.index.shape[1]
    count = 0 if globals_ is None else globals_.count
    allowed = plan.allowed.unsqueeze(0)  # (1, nqb, 1, bs, width): the band, causality
    if key_padding_mask is not None:
        keep = ~F.pad(key_padding_mask, (0, 1), value=True)[:, plan.index]  # (batch, nqb, width)
        allowed = allowed & keep.view(-1, n_query_blocks, 1, 1, width)
    if not count:
        return allowed
    positions = globals_.positions  # (batch or 1, count)
    seen = globals_.valid
    if key_padding_mask is not None:
        seen = seen & ~key_padding_mask.gather(1, positions.expand(key_padding_mask.shape[0], count))
    query = plan.query_positions.view(1, n_query_blocks, 1, bs, 1)
    key = positions.view(-1, 1, 1, 1, count)
    # Farther than the window (causally: behind it). Bounds on the (small) query side, so that only
    # comparisons run at (nqb, bs, count).
    behind = key <= query - window
    seen = seen.view(-1, 1, 1, 1, count) & (behind if causal else behind | (key >= query + window))
    rows = max(allowed.shape[0], seen.shape[0])
    return torch.cat([allowed.expand(rows, n_query_blocks, 1, bs, width),
                      seen.expand(rows, n_query_blocks, 1, bs, count)], dim=-1)


def longformer_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    plan: BlockPlan,
    globals_: Optional[GlobalPositions],
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float],
    projections: Optional[Projections] = None,
    block_mask: Optional[Tensor] = None,
) -> Tensor:
    """:func:`longformer_attention` for callers that validated the arguments (the mechanism): ``plan`` is the
    window's :func:`window_plan` for this window, length and causality, ``globals_`` the call's
    :func:`gather_global_positions` (None or a count of 0: no global position), ``block_mask`` this call's
    :func:`longformer_block_mask` if the caller kept one (made here when None)."""
    batch, heads, length, _ = q.shape
    dim_v = v.shape[3]
    k0, v0 = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    n_query_blocks, bs = plan.query_positions.shape
    count = 0 if globals_ is None else globals_.count

    k_global = v_global = None
    if count:
        index = globals_.positions.view(-1, 1, count, 1)
        kv_heads = k0.shape[1]
        k_global = k0.gather(2, index.expand(batch, kv_heads, count, k0.shape[3]))  # (batch, kv_heads, count, dim)
        v_global = v0.gather(2, index.expand(batch, kv_heads, count, dim_v))
    q_blocks = _gather_queries(q, plan)  # (batch * nqb, heads, bs, dim)
    # Each block's window keys, then the global keys: (batch * nqb, heads, width + count, dim).
    k_blocks = _gather_keys(k0, plan.layout, plan.index, k_global)
    v_blocks = _gather_keys(v0, plan.layout, plan.index, v_global)
    if block_mask is None:
        block_mask = longformer_block_mask(plan, window, globals_, causal, key_padding_mask)
    # One (batch * nqb, 1, bs, keys) mask, so that SDPA sees 4-D inputs and may pick a fused kernel.
    allowed = block_mask.expand(batch, *block_mask.shape[1:]).reshape(batch * n_query_blocks, 1, bs, -1)
    # Without padding every row sees a key (its own, from the window or as a global key; which rows do is fixed
    # by the shapes and by which masks are given, not by values): plain SDPA, no empty-row handling.
    out = grouped_sdpa(q_blocks, k_blocks, v_blocks, allowed, scale, empty_rows=key_padding_mask is not None)
    out = _to_positions(out, plan, batch, heads, length)  # (batch, heads, seq, dim_v)
    if not count:
        return out

    # The global queries' rows: each over every key (but padding; causally, up to itself), densely.
    positions = globals_.positions
    q_global = q.gather(2, positions.view(-1, 1, count, 1).expand(batch, heads, count, q.shape[3]))
    keys, values = k0, v0
    if projections is not None:
        w_q, w_k, w_v = (w.to(q.dtype) for w in projections)
        q_global, keys, values = q_global @ w_q, k0 @ w_k, v0 @ w_v
    rows_allowed = None
    if key_padding_mask is not None:
        rows_allowed = ~key_padding_mask.view(batch, 1, 1, length)
    if causal:
        before = torch.arange(length, device=q.device).view(1, 1, 1, length) <= positions.view(-1, 1, count, 1)
        rows_allowed = before if rows_allowed is None else rows_allowed & before
    global_rows = grouped_sdpa(q_global, keys, values, rows_allowed, scale)  # (batch, heads, count, dim_v)
    # Written over their positions' rows: slots past an element's own count go to an extra row, cut off.
    target = torch.where(globals_.valid, positions, length).view(-1, 1, count, 1)
    out = F.pad(out, (0, 0, 0, 1)).scatter(2, target.expand(batch, heads, count, dim_v), global_rows)
    return out[:, :, :length]


def longformer_dense_mask(window: int, global_mask: Tensor, causal: bool = False,
                          key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """(batch, seq, seq) bool, True where query i may attend to key j, written from the definition: the window,
    or j global, or i global; causally j <= i; never a padded key. Quadratic: for the reference and tests."""
    batch, length = global_mask.shape
    i = torch.arange(length, device=global_mask.device)
    near = (i[:, None] - i[None, :]).abs() < window
    allowed = near[None] | global_mask[:, None, :] | global_mask[:, :, None]
    if causal:
        allowed = allowed & (i[None, :] <= i[:, None])[None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, :]
    return allowed


def longformer_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    global_mask: Optional[Tensor] = None,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    global_projections: Optional[Projections] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """Dense float64 softmax under :func:`longformer_dense_mask`, each global query's row computed from the
    projected tensors (``q @ Wq`` over ``k @ Wk``, ``v @ Wv``) where ``global_projections`` are given:
    obviously correct and quadratic, for tests. Same arguments as :func:`longformer_attention`; returns
    float64."""
    batch, _, length, dim = q.shape
    q, k, v = q.double(), zero_padded(k.double(), key_padding_mask), zero_padded(v.double(), key_padding_mask)
    if global_mask is None:
        global_mask = torch.zeros(batch, length, dtype=torch.bool, device=q.device)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    allowed = longformer_dense_mask(window, global_mask, causal, key_padding_mask)[:, None]  # (batch, 1, N, N)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
        return masked_softmax_reference(logits, allowed) @ v

    plain = attend(q, k, v)
    if global_projections is None:
        return plain
    w_q, w_k, w_v = (w.double() for w in global_projections)
    projected = attend(q @ w_q, k @ w_k, v @ w_v)  # a global query's row allows every key
    return torch.where(global_mask[:, None, :, None], projected, plain)


# -- packed rows (cu_seqlens) ------------------------------------------------------------------------------------
def packed_window_plan(window: int, block_size: int, spans: List[Tuple[int, int]], causal: bool,
                       device: torch.device) -> BlockPlan:
    """The window part of a packed row of documents ``spans`` ((start, end) in order): each document's window
    laid out as it is alone (:func:`~.blocksparse.packed_blocksparse_plan`)."""
    return packed_blocksparse_plan(LocalPattern(window, block_size), spans, causal, device,
                                   dense_when_cheaper=False).blocks


def packed_static_global_mask(spans: List[Tuple[int, int]], global_tokens: int, global_indices: Sequence[int],
                              device: Optional[torch.device] = None) -> Tensor:
    """(1, N) bool: each document's :func:`static_global_mask`, as the document alone has it (its first
    ``global_tokens`` positions, ``global_indices`` counted from its own start and end; the caller checks that
    they lie in every document)."""
    alone = {length: static_global_mask(length, global_tokens, global_indices, device)
             for length in spans_by_length(spans)}
    return torch.cat([alone[end - start] for start, end in spans]).view(1, -1)


def _document_globals(mask: Tensor, spans: List[Tuple[int, int]]) -> Tuple[Tensor, Tensor, Tensor]:
    """For a packed row's global ``mask`` (1, N): the document of each position (N,), and each document's
    global positions (docs, G) in ascending order (0 past its own count) with their validity (docs, G)."""
    device = mask.device
    lengths = torch.tensor([end - start for start, end in spans], device=device)
    document = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)
    positions = torch.nonzero(mask[0]).squeeze(1)  # ascending, so grouped by document
    counts = torch.bincount(document[positions], minlength=len(spans))
    count = int(counts.max()) if positions.numel() else 0
    valid = torch.arange(count, device=device)[None, :] < counts[:, None]
    first = counts.cumsum(0) - counts
    slots = (first[:, None] + torch.arange(count, device=device)).clamp(max=max(positions.numel() - 1, 0))
    table = torch.where(valid, positions[slots], 0) if count else positions.new_zeros(len(spans), 0)
    return document, table, valid


def _with_document_globals(plan: BlockPlan, window: int, document: Tensor, table: Tensor, valid: Tensor,
                           causal: bool) -> BlockPlan:
    """``plan`` (a packed window plan) with each query block's document's global keys after its window: seen
    where they lie beyond the window (each key counts once) and, causally, behind the query."""
    n_query_blocks, bs = plan.query_positions.shape
    owner = document[plan.query_positions[:, 0]]  # a window block starts with a position of its document
    keys, seen = table[owner], valid[owner]  # (nqb, G)
    query, key = plan.query_positions.view(n_query_blocks, bs, 1), keys.view(n_query_blocks, 1, -1)
    behind = key <= query - window
    seen = seen.view(n_query_blocks, 1, -1) & (behind if causal else behind | (key >= query + window))
    index = torch.cat([plan.index, torch.where(valid[owner], keys, plan.length)], dim=1)
    return plan._replace(index=index, allowed=torch.cat([plan.allowed, seen.unsqueeze(1)], dim=-1))


def packed_longformer_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, window: int, plan: BlockPlan, spans: List[Tuple[int, int]],
    global_mask: Tensor, causal: bool, scale: Optional[float], projections: Optional[Projections] = None,
) -> Tensor:
    """Longformer attention over a packed row q, k (1, heads, N, head_dim), v (1, heads, N, head_dim_v) of
    documents ``spans``, each as it is alone: ``plan`` its :func:`packed_window_plan`, ``global_mask`` (1, N) the
    row's global positions (e.g. :func:`packed_static_global_mask`, with a call's own). Returns (1, heads, N,
    head_dim_v)."""
    document, table, valid = _document_globals(global_mask, spans)
    out = blockwise_rows(q, k, v, _with_document_globals(plan, window, document, table, valid, causal), None, scale)
    if projections is not None:
        w_q, w_k, w_v = (w.to(q.dtype) for w in projections)
        k, v = k @ w_k, v @ w_v
    starts = {start: index for index, (start, _) in enumerate(spans)}
    positions, replaced = [], []
    for length, firsts in spans_by_length(spans).items():
        # The global queries of the documents of this length, each over every key of its document, densely.
        documents = torch.tensor([starts[start] for start in firsts], device=q.device)
        seen = valid[documents]
        count = int(seen.sum(1).max()) if seen.numel() else 0
        if not count:
            continue
        queries, seen = table[documents, :count], seen[:, :count]
        keys = torch.tensor(firsts, device=q.device)[:, None] + torch.arange(length, device=q.device)
        q_rows = q[0][:, queries].transpose(0, 1)  # (docs, heads, count, dim)
        if projections is not None:
            q_rows = q_rows @ w_q
        k_rows, v_rows = (x[0][:, keys].transpose(0, 1) for x in (k, v))
        allowed = seen.view(-1, 1, count, 1)
        if causal:
            allowed = allowed & (keys.view(-1, 1, 1, length) <= queries.view(-1, 1, count, 1))
        rows = grouped_sdpa(q_rows, k_rows, v_rows, allowed, scale).transpose(0, 1)[:, seen]  # (heads, n, dim_v)
        positions.append(queries[seen])
        replaced.append(rows.unsqueeze(0).to(out.dtype))
    if not positions:
        return out
    return out.index_copy(2, torch.cat(positions), torch.cat(replaced, dim=2))  # one copy of the rows

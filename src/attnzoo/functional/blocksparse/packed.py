"""Packed rows (``cu_seqlens``) on the blockwise core: every document laid out exactly as the pattern lays it
out alone, the documents' layouts side by side in one plan.

A fixed pattern's blocks, windows, strides, segments, sinks, global and random blocks all count positions from
the start of the sequence. In a packed row a document starts anywhere, so its blocks are not the row's
blocks: :func:`packed_blocksparse_plan` makes the plan of each distinct document length once (as for that
document alone, its lengths not a multiple of the block size padded inside the document), moves its positions
to the document's place in the row, and stacks the query blocks of all documents into one plan. A query block
then gathers only keys of its own document, under the mask the document alone has, so every document gets
exactly the keys, and so the output, it gets alone; one gather and one softmax run over the whole row.

A document short enough that its blocks would compute most of its logits runs, as it does alone, as one dense
masked softmax (one call per such length; the others are stacked into one sub-row).

Documents whose blocks differ in size (a dilated pattern shrinks its blocks to short sequences) are padded to
the widest: extra query rows are padding slots, extra key slots are never allowed. A pattern's global queries
(BigBird's global blocks) are the first positions of each document: their dense rows run per distinct
document length, over that document's keys. Memory O(N * blocks_per_row * block_size) plus the padding of
each document to whole blocks; nothing N x N.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..packing import spans_by_length
from .core import blockwise_rows, grouped_sdpa
from .layout import BlockLayout, BlockPattern
from .plan import BlockPlan, _block_plan, blocksparse_plan


class GlobalRows(NamedTuple):
    """The global queries of the documents of one length, each seeing every key of its document.

    Attributes:
        queries: (docs, g) row positions of the documents' first g positions.
        keys: (docs, length) row positions of the documents' keys.
        allowed: (1, 1, g, length) bool (causality within the document), or None: every key.
    """

    queries: Tensor
    keys: Tensor
    allowed: Optional[Tensor]


class DenseDocuments(NamedTuple):
    """Documents of one length that run, as they do alone, as one dense masked softmax (short documents,
    whose blocks would compute at least :data:`~.plan.DENSE_SHARE` of their logits).

    Attributes:
        positions: (docs, length) row positions of the documents.
        allowed: (1, 1, length, length) bool, the pattern's mask with causality.
    """

    positions: Tensor
    allowed: Tensor


class PackedBlockPlan(NamedTuple):
    """The input-independent part of a packed block-sparse call (:func:`packed_blocksparse_plan`).

    Attributes:
        blocks: one :class:`~.plan.BlockPlan` of the documents run blockwise, back to back (its ``parts`` each
            packed alike): query slots and gather indices in positions of that sub-row, every document's element
            mask, ``order`` always given; None when every document runs densely.
        blockwise: (M,) the row positions of that sub-row, or None when it is the whole row.
        global_rows: one :class:`GlobalRows` (positions of the sub-row) per document length run blockwise whose
            layout has global queries.
        dense: one :class:`DenseDocuments` per document length run densely.
    """

    blocks: Optional[BlockPlan]
    blockwise: Optional[Tensor]
    global_rows: Tuple[GlobalRows, ...]
    dense: Tuple[DenseDocuments, ...] = ()


def packed_blocksparse_plan(pattern: BlockPattern, spans: List[Tuple[int, int]], causal: bool,
                            device: torch.device, *, dense_when_cheaper: bool = True) -> PackedBlockPlan:
    """The plan of a packed row whose documents are ``spans`` ((start, end), covering the row in order, as
    :func:`~attnzoo.functional.packing.check_cu_seqlens` returns them): each document as it runs alone.
    ``dense_when_cheaper``: a document length whose blocks would compute :data:`~.plan.DENSE_SHARE` of its
    logits or more runs densely, as :func:`~.plan.blocksparse_plan` decides for the document alone."""
    dense, kept = [], []
    for length, starts in spans_by_length(spans).items():
        alone = blocksparse_plan(pattern, length, causal, device, dense_when_cheaper=dense_when_cheaper)
        if alone.dense is None:
            kept += [(start, start + length) for start in starts]
        else:
            positions = torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
            dense.append(DenseDocuments(positions, alone.dense))
    if not kept:
        return PackedBlockPlan(None, None, (), tuple(dense))
    kept.sort()
    blockwise = None
    if dense:  # the documents run blockwise, back to back in a sub-row of their own
        blockwise = torch.cat([torch.arange(start, end, device=device) for start, end in kept])
        ends = torch.tensor([end - start for start, end in kept]).cumsum(0).tolist()
        kept = list(zip([0] + ends[:-1], ends))
    blocks, global_rows = _blockwise_plan(pattern, kept, causal, device)
    return PackedBlockPlan(blocks, blockwise, global_rows, tuple(dense))


def _blockwise_plan(pattern: BlockPattern, spans: List[Tuple[int, int]], causal: bool,
                    device: torch.device) -> Tuple[BlockPlan, Tuple[GlobalRows, ...]]:
    """The stacked plan of documents ``spans`` (a row of their own) and their global queries' rows."""
    groups = {length: torch.tensor(starts, device=device) for length, starts in spans_by_length(spans).items()}
    row = spans[-1][1]
    parts = pattern.parts()
    if parts:
        plans = tuple(_stacked(part, groups, row, causal, device) for part in parts)
        blocks = plans[0]._replace(parts=plans)
    else:
        blocks = _stacked(pattern, groups, row, causal, device)
    global_rows = []
    for length, starts in groups.items():
        g = pattern.layout(length, causal, device).global_queries if not parts else 0
        if g:
            allowed = None
            if causal:
                i = torch.arange(length, device=device)
                allowed = (i[None, :] <= i[:g, None]).view(1, 1, g, length)
            global_rows.append(GlobalRows(starts[:, None] + torch.arange(g, device=device),
                                          starts[:, None] + torch.arange(length, device=device), allowed))
    return blocks, tuple(global_rows)


def _stacked(pattern: BlockPattern, groups: Dict[int, Tensor], row: int, causal: bool,
             device: torch.device) -> BlockPlan:
    """One plan of the row: for each document length, the document's own plan moved to every start."""
    alone = {length: _block_plan(pattern, length, causal, device) for length in groups}
    bs = max(plan.query_positions.shape[1] for plan in alone.values())
    width = max(plan.index.shape[1] for plan in alone.values())
    query_positions, index, allowed, slots, places = [], [], [], [], []
    used = 0  # query slots of the groups before
    for length, starts in groups.items():
        plan = alone[length]
        n_blocks, own_bs = plan.query_positions.shape
        docs, shift = starts.numel(), starts.view(-1, 1, 1)
        positions = F.pad(plan.query_positions, (0, bs - own_bs), value=-1)
        query_positions.append(torch.where(positions >= 0, positions + shift, -1).reshape(-1, bs))
        keys = F.pad(plan.index, (0, width - plan.index.shape[1]), value=length)
        index.append(torch.where(keys < length, keys + shift, row).reshape(-1, width))
        # Extra key slots are never seen; extra query rows are padding slots, which may see any slot.
        mask = F.pad(plan.allowed, (0, width - plan.index.shape[1]), value=False)
        allowed.append(F.pad(mask, (0, 0, 0, bs - own_bs), value=True).repeat(docs, 1, 1, 1))
        own = torch.arange(length, device=device) if plan.order is None else plan.order
        own = own // own_bs * bs + own % own_bs  # the slot of each document position, in blocks of bs
        first = used + n_blocks * bs * torch.arange(docs, device=device)
        slots.append((first[:, None] + own).reshape(-1))
        places.append((starts[:, None] + torch.arange(length, device=device)).reshape(-1))
        used += docs * n_blocks * bs
    order = torch.empty(row, dtype=torch.long, device=device)
    order[torch.cat(places)] = torch.cat(slots)  # the slot of each row position
    query_positions, index = torch.cat(query_positions), torch.cat(index)
    # The row has no one key sequence to list blocks of: its keys are gathered by position (``index``).
    layout = BlockLayout(bs, query_positions, None, None, index.new_empty(query_positions.shape[0], 0))
    full_rows = all(plan.full_rows for plan in alone.values())
    return BlockPlan(layout, row, causal, query_positions, index, torch.cat(allowed), full_rows, order)


def packed_blocksparse_attention_unchecked(q: Tensor, k: Tensor, v: Tensor, plan: PackedBlockPlan,
                                           scale: Optional[float]) -> Tensor:
    """Block-sparse attention over a packed row q (1, heads, N, head_dim), k (1, kv_heads, N, head_dim), v (1,
    kv_heads, N, head_dim_v) (``kv_heads`` dividing ``heads``), each document as it is alone, by a
    :func:`packed_blocksparse_plan` of its documents. Returns (1, heads, N, head_dim_v)."""
    heads, dim_v = q.shape[1], v.shape[3]
    pieces = []  # (row positions, (1, heads, positions, dim_v) outputs), unless the blocks hold the whole row
    if plan.blocks is not None:
        sub = (q, k, v) if plan.blockwise is None else tuple(x.index_select(2, plan.blockwise) for x in (q, k, v))
        out = _blockwise(*sub, plan, scale)
        if plan.blockwise is None:
            return out
        pieces.append((plan.blockwise, out))
    for documents in plan.dense:
        # (docs, heads, length, dim): each document a batch element, one dense masked softmax.
        q_docs, k_docs, v_docs = (x[0][:, documents.positions].transpose(0, 1) for x in (q, k, v))
        out = grouped_sdpa(q_docs, k_docs, v_docs, documents.allowed, scale)
        pieces.append((documents.positions.reshape(-1), out.transpose(0, 1).reshape(1, heads, -1, dim_v)))
    # Every position is in exactly one piece: one gather puts them back in row order.
    order = torch.argsort(torch.cat([positions for positions, _ in pieces]))
    return torch.cat([values.to(pieces[0][1].dtype) for _, values in pieces], dim=2).index_select(2, order)


def _blockwise(q: Tensor, k: Tensor, v: Tensor, plan: PackedBlockPlan, scale: Optional[float]) -> Tensor:
    """The documents of ``plan.blocks``, back to back in q, k, v: the blocks, then their global queries' rows."""
    out = blockwise_rows(q, k, v, plan.blocks, None, scale)
    if not plan.global_rows:
        return out
    heads, dim_v = q.shape[1], v.shape[3]
    positions, replaced = [], []
    for rows in plan.global_rows:
        # (docs, heads, g or length, dim): each document a batch element, over its own keys densely.
        q_rows = q[0][:, rows.queries].transpose(0, 1)
        k_rows, v_rows = (x[0][:, rows.keys].transpose(0, 1) for x in (k, v))
        dense = grouped_sdpa(q_rows, k_rows, v_rows, rows.allowed, scale)
        positions.append(rows.queries.reshape(-1))
        replaced.append(dense.transpose(0, 1).reshape(1, heads, -1, dim_v).to(out.dtype))
    return out.index_copy(2, torch.cat(positions), torch.cat(replaced, dim=2))  # one copy of the rows

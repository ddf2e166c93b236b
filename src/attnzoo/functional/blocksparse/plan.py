"""The input-independent part of a block-sparse call (:class:`BlockPlan`): gather indices and the element
mask for one (pattern, length, causal), reusable across calls, and whether a dense pass would be cheaper."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .layout import BlockLayout, BlockPattern, _natural_positions


class BlockPlan(NamedTuple):
    """Everything about one (pattern, length, causal) call that does not depend on the inputs: made by
    :func:`blocksparse_plan` and reusable across calls (the mechanisms keep the last one).

    Attributes:
        layout: the pattern's :class:`BlockLayout`.
        length: the sequence length planned for; causal: whether causality is in ``allowed``.
        query_positions: (n_query_blocks, block_size) position of each query slot (-1: padding).
        index: (n_query_blocks, S) key position of each gathered slot, ``length`` for none (a zero row).
        allowed: (n_query_blocks, 1, block_size, S) bool: slot validity, the pattern's rule, causality.
            Padding query slots (discarded) may see every slot, so that no row of it is empty.
        full_rows: every row of ``allowed`` sees at least one key (then, without key padding, no output row
            needs zeroing).
        order: (length,) the slot of each position when queries are permuted, else None.
        parts: the plans of the pattern's :meth:`BlockPattern.parts` (empty when it is laid out whole); the
            fields above then describe the first part.
        dense: (1, 1, length, length) bool, the pattern's whole mask with causality, when the blocks would
            compute at least :data:`DENSE_SHARE` of the dense logits (short sequences): the core then runs
            one masked dense softmax instead, which gives the same output faster. None otherwise.
    """

    layout: BlockLayout
    length: int
    causal: bool
    query_positions: Tensor
    index: Tensor
    allowed: Tensor
    full_rows: bool
    order: Optional[Tensor]
    parts: Tuple["BlockPlan", ...] = ()
    dense: Optional[Tensor] = None


DENSE_SHARE = 0.5
"""A pattern whose blocks hold at least this share of the N x N logits runs as one dense masked softmax.
Measured on the CPU (``scripts/bench_blocksparse_dense.py``, docs/lra.md): at N = 256 the blocks hold 1.25 N^2
logits and the dense pass is 9x faster for strided, 1.6x for local; at N = 1024 (about 0.3 N^2) local's blocks
are 2.7x faster than dense while strided's two merged parts are 1.6x slower. The threshold sits between the
measured shares."""


def blockwise_logits(plan: BlockPlan) -> int:
    """How many logits the blocks of ``plan`` compute (every part, plus the dense rows of global queries)."""
    return (sum(p.index.shape[0] * p.query_positions.shape[1] * p.index.shape[1] for p in plan.parts or (plan,))
            + plan.layout.global_queries * plan.length)


def blocksparse_plan(pattern: BlockPattern, length: int, causal: bool, device: torch.device, *,
                     dense_when_cheaper: bool = True) -> BlockPlan:
    """The input-independent part of a block-sparse call (layout, gather indices, element mask).
    ``dense_when_cheaper``: fill :attr:`BlockPlan.dense` when the blocks would compute :data:`DENSE_SHARE`
    of the dense logits or more (callers that run the blocks themselves say False)."""
    plan = _block_plan(pattern, length, causal, device)
    if dense_when_cheaper and blockwise_logits(plan) >= DENSE_SHARE * length * length:
        allowed = pattern.dense(length, device)  # unchecked: under tracing the length is a traced size
        if causal:
            allowed = allowed & torch.ones_like(allowed).tril()
        plan = plan._replace(dense=allowed.view(1, 1, *allowed.shape))
    return plan


def _block_plan(pattern: BlockPattern, length: int, causal: bool, device: torch.device) -> BlockPlan:
    parts = pattern.parts()
    if parts:
        plans = tuple(_block_plan(part, length, causal, device) for part in parts)
        return plans[0]._replace(parts=plans)
    layout = pattern.layout(length, causal, device)
    bs = layout.block_size
    table = layout.table
    n_query_blocks, per_row = table.shape
    if layout.query_positions is None:
        query_pos = _natural_positions(length, bs, device)
        order = None
    else:
        query_pos = layout.query_positions
        big = torch.iinfo(torch.long).max
        flat = query_pos.reshape(-1)
        order = torch.argsort(torch.where(flat >= 0, flat, big))[:length]  # slot of positions 0..N-1
    key_seq = layout.key_positions
    if key_seq is None:
        key_seq = _natural_positions(length, bs, device)
    used = (table >= 0).unsqueeze(-1)
    rows = table.clamp_min(0)
    key_pos = torch.where(used, key_seq[rows], -1).reshape(n_query_blocks, per_row * bs)
    if layout.key_tags is None:
        tags = torch.zeros((), dtype=torch.long, device=device)
    else:
        tags = layout.key_tags[rows].reshape(n_query_blocks, 1, per_row * bs)
    qp, kp = query_pos.unsqueeze(-1), key_pos.unsqueeze(1)  # (nqb, bs, 1), (nqb, 1, S)
    allowed = (kp >= 0) & pattern.rule(qp, kp, tags)
    if causal:
        allowed = allowed & (kp <= qp)
    allowed = allowed | (qp < 0)
    full_rows = bool(allowed.any(-1).all())
    index = torch.where(key_pos >= 0, key_pos, length)
    return BlockPlan(layout, length, causal, query_pos, index, allowed.unsqueeze(1), full_rows, order)

"""Block-sparse attention for fixed sparsity patterns: one blockwise core, the patterns declared on top of it,
and a dense float64 reference.

Every fixed pattern here reads "each query block attends to a set of key blocks":

* The queries, in a processing order (the natural one, or a permutation such as "grouped by position modulo
  a stride"), are cut into blocks of ``block_size``; lengths that are not a multiple are padded, the padding
  slots holding position -1.
* The keys are laid out as a *key sequence* of original positions, also cut into blocks. It may visit
  positions in another order or more than once (several *views*, e.g. the natural order followed by the
  compacted "summary" positions of the fixed pattern); each key slot carries a view ``tag``.
* An index table ``(n_query_blocks, blocks_per_row)`` lists the key blocks each query block sees (-1 for an
  unused slot). The core gathers those blocks and runs one exact softmax over their union, under an element
  mask: the slot is real, the pattern's rule on (query position, key position, tag) holds, causality by
  original positions, key padding. A row that may see no key outputs zeros (:func:`masked_sdpa`).

A pattern may instead be a disjoint union of *parts* (:meth:`BlockPattern.parts`), each laid out as above in
its own order (the strided pattern: its window in natural order, its column grouped by residue); the core
runs each part blockwise and merges their softmaxes into one (:func:`_merged_parts`).

Memory is O(N * blocks_per_row * block_size) (the gathered keys, logits and mask); nothing N x N is made. A
pattern's rule and table must agree: the rule is applied to the gathered keys only, so the table must reach
every key the rule allows (and a position must never be reachable twice, through two views, unless the rule
admits it in only one of them). The tests hold every pattern's fast path to its dense mask, which each
pattern writes separately, straight from its definition (:meth:`BlockPattern.dense`).

Patterns: :class:`LocalPattern` (sliding window), :class:`DilatedPattern`, :class:`StridedPattern` and
:class:`FixedPattern` (Child et al. 2019), :class:`LongformerPattern` (window + global tokens, Beltagy et al.
2020), :class:`BigBirdPattern` (window + global + random blocks, Zaheer et al. 2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_key_padding_mask, check_number, check_positive_int, check_qkv
from .masks import zero_padded
from .softmax import masked_sdpa, masked_softmax_reference


class BlockLayout(NamedTuple):
    """Where a pattern's blocks come from, for one sequence length (positions are original positions).

    Attributes:
        block_size: positions per block (queries and keys alike).
        query_positions: (n_query_blocks, block_size) long, the position processed in each query slot (-1 for
            padding); every position 0..N-1 exactly once. None: the natural order, padded at the end.
        key_positions: (n_key_blocks, block_size) long, the key sequence's positions (-1 for padding); may
            repeat a position in several views. None: the natural order, padded at the end.
        key_tags: (n_key_blocks, block_size) long view ids handed to the pattern's rule, or None (all 0).
        table: (n_query_blocks, blocks_per_row) long key-block indices, -1 for an unused slot; no key block
            twice in a row.
        band: when not None, ``table[i, r] == i + band + r`` wherever it is in range (and -1 elsewhere) with
            natural key order: the core then slices the blocks out of a padded view instead of gathering.
        global_queries: the first ``global_queries`` positions (natural order) attend to every key (causal
            and padding aside); computed as a dense (global_queries x N) pass beside the blocks.
    """

    block_size: int
    query_positions: Optional[Tensor]
    key_positions: Optional[Tensor]
    key_tags: Optional[Tensor]
    table: Tensor
    band: Optional[int] = None
    global_queries: int = 0


class BlockPattern:
    """A fixed sparsity pattern: its block layout for a length, its element rule, and its dense mask.

    Subclasses implement :meth:`layout` (the block index table and orders), :meth:`rule` (which gathered
    key slots a query may see; causality, key padding and slot validity are the core's business) and
    :meth:`dense` (the pattern's (N, N) allowed mask written from its definition, for the reference and
    tests)."""

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        raise NotImplementedError

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        """Bool, broadcast over ``query`` (..., bs, 1) / ``key`` (..., 1, S) positions and key ``tag``s."""
        raise NotImplementedError

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        """(length, length) bool: query i may attend to key j (before causality and padding)."""
        raise NotImplementedError

    def parts(self) -> Tuple["BlockPattern", ...]:
        """Patterns with disjoint masks whose union is this one, each laid out on its own (its own query
        order, keys and table); the core runs each blockwise and merges their softmaxes. Empty (the default):
        the pattern is laid out whole by :meth:`layout`."""
        return ()


# -- table helpers ------------------------------------------------------------------------------------------
def _blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _band_table(n_query_blocks: int, n_key_blocks: int, first: int, last: int, device: torch.device) -> Tensor:
    """Row i lists key blocks i+first .. i+last (-1 where out of range)."""
    rows = torch.arange(n_query_blocks, device=device).unsqueeze(1)
    table = rows + torch.arange(first, last + 1, device=device)
    return torch.where((table >= 0) & (table < n_key_blocks), table, torch.full_like(table, -1))


def _dedupe_rows(table: Tensor) -> Tensor:
    """Each row's distinct valid entries (sorted), -1 elsewhere, trimmed to the widest row."""
    big = torch.iinfo(table.dtype).max
    ordered = torch.sort(torch.where(table >= 0, table, torch.full_like(table, big)), dim=1).values
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.where(repeat | (ordered == big), torch.full_like(ordered, big), ordered)
    ordered = torch.sort(ordered, dim=1).values
    width = max(1, int((ordered != big).sum(1).max()))
    ordered = ordered[:, :width]
    return torch.where(ordered == big, torch.full_like(ordered, -1), ordered)


def _natural_positions(length: int, block_size: int, device: torch.device) -> Tensor:
    """(n_blocks, block_size) positions 0..length-1 in order, -1 padding."""
    slots = torch.arange(_blocks(length, block_size) * block_size, device=device)
    return torch.where(slots < length, slots, torch.full_like(slots, -1)).view(-1, block_size)


# -- patterns -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalPattern(BlockPattern):
    """Sliding window: query i sees keys j with ``|i - j| < window`` (so causally the ``window`` positions
    i-window+1 .. i, itself included). Blocks: a band of ``ceil((window-1)/block_size)`` key blocks on each
    side (only behind when causal)."""

    window: int
    block_size: int

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs = self.block_size
        n = _blocks(length, bs)
        reach = min(-(-(self.window - 1) // bs), n - 1)
        first, last = -reach, (0 if causal else reach)
        return BlockLayout(bs, None, None, None, _band_table(n, n, first, last, device), band=first)

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        return (query - key).abs() < self.window

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        return (i[:, None] - i[None, :]).abs() < self.window


@dataclass(frozen=True)
class DilatedPattern(BlockPattern):
    """Dilated (atrous) attention: query i sees keys j with ``(i - j) % stride == 0``.

    Both queries and keys are processed grouped by residue (position modulo ``stride``), each residue class
    padded to whole blocks, so a query block holds one class and sees that class's key blocks alone: O(N^2 /
    stride) work, no block wasted. The block size shrinks to the class size for short sequences."""

    stride: int
    block_size: int

    def _grouped(self, length: int, device: torch.device) -> tuple:
        classes = min(self.stride, length)
        members = -(-length // self.stride)  # the largest class
        bs = min(self.block_size, members)
        per_class = _blocks(members, bs)
        t = torch.arange(per_class * bs, device=device)
        positions = torch.arange(classes, device=device)[:, None] + self.stride * t[None, :]
        positions = torch.where(positions < length, positions, torch.full_like(positions, -1))
        return bs, classes, per_class, positions.reshape(-1, bs)

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs, classes, per_class, positions = self._grouped(length, device)
        block = torch.arange(classes * per_class, device=device)
        own_class_first = (block - block % per_class).unsqueeze(1)
        table = own_class_first + torch.arange(per_class, device=device)
        if causal:  # later blocks of the class hold later positions only
            table = torch.where(table <= block.unsqueeze(1), table, torch.full_like(table, -1))
        return BlockLayout(bs, positions, positions, None, table)

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        return (query - key) % self.stride == 0

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        return (i[:, None] - i[None, :]) % self.stride == 0


@dataclass(frozen=True)
class StridedPattern(BlockPattern):
    """The strided pattern of the Sparse Transformer (Child et al. 2019), both components in one head: query
    i sees keys j with ``|i - j| < stride`` (the previous ``stride`` positions, causally) or ``(i - j) %
    stride == 0`` (every stride-th).

    Two parts (:meth:`parts`), one softmax: the window, a band of blocks in natural order
    (:class:`LocalPattern`), and the column beyond it, with queries and keys grouped by residue (position
    modulo ``stride``) as in :class:`DilatedPattern`, so a query block reads its own residue class alone (a
    natural-order block of b queries would read b classes to use one each). Each query block reads O(stride +
    block_size) keys of the window and O(N / stride) of the column: time O(N (stride + N / stride))."""

    stride: int
    block_size: int

    def parts(self) -> Tuple[BlockPattern, ...]:
        return LocalPattern(self.stride, self.block_size), _FarColumnPattern(self.stride, self.block_size)

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        distance = query - key
        return (distance.abs() < self.stride) | (distance % self.stride == 0)

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        distance = i[:, None] - i[None, :]
        return (distance.abs() < self.stride) | (distance % self.stride == 0)


@dataclass(frozen=True)
class _FarColumnPattern(DilatedPattern):
    """The strided pattern's column outside its window: ``(i - j) % stride == 0`` and ``|i - j| >= stride``
    (the window part covers the rest), on the dilated layout."""

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        distance = query - key
        return (distance % self.stride == 0) & (distance.abs() >= self.stride)

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        distance = i[:, None] - i[None, :]
        return (distance % self.stride == 0) & (distance.abs() >= self.stride)


@dataclass(frozen=True)
class FixedPattern(BlockPattern):
    """The fixed pattern of the Sparse Transformer (Child et al. 2019): positions are cut into segments of
    ``stride`` (the paper's l); query i sees its own segment (``j // l == i // l``) and the last ``summary``
    positions (the paper's c) of every segment (``j % l >= l - c``); causally, of the earlier ones.

    Two key views: the natural order (tag 0, for the own segment) and the summary positions compacted (tag 1,
    admitted only outside the own segment, which view 0 already covers). Time O(N (l + c N / l))."""

    stride: int
    summary: int
    block_size: int

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs, seg = self.block_size, self.stride
        n = _blocks(length, bs)
        natural = _natural_positions(length, bs, device)
        segments = -(-length // seg)
        offsets = torch.arange(seg - self.summary, seg, device=device)
        summary = (torch.arange(segments, device=device)[:, None] * seg + offsets[None, :]).reshape(-1)
        summary = summary[summary < length]
        n_summary = _blocks(summary.numel(), bs)
        padded = torch.full((n_summary * bs,), -1, dtype=torch.long, device=device)
        padded[: summary.numel()] = summary
        keys = torch.cat([natural, padded.view(-1, bs)])
        tags = torch.cat([torch.zeros_like(natural), torch.ones(n_summary, bs, dtype=torch.long, device=device)])
        # View 0: the natural blocks spanning the segments of the block's first and last query.
        first = torch.arange(n, device=device) * bs
        last = torch.clamp(first + bs - 1, max=length - 1)
        lo = (first // seg * seg) // bs
        hi = ((last // seg + 1) * seg - 1).clamp(max=length - 1) // bs
        width = int((hi - lo).max()) + 1
        own = lo[:, None] + torch.arange(width, device=device)
        own = torch.where(own <= hi[:, None], own, torch.full_like(own, -1))
        # View 1: every summary block (causally, those starting at or before the block's last query).
        summary_blocks = torch.arange(n_summary, device=device)
        view1 = (n + summary_blocks).expand(n, n_summary)
        if causal:
            starts = padded.view(-1, bs)[:, 0]
            view1 = torch.where(starts[None, :] <= last[:, None], view1, torch.full_like(view1, -1))
        return BlockLayout(bs, None, keys, tags, torch.cat([own, view1], dim=1))

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        same = query.div(self.stride, rounding_mode="floor") == key.div(self.stride, rounding_mode="floor")
        return torch.where(tag == 0, same, ~same)

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        same = (i[:, None] // self.stride) == (i[None, :] // self.stride)
        return same | (i[None, :] % self.stride >= self.stride - self.summary)


@dataclass(frozen=True)
class LongformerPattern(BlockPattern):
    """Longformer (Beltagy et al. 2020): a sliding window (``|i - j| < window``) plus ``global_tokens``
    leading positions that see every key and that every query sees.

    Blocks: the window band plus the blocks holding the global keys; the global queries' rows are a dense
    (global_tokens x N) pass (:attr:`BlockLayout.global_queries`). The fixed form with leading global tokens
    only: the ``longformer`` mechanism runs :func:`attnzoo.functional.longformer.longformer_attention`, whose
    global positions may be anywhere and differ between batch elements (the two agree on leading ones)."""

    window: int
    global_tokens: int
    block_size: int

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs = self.block_size
        n = _blocks(length, bs)
        reach = min(-(-(self.window - 1) // bs), n - 1)
        band = _band_table(n, n, -reach, 0 if causal else reach, device)
        g = min(self.global_tokens, length)
        table = band
        if g:
            global_blocks = torch.arange(_blocks(g, bs), device=device).expand(n, -1)
            table = _dedupe_rows(torch.cat([band, global_blocks], dim=1))
        return BlockLayout(bs, None, None, None, table, global_queries=g)

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        return ((query - key).abs() < self.window) | (key < self.global_tokens) | (query < self.global_tokens)

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        near = (i[:, None] - i[None, :]).abs() < self.window
        return near | (i[None, :] < self.global_tokens) | (i[:, None] < self.global_tokens)


@dataclass(frozen=True, eq=False)
class BigBirdPattern(BlockPattern):
    """BigBird (Zaheer et al. 2020), block form: query block b sees key blocks ``|b - b'| <= window_blocks``,
    the first ``global_blocks`` blocks (whose queries see every key), and ``random[b]``'s blocks.

    ``random`` is a (max_blocks, random_blocks) long table of block indices drawn once (seeded) and kept by
    the mechanism; for a sequence of n blocks, row b's entries are taken modulo n, and entries that repeat
    a window or global block are ignored (the table is deduplicated)."""

    block_size: int
    window_blocks: int
    global_blocks: int
    random: Tensor

    def _random_blocks(self, n: int, device: torch.device) -> Tensor:
        return self.random[:n].to(device) % n

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs = self.block_size
        n = _blocks(length, bs)
        reach = min(self.window_blocks, n - 1)
        band = _band_table(n, n, -reach, reach, device)
        g = min(self.global_blocks, n)
        parts = [band, self._random_blocks(n, device)]
        if g:
            parts.append(torch.arange(g, device=device).expand(n, -1))
        return BlockLayout(bs, None, None, None, _dedupe_rows(torch.cat(parts, dim=1)),
                           global_queries=min(g * bs, length))

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        # The table is the pattern (random blocks are whole blocks); the global query rows run densely.
        return torch.ones((), dtype=torch.bool, device=query.device)

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        bs = self.block_size
        n = _blocks(length, bs)
        block = torch.arange(length, device=device) // bs
        allowed = (block[:, None] - block[None, :]).abs() <= self.window_blocks
        allowed = allowed | (block[None, :] < self.global_blocks) | (block[:, None] < self.global_blocks)
        pairs = torch.zeros(n, n, dtype=torch.bool, device=device)
        chosen = self._random_blocks(n, pairs.device)
        pairs[torch.arange(n, device=pairs.device)[:, None].expand_as(chosen), chosen] = True
        return allowed | pairs[block[:, None], block[None, :]]


# -- the core -----------------------------------------------------------------------------------------------
def blocksparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Exact softmax attention restricted to a fixed sparsity ``pattern``, computed blockwise.

    Args:
        q, k: (batch, heads, seq, head_dim); v: (batch, heads, seq, head_dim_v). Self-attention: one sequence.
        pattern: a :class:`BlockPattern`.
        causal: key j visible to query i only if j <= i.
        key_padding_mask: (batch, seq) bool, True marks padding.
        scale: logit scale (> 0), ``1/sqrt(head_dim)`` by default.

    Returns:
        (batch, heads, seq, head_dim_v); rows that may see no key are zeros. Memory O(N * blocks_per_row *
        block_size).
    """
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v)
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"pattern must be a BlockPattern, got {type(pattern).__name__}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"block-sparse patterns pair positions of one sequence: q seq={q.shape[2]} and "
                         f"k seq={k.shape[2]} must be equal")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    return blocksparse_attention_unchecked(q, k, v, pattern, causal, key_padding_mask, scale)


def _gather_keys(x: Tensor, layout: BlockLayout, index: Tensor, shared: Optional[Tensor] = None) -> Tensor:
    """(batch * n_query_blocks, heads, S, dim): the key-sequence slots ``index`` (n_query_blocks, S) of ``x``
    (batch, heads, seq, dim), already zero-padded, where index ``seq`` stands for a zero row.

    ``shared``: (batch, heads, G, dim) rows appended to every query block's (S + G slots; e.g. longformer's
    global keys), in the same copy.

    Query blocks lead and heads follow so that the (per-block) mask broadcasts over the heads of a 4-D
    call, which lets ``scaled_dot_product_attention`` pick its fused kernels."""
    batch, heads, length, dim = x.shape
    n_query_blocks, width = index.shape
    bs = layout.block_size
    rows = x.transpose(1, 2)  # (batch, seq, heads, dim)
    if layout.band is not None:
        # A band of consecutive blocks in natural order: overlapping windows of a padded copy, no gather.
        before = -layout.band * bs
        total = (n_query_blocks - 1) * bs + width
        padded = F.pad(rows, (0, 0, 0, 0, before, total - before - length))
        blocks = padded.unfold(1, width, bs).permute(0, 1, 2, 4, 3)  # (batch, nqb, heads, width, dim), a view
    else:
        extended = F.pad(rows, (0, 0, 0, 0, 0, 1))
        blocks = extended.index_select(1, index.reshape(-1)).view(batch, n_query_blocks, width, heads, dim)
        blocks = blocks.transpose(2, 3)
    if shared is not None:
        extra = shared.unsqueeze(1).expand(batch, n_query_blocks, heads, shared.shape[2], dim)
        blocks = torch.cat([blocks, extra], dim=3)
    return blocks.reshape(batch * n_query_blocks, heads, -1, dim)


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


def _gather_queries(q: Tensor, plan: BlockPlan) -> Tensor:
    """(batch * n_query_blocks, heads, block_size, dim): the query slots of ``plan``."""
    batch, heads, length, dim = q.shape
    n_query_blocks, bs = plan.query_positions.shape
    rows = q.transpose(1, 2)  # (batch, seq, heads, dim)
    if plan.order is None:
        rows = F.pad(rows, (0, 0, 0, 0, 0, n_query_blocks * bs - length))
    else:
        slots = torch.where(plan.query_positions >= 0, plan.query_positions, length).reshape(-1)
        rows = F.pad(rows, (0, 0, 0, 0, 0, 1)).index_select(1, slots)
    blocks = rows.reshape(batch, n_query_blocks, bs, heads, dim).transpose(2, 3)
    return blocks.reshape(batch * n_query_blocks, heads, bs, dim)


def _gathered(q: Tensor, k0: Tensor, v0: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor]) -> tuple:
    """The query blocks, gathered key and value blocks of ``plan`` (keys and values already zero-padded) and
    the element mask, (batch * n_query_blocks, 1, block_size, S), key padding included."""
    batch = q.shape[0]
    n_query_blocks, bs = plan.query_positions.shape
    width = plan.index.shape[1]
    q_blocks = _gather_queries(q, plan)
    k_blocks = _gather_keys(k0, plan.layout, plan.index)
    v_blocks = _gather_keys(v0, plan.layout, plan.index)
    if key_padding_mask is None:
        allowed = plan.allowed.repeat(batch, 1, 1, 1) if batch > 1 else plan.allowed
    else:
        keep = ~F.pad(key_padding_mask, (0, 1), value=True)[:, plan.index]  # (batch, nqb, S)
        allowed = (plan.allowed.unsqueeze(0) & keep.view(batch, n_query_blocks, 1, 1, width))
        allowed = allowed.reshape(batch * n_query_blocks, 1, bs, width)
    return q_blocks, k_blocks, v_blocks, allowed


def _to_positions(x: Tensor, plan: BlockPlan, batch: int, heads: int, length: int) -> Tensor:
    """(batch * n_query_blocks, heads, block_size, d) per query slot -> (batch, heads, length, d) by position."""
    n_query_blocks, bs = plan.query_positions.shape
    x = x.reshape(batch, n_query_blocks, heads, bs, x.shape[-1]).transpose(1, 2)
    x = x.reshape(batch, heads, n_query_blocks * bs, x.shape[-1])
    return x[:, :, :length] if plan.order is None else x.index_select(2, plan.order)


def _merged_parts(q: Tensor, k0: Tensor, v0: Tensor, parts: Tuple[BlockPlan, ...],
                  key_padding_mask: Optional[Tensor], scale: Optional[float]) -> Tensor:
    """One softmax over the union of disjoint parts: each part's unnormalised sums (exp(logit - its row
    max) against the values, and alone) by position, rescaled to a common max and divided once. A row no part
    lets see a key is zeros. The maxima are detached: they cancel, and only keep exp() in range."""
    batch, heads, length, dim = q.shape
    out_dtype, dtype = q.dtype, working_dtype(q.dtype)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q, k0, v0 = q.to(dtype), k0.to(dtype), v0.to(dtype)
    terms = []
    for plan in parts:
        q_blocks, k_blocks, v_blocks, allowed = _gathered(q, k0, v0, plan, key_padding_mask)
        logits = (q_blocks @ k_blocks.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
        top = logits.detach().amax(-1, keepdim=True)  # -inf on a row that sees no key of this part
        weights = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        numerator, total = weights @ v_blocks, weights.sum(-1, keepdim=True)
        terms.append(tuple(_to_positions(x, plan, batch, heads, length) for x in (numerator, total, top)))
    top = torch.stack([t[2] for t in terms]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    numerator, total = 0.0, 0.0
    for part_numerator, part_total, part_top in terms:
        factor = torch.exp(part_top - top)  # 0 for a part whose row is empty
        numerator = numerator + part_numerator * factor
        total = total + part_total * factor
    out = numerator / torch.where(total > 0, total, torch.ones_like(total))
    return out.to(out_dtype)



def blocksparse_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float],
    plan: Optional[BlockPlan] = None,
) -> Tensor:
    """:func:`blocksparse_attention` for callers that validated the arguments (the mechanisms). ``plan``: a
    :func:`blocksparse_plan` of this pattern, length and causality to reuse; one with a ``dense`` mask runs as
    a dense masked softmax. None: a blockwise plan is made here."""
    batch, heads, length, _ = q.shape
    if plan is None:
        plan = blocksparse_plan(pattern, length, causal, q.device, dense_when_cheaper=False)

    k0, v0 = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    if plan.dense is not None:  # short sequence: one dense pass under the pattern's mask is faster
        allowed = plan.dense
        if key_padding_mask is not None:
            allowed = allowed & ~key_padding_mask.view(batch, 1, 1, length)
        return masked_sdpa(q, k0, v0, allowed, scale)
    if plan.parts:
        out = _merged_parts(q, k0, v0, plan.parts, key_padding_mask, scale)
    else:
        q_blocks, k_blocks, v_blocks, allowed = _gathered(q, k0, v0, plan, key_padding_mask)
        if key_padding_mask is None and plan.full_rows:
            # Every row sees a key (which rows do is fixed by the shapes, not by input values): plain SDPA.
            out = F.scaled_dot_product_attention(q_blocks, k_blocks, v_blocks, attn_mask=allowed, scale=scale)
        else:
            out = masked_sdpa(q_blocks, k_blocks, v_blocks, allowed, scale)  # (batch * nqb, heads, bs, dim_v)
        out = _to_positions(out, plan, batch, heads, length)

    g = plan.layout.global_queries
    if g:
        # Global queries see every key: a dense (g x N) pass replaces their rows.
        device = q.device
        rows_allowed = torch.ones(g, length, dtype=torch.bool, device=device)
        if causal:
            rows_allowed = torch.arange(length, device=device)[None, :] <= torch.arange(g, device=device)[:, None]
        rows_allowed = rows_allowed.view(1, 1, g, length)
        if key_padding_mask is not None:
            rows_allowed = rows_allowed & ~key_padding_mask.view(batch, 1, 1, length)
        dense_rows = masked_sdpa(q[:, :, :g], k0, v0, rows_allowed, scale)
        out = torch.cat([dense_rows, out[:, :, g:]], dim=2)
    return out


def pattern_dense_mask(pattern: BlockPattern, length: int, causal: bool = False,
                       device: Optional[torch.device] = None) -> Tensor:
    """The (length, length) bool mask of ``pattern`` (True: query i may attend to key j), with causality if
    asked. Quadratic: for tests and the reference."""
    check_positive_int("length", length)
    check_bool("causal", causal)
    allowed = pattern.dense(length, device)
    if causal:
        i = torch.arange(length, device=device)
        allowed = allowed & (i[None, :] <= i[:, None])
    return allowed


def blocksparse_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Dense float64 softmax under the pattern's (N, N) boolean mask: obviously correct and quadratic, for
    tests. Same arguments as :func:`blocksparse_attention`; returns float64."""
    length = q.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    if key_padding_mask is not None:
        k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    allowed = pattern_dense_mask(pattern, length, causal, q.device).view(1, 1, length, length)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.view(-1, 1, 1, length)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    return masked_softmax_reference(logits, allowed) @ v

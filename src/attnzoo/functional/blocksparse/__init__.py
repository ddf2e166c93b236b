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
runs each part blockwise and merges their softmaxes into one (:func:`.core._merged_parts`).

Memory is O(N * blocks_per_row * block_size) (the gathered keys, logits and mask); nothing N x N is made. A
pattern's rule and table must agree: the rule is applied to the gathered keys only, so the table must reach
every key the rule allows (and a position must never be reachable twice, through two views, unless the rule
admits it in only one of them). The tests hold every pattern's fast path to its dense mask, which each
pattern writes separately, straight from its definition (:meth:`BlockPattern.dense`).

Patterns: :class:`LocalPattern` (sliding window), :class:`SinkLocalPattern` (sliding window plus attention
sinks, Xiao et al. 2023), :class:`DilatedPattern`, :class:`StridedPattern` and
:class:`FixedPattern` (Child et al. 2019), :class:`LongformerPattern` (window + global tokens, Beltagy et al.
2020), :class:`BigBirdPattern` (window + global + random blocks, Zaheer et al. 2020).

Modules: :mod:`.layout` (what a pattern is: :class:`BlockLayout`, :class:`BlockPattern`), :mod:`.patterns`
(the patterns), :mod:`.plan` (the input-independent part of a call, :class:`BlockPlan`), :mod:`.core` (the
blockwise kernel), :mod:`.reference` (the dense float64 reference and each pattern's dense mask),
:mod:`.window_cache` (constant-memory decoding of a sliding window with attention sinks), :mod:`.packed`
(packed rows of documents, ``cu_seqlens``: each document laid out as it is alone).
"""

from .core import blocksparse_attention, blocksparse_attention_unchecked, grouped_sdpa
from .layout import BlockLayout, BlockPattern
from .patterns import (
    DEFAULT_BLOCK,
    default_block,
    BigBirdPattern,
    DilatedPattern,
    FixedPattern,
    LocalPattern,
    LongformerPattern,
    SinkLocalPattern,
    StridedPattern,
    window_pattern,
)
from .packed import (
    DenseDocuments,
    GlobalRows,
    PackedBlockPlan,
    packed_blocksparse_attention_unchecked,
    packed_blocksparse_plan,
)
from .plan import DENSE_SHARE, BlockPlan, blocksparse_plan, blockwise_logits
from .reference import blocksparse_attention_reference, pattern_dense_mask
from .window_cache import (
    check_sink_tokens,
    window_cache_layout,
    window_cache_prefill,
    window_cache_step,
    window_ring,
)

__all__ = [
    "DEFAULT_BLOCK",
    "DENSE_SHARE",
    "default_block",
    "DenseDocuments",
    "BigBirdPattern",
    "BlockLayout",
    "BlockPattern",
    "BlockPlan",
    "DilatedPattern",
    "FixedPattern",
    "GlobalRows",
    "LocalPattern",
    "LongformerPattern",
    "PackedBlockPlan",
    "SinkLocalPattern",
    "StridedPattern",
    "blocksparse_attention",
    "blocksparse_attention_reference",
    "blocksparse_attention_unchecked",
    "blocksparse_plan",
    "check_sink_tokens",
    "grouped_sdpa",
    "blockwise_logits",
    "packed_blocksparse_attention_unchecked",
    "packed_blocksparse_plan",
    "pattern_dense_mask",
    "window_cache_layout",
    "window_cache_prefill",
    "window_cache_step",
    "window_pattern",
    "window_ring",
]

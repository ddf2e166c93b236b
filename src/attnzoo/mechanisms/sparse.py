"""Fixed sparse attention patterns as mechanisms: local (sliding window), strided (dilated and the Sparse
Transformer's strided and fixed patterns), longformer and bigbird. One blockwise core runs them all
(:mod:`attnzoo.functional.blocksparse`); each mechanism only declares its pattern, except longformer, whose
global positions may differ between the elements of a batch: it runs its window on the core and its global
positions beside it (:mod:`attnzoo.functional.longformer`)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import (
    check_bool,
    check_choice,
    check_indices,
    check_number,
    check_position_mask,
    check_positive_int,
)
from ..functional.blocksparse import (
    BigBirdPattern,
    BlockPattern,
    BlockPlan,
    DilatedPattern,
    PackedBlockPlan,
    FixedPattern,
    LocalPattern,
    SinkLocalPattern,
    StridedPattern,
    blocksparse_attention_reference,
    blocksparse_attention_unchecked,
    blocksparse_plan,
    check_sink_tokens,
    packed_blocksparse_attention_unchecked,
    packed_blocksparse_plan,
    window_cache_layout,
    window_cache_prefill,
    window_cache_step,
)
from ..functional.longformer import (
    DEFAULT_BLOCK,
    GlobalPositions,
    gather_global_positions,
    longformer_attention_reference,
    longformer_block_mask,
    longformer_attention_unchecked,
    out_of_range,
    packed_longformer_attention_unchecked,
    packed_static_global_mask,
    packed_window_plan,
    static_global_mask,
    window_plan,
)
from ..functional.softmax import masked_sdpa
from .base import OWN, PACKED_NATIVE, Capabilities, Mechanism, StateLayout, UnsupportedOptionError, register


def check_packed_call(mechanism: Mechanism, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      key_padding_mask: Optional[Tensor], cross: bool, cu_seqlens: object) -> List[Tuple[int, int]]:
    """Check a packed call (errors name the argument, before any computation) and return its documents'
    (start, end). As :meth:`Mechanism.forward` checks it, except that ``max_length`` binds each document, not
    the row: a pattern runs on each document alone, counting its positions from the document's start."""
    check_bool("causal", causal)
    check_bool("cross", cross)
    mechanism.check_grouping(q, k, v, refuse=False)
    if k.shape[2] != q.shape[2] or cross:  # refused there, naming what
        mechanism.check_inputs(q, k, v, causal, key_padding_mask, cross)
    spans = mechanism.check_packing(q, key_padding_mask, cross, cu_seqlens)
    longest = max(end - start for start, end in spans)
    mechanism.check_inputs(q[:, :, :longest], k[:, :, :longest], v[:, :, :longest], causal, None, cross)
    return spans


class BlockSparseAttention(Mechanism):
    """Base of the fixed-pattern mechanisms: softmax attention restricted to the pattern :meth:`pattern`
    returns, by the blockwise core (fast path) or a dense masked softmax (:meth:`reference`).

    Self-attention only: a pattern pairs positions of one sequence. Shapes: q, k (batch, heads, seq,
    head_dim), v (batch, heads, seq, head_dim_v) -> (batch, heads, seq, head_dim_v).
    """

    def pattern(self) -> BlockPattern:
        raise NotImplementedError

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The block plan for this call, reused while the length, causality, device and pattern stay the same
        (the last one is kept: indices and an element mask of O(N * blocks_per_row * block_size) bools)."""
        pattern = self.pattern()
        key = (pattern, length, causal, device)
        cached = getattr(self, "_last_plan", None)
        if cached is None or cached[0] != key:
            cached = (key, blocksparse_plan(pattern, length, causal, device))
            self._last_plan = cached
        return cached[1]

    def packed_plan(self, spans: List[Tuple[int, int]], causal: bool, device: torch.device) -> PackedBlockPlan:
        """The block plan of a packed row of documents ``spans``, each laid out as it is alone (the last one is
        kept, while the documents, causality, device and pattern stay the same)."""
        pattern = self.pattern()
        key = (pattern, tuple(spans), causal, device)
        cached = getattr(self, "_last_packed_plan", None)
        if cached is None or cached[0] != key:
            cached = (key, packed_blocksparse_plan(pattern, spans, causal, device))
            self._last_packed_plan = cached
        return cached[1]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """:meth:`Mechanism.forward`; with ``cu_seqlens``, ``max_length`` binds each document, not the row."""
        if cu_seqlens is None:
            return super().forward(q, k, v, causal, key_padding_mask, cross=cross)
        spans = check_packed_call(self, q, k, v, causal, key_padding_mask, cross, cu_seqlens)
        k, v = self.repeated_kv(q, k, v)
        return self.attend_packed(q, k, v, causal, spans)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        plan = self.packed_plan(spans, causal, q.device)
        return packed_blocksparse_attention_unchecked(q, k, v, plan, None)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        return blocksparse_attention_unchecked(q, k, v, self.pattern(), causal, key_padding_mask, None, plan)

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> Tensor:
        return blocksparse_attention_reference(q, k, v, self.pattern(), causal, key_padding_mask)


def _block_size(block_size: Optional[int]) -> Optional[int]:
    return check_number("block_size", block_size, integer=True, minimum=1, optional=True)


@register
class LocalAttention(BlockSparseAttention):
    """Sliding-window attention: query i attends to keys j with ``|i - j| < window``.

    Causal: the ``window`` positions ``i - window + 1 .. i`` (itself included). Non-causal: also the
    ``window - 1`` positions after it (a symmetric window of ``2 * window - 1``). Time and memory O(N *
    window).

    Options:
        window: keys looked back over (itself included), and ahead when non-causal; >= 1. Named like the
            ``local-attention`` package's option, so ``attnzoo compare --set local.window=W`` compares the
            two at one window (that package's buckets see between W and 2W keys back, this one exactly W).
        block_size: positions per block of the blockwise core (a speed knob; the output does not depend
            on it). None: ``min(window, 64)``.
        sink_tokens: attention sinks (Xiao et al. 2023, StreamingLLM): the first ``sink_tokens`` positions
            are visible to every query besides its window (causally, to the queries at or after them), an
            int with ``0 <= sink_tokens <= window``; 0 (the default): none. Blockwise, nothing N x N: every
            query block also reads the sink blocks (:class:`~attnzoo.functional.blocksparse.SinkLocalPattern`).

    Decoding state (``step``/``prefill``): a ring buffer of the last ``window`` keys and values, constant
    memory: ``{"k": (batch, heads, window, head_dim), "v": (batch, heads, window, head_dim),
    "positions": (batch, window)}``; position t goes to slot ``t % window``, ``positions`` holds the position
    in each slot (-1 while empty), and a step attends to the filled slots only. With sinks, also
    ``"sink_k"``, ``"sink_v"``: (batch, heads, sink_tokens, head_dim), the first positions, kept for good
    (:mod:`attnzoo.functional.blocksparse.window_cache`): still constant memory, ``window + sink_tokens``.
    """

    name = "local"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N w), memory O(N w)",
        summary="sliding-window attention: each query sees the w nearest keys (Beltagy et al. 2020; "
                "Child et al. 2019)",
        packing=PACKED_NATIVE,
    )
    test_options = {"window": 3, "block_size": 2}
    test_variants = ({"window": 5}, {"window": 1, "block_size": 4}, {"window": 40, "block_size": 3})
    test_variants += ({"window": 3, "sink_tokens": 2, "block_size": 2}, {"window": 4, "sink_tokens": 4})

    def __init__(self, heads: int, head_dim: int, *, window: int = 128, block_size: Optional[int] = None,
                 sink_tokens: int = 0) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        self.block_size = _block_size(block_size)
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)

    def pattern(self) -> BlockPattern:
        if self.sink_tokens:
            return SinkLocalPattern(self.window, self.sink_tokens, self.block_size or min(self.window, 64))
        return LocalPattern(self.window, self.block_size or min(self.window, 64))

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        if self.sink_tokens:
            heads = getattr(self, "kv_heads", None) or self.heads  # the key/value heads the buffers hold
            return window_cache_layout(heads, self.window, self.sink_tokens, self.head_dim, dtype)
        return {
            "k": ((self.heads, self.window, self.head_dim), dtype),
            "v": ((self.heads, self.window, self.head_dim), dtype),
            "positions": ((self.window,), torch.long),
        }

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        if self.sink_tokens:
            return window_cache_step(q_t, k_t, v_t, tensors, length, self.window, self.sink_tokens)
        if tensors is None:
            batch = q_t.shape[0]
            tensors = {
                "k": k_t.new_zeros(batch, self.heads, self.window, k_t.shape[3]),
                "v": v_t.new_zeros(batch, self.heads, self.window, v_t.shape[3]),
                "positions": torch.full((batch, self.window), -1, dtype=torch.long, device=q_t.device),
            }
        slot = length % self.window
        # Fresh buffers (O(window) copy, like the attention itself): the previous state stays valid.
        k, v, positions = tensors["k"].clone(), tensors["v"].clone(), tensors["positions"].clone()
        k[:, :, slot] = k_t[:, :, 0]
        v[:, :, slot] = v_t[:, :, 0]
        positions[:, slot] = length
        # Slots not yet written hold position -1 (and zeros): masked by position, not by the step count.
        allowed = (positions >= 0).view(positions.shape[0], 1, 1, self.window)
        return masked_sdpa(q_t, k, v, allowed), {"k": k, "v": v, "positions": positions}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        out = self.attend(q, k, v, True, None, False)
        if self.sink_tokens:
            return out, window_cache_prefill(k, v, self.window, self.sink_tokens)
        batch, _, length, _ = k.shape
        # Slot s holds the latest position p < length with p % window == s (if any).
        slots = torch.arange(self.window, device=k.device)
        latest = (length - 1) - torch.remainder(length - 1 - slots, self.window)
        filled = latest >= 0
        index = latest.clamp_min(0)
        keep = filled.view(1, 1, -1, 1)
        state = {
            "k": torch.where(keep, k.index_select(2, index), torch.zeros_like(k[:, :, :1])),
            "v": torch.where(keep, v.index_select(2, index), torch.zeros_like(v[:, :, :1])),
            "positions": torch.where(filled, latest, torch.full_like(latest, -1)).expand(batch, -1).clone(),
        }
        return out, state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, block_size={self.block_size}" + (
            f", sink_tokens={self.sink_tokens}" if self.sink_tokens else "")


STRIDED_PATTERNS = ("strided", "fixed", "dilated")


@register
class StridedAttention(BlockSparseAttention):
    """Strided sparse attention: the Sparse Transformer's patterns (Child et al. 2019) and dilated attention,
    each as one head seeing the union of its components (one softmax over it).

    Options:
        pattern: ``"strided"``: query i sees keys j with ``|i - j| < stride`` (the previous ``stride``
            positions when causal) or ``(i - j) % stride == 0`` (every stride-th). ``"fixed"``: positions are
            cut into segments of ``stride`` positions (the paper's l); query i sees its own segment and the
            last ``summary`` positions (the paper's c) of every segment (of every earlier one, causally).
            ``"dilated"``: keys j with ``(i - j) % stride == 0`` only (atrous attention, no limit).
        stride: the paper's l (>= 1); ~sqrt(N) gives O(N sqrt(N)).
        summary: the fixed pattern's c, 1 <= c <= stride (ignored by the other patterns). None:
            ``max(1, stride // 16)`` (the paper's c = 8 at l = 128).
        block_size: positions per block of the blockwise core (a speed knob; the output does not depend on
            it). None: 64.

    Time O(N (l + N / l)) for strided (its window in natural order, its column grouped by residue modulo l),
    O(N (l + c N / l)) for fixed, O(N^2 / l) for dilated; memory alike. Self-attention only; no decoding state (the patterns reach back to the start).
    """

    name = "strided"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N sqrt N) at stride ~ sqrt N (strided, fixed), O(N^2 / stride) (dilated)",
        summary="Sparse Transformer strided/fixed patterns and dilated attention (Child et al. 2019)",
        packing=PACKED_NATIVE,
    )
    test_options = {"pattern": "strided", "stride": 3, "block_size": 2}
    test_variants = (
        {"pattern": "strided", "stride": 4, "block_size": 3},
        {"pattern": "fixed", "stride": 4, "summary": 1, "block_size": 3},
        {"pattern": "fixed", "stride": 3, "summary": 2, "block_size": 2},
        {"pattern": "dilated", "stride": 3, "block_size": 2},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        pattern: str = "strided",
        stride: int = 128,
        summary: Optional[int] = None,
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.pattern_name = check_choice("pattern", pattern, STRIDED_PATTERNS)
        self.stride = check_positive_int("stride", stride)
        summary = check_number("summary", summary, integer=True, minimum=1, optional=True)
        self.summary = max(1, self.stride // 16) if summary is None else summary
        if self.pattern_name == "fixed" and self.summary > self.stride:
            raise ValueError(f"summary must be <= stride ({self.stride}) for pattern='fixed', got {summary}")
        self.block_size = _block_size(block_size)

    def pattern(self) -> BlockPattern:
        if self.pattern_name == "strided":
            return StridedPattern(self.stride, self.block_size or 64)
        if self.pattern_name == "fixed":
            return FixedPattern(self.stride, self.summary, self.block_size or 64)
        return DilatedPattern(self.stride, self.block_size or 64)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, pattern={self.pattern_name!r}, stride={self.stride}, "
                f"summary={self.summary}, block_size={self.block_size}")


@register
class LongformerAttention(Mechanism):
    """Longformer attention (Beltagy et al. 2020): a sliding window plus global positions.

    Query i attends to keys j with ``|i - j| < window`` (causally the ``window`` positions up to itself) and to
    every global position; a global position's query attends to every key. Causally a global position is seen
    only by the queries at or after it, and a global query sees the keys up to itself. A padded key is never
    attended, even at a global position (padding wins). See :mod:`attnzoo.functional.longformer`.

    Which positions are global: the union of

    * the first ``global_tokens`` positions (e.g. a [CLS] token at position 0),
    * the positions ``global_indices`` (a negative index counts from the end: ``-1`` is the last position,
      e.g. a summary token), fixed at construction,
    * and, per call, ``forward(..., global_mask=...)``: a (batch, seq) bool tensor, True marking a global
      position of that batch element (so each element may have its own; build with ``global_tokens=0`` to let
      the mask alone decide). ``MultiHeadAttention.forward`` passes it on (``global_mask`` is in
      :attr:`call_options`).

    An index of ``global_indices`` outside ``[-seq, seq)`` for a call's sequence length is refused
    (:class:`~attnzoo.UnsupportedOptionError` naming ``global_indices``), never dropped; two indices that name
    the same position at some length (``0`` and ``-seq``) simply name it once.

    Options:
        window: as :class:`LocalAttention`'s (>= 1).
        global_tokens: how many leading positions are global (>= 0; 0 with no other global position is plain
            local attention).
        global_indices: further global positions, a tuple of distinct ints, or None for none.
        global_projections: separate projections for the global attention, as in the paper: learned per-head
            (head_dim x head_dim) maps ``query_global``, ``key_global``, ``value_global`` (parameters of shape
            (heads, head_dim, head_dim), initialised to the identity, so the option starts equal to the plain
            form). A global query's row is ``softmax((q_i Wq)(K Wk)^T / sqrt(head_dim)) (V Wv)`` over every
            key, with q_i, K, V the given per-head tensors and ``x @ W[h]`` per head; every other row uses the
            plain q, k, v, for its window and for the global keys alike. The values' head_dim must then equal
            head_dim.
        block_size: positions per block of the window part (a speed knob; the output does not depend on it).
            None: ``min(window, 128)`` (:data:`attnzoo.functional.longformer.DEFAULT_BLOCK`).

    Time and memory O(N (window + G)) for G global positions (the most of any batch element), nothing N x N.
    The count G of a ``global_mask`` is read from its values (one host synchronisation per call), so a call
    with ``global_mask`` cannot be traced by ``torch.jit.trace`` (refused) though ``global_tokens`` and
    ``global_indices`` can. Self-attention only; no decoding state.
    """

    name = "longformer"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N (w + g)), memory O(N (w + g))",
        summary="sliding window plus global positions by count, index or per-call mask, optional separate "
                "global projections (Beltagy et al. 2020)",
        packing=PACKED_NATIVE,
    )
    call_options = ("global_mask",)
    # Index -1 is in range at every length: the property tests run test_options from one position up.
    test_options = {"window": 2, "global_tokens": 1, "global_indices": (-1,), "block_size": 2}
    test_variants = (
        {"window": 3, "global_tokens": 0, "block_size": 4},
        {"window": 4, "global_tokens": 5, "block_size": 3},
        {"window": 2, "global_tokens": 0, "global_indices": (2, -2), "block_size": 2},
        {"window": 3, "global_tokens": 1, "global_indices": (-1, 3), "global_projections": True, "block_size": 2},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        window: int = 128,
        global_tokens: int = 1,
        global_indices: Optional[Tuple[int, ...]] = None,
        global_projections: bool = False,
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        self.global_tokens = check_number("global_tokens", global_tokens, integer=True, minimum=0)
        self.global_indices = () if global_indices is None else check_indices("global_indices", global_indices)
        self.global_projections = check_bool("global_projections", global_projections)
        self.block_size = _block_size(block_size)
        if self.global_projections:
            identity = torch.eye(head_dim).expand(heads, head_dim, head_dim)
            self.query_global = nn.Parameter(identity.clone())
            self.key_global = nn.Parameter(identity.clone())
            self.value_global = nn.Parameter(identity.clone())

    def projections(self) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """(Wq, Wk, Wv) of the global attention, each (heads, head_dim, head_dim), or None without them."""
        if not self.global_projections:
            return None
        return self.query_global, self.key_global, self.value_global

    def plan(self, length: int, causal: bool, device: torch.device) -> Tuple[BlockPlan, GlobalPositions, Tensor]:
        """The window's block plan, the fixed global positions (``global_tokens``, ``global_indices``) and the
        block mask of a call without ``key_padding_mask`` or ``global_mask``, reused while the length, causality
        and device stay the same (the last ones are kept: O(N (window + G)) bools)."""
        key = (length, causal, device)
        cached = getattr(self, "_last_plan", None)
        if cached is None or cached[0] != key:
            block = self.block_size or min(self.window, DEFAULT_BLOCK)
            plan = window_plan(self.window, block, length, causal, device)
            fixed = static_global_mask(length, self.global_tokens, self.global_indices, device)
            fixed = gather_global_positions(fixed.view(1, length))
            cached = (key, (plan, fixed, longformer_block_mask(plan, self.window, fixed, causal, None)))
            self._last_plan = cached
        return cached[1]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
        global_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """:meth:`Mechanism.forward`, plus ``global_mask``: (batch, seq) bool, True marks further global
        positions of each batch element for this call (with those of the options), or None. With
        ``cu_seqlens`` (a packed row), each document has the global positions it has alone, and
        ``global_mask`` (1, seq) marks positions of the row."""
        spans = None
        if cu_seqlens is None:
            self.check_inputs(q, k, v, causal, key_padding_mask, cross)
        else:
            spans = check_packed_call(self, q, k, v, causal, key_padding_mask, cross, cu_seqlens)
            self.check_document_indices(spans)
        check_position_mask("global_mask", global_mask, q.shape[0], q.shape[2], q.device)
        if global_mask is not None and torch.jit.is_tracing():
            raise UnsupportedOptionError(
                "longformer: global_mask cannot be traced: the number of global positions is read from its values"
            )
        k, v = self.repeated_kv(q, k, v)
        if spans is not None:
            return self._attend_packed(q, k, v, causal, spans, global_mask)
        return self._attend(q, k, v, causal, key_padding_mask, global_mask)

    def check_document_indices(self, spans: List[Tuple[int, int]]) -> None:
        """Refuse, naming ``global_indices``, a packed row with a document too short for them (as that
        document alone is refused)."""
        for start, end in spans:
            outside = out_of_range(self.global_indices, end - start)
            if outside:
                raise UnsupportedOptionError(
                    f"{self.name}: global_indices {list(outside)} name no position of the document [{start}, {end}) "
                    f"of cu_seqlens, of length {end - start} (an index i needs {start - end} <= i < {end - start})")

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        return self._attend(q, k, v, causal, key_padding_mask, None)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        return self._attend_packed(q, k, v, causal, spans, None)

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]],
                       global_mask: Optional[Tensor]) -> Tensor:
        key = (tuple(spans), causal, q.device)
        cached = getattr(self, "_last_packed_plan", None)
        if cached is None or cached[0] != key:
            block = self.block_size or min(self.window, DEFAULT_BLOCK)
            fixed = packed_static_global_mask(spans, self.global_tokens, self.global_indices, q.device)
            cached = (key, (packed_window_plan(self.window, block, spans, causal, q.device), fixed))
            self._last_packed_plan = cached
        plan, fixed = cached[1]
        mask = fixed if global_mask is None else fixed | global_mask
        return packed_longformer_attention_unchecked(q, k, v, self.window, plan, spans, mask, causal, None,
                                                     self.projections())

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
        global_mask: Optional[Tensor],
    ) -> Tensor:
        plan, fixed, block_mask = self.plan(q.shape[2], causal, q.device)
        if global_mask is not None or key_padding_mask is not None:
            block_mask = None  # made for this call's masks
        if global_mask is not None:
            fixed = gather_global_positions(fixed.mask | global_mask)
        return longformer_attention_unchecked(q, k, v, self.window, plan, fixed, causal, key_padding_mask, None,
                                              self.projections(), block_mask)

    def global_positions(self, batch: int, length: int, global_mask: Optional[Tensor] = None,
                         device: Optional[torch.device] = None) -> Tensor:
        """(batch, length) bool: the global positions of a call (the options' and ``global_mask``'s)."""
        fixed = static_global_mask(length, self.global_tokens, self.global_indices, device)
        mask = fixed.expand(batch, length)
        return mask if global_mask is None else mask | global_mask

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
        global_mask: Optional[Tensor] = None,
    ) -> Tensor:
        mask = self.global_positions(q.shape[0], q.shape[2], global_mask, q.device)
        return longformer_attention_reference(q, k, v, self.window, mask, causal, key_padding_mask,
                                              global_projections=self.projections())

    def unsupported_reasons(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> List[str]:
        reasons = super().unsupported_reasons(q, k, v, causal, key_padding_mask, cross=cross)
        length = q.shape[2]
        outside = out_of_range(self.global_indices, length)
        if outside:
            reasons.append(f"{self.name}: global_indices {list(outside)} name no position of a sequence of length "
                           f"{length} (an index i needs {-length} <= i < {length})")
        if self.global_projections and v.shape[3] != self.head_dim:
            reasons.append(f"{self.name} with global_projections=True: v has head_dim {v.shape[3]}, the value "
                           f"projection maps head_dim={self.head_dim}")
        return reasons

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}, global_tokens={self.global_tokens}, "
                f"global_indices={self.global_indices}, global_projections={self.global_projections}, "
                f"block_size={self.block_size}")


@register
class BigBirdAttention(BlockSparseAttention):
    """BigBird attention (Zaheer et al. 2020), block form, non-causal.

    Positions are cut into blocks of ``block_size``; query block b attends to key blocks b - window_blocks
    .. b + window_blocks, to the first ``global_blocks`` blocks (whose queries attend to every key), and to
    ``random_blocks`` random blocks of its own. The random blocks are drawn once, at construction, from
    ``seed`` (not the global generator) into the buffer ``random_table`` (max_seq_len / block_size rows), so a
    saved and reloaded model attends to the same blocks; for a sequence of n blocks, row b's entries are
    taken modulo n, and one that lands on a window or global block adds nothing.

    Options:
        block_size: positions per block (the pattern's granularity, >= 1).
        window_blocks: blocks on each side of the own block (>= 0; 1 gives BigBird's 3-block window).
        global_blocks: leading global blocks (>= 0).
        random_blocks: random key blocks per query block (>= 0).
        seed: seed of the random blocks (an int >= 0).
        max_seq_len: the longest sequence accepted (the random table's size).

    Time and memory O(N block_size (2 window_blocks + 1 + global_blocks + random_blocks)), plus the global
    rows' O(global_blocks block_size N). Self-attention only, non-causal (the random blocks look ahead).
    """

    name = "bigbird"
    capabilities = Capabilities(
        causal=False,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N b (2w + 1 + g + r)), memory alike",
        summary="window, global and random blocks (Zaheer et al. 2020)",
        packing=PACKED_NATIVE,
    )
    test_options = {"block_size": 2, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1, "max_seq_len": 24}
    test_variants = (
        {"block_size": 3, "window_blocks": 0, "global_blocks": 0, "random_blocks": 2, "seed": 3, "max_seq_len": 24},
        {"block_size": 1, "window_blocks": 2, "global_blocks": 2, "random_blocks": 0, "max_seq_len": 24},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        block_size: int = 64,
        window_blocks: int = 1,
        global_blocks: int = 1,
        random_blocks: int = 2,
        seed: int = 0,
        max_seq_len: int = 65536,
    ) -> None:
        super().__init__(heads, head_dim)
        self.block_size = check_positive_int("block_size", block_size)
        self.window_blocks = check_number("window_blocks", window_blocks, integer=True, minimum=0)
        self.global_blocks = check_number("global_blocks", global_blocks, integer=True, minimum=0)
        self.random_blocks = check_number("random_blocks", random_blocks, integer=True, minimum=0)
        self.seed = check_number("seed", seed, integer=True, minimum=0)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        rows = -(-self.max_seq_len // self.block_size)
        generator = torch.Generator().manual_seed(self.seed)
        table = torch.randint(0, 1 << 30, (rows, self.random_blocks), generator=generator)
        self.register_buffer("random_table", table)

    @property
    def max_length(self) -> Optional[int]:
        return self.max_seq_len

    def pattern(self) -> BlockPattern:
        # One pattern object per state of the buffer, so the block plan is reused across calls. Dynamo cannot
        # compare data pointers, so a compiled call builds the pattern afresh (its graph holds the plan anyway).
        table = self.random_table
        if torch.compiler.is_compiling():
            return BigBirdPattern(self.block_size, self.window_blocks, self.global_blocks, table)
        key = (id(table), table.data_ptr(), table._version, table.device)
        cached = getattr(self, "_last_pattern", None)
        if cached is None or cached[0] != key:
            pattern = BigBirdPattern(self.block_size, self.window_blocks, self.global_blocks, table)
            cached = (key, pattern)
            self._last_pattern = cached
        return cached[1]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, window_blocks={self.window_blocks}, "
                f"global_blocks={self.global_blocks}, random_blocks={self.random_blocks}, seed={self.seed}, "
                f"max_seq_len={self.max_seq_len}")

"""Fixed sparse attention patterns as mechanisms: local (sliding window), strided (dilated and the Sparse
Transformer's strided and fixed patterns), longformer and bigbird. One blockwise core runs them all
(:mod:`attnzoo.functional.blocksparse`); each mechanism only declares its pattern, except longformer, whose
global positions may differ between the elements of a batch: it runs its window on the core and its global
positions beside it (:mod:`.longformer`, imported here so that the family registers together)."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_choice, check_number, check_positive_int
from ..functional.blocksparse import (
    DEFAULT_BLOCK,
    BigBirdPattern,
    BlockPattern,
    BlockPlan,
    DilatedPattern,
    FixedPattern,
    PackedBlockPlan,
    StridedPattern,
    blocksparse_attention_reference,
    blocksparse_attention_unchecked,
    blocksparse_plan,
    check_sink_tokens,
    default_block,
    grouped_sdpa,
    packed_blocksparse_attention_unchecked,
    packed_blocksparse_plan,
    window_cache_layout,
    window_cache_prefill,
    window_cache_step,
    window_pattern,
)
from .base import NATIVE_KV, OWN, PACKED_NATIVE, Capabilities, Mechanism, StateLayout
from .capabilities import PADDED_NEITHER, PADDED_RIGHT
from .registry import register
from .longformer import LongformerAttention  # noqa: F401 - registered with the family, importable from here
from .plan_cache import last_plan
from .sparse_checks import check_block_size


class BlockSparseAttention(Mechanism):
    """Base of the fixed-pattern mechanisms: softmax attention restricted to the pattern :meth:`pattern`
    returns, by the blockwise core (fast path) or a dense masked softmax (:meth:`reference`).

    Self-attention only: a pattern pairs positions of one sequence. Shapes: q (batch, heads, seq, head_dim),
    k (batch, kv_heads, seq, head_dim), v (batch, kv_heads, seq, head_dim_v) -> (batch, heads, seq,
    head_dim_v). Grouped-query inputs are native: the blockwise core gathers each key/value head once for the
    query heads sharing it (decoding states hold ``kv_heads``). Packed rows (``cu_seqlens``) are native: each
    document laid out as it is alone (:mod:`attnzoo.functional.blocksparse.packed`), ``max_length`` binding each
    document.
    """

    def pattern(self) -> BlockPattern:
        raise NotImplementedError

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The block plan for this call, reused while the length, causality, device and pattern stay the same
        (the last one is kept: indices and an element mask of O(N * blocks_per_row * block_size) bools)."""
        pattern = self.pattern()
        return last_plan(self, "_plan", (pattern, length, causal, device),
                         lambda: blocksparse_plan(pattern, length, causal, device))

    def packed_plan(self, spans: List[Tuple[int, int]], causal: bool, device: torch.device) -> PackedBlockPlan:
        """The block plan of a packed row of documents ``spans``, each laid out as it is alone (the last one is
        kept, while the documents, causality, device and pattern stay the same)."""
        pattern = self.pattern()
        return last_plan(self, "_packed_plan", (pattern, tuple(spans), causal, device),
                         lambda: packed_blocksparse_plan(pattern, spans, causal, device))

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        plan = self.packed_plan(spans, causal, q.device)
        return packed_blocksparse_attention_unchecked(q, k, v, plan, None)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        return blocksparse_attention_unchecked(q, k, v, self.pattern(), causal, key_padding_mask, None, plan)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        return blocksparse_attention_reference(q, k, v, self.pattern(), causal, key_padding_mask)


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
            on it). None: ``min(window, 64)`` (:data:`~attnzoo.functional.blocksparse.DEFAULT_BLOCK`).
        sink_tokens: attention sinks (Xiao et al. 2023, StreamingLLM): the first ``sink_tokens`` positions
            are visible to every query besides its window (causally, to the queries at or after them), an
            int with ``0 <= sink_tokens <= window``; 0 (the default): none. Blockwise, nothing N x N: every
            query block also reads the sink blocks (:class:`~attnzoo.functional.blocksparse.SinkLocalPattern`).

    Decoding state (``step``/``prefill``): a ring buffer of the last ``window`` keys and values, constant
    memory: ``{"k": (batch, kv_heads, window, head_dim), "v": (batch, kv_heads, window, head_dim),
    "positions": (batch, window)}``; position t goes to slot ``t % window``, ``positions`` holds the position
    in each slot (-1 while empty), and a step attends to the filled slots only. With sinks, also
    ``"sink_k"``, ``"sink_v"``: (batch, kv_heads, sink_tokens, head_dim), the first positions, kept for good
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
        grouped_kv=NATIVE_KV,
        dot_product_logits=True,
        window_option="window",
    )
    test_options = {"window": 3, "block_size": 2}
    test_variants = ({"window": 5}, {"window": 1, "block_size": 4}, {"window": 40, "block_size": 3})
    test_variants += ({"window": 3, "sink_tokens": 2, "block_size": 2}, {"window": 4, "sink_tokens": 4})

    def __init__(self, heads: int, head_dim: int, *, window: int = 128, block_size: Optional[int] = None,
                 sink_tokens: int = 0) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        self.block_size = check_block_size(block_size)
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)
        if self.sink_tokens:
            # The sinks are the row's first positions, padding on the left included.
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)

    def pattern(self) -> BlockPattern:
        return window_pattern(self.window, self.sink_tokens, self.block_size)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        heads = self.heads if kv_heads is None else kv_heads  # the key/value heads the buffers hold
        if self.sink_tokens:
            return window_cache_layout(heads, self.window, self.sink_tokens, self.head_dim, dtype, value_width)
        return {
            "k": ((heads, self.window, self.head_dim), dtype),
            "v": ((heads, self.window, self.value_width(value_width)), dtype),
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
                "k": k_t.new_zeros(batch, k_t.shape[1], self.window, k_t.shape[3]),
                "v": v_t.new_zeros(batch, v_t.shape[1], self.window, v_t.shape[3]),
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
        return grouped_sdpa(q_t, k, v, allowed, None), {"k": k, "v": v, "positions": positions}

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
        grouped_kv=NATIVE_KV,
        dot_product_logits=True,
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
        self.block_size = check_block_size(block_size)
        if self.pattern_name == "fixed":
            # Its stride-long blocks and their summary positions are counted from the row's start.
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)

    def pattern(self) -> BlockPattern:
        if self.pattern_name == "strided":
            return StridedPattern(self.stride, default_block(block_size=self.block_size))
        if self.pattern_name == "fixed":
            return FixedPattern(self.stride, self.summary, default_block(block_size=self.block_size))
        return DilatedPattern(self.stride, default_block(block_size=self.block_size))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, pattern={self.pattern_name!r}, stride={self.stride}, "
                f"summary={self.summary}, block_size={self.block_size}")


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
        max_seq_len: the longest sequence accepted (the random table's size); in a packed row, the longest
            document.

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
        # Its blocks (global ones first) are counted from the row's start: padding on the left moves them.
        padding_invariance=PADDED_RIGHT,
        packing=PACKED_NATIVE,
        grouped_kv=NATIVE_KV,
        dot_product_logits=True,
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
        block_size: int = DEFAULT_BLOCK,
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
        if self.random_blocks:
            # Each block row's random blocks are drawn among the padded row's blocks: its length changes them.
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_NEITHER)

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

"""The fixed sparsity patterns: :class:`LocalPattern` (sliding window), :class:`DilatedPattern`,
:class:`StridedPattern` and :class:`FixedPattern` (Child et al. 2019), :class:`LongformerPattern` (window +
global tokens, Beltagy et al. 2020), :class:`BigBirdPattern` (window + global + random blocks, Zaheer et al.
2020). Each declares its block layout, its element rule and its dense mask written from its definition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .layout import BlockLayout, BlockPattern, _band_table, _blocks, _dedupe_rows, _natural_positions

DEFAULT_BLOCK = 64
"""The block size of every blockwise pattern built without one (a speed knob: outputs do not depend on it):
local, strided, bigbird, longformer's window, based's and nsa's windows. Measured by
``scripts/bench_block_size.py {local,longformer}`` (N=8192, 4 heads of 64, forward+backward, one thread, medians
of 5), blocks of 128 against 64 took 0.88-1.27x the time for local and 0.83-0.96x for longformer at windows
128 and 256: no one size wins everywhere, and 64 is the one most of the family had."""


def default_block(span: Optional[int] = None, block_size: Optional[int] = None) -> int:
    """``block_size``, or the family's default: :data:`DEFAULT_BLOCK`, no longer than a window's ``span``."""
    if block_size:
        return block_size
    return DEFAULT_BLOCK if span is None else min(span, DEFAULT_BLOCK)


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


@dataclass(frozen=True)
class SinkLocalPattern(BlockPattern):
    """Sliding window plus attention sinks (Xiao et al. 2023, StreamingLLM): query i sees keys j with ``|i -
    j| < window`` and the first ``sinks`` positions (``j < sinks``); causally, of these, those at or before i.

    Two key views: the natural order (tag 0, the window's band of blocks) and the sink positions compacted
    into ``ceil(sinks / block_size)`` blocks (tag 1, admitted only outside the window, which view 0 already
    covers, so no key is counted twice). Every query block reads its band plus the sink blocks: time O(N
    (window + sinks)), nothing N x N."""

    window: int
    sinks: int
    block_size: int

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        bs = self.block_size
        n = _blocks(length, bs)
        reach = min(-(-(self.window - 1) // bs), n - 1)
        band = _band_table(n, n, -reach, 0 if causal else reach, device)
        natural = _natural_positions(length, bs, device)
        sinks = min(self.sinks, length)
        n_sink = _blocks(sinks, bs)
        slots = torch.arange(n_sink * bs, device=device)
        sink_keys = torch.where(slots < sinks, slots, torch.full_like(slots, -1)).view(n_sink, bs)
        keys = torch.cat([natural, sink_keys])
        tags = torch.cat([torch.zeros_like(natural), torch.ones_like(sink_keys)])
        sink_columns = (n + torch.arange(n_sink, device=device)).expand(n, n_sink)
        return BlockLayout(bs, None, keys, tags, torch.cat([band, sink_columns], dim=1))

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        near = (query - key).abs() < self.window
        return torch.where(tag == 0, near, ~near & (key < self.sinks))

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        i = torch.arange(length, device=device)
        return ((i[:, None] - i[None, :]).abs() < self.window) | (i[None, :] < self.sinks)


def window_pattern(window: int, sinks: int = 0, block_size: Optional[int] = None) -> BlockPattern:
    """A sliding window, ``|i - j| < window``, plus the first ``sinks`` positions when > 0, on blocks of
    ``block_size`` (None: :func:`default_block` of the window): the exact part of ``local`` and of the
    mechanisms that pair a window with a linear-time part (``based``, ``lolcats``, ``liger``)."""
    block = default_block(window, block_size)
    return SinkLocalPattern(window, sinks, block) if sinks else LocalPattern(window, block)

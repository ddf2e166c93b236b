"""Native sparse attention (Yuan et al. 2025, NSA): three softmax branches over the same queries, combined by
gates per head and position,

    o_t = g_cmp * Attn(q_t, compressed K, V) + g_slc * Attn(q_t, selected blocks) + g_win * Attn(q_t, window).

* Compressed: the keys and values are cut into blocks of ``compress_block`` (l) positions every
  ``compress_stride`` (d) positions (overlapping when d < l); each block is summarised by the mean of its
  keys, resp. values, followed by a learned linear map (``k_weight``, ``v_weight``, (dim, dim),
  shared by the heads). The paper's learned MLP with an intra-block position encoding is replaced by mean +
  linear (fla's reference pools by the mean alone). Causally, query t sees block i once the block is complete,
  ``i * d + l - 1 <= t``; only whole blocks exist (a tail shorter than l has no summary).
* Selected: the keys are cut into blocks of ``select_block`` (l') positions. Each query scores block j by the
  compressed attention probabilities of the compressed blocks overlapping it (the paper's Eq. 9, written with
  an overlap matrix), summed over the ``selection_group`` heads that share a selection (the paper shares it
  among the query heads of a key/value group), and reads its ``top_k`` best blocks in full. As in the paper
  (one initial and two local blocks), the query's own block is always selected, the first block too when
  ``top_k >= 2`` and the block before its own when ``top_k >= 3``; blocks after the query's are never
  candidates causally. Candidates no visible compressed
  block overlaps (score 0) rank below every scored block, later blocks first, so ties are broken the same way
  in every precision. The choice is not differentiated (as in the paper): gradients flow through the
  attention over the chosen blocks, and through the compressed branch.
* Window: exact softmax over the ``window`` nearest keys (``|i - j| < window``), on the blockwise core of the
  fixed sparse patterns.

Gates: ``(batch, heads, seq, 3)`` in [0, 1], given explicitly (the mechanism computes them from the queries).

Padding: a padded position is not part of the sequence. Blocks, the window and causal order are counted over
each row's unpadded positions (the i-th unpadded position is position i), so a sequence's output at its
positions is what it gives alone, however much padding it has on either side (or inside). The fast path
moves each row's unpadded positions to its front (one gather, a stable sort of the mask), runs on that
right-padded row, where a compressed block with a padded position and a selectable block with no unpadded
position are left out, and moves the outputs back. Padded positions output zeros.

Nothing N x N: the compressed scores are (N, N / d), the selected branch gathers ``top_k * l'`` keys per query
in chunks of queries, the window O(N * window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import working_dtype
from ._autocast import without_autocast
from .._validation import (
    check_bool,
    check_floating,
    check_key_padding_mask,
    check_number,
    check_positive_int,
    check_qkv,
)
from .blocksparse import BlockPlan, blocksparse_attention_unchecked, window_pattern
from .blocksparse.selected import selected_blocks_attention_unchecked
from .masks import zero_padded
from .softmax import masked_sdpa, masked_softmax_reference

GATES = 3
"""Branches, in the order of the gates' last dim: compressed, selected, window."""


@dataclass(frozen=True)
class NSABlocks:
    """NSA's block sizes and counts (checked by :meth:`checked`; errors name the option).

    Attributes:
        compress_block: l, positions summarised by one compressed block.
        compress_stride: d, positions between the starts of consecutive compressed blocks; divides l.
        select_block: l', positions per selectable block; a multiple of d.
        top_k: n, blocks each query reads in full.
        window: keys of the sliding window (itself included).
        selection_group: consecutive heads sharing one selection (their scores summed); divides the heads.
    """

    compress_block: int = 32
    compress_stride: int = 16
    select_block: int = 64
    top_k: int = 16
    window: int = 512
    selection_group: int = 1

    def checked(self) -> "NSABlocks":
        for name in ("compress_block", "compress_stride", "select_block", "top_k", "window", "selection_group"):
            check_positive_int(name, getattr(self, name))
        if self.compress_block % self.compress_stride:
            raise ValueError(f"compress_stride ({self.compress_stride}) must divide compress_block "
                             f"({self.compress_block}): compressed blocks start every compress_stride positions")
        if self.select_block % self.compress_stride:
            raise ValueError(f"select_block ({self.select_block}) must be a multiple of compress_stride "
                             f"({self.compress_stride}), as the paper's selection scores require")
        return self

    def check_heads(self, heads: int) -> None:
        if heads % self.selection_group:
            raise ValueError(f"selection_group ({self.selection_group}) must divide heads ({heads})")

    def check_length(self, length: int) -> None:
        """The selected-block count against the blocks of a key sequence of ``length`` (the checked entry)."""
        blocks = -(-length // self.select_block)
        if self.top_k > blocks:
            raise ValueError(f"top_k ({self.top_k}) exceeds the {blocks} blocks of select_block={self.select_block} "
                             f"in a sequence of {length} positions")


def compressed_blocks(length: int, blocks: NSABlocks) -> int:
    """How many whole compressed blocks a sequence of ``length`` positions has."""
    if length < blocks.compress_block:
        return 0
    return (length - blocks.compress_block) // blocks.compress_stride + 1


@without_autocast  # sums in its working dtype, returned in x's: a decoding state's declared dtype, autocast or not
def compress(
    x: Tensor, weight: Tensor, blocks: NSABlocks, key_padding_mask: Optional[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """Block summaries of x (batch, heads, seq, dim), padded positions already zeroed: the mean of each whole
    block's rows times ``weight^T`` (dim, dim). Returns ((batch, heads, n_blocks, dim) in x's dtype,
    (batch, n_blocks) bool: every row of the block is unpadded, or None without padding). Rows padded on the
    right (as :func:`nsa_attention_unchecked` lays them out), a block reaching into the padding is a partial
    block of the sequence: it has no summary, as it would not alone."""
    l, d = blocks.compress_block, blocks.compress_stride
    n = compressed_blocks(x.shape[2], blocks)
    dtype = working_dtype(x.dtype)
    if n == 0:
        empty = None if key_padding_mask is None else key_padding_mask.new_zeros(x.shape[0], 0)
        return x[:, :, :0] @ weight.to(x.dtype).t(), empty
    sums = x.to(dtype)[:, :, : (n - 1) * d + l].unfold(2, l, d).sum(-1)  # (batch, heads, n, dim)
    valid = None
    count = torch.full((), float(l), dtype=dtype, device=x.device)
    if key_padding_mask is not None:
        kept = (~key_padding_mask[:, : (n - 1) * d + l]).to(dtype).unfold(1, l, d).sum(-1)  # (batch, n)
        valid = kept == l
    return ((sums / count) @ weight.to(dtype).t()).to(x.dtype), valid


def _check_weight(name: str, weight: Optional[Tensor], dim: int, like: Tensor) -> None:
    """A compression map: None, or a finite floating (dim, dim) tensor on the inputs' device."""
    if weight is None:
        return
    if not isinstance(weight, Tensor) or weight.shape != (dim, dim):
        raise ValueError(f"{name} must be a tensor of shape {(dim, dim)}, got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    check_floating(name, weight)
    if weight.device != like.device:
        raise ValueError(f"{name} is on {weight.device}, the inputs on {like.device}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name} must be finite")


def check_nsa_inputs(
    q: Tensor, k: Tensor, v: Tensor, gates: Tensor, blocks: NSABlocks, causal: bool,
    key_padding_mask: Optional[Tensor], scale: Optional[float],
    k_weight: Optional[Tensor] = None, v_weight: Optional[Tensor] = None,
) -> Optional[float]:
    """Every argument of :func:`nsa_attention` checked, naming it; returns the scale."""
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v)
    if not isinstance(blocks, NSABlocks):
        raise TypeError(f"blocks must be an NSABlocks, got {type(blocks).__name__}")
    blocks.checked().check_heads(q.shape[1])
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"NSA is self-attention: q seq={q.shape[2]} and k seq={k.shape[2]} must be equal")
    blocks.check_length(k.shape[2])
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if not isinstance(gates, Tensor) or gates.shape != (*q.shape[:3], GATES):
        raise ValueError(f"gates must be a tensor of shape {(*q.shape[:3], GATES)}, got "
                         f"{tuple(gates.shape) if isinstance(gates, Tensor) else type(gates).__name__}")
    check_floating("gates", gates)
    if gates.device != q.device:
        raise ValueError(f"gates is on {gates.device}, q on {q.device}")
    # Padded rows are left out: whatever a padded position holds must not matter.
    kept = gates if key_padding_mask is None else gates.masked_fill(key_padding_mask[:, None, :, None], 0.5)
    if not bool(((kept >= 0) & (kept <= 1)).all()):  # NaN fails both comparisons
        raise ValueError("gates must lie in [0, 1] (e.g. a sigmoid) at every unpadded position")
    _check_weight("k_weight", k_weight, k.shape[3], k)
    _check_weight("v_weight", v_weight, v.shape[3], v)
    return scale


def nsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    blocks: NSABlocks,
    *,
    k_weight: Optional[Tensor] = None,
    v_weight: Optional[Tensor] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """Native sparse attention (see the module docstring).

    Args:
        q, k: (batch, heads, seq, dim); v: (batch, heads, seq, dim_v). Self-attention: one sequence.
        gates: (batch, heads, seq, 3): the weights of the compressed, selected and window branches.
        blocks: the block sizes and counts (:class:`NSABlocks`); ``top_k`` may not exceed the ``select_block``
            blocks of the sequence.
        k_weight, v_weight: (dim, dim), (dim_v, dim_v) linear maps of the compressed summaries (None: identity,
            mean pooling).
        causal: the paper's setting; non-causal lets every query see every block and a symmetric window.
        key_padding_mask: (batch, seq) bool, True marks padding.
        scale: logit scale of every branch, ``1/sqrt(dim)`` by default.

    Returns:
        (batch, heads, seq, dim_v).
    """
    scale = check_nsa_inputs(q, k, v, gates, blocks, causal, key_padding_mask, scale, k_weight, v_weight)
    k_weight = torch.eye(k.shape[3], dtype=k.dtype, device=k.device) if k_weight is None else k_weight
    v_weight = torch.eye(v.shape[3], dtype=v.dtype, device=v.device) if v_weight is None else v_weight
    return nsa_attention_unchecked(q, k, v, gates, blocks, k_weight, v_weight, causal, key_padding_mask, scale)


def nsa_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, gates: Tensor, blocks: NSABlocks, k_weight: Tensor, v_weight: Tensor,
    causal: bool, key_padding_mask: Optional[Tensor], scale: Optional[float], plan: Optional[BlockPlan] = None,
) -> Tensor:
    """:func:`nsa_attention` on checked inputs (the mechanism's path). ``plan``: a block plan of the window's
    :func:`~attnzoo.functional.blocksparse.window_pattern` for this length and causality, to reuse."""
    order = None
    if key_padding_mask is not None:
        # Each row's unpadded positions first, in order: blocks and the window then start at the sequence's
        # first position and end at its last, wherever the padding was (a grid anchored at the padded row
        # would move with the padding). Always sorted, never branched on the mask's values.
        order = torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True).indices
        key_padding_mask = key_padding_mask.gather(1, order)
        q, k, v, gates = (_gather_positions(x, order) for x in (q, k, v, gates))
        q = zero_padded(q, key_padding_mask)  # a padded query's NaN stays out of every row's arithmetic
        gates = gates.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # padded positions output zeros
    k0, v0 = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    ck, valid = compress(k0, k_weight, blocks, key_padding_mask)
    cv, _ = compress(v0, v_weight, blocks, key_padding_mask)
    positions = torch.arange(q.shape[2], device=q.device)
    out = nsa_branches(q, k0, v0, ck, cv, valid, gates, blocks, positions, causal, key_padding_mask, scale, plan)
    if order is None:
        return out
    return out.gather(2, _position_index(torch.argsort(order, dim=1), out))


def _position_index(order: Tensor, x: Tensor) -> Tensor:
    """``order`` (batch, seq) expanded to index dim 2 of x (batch, heads, seq, width)."""
    return order[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[3])


def _gather_positions(x: Tensor, order: Tensor) -> Tensor:
    """x (batch, heads, seq, width) with its positions in ``order`` (batch, seq)."""
    return x.gather(2, _position_index(order, x))


def window_attention(
    q: Tensor, k0: Tensor, v0: Tensor, window: int, positions: Tensor, causal: bool,
    key_padding_mask: Optional[Tensor], scale: Optional[float], plan: Optional[BlockPlan],
) -> Tensor:
    """The window branch: the blockwise core when queries and keys are one sequence; else (decoding, causal,
    queries the last ``seq_q`` positions) a masked softmax over the last ``window + seq_q - 1`` keys."""
    q_len, k_len = q.shape[2], k0.shape[2]
    if q_len == k_len:
        return blocksparse_attention_unchecked(q, k0, v0, window_pattern(window), causal, key_padding_mask, scale,
                                               plan)
    start = max(0, k_len - q_len - window + 1)
    keys = torch.arange(start, k_len, device=q.device)
    distance = positions.view(-1, 1) - keys.view(1, -1)
    allowed = ((distance >= 0) & (distance < window)).view(1, 1, q_len, -1)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, start:]
    return masked_sdpa(q, k0[:, :, start:], v0[:, :, start:], allowed, scale)


def _compressed_branch(
    q: Tensor, ck: Tensor, cv: Tensor, valid: Optional[Tensor], blocks: NSABlocks, positions: Tensor,
    causal: bool, scale: float,
) -> Tuple[Tensor, Tensor]:
    """(output (batch, heads, seq_q, dim_v), probabilities (batch, heads, seq_q, n_blocks)) of the queries over
    the compressed blocks they may see; rows that see none are zeros."""
    n = ck.shape[2]
    allowed = torch.ones(1, 1, q.shape[2], n, dtype=torch.bool, device=q.device)
    if causal:
        ends = torch.arange(n, device=q.device) * blocks.compress_stride + blocks.compress_block - 1
        allowed = (ends.view(1, -1) <= positions.view(-1, 1)).view(1, 1, q.shape[2], n)
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    empty = ~allowed.any(-1, keepdim=True)
    logits = (q @ ck.transpose(-1, -2) * scale).masked_fill(~(allowed | empty), -math.inf)
    probabilities = torch.softmax(logits, dim=-1).masked_fill(empty, 0.0)
    return probabilities @ cv, probabilities


def block_overlap(n_compressed: int, n_selectable: int, blocks: NSABlocks, device: torch.device) -> Tensor:
    """(n_compressed, n_selectable) 0/1: compressed block i (positions ``i d .. i d + l - 1``) overlaps
    selectable block j (``j l' .. (j + 1) l' - 1``)."""
    starts = torch.arange(n_compressed, device=device).view(-1, 1) * blocks.compress_stride
    first = torch.arange(n_selectable, device=device).view(1, -1) * blocks.select_block
    return ((starts < first + blocks.select_block) & (starts + blocks.compress_block > first)).float()


def ranked_blocks(scores: Tensor, candidate: Tensor, forced: Tensor, top_k: int) -> Tensor:
    """The ``top_k`` best candidates per row, -1 for slots no candidate fills: ``scores`` (..., n) >= 0,
    ``candidate`` and ``forced`` bool broadcastable to it. Forced blocks first, then by score; candidates scoring
    0 after every scored one, later blocks first."""
    n = scores.shape[-1]
    recency = torch.arange(n, device=scores.device, dtype=scores.dtype) / n - 1.0  # in [-1, 0)
    ranked = torch.where(scores > 0, scores, recency)
    ranked = torch.where(forced, torch.full_like(ranked, math.inf), ranked)
    ranked = torch.where(candidate, ranked, torch.full_like(ranked, -math.inf))
    best = torch.topk(ranked, min(top_k, n), dim=-1)
    return torch.where(best.values > -math.inf, best.indices, torch.full_like(best.indices, -1))


def select(
    probabilities: Tensor, blocks: NSABlocks, k_len: int, positions: Tensor, causal: bool,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """(batch, heads, seq_q, min(top_k, n)) the selectable blocks each query reads (-1: none). Keys padded on
    the right (``key_padding_mask`` (batch, k_len)): a block with no unpadded key is no candidate (it does not
    exist for the sequence alone; scoring 0, it would otherwise rank above earlier unscored blocks)."""
    batch, heads, q_len, n_compressed = probabilities.shape
    n = -(-k_len // blocks.select_block)
    overlap = block_overlap(n_compressed, n, blocks, probabilities.device).to(probabilities.dtype)
    scores = probabilities.detach() @ overlap  # (batch, heads, seq_q, n)
    group = blocks.selection_group
    scores = scores.view(batch, heads // group, group, q_len, n).sum(2, keepdim=True)
    block = torch.arange(n, device=probabilities.device).view(1, -1)
    own = (positions // blocks.select_block).view(-1, 1)
    candidate = block <= own if causal else torch.ones_like(block, dtype=torch.bool)
    if key_padding_mask is not None:
        exists = ~key_padding_mask[:, :: blocks.select_block]  # (batch, n): the block's first key is unpadded
        candidate = candidate & exists.view(batch, 1, 1, 1, n)
    forced = block == own
    if blocks.top_k >= 2:
        forced = forced | (block == 0)
    if blocks.top_k >= 3:
        forced = forced | (block == own - 1)
    chosen = ranked_blocks(scores, candidate, forced, blocks.top_k)
    return chosen.expand(batch, heads // group, group, q_len, -1).reshape(batch, heads, q_len, -1)


def nsa_branches(
    q: Tensor, k0: Tensor, v0: Tensor, ck: Tensor, cv: Tensor, valid: Optional[Tensor], gates: Tensor,
    blocks: NSABlocks, positions: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
    scale: Optional[float], plan: Optional[BlockPlan] = None,
) -> Tensor:
    """The three branches of queries at ``positions`` (seq_q,) over keys k0, v0 (padding zeroed) and their
    compressed blocks ck, cv (valid: (batch, n) or None), gated. Returns (batch, heads, seq_q, dim_v) in q's
    dtype."""
    out_dtype, dtype = q.dtype, working_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    q, k0, v0, ck, cv = (x.to(dtype) for x in (q, k0, v0, ck, cv))
    compressed, probabilities = _compressed_branch(q, ck, cv, valid, blocks, positions, causal, scale)
    chosen = select(probabilities, blocks, k0.shape[2], positions, causal, key_padding_mask)
    selected = selected_blocks_attention_unchecked(q, k0, v0, chosen, blocks.select_block, positions, causal,
                                                   key_padding_mask, scale)
    local = window_attention(q, k0, v0, blocks.window, positions, causal, key_padding_mask, scale, plan)
    gates = gates.to(dtype)
    out = gates[..., 0:1] * compressed + gates[..., 1:2] * selected + gates[..., 2:3] * local
    return out.to(out_dtype)


def nsa_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    blocks: NSABlocks,
    *,
    k_weight: Optional[Tensor] = None,
    v_weight: Optional[Tensor] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """:func:`nsa_attention` in float64 from the definitions: each compressed block averaged on its own, the
    selection as a dense (seq, seq) mask over key positions, the window as its dense mask; every branch a
    masked softmax over all N keys. Padding by rank: the unpadded positions of a row, numbered 0, 1, ... in
    order, are the sequence; blocks and the window are over those numbers; padded positions output zeros.
    Quadratic: for tests."""
    q, k, v, gates = q.double(), k.double(), v.double(), gates.double()
    batch, heads, length, _ = q.shape
    k_weight = torch.eye(k.shape[3], dtype=k.dtype, device=k.device) if k_weight is None else k_weight.double()
    v_weight = torch.eye(v.shape[3], dtype=v.dtype, device=v.device) if v_weight is None else v_weight.double()
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    padded = torch.zeros(batch, length, dtype=torch.bool, device=q.device) if key_padding_mask is None \
        else key_padding_mask
    real = ~padded
    q, k, v = zero_padded(q, padded), zero_padded(k, padded), zero_padded(v, padded)
    gates = gates.masked_fill(padded[:, None, :, None], 0.0)
    rank = real.long().cumsum(1) - 1  # (batch, seq): a position's place in its sequence (meaningless if padded)
    i = torch.arange(length, device=q.device)
    l, d, chosen_size = blocks.compress_block, blocks.compress_stride, blocks.select_block
    starts = torch.arange(0, max(length - l + 1, 0), d, device=q.device)  # (n_compressed,)
    n_compressed = starts.numel()
    # (batch, n_compressed, seq): the unpadded positions whose rank lies in the block; a whole block has l.
    member = real[:, None, :] & (rank[:, None, :] >= starts[None, :, None]) & (rank[:, None, :] < starts[None, :, None] + l)
    whole = member.sum(-1) == l  # (batch, n_compressed)
    weights = member.double() / l
    ck = torch.einsum("bcn,bhnd->bhcd", weights, k) @ k_weight.t()
    cv = torch.einsum("bcn,bhnd->bhcd", weights, v) @ v_weight.t()
    later = i[None, :] > i[:, None]  # key after query
    allowed = whole[:, None, :].expand(batch, length, n_compressed)  # (batch, seq, n_compressed)
    if causal:  # a block is seen once its last position is at or before the query
        allowed = allowed & (starts[None, None, :] + l - 1 <= rank[:, :, None])
    allowed = allowed.unsqueeze(1)
    if n_compressed:
        probabilities = masked_softmax_reference(q @ ck.transpose(-1, -2) * scale, allowed)
    else:
        probabilities = q.new_zeros(batch, heads, length, 0)
    compressed = probabilities @ cv

    n = -(-length // chosen_size)
    j = torch.arange(n, device=q.device)
    own = rank // chosen_size  # (batch, seq): the block of each position
    selectable = real[:, None, :] & (own[:, None, :] == j[None, :, None])  # (batch, n, seq)
    overlap = (torch.einsum("bcn,bjn->bcj", member.double(), selectable.double()) > 0).double()
    scores = torch.einsum("bhic,bcj->bhij", probabilities, overlap)
    scores = scores.view(batch, heads // blocks.selection_group, blocks.selection_group, length, n).sum(2, keepdim=True)
    exists = selectable.any(-1)  # (batch, n): blocks of the sequence
    candidate = exists[:, None, :] & ((j[None, None, :] <= own[:, :, None]) if causal else True)  # (batch, seq, n)
    forced = j[None, None, :] == own[:, :, None]  # the query's own block
    if blocks.top_k >= 2:
        forced = forced | (j == 0)
    if blocks.top_k >= 3:  # the block before the query's own
        forced = forced | (j[None, None, :] == own[:, :, None] - 1)
    chosen = ranked_blocks(scores, candidate[:, None, None], forced[:, None, None], blocks.top_k)
    chosen = chosen.expand(-1, -1, blocks.selection_group, -1, -1).reshape(batch, heads, length, -1)
    picked = torch.zeros(batch, heads, length, n + 1, dtype=torch.bool, device=q.device)
    picked.scatter_(-1, torch.where(chosen >= 0, chosen, n), True)
    key_block = own.clamp_min(0)[:, None, None, :].expand(batch, heads, length, length)
    visible = real[:, None, None, :] & (~later if causal else torch.ones_like(later))
    logits = q @ k.transpose(-1, -2) * scale
    selected = masked_softmax_reference(logits, picked[..., :n].gather(-1, key_block) & visible) @ v
    near = (rank[:, :, None] - rank[:, None, :]).abs() < blocks.window  # (batch, seq, seq), by rank
    local = masked_softmax_reference(logits, near[:, None] & visible) @ v
    return gates[..., 0:1] * compressed + gates[..., 1:2] * selected + gates[..., 2:3] * local

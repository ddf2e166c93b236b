"""Transformer-VQ attention (Lingle 2023, "Transformer-VQ: Linear-Time Transformers via Vector Quantization"):
softmax attention over keys replaced by their nearest codewords, computed in linear time, with a float64
reference.

Every key ``k_j`` is quantized to the nearest codeword of its head's codebook (squared Euclidean distance,
ties to the lowest index), ``k^_j = C[z_j]``, and attention is exact softmax attention over the quantized keys:
``out_i = sum_j exp(q_i . k^_j / sqrt(d)) v_j / sum_j exp(q_i . k^_j / sqrt(d))`` over the keys query i sees.
All keys sharing a codeword share their score with a query, so keys far away enter through a cache per
codeword: how many keys it stands for and the sum of their values. That makes causal attention linear in N.

Blocks. The sequence is cut into blocks of ``block_size`` positions. The queries of block g see the keys of
blocks g - 1 and g one by one (the "exact window", causally masked inside block g), and all other keys (earlier
blocks; in non-causal attention also later ones) through the codeword cache. The output is the same whichever
way a key enters; only gradients differ, as in the paper: with ``straight_through=True`` (training) the keys
of the exact window pass the attention's gradient straight through to ``k`` (the straight-through estimator),
while keys in the cache are their codewords (no gradient to ``k``, as the paper stops gradients through the
cache; values and queries keep theirs). With ``straight_through=False`` no gradient reaches ``k`` through the
attention: the output is piecewise constant in ``k``.

Without the straight-through estimator nothing depends on which way a key enters, so the fast path keeps
in the exact window only what the cache cannot hold: the current block of a causal query (non-causal: no
window, one cache of all keys). The output and the gradients of q and v are those of the definition either
way (tested against the float64 reference).

Cost: time O(N (S d + S e + L (d + e))), memory O(N S + (N / L) S e) for codebook size S, block size L, key
width d and value width e. A sequence no longer than the codebook (N <= S) is attended densely instead, key by
key over its quantized keys, in O(N^2 (d + e)): fewer scores than the cache's N x S, the same outputs and
gradients (:func:`dense_vq_attention`). The softmax over the cache and the window is one hand-written autograd function:
its backward forms the score gradients in place instead of allocating an (N x S) tensor per elementwise
step (see :class:`_SoftmaxOverCacheAndWindow`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._autocast import outside_autocast, without_autocast
from .._dtypes import working_dtype
from .._validation import check_bool, check_key_padding_mask, check_number, check_qkv
from .masks import zero_padded
from .prefix import lagged_prefix_sums
from .softmax import masked_softmax_reference


# -- quantization -----------------------------------------------------------------------------------------------
def quantize(k: Tensor, codebook: Tensor) -> Tensor:
    """Codes of the nearest codewords: k (batch, heads, seq, d), codebook (heads, S, d) -> (batch, heads, seq)
    long. Squared distances ``|c|^2 - 2 k . c`` (``|k|^2`` is the same for every codeword), ties to the lowest
    index."""
    batch, heads, length, dim = k.shape
    codebook = codebook.to(k.dtype)
    size = codebook.shape[1]
    # One fused product per head: |c|^2 + (-2) k . c (a view of the codebook when batch is 1).
    squares = codebook.square().sum(-1)[None, :, None, :].expand(batch, heads, 1, size).reshape(-1, 1, size)
    transposed = codebook.transpose(-1, -2)[None].expand(batch, heads, dim, size).reshape(-1, dim, size)
    distances = torch.baddbmm(squares, k.reshape(-1, length, dim), transposed, alpha=-2.0)
    return distances.argmin(dim=-1).view(batch, heads, length)


def quantize_reference(k: Tensor, codebook: Tensor) -> Tensor:
    """:func:`quantize` by the definition in float64: every squared distance ``|k - c|^2`` written out."""
    differences = k.double()[:, :, :, None, :] - codebook.double()[None, :, None, :, :]
    return differences.square().sum(-1).argmin(dim=-1)


def codewords(codebook: Tensor, codes: Tensor) -> Tensor:
    """The codewords of ``codes`` (batch, heads, seq): (batch, heads, seq, d), in the codebook's dtype."""
    heads = codebook.shape[0]
    index = codes + torch.arange(heads, device=codes.device).view(1, heads, 1) * codebook.shape[1]
    return codebook.reshape(-1, codebook.shape[2])[index]


def straight_through(k: Tensor, quantized: Tensor) -> Tensor:
    """``quantized`` in value, with the gradient of ``k`` (the straight-through estimator)."""
    return k + (quantized - k).detach()


def code_aggregates(codes: Tensor, v: Tensor, valid: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """Per codeword, the number of valid keys it stands for and the sum of their values.

    Args:
        codes: (..., n) long; v: (..., n, e); valid: (..., n) bool, broadcastable to codes; size: S.

    Returns:
        counts (..., S) and sums (..., S, e), in v's dtype.
    """
    weight = valid.to(v.dtype).expand(codes.shape)
    counts = v.new_zeros(*codes.shape[:-1], size).scatter_add(-1, codes, weight)
    sums = v.new_zeros(*codes.shape[:-1], size, v.shape[-1])
    sums = sums.scatter_add(-2, codes.unsqueeze(-1).expand(*codes.shape, v.shape[-1]), v * weight.unsqueeze(-1))
    return counts, sums


# -- attention --------------------------------------------------------------------------------------------------
def vq_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    block_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    straight_through: bool = False,
) -> Tensor:
    """Softmax attention over keys quantized to ``codebook`` (see the module docstring).

    Args:
        q, k: (batch, heads, seq, d); v: (batch, heads, seq, e); self-attention (equal lengths).
        codebook: (heads, S, d).
        block_size: L, positions per block.
        causal: each query sees the keys up to its own position.
        key_padding_mask: (batch, seq) bool, True = padding.
        straight_through: the exact window's keys pass the gradient straight through to ``k``.

    Returns:
        (batch, heads, seq, e); a row that sees no key is zero.
    """
    check_bool("causal", causal)
    check_bool("straight_through", straight_through)
    check_number("block_size", block_size, integer=True, minimum=1)
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"vq_attention is self-attention: q and k lengths must match, got {q.shape[2]}, {k.shape[2]}")
    if codebook.dim() != 3 or codebook.shape[0] != q.shape[1] or codebook.shape[2] != q.shape[3]:
        raise ValueError(f"codebook must have shape (heads, size, head_dim) = ({q.shape[1]}, S, {q.shape[3]}), got "
                         f"{tuple(codebook.shape)}")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    codes = quantize(zero_padded(k, key_padding_mask).to(working_dtype(k.dtype)), codebook)
    return vq_attention_unchecked(q, k, v, codebook, codes, block_size, causal, key_padding_mask, straight_through)


def _blocks(x: Tensor, blocks: int, size: int) -> Tensor:
    """(batch, heads, seq, ...) -> (batch, heads, blocks, size, ...), zero-padded at the end."""
    length = x.shape[2]
    if blocks * size != length:
        pad = [0, 0] * (x.dim() - 3) + [0, blocks * size - length]
        x = F.pad(x, pad)
    return x.reshape(*x.shape[:2], blocks, size, *x.shape[3:])


def _previous(x: Tensor, shift: int) -> Tensor:
    """x (batch, heads, blocks, ...) moved ``shift`` blocks later, zeros in front."""
    pad = [0, 0] * (x.dim() - 3) + [shift, 0]
    return F.pad(x, pad)[:, :, : x.shape[2]]


class _SoftmaxOverCacheAndWindow(torch.autograd.Function):
    """One softmax over the codeword cache and the exact window, by hand in both directions.

    Forward, for query blocks q (batch, heads, blocks, L, d), already scaled:
    ``scores = [q C^T + cache_bias, q K_w^T + window_bias for each window part]``, one shift (the row maximum,
    a constant for the gradient), ``E = exp(scores - shift)`` in place, ``num = E_cache cache + sum E_w V_w``
    (values with a last column of counts or valid flags, so that ``num`` holds the softmax numerator and its
    denominator), ``out = num[:e] / num[e]`` (0 where the denominator is 0).

    Backward, with ``g = [dout, -(dout . out)] / den`` (the gradient of ``num``): ``dE = g V^T``, the score
    gradient ``dE * E`` formed in place, ``dV = E^T g``, ``dq = dS C + sum dS_w K_w``, ``dK_w = dS_w^T q``.
    Autograd would allocate a fresh (N x S) tensor for each of its elementwise steps; at N = 8192 and S = 512
    that is 134 MB a step, whose page faults cost more on CPU than the arithmetic.
    """

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, codebook: Tensor, cache: Tensor, cache_bias: Optional[Tensor],  # type: ignore[override]
                *window: Optional[Tensor]) -> Tensor:
        batch, heads, blocks, block, dim = q.shape
        size = codebook.shape[1]
        parts = [(window[i], window[i + 1], window[i + 2]) for i in range(0, len(window), 3)]
        weights = torch.matmul(q.view(batch, heads, blocks * block, dim), codebook.transpose(-1, -2)[None])
        weights = weights.view(batch, heads, blocks, block, size)
        if cache_bias is not None:
            weights.add_(cache_bias.unsqueeze(3))
        shift = weights.amax(-1, keepdim=True)
        window_weights = []
        for keys, _, bias in parts:
            scores = torch.matmul(q, keys.transpose(-1, -2))
            if bias is not None:
                scores.add_(bias)
            torch.maximum(shift, scores.amax(-1, keepdim=True), out=shift)
            window_weights.append(scores)
        shift.masked_fill_(~torch.isfinite(shift), 0.0)  # a row that sees no key: all its weights are 0
        num = torch.matmul(weights.sub_(shift).exp_(), cache)
        for scores, (_, values, _) in zip(window_weights, parts):
            num.add_(torch.matmul(scores.sub_(shift).exp_(), values))
        width = num.shape[-1] - 1
        denominator = num[..., width:]
        denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        out = num[..., :width] / denominator
        ctx.save_for_backward(q, codebook, cache, weights, out, denominator,
                              *[t for (keys, values, _), w in zip(parts, window_weights) for t in (keys, values, w)])
        return out

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        q, codebook, cache, weights, out, denominator, *saved = ctx.saved_tensors
        batch, heads, blocks, block, dim = q.shape
        needs = ctx.needs_input_grad
        grad_num = torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1).div_(denominator)
        grad_cache = torch.matmul(weights.transpose(-1, -2), grad_num) if needs[2] else None
        grad_scores = torch.matmul(grad_num, cache.transpose(-1, -2)).mul_(weights)
        grad_q = torch.matmul(grad_scores.view(batch, heads, blocks * block, -1), codebook[None])
        grad_q = grad_q.view(q.shape)
        grad_window = []
        for i in range(0, len(saved), 3):
            keys, values, window_weights = saved[i:i + 3]
            grad_values = torch.matmul(window_weights.transpose(-1, -2), grad_num) if needs[4 + i + 1] else None
            grad_window_scores = torch.matmul(grad_num, values.transpose(-1, -2)).mul_(window_weights)
            grad_q.add_(torch.matmul(grad_window_scores, keys))
            grad_keys = torch.matmul(grad_window_scores.transpose(-1, -2), q) if needs[4 + i] else None
            grad_window += [grad_keys, grad_values, None]
        return (grad_q, None, grad_cache, None, *grad_window)


def vq_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    block_size: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    straight_through: bool,
) -> Tensor:
    """:func:`vq_attention` on checked arguments, with the keys' ``codes`` (batch, heads, seq) given.

    A sequence no longer than the codebook is attended densely (:func:`dense_vq_attention`): its N x N scores
    cost less than the N x S ones over the codeword cache, and give the same outputs and gradients."""
    if q.shape[2] <= codebook.shape[1]:
        return dense_vq_attention(q, k, v, codebook, codes, block_size, causal, key_padding_mask, straight_through)
    return cached_vq_attention(q, k, v, codebook, codes, block_size, causal, key_padding_mask, straight_through)


@without_autocast  # its own working dtype, as the cached path's Function
def dense_vq_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    block_size: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    straight_through: bool,
) -> Tensor:
    """:func:`vq_attention_unchecked` as exact softmax over the quantized keys, key by key: O(N^2) scores.

    The straight-through estimator keeps its window: the scores of the keys in a query's own and previous
    block gain ``q . (k - k.detach())``, zero in value, which passes their gradient to ``k``; other keys are
    their codewords alone, as in the cache."""
    dtype = q.dtype
    compute = working_dtype(dtype)
    batch, heads, length, dim = q.shape
    device = q.device
    q = q.to(compute) * (1.0 / math.sqrt(dim))
    quantized = codewords(codebook.detach().to(compute), codes)
    scores = torch.matmul(q, quantized.transpose(-1, -2))
    positions = torch.arange(length, device=device)
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    if causal:
        allowed = positions[None, :] <= positions[:, None]
    if straight_through:
        block = min(block_size, length)
        lag = positions[:, None] // block - positions[None, :] // block
        window = (lag >= 0) & (lag <= 1) & allowed  # keys of the query's own block and the one before
        keys = zero_padded(k, key_padding_mask).to(compute)
        scores = scores + torch.matmul(q, (keys - keys.detach()).transpose(-1, -2)) * window
    allowed = allowed.expand(batch, 1, length, length)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    empty = ~allowed.any(dim=-1, keepdim=True)  # a row that sees no key outputs zeros, without NaN
    weights = torch.softmax(scores.masked_fill(~(allowed | empty), -math.inf), dim=-1)
    out = torch.matmul(weights, zero_padded(v, key_padding_mask).to(compute)).masked_fill(empty, 0.0)
    return out.to(dtype)


def cached_vq_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    block_size: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    straight_through: bool,
) -> Tensor:
    """:func:`vq_attention_unchecked` in linear time, by the codeword cache and the exact window."""
    dtype = q.dtype
    compute = working_dtype(dtype)
    batch, heads, length, dim = q.shape
    size = codebook.shape[1]
    scale = 1.0 / math.sqrt(dim)
    device = q.device
    block = min(block_size, length)
    blocks = -(-length // block)
    codebook = codebook.to(compute)
    # Without the straight-through estimator a key gives the same output and the same gradients whether it
    # enters by the exact window or by the cache, so the window keeps only what the cache cannot hold: the
    # current block of a causal query (non-causal: nothing). With it, the window is blocks g - 1 and g.
    if straight_through:
        window = 2
    else:
        window = 1 if causal else 0

    valid = torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None \
        else ~key_padding_mask
    valid = F.pad(valid, (0, blocks * block - length)).view(batch, 1, blocks, block)
    # Values carry a column of ones (of valid flags), so that one product gives the softmax numerator and its
    # denominator together.
    width = v.shape[-1]
    v = _blocks(zero_padded(v, key_padding_mask).to(compute), blocks, block)
    v = torch.cat([v, valid.to(compute).expand(batch, heads, blocks, block).unsqueeze(-1)], dim=-1)
    q = _blocks(q.to(compute) * scale, blocks, block)
    code_blocks = _blocks(codes, blocks, block)

    # The cache: per codeword, the sum of the values (and, last column, the number) of the keys outside the
    # window. (batch, heads, blocks, S, e + 1), or one for all blocks (batch, heads, 1, S, e + 1).
    per_block = v.new_zeros(batch, heads, blocks, size, width + 1)
    per_block = per_block.scatter_add(3, code_blocks.unsqueeze(-1).expand(-1, -1, -1, -1, width + 1), v)
    if causal:
        cache = lagged_prefix_sums(per_block, window)
    elif window == 0:
        cache = per_block.sum(dim=2, keepdim=True)
    else:
        cache = per_block.sum(dim=2, keepdim=True) - per_block - _previous(per_block, 1)
    with torch.no_grad():
        present = cache[..., width] > 0.5  # counts are whole numbers; the sums of other blocks may round
        cache_bias = torch.zeros(present.shape, dtype=compute, device=device).masked_fill_(~present, -math.inf)

    # The exact window, key by key: the current block (causally masked when causal) and, with the
    # straight-through estimator, the previous one. Each part: keys, values, an additive bias (masks).
    parts: List[Optional[Tensor]] = []
    if window:
        quantized = _blocks(codewords(codebook, codes), blocks, block)
        if straight_through:  # the argument: the estimator itself is written out (its name is taken)
            keys = _blocks(zero_padded(k, key_padding_mask).to(compute), blocks, block)
            keys = keys + (quantized - keys).detach()
        else:
            keys = quantized
        padding = torch.zeros(valid.shape, dtype=compute, device=device).masked_fill_(~valid, -math.inf)
        own_bias = padding.unsqueeze(3)  # (batch, 1, blocks, 1, block)
        if causal:
            own_bias = own_bias.masked_fill(torch.ones(block, block, dtype=torch.bool, device=device).triu(1),
                                            -math.inf)
        parts += [keys, v, own_bias]
        if window == 2:  # block 0 has no previous block: its keys there are all masked
            previous_padding = F.pad(padding, (0, 0, 1, 0), value=-math.inf)[:, :, :blocks]
            parts += [_previous(keys, 1), _previous(v, 1), previous_padding.unsqueeze(3)]
    queries = q if cache.shape[2] == blocks else q.view(batch, heads, 1, blocks * block, dim)
    out = _SoftmaxOverCacheAndWindow.apply(queries, codebook, cache, cache_bias, *parts)
    return out.reshape(batch, heads, blocks * block, -1)[:, :, :length].to(dtype)


def vq_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    block_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    straight_through: bool = False,
) -> Tensor:
    """:func:`vq_attention` by the definition in float64: keys replaced by their nearest codewords, one full
    masked softmax. With ``straight_through``, the score of a (query, key) pair in the exact window takes the
    key through the straight-through estimator, every other score the codeword alone (the same values)."""
    q, v = q.double(), zero_padded(v.double(), key_padding_mask)
    k = zero_padded(k.double(), key_padding_mask)
    codebook = codebook.double()
    batch, heads, length, dim = q.shape
    quantized = codewords(codebook, quantize_reference(k, codebook))
    logits = torch.einsum("bhid,bhjd->bhij", q, quantized) / math.sqrt(dim)
    if straight_through:
        block = torch.arange(length) // block_size
        window = (block[None, :] == block[:, None]) | (block[None, :] == block[:, None] - 1)
        through = torch.einsum("bhid,bhjd->bhij", q, k + (quantized - k).detach()) / math.sqrt(dim)
        logits = torch.where(window, through, logits)
    allowed = torch.ones(batch, heads, length, length, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    return masked_softmax_reference(logits, allowed) @ v


# -- decoding ---------------------------------------------------------------------------------------------------
def vq_attention_step(
    q_t: Tensor, codebook: Tensor, counts: Tensor, sums: Tensor
) -> Tensor:
    """One query per sequence (batch, heads, 1, d) over a cache of every key so far, the new one included:
    ``counts`` (batch, heads, S) and value ``sums`` (batch, heads, S, e) per codeword. Returns (batch, heads,
    1, e) in the cache's dtype."""
    scale = 1.0 / math.sqrt(q_t.shape[3])
    codebook = codebook.to(sums.dtype)
    scores = torch.matmul(q_t.to(sums.dtype), codebook.transpose(-1, -2)[None]) * scale  # (batch, heads, 1, S)
    scores = scores.masked_fill((counts <= 0).unsqueeze(2), -math.inf)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.matmul(weights, sums) / torch.matmul(weights, counts.unsqueeze(-1))


__all__ = [
    "code_aggregates",
    "codewords",
    "quantize",
    "quantize_reference",
    "straight_through",
    "vq_attention",
    "vq_attention_reference",
    "vq_attention_step",
    "vq_attention_unchecked",
    "dense_vq_attention",
    "cached_vq_attention",
]

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

Cost: time O(N (S d + S e + L (d + e))), memory O(N S + (N / L) S e) for codebook size S, block size L, key
width d and value width e.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_key_padding_mask, check_number, check_qkv
from .masks import zero_padded
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
    """:func:`vq_attention` on checked arguments, with the keys' ``codes`` (batch, heads, seq) given."""
    dtype = q.dtype
    compute = working_dtype(dtype)
    batch, heads, length, dim = q.shape
    size = codebook.shape[1]
    scale = 1.0 / math.sqrt(dim)
    device = q.device
    block = min(block_size, length)
    blocks = -(-length // block)
    codebook = codebook.to(compute)

    valid = torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None \
        else ~key_padding_mask
    valid = F.pad(valid, (0, blocks * block - length)).view(batch, 1, blocks, block)
    q = _blocks(q.to(compute), blocks, block)
    v = _blocks(zero_padded(v, key_padding_mask).to(compute), blocks, block)
    quantized = codewords(codebook, codes)
    if straight_through:  # the argument: the estimator itself is written out (its name is taken)
        k = zero_padded(k, key_padding_mask).to(compute)
        quantized = k + (quantized - k).detach()
    keys = _blocks(quantized, blocks, block)
    codes = _blocks(codes, blocks, block)

    # Values carry a column of ones (of valid flags for the cache), so that one product gives the softmax
    # numerator and its denominator together.
    width = v.shape[-1]
    v = torch.cat([v, valid.to(compute).expand(batch, heads, blocks, block).unsqueeze(-1)], dim=-1)
    q = q * scale

    # The exact window: blocks g - 1 and g, one key at a time. (batch, heads, blocks, block, 2 block)
    window_keys = torch.cat([_previous(keys, 1), keys], dim=3)
    window_values = torch.cat([_previous(v, 1), v], dim=3)
    window_valid = torch.cat([_previous(valid, 1), valid], dim=3)[:, :, :, None, :]
    if causal:
        own = torch.ones(block, block, dtype=torch.bool, device=device).tril()
        window_valid = window_valid & torch.cat([own.new_ones(block, block), own], dim=1)
    window_bias = torch.zeros(window_valid.shape, dtype=compute, device=device).masked_fill(~window_valid, -math.inf)
    window_scores = torch.matmul(q, window_keys.transpose(-1, -2)) + window_bias

    # The cache: per codeword of every block outside the window, the sum of its values and (last column) how
    # many keys it stands for. (batch, heads, blocks, S, e + 1)
    per_block = v.new_zeros(batch, heads, blocks, size, width + 1)
    per_block = per_block.scatter_add(3, codes.unsqueeze(-1).expand(-1, -1, -1, -1, width + 1), v)
    if causal:
        # Block g reads blocks 0 .. g - 2: running sums, one block at a time (cumsum along a middle dim is
        # several times slower on CPU).
        # unbind: one backward node for all the slices (indexing them one by one would make one full-size
        # gradient per slice).
        slices = per_block.unbind(dim=2)
        running, cache = torch.zeros_like(slices[0]), []
        for g in range(blocks):
            if g >= 2:
                running = running + slices[g - 2]
            cache.append(running)
        cache = torch.stack(cache, dim=2)
    else:
        cache = per_block.sum(dim=2, keepdim=True) - per_block - _previous(per_block, 1)
    present = cache[..., width] > 0.5  # counts are whole numbers; the sums of other blocks may round
    cache_bias = torch.zeros(present.shape, dtype=compute, device=device).masked_fill(~present, -math.inf)
    # One product per head over all positions (a per-block product would copy the codebook for every block).
    cache_scores = torch.matmul(q.view(batch, heads, blocks * block, dim), codebook.transpose(-1, -2)[None])
    cache_scores = cache_scores.view(batch, heads, blocks, block, size) + cache_bias.unsqueeze(3)

    # Masks enter as additive biases and the shift (a constant for the gradient) is subtracted in place:
    # every pass over the (N x S) scores counts, forward and backward.
    with torch.no_grad():
        shift = torch.maximum(window_scores.amax(-1, keepdim=True), cache_scores.amax(-1, keepdim=True))
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    both = torch.matmul(window_scores.sub_(shift).exp_(), window_values) \
        + torch.matmul(cache_scores.sub_(shift).exp_(), cache)
    numerator, denominator = both[..., :width], both[..., width:]
    out = numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
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
]

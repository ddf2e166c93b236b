"""FLASH's mixed chunk attention (Hua et al. 2022, "Transformer Quality in Linear Time"), on per-head tensors,
with a float64 reference. Not Dao et al.'s FlashAttention (an exact softmax kernel): "FLASH" is the paper's
name for its model; the mechanism is registered as ``flash_gau``.

Its queries and keys are the paper's shared-projection forms (:func:`attnzoo.functional.gau.scale_offset`,
optionally :func:`attnzoo.functional.gau.rotate`), four of them, taken ready-made. The sequence is cut into
chunks of ``c`` positions (the last one may be shorter). Inside each chunk, exact quadratic attention on the
quadratic forms ``(q_quad, k_quad)``: squared-ReLU weights ``relu(q_i . k_j / sqrt(d))^2`` divided by the chunk
size ``c`` (a constant, as in the paper, also for the last chunk and under causal masking), or a softmax over
the chunk's visible keys (``scores="softmax"``). Across chunks, linear attention on the linear forms
``(q_lin, k_lin)`` with no feature map and no row normalisation: ``q_lin_i . (sum_j k_lin_j v_j^T) / (sqrt(d)
n_i)``, where the sum runs over every unpadded key of the sequence (own chunk included) when non-causal, and
over the keys of the *previous* chunks when causal (prefix sums of the chunk states); ``n_i`` is the number of
keys in that sum (at least 1), so the paper's 1/N when non-causal. The two parts are added.

Padded keys and values are zeroed before use and masked out of every sum, so whatever they hold changes no
output. Code paths depend on shapes only, never on mask values.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_key_padding_mask, check_number, check_qkv
from .gau import _check_common, squared_relu_attention
from .masks import zero_padded
from .prefix import lagged_prefix_sums
from .softmax import masked_sdpa, masked_softmax_reference


def mixed_chunk_attention(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """FLASH's mixed chunk attention (see the module docstring for the exact scaling).

    Args:
        q_quad, k_quad: (batch, heads, seq, d), the forms of the quadratic attention inside each chunk.
        q_lin, k_lin: (batch, heads, seq, d), the forms of the linear attention across chunks.
        v: (batch, heads, seq, e).
        chunk_size: c, positions per chunk (the last chunk may be shorter).
        causal: causal mask inside the chunk, prefix sums of the previous chunks' states across chunks.
        key_padding_mask: (batch, seq) bool, True = padding.
        scores: "relu2" or "softmax" inside the chunks.

    Returns:
        (batch, heads, seq, e). Time O(N c (d + e) + N d e), memory O(N c + (N / c) d e).
    """
    _check_common(causal, scores)
    check_number("chunk_size", chunk_size, integer=True, minimum=1)
    check_qkv(q_quad, k_quad, v)
    check_qkv(q_lin, k_lin, v)
    if not (q_quad.shape == k_quad.shape == q_lin.shape == k_lin.shape):
        raise ValueError(
            "q_quad, k_quad, q_lin and k_lin must share one shape (self-attention), got "
            f"{tuple(q_quad.shape)}, {tuple(k_quad.shape)}, {tuple(q_lin.shape)}, {tuple(k_lin.shape)}"
        )
    check_key_padding_mask(key_padding_mask, q_quad.shape[0], q_quad.shape[2], q_quad.device)
    return mixed_chunk_attention_unchecked(q_quad, k_quad, q_lin, k_lin, v, chunk_size, causal, key_padding_mask,
                                           scores)


def _chunked(x: Tensor, chunks: int, size: int) -> Tensor:
    """(batch, heads, seq, dim) -> (batch, heads, chunks, size, dim), zero-padded at the end."""
    batch, heads, length, dim = x.shape
    if chunks * size != length:
        x = F.pad(x, (0, 0, 0, chunks * size - length))
    return x.reshape(batch, heads, chunks, size, dim)


def mixed_chunk_attention_unchecked(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scores: str,
) -> Tensor:
    """:func:`mixed_chunk_attention` on checked arguments."""
    dtype = q_quad.dtype
    compute = working_dtype(dtype)
    batch, heads, length, dim = q_quad.shape
    width = v.shape[3]
    device = q_quad.device
    # Tensors are cut into chunks of `size` positions; the scale stays 1/chunk_size (a sequence shorter than one
    # chunk is one short chunk, not padded to a full one).
    size = min(chunk_size, length)
    chunks = -(-length // size)
    total = chunks * size

    valid = torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None \
        else ~key_padding_mask
    valid = F.pad(valid, (0, total - length))  # the positions added to fill the last chunk are not keys
    valid_chunks = valid.view(batch, 1, chunks, size)

    k_quad, k_lin = zero_padded(k_quad, key_padding_mask), zero_padded(k_lin, key_padding_mask)
    q_quad, k_quad = (_chunked(x.to(compute), chunks, size) for x in (q_quad, k_quad))
    q_lin, k_lin = (_chunked(x.to(compute), chunks, size) for x in (q_lin, k_lin))
    v = _chunked(zero_padded(v, key_padding_mask).to(compute), chunks, size)
    zero = torch.zeros((), dtype=compute, device=device)
    k_lin = torch.where(valid_chunks[..., None], k_lin, zero)

    # Quadratic attention inside each chunk: (batch, heads, chunks, size, size).
    allowed = valid_chunks[:, :, :, None, :]
    if causal:
        allowed = allowed & torch.ones(size, size, dtype=torch.bool, device=device).tril()
    allowed = allowed.expand(batch, 1, chunks, size, size)
    if scores == "softmax":
        flat = lambda x: x.reshape(batch, heads * chunks, size, x.shape[-1])  # noqa: E731
        mask = allowed.expand(batch, heads, chunks, size, size).reshape(batch, heads * chunks, size, size)
        quadratic = masked_sdpa(flat(q_quad), flat(k_quad), flat(v), mask).view(batch, heads, chunks, size, width)
    else:
        # relu(s / sqrt(d))^2 / c = relu(s / sqrt(d c))^2: both scales go on q, none over the (size x size) scores.
        quadratic = squared_relu_attention(q_quad * (1.0 / math.sqrt(dim * chunk_size)), k_quad, v, allowed)

    # Linear attention across chunks, on one (dim x width) state per chunk.
    states = torch.matmul(k_lin.transpose(-1, -2), v)  # (batch, heads, chunks, dim, width)
    counts = valid_chunks.sum(-1).to(compute)  # (batch, 1, chunks)
    if causal:
        # Exclusive prefix sums: chunk g reads chunks 0 .. g - 1 (written in place, forward and backward).
        states = lagged_prefix_sums(states, 1)
        counts = torch.cumsum(counts, dim=2) - counts
    else:
        states = states.sum(dim=2, keepdim=True)
        counts = counts.sum(dim=2, keepdim=True)
    scale = (counts.clamp_min(1.0) * math.sqrt(dim))[..., None, None]
    linear = torch.matmul(q_lin, states / scale)

    out = (quadratic + linear).reshape(batch, heads, total, width)[:, :, :length]
    return out.to(dtype)


def mixed_chunk_attention_reference(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """:func:`mixed_chunk_attention` by the definition in float64: one full (seq x seq) weight matrix, the
    quadratic weight of every pair in one chunk plus the linear weight of every pair the linear part covers."""
    q_quad, q_lin = q_quad.double(), q_lin.double()
    k_quad = zero_padded(k_quad.double(), key_padding_mask)
    k_lin = zero_padded(k_lin.double(), key_padding_mask)
    v = zero_padded(v.double(), key_padding_mask)
    batch, heads, length, dim = q_quad.shape
    chunk = torch.arange(length) // chunk_size
    same_chunk = chunk[:, None] == chunk[None, :]
    earlier_chunk = chunk[None, :] < chunk[:, None]
    is_key = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    if key_padding_mask is not None:
        is_key = ~key_padding_mask[:, None, None, :]

    in_chunk = same_chunk & (torch.ones(length, length, dtype=torch.bool).tril() if causal else True)
    in_chunk = in_chunk & is_key
    logits = torch.einsum("bhid,bhjd->bhij", q_quad, k_quad) / math.sqrt(dim)
    if scores == "softmax":
        quadratic = masked_softmax_reference(logits, in_chunk.expand(batch, heads, length, length))
    else:
        quadratic = torch.where(in_chunk, torch.clamp(logits, min=0.0) ** 2, torch.zeros_like(logits)) / chunk_size

    covered = (earlier_chunk if causal else torch.ones(length, length, dtype=torch.bool)) & is_key
    count = covered.sum(-1, keepdim=True).clamp_min(1).double()
    lin_logits = torch.einsum("bhid,bhjd->bhij", q_lin, k_lin) / math.sqrt(dim)
    linear = torch.where(covered, lin_logits, torch.zeros_like(lin_logits)) / count
    return (quadratic + linear) @ v


__all__ = ["mixed_chunk_attention", "mixed_chunk_attention_reference", "mixed_chunk_attention_unchecked"]

"""Multi-head latent attention's decoding maths (DeepSeek-V2, 2024): attention over a cache of latents.

The layer (:class:`attnzoo.models.latent_attention.MultiHeadLatentAttention`) caches per position only the
latent ``c`` (latent_dim) and the rotated rotary key ``k_R`` (rope_dim), side by side in one row ``[c ; k_R]``.
Head h's key is ``[c W_uk_h^T ; k_R]`` and its value ``c W_uv_h^T`` (``W_uk_h``, ``W_uv_h``: (head_dim,
latent_dim)), so its logit for a query ``[q_C ; q_R]`` is ``(q_C W_uk_h) . c + q_R . k_R`` and its output
``(sum_j w_j c_j) W_uv_h^T``: the up-projections are absorbed into the query and the output, and every head
attends to the same cached rows, the values being their first latent_dim channels. That is one multi-query
softmax attention of width latent_dim + rope_dim, which :func:`absorbed_latent_attention` runs through the
exact softmax core without materialising a key or a value.

:func:`latent_attention_reference` is the float64 form that materialises every head's keys and values.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .softmax import softmax_attention_reference, softmax_attention_unchecked


def absorbed_queries(q_content: Tensor, up_keys: Tensor) -> Tensor:
    """Each head's content query carried into the latent space, ``q_C W_uk_h``.

    Args:
        q_content: (batch, heads, seq, head_dim).
        up_keys: (heads, head_dim, latent_dim), head h's key up-projection (its keys are ``c up_keys[h]^T``).

    Returns:
        (batch, heads, seq, latent_dim), whose dot product with a latent c is ``q_C . (c up_keys[h]^T)``.
    """
    return torch.einsum("bhsd,hdl->bhsl", q_content, up_keys)


def expand_latent_values(latent_out: Tensor, up_values: Tensor) -> Tensor:
    """Each head's weighted sum of latents taken to its value space, ``o_h W_uv_h^T``.

    Args:
        latent_out: (batch, heads, seq, latent_dim), head h's softmax-weighted sum of cached latents.
        up_values: (heads, head_dim, latent_dim), head h's value up-projection.

    Returns:
        (batch, heads, seq, head_dim): the weighted sum of head h's values (the weights sum to one).
    """
    return torch.einsum("bhsl,hdl->bhsd", latent_out, up_values)


def absorbed_latent_attention(q_latent: Tensor, q_rope: Optional[Tensor], cached: Tensor, scale: float) -> Tensor:
    """Softmax attention of every query over every cached row, with the up-projections absorbed.

    Args:
        q_latent: (batch, heads, seq_q, latent_dim), from :func:`absorbed_queries`.
        q_rope: (batch, heads, seq_q, rope_dim), the rotated rotary queries; None without a rotary part.
        cached: (batch, seq_kv, latent_dim + rope_dim), rows ``[c ; k_R]`` (rope_dim 0 without a rotary part).
        scale: the logit scale, ``1 / sqrt(head_dim + rope_dim)`` for the layer's attention.

    Returns:
        (batch, heads, seq_q, latent_dim): each head's softmax-weighted sum of the cached latents. Every query
        sees every cached row (a decoding step: the cache holds only earlier positions and its own).
    """
    batch, heads, seq_q, latent_dim = q_latent.shape
    queries = q_latent if q_rope is None else torch.cat([q_latent, q_rope], dim=-1)
    # One key/value head shared by all: the heads' queries become rows of one query block, so the cache is read
    # once for all of them (a matrix product, not one matrix-vector product per head).
    queries = queries.reshape(batch, 1, heads * seq_q, queries.shape[-1])
    keys = cached[:, None]
    # The latents are the values. The whole rows are passed as values, and the rotary channels of the output
    # dropped: SDPA's fused kernels need values as wide as the keys, and run faster so than the unfused path
    # does on the narrower view, though they also sum the rope_dim channels.
    out = softmax_attention_unchecked(queries, keys, keys, False, None, False, scale)[..., :latent_dim]
    return out.reshape(batch, heads, seq_q, latent_dim)


def latent_attention_reference(
    q_content: Tensor, q_rope: Optional[Tensor], latent: Tensor, k_rope: Optional[Tensor], up_keys: Tensor,
    up_values: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Multi-head latent attention in float64 with every head's keys and values materialised, for tests.

    Args:
        q_content: (batch, heads, seq_q, head_dim); q_rope: (batch, heads, seq_q, rope_dim) or None.
        latent: (batch, seq_kv, latent_dim), the normalised latents c; k_rope: (batch, seq_kv, rope_dim), the
            rotated rotary keys shared by every head, or None.
        up_keys, up_values: (heads, head_dim, latent_dim).
        causal, key_padding_mask: as :func:`attnzoo.functional.softmax.softmax_attention`.

    Returns:
        (batch, heads, seq_q, head_dim) float64, softmax at scale ``1 / sqrt(head_dim + rope_dim)``.
    """
    latent, up_keys, up_values = latent.double(), up_keys.double(), up_values.double()
    keys = torch.einsum("bsl,hdl->bhsd", latent, up_keys)
    values = torch.einsum("bsl,hdl->bhsd", latent, up_values)
    queries = q_content.double()
    if q_rope is not None and k_rope is not None:
        queries = torch.cat([queries, q_rope.double()], dim=-1)
        shared = k_rope.double()[:, None].expand(-1, keys.shape[1], -1, -1)
        keys = torch.cat([keys, shared], dim=-1)
    scale = 1.0 / math.sqrt(queries.shape[-1])
    return softmax_attention_reference(queries, keys, values, causal, key_padding_mask, scale=scale)


__all__ = ["absorbed_latent_attention", "absorbed_queries", "expand_latent_values", "latent_attention_reference"]

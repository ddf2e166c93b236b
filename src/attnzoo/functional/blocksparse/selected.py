"""Attention over key blocks chosen per query (data-dependent block sparsity, as NSA's selected branch): each
query row of each batch element and head lists the key blocks it reads, and one exact softmax runs over their
keys under an element mask (slot in use, causality by positions, key padding).

Unlike the fixed patterns of this package (one index table for every batch element and head, made once per
length), the table here is an input, ``(batch, heads, seq_q, blocks_per_query)``. The keys are cut into
blocks of ``block_size`` in natural order (the last padded). Two exact paths, chosen by the shapes
(:data:`DENSE_SHARE`): chunks of queries against every key they may see under the mask of their chosen blocks
(matrix products, O(chunk * seq_kv) logits a chunk), or each query's blocks gathered by one ``index_select``
over the flattened (batch, head, block) rows per chunk of queries (O(chunk * blocks_per_query * block_size *
dim)). Nothing N x N is made either way."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..softmax import masked_sdpa

GATHERED_KEYS = 1 << 16
"""Keys gathered per (batch, head) in one chunk of queries: the chunk holds ``GATHERED_KEYS // (blocks per
query * block_size)`` queries (at least one)."""

MASKED_LOGITS = 1 << 18
"""Logits per (batch, head) in one chunk of the masked path: ``MASKED_LOGITS // seq_kv`` queries a chunk."""

DENSE_SHARE = 128
"""The masked path runs when the chosen keys per query, times this, reach the key length. A gather copies every
chosen key once per query (one key of memory traffic per multiply-add); the masked path computes more logits,
in matrix products that reuse each key they read across a chunk of queries. Measured on the CPU, one thread,
4 heads of dim 64, 16 chosen blocks of 64 (1024 keys per query), causal forward+backward: N = 1024, masked
0.17 s, gathered 12.5 s; N = 4096, masked 2.4 s, gathered 82 s (the masked path's share of useless logits
grows with N, but the gather stays ~40x slower per key), so the gather only pays for keys far longer than the
chosen blocks (decoding a long context)."""


def selected_blocks_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Tensor,
    block_size: int,
    query_positions: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float] = None,
) -> Tensor:
    """Softmax attention of each query over the keys of its listed blocks, on checked inputs.

    Args:
        q: (batch, heads, seq_q, dim); k: (batch, heads, seq_kv, dim), v: (batch, heads, seq_kv, dim_v), with
            padded positions already zeroed (:func:`~attnzoo.functional.masks.zero_padded`).
        blocks: (batch, heads, seq_q, S) long, key block indices (block b holds positions ``b * block_size``
            to ``(b + 1) * block_size - 1``), -1 for an unused slot; no block twice in a row.
        query_positions: (seq_q,) long, each query's position among the keys (for causality).
        causal: a query sees only keys at or before its position.
        key_padding_mask: (batch, seq_kv) bool, True marks padding, or None.
        scale: logit scale, ``1/sqrt(dim)`` by default.

    Returns:
        (batch, heads, seq_q, dim_v); a row that sees no key is zeros.
    """
    k_len, width = k.shape[2], blocks.shape[3]
    keep = torch.ones(q.shape[0], k_len, dtype=torch.bool, device=q.device) if key_padding_mask is None \
        else ~key_padding_mask
    if width * block_size * DENSE_SHARE >= k_len:
        return _masked_chunks(q, k, v, blocks, block_size, query_positions, causal, keep, scale)
    return _gathered_blocks(q, k, v, blocks, block_size, query_positions, causal, keep, scale)


def _masked_chunks(
    q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block_size: int, query_positions: Tensor, causal: bool,
    keep: Tensor, scale: Optional[float],
) -> Tensor:
    """Chunks of queries against every key under the mask of their chosen blocks: matrix products over
    ``chunk x seq_kv`` logits, no gather (causally, each chunk reads the keys up to its last query).

    With gradients, each chunk is recomputed in the backward pass (activation checkpointing) instead of keeping
    its mask: the masks of all chunks together would hold O(N^2) values."""
    q_len, k_len = q.shape[2], k.shape[2]
    chunk = max(1, MASKED_LOGITS // k_len)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outputs = []
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        # Queries are the last q_len positions (bottom-right): keys after the chunk's last query are unseen.
        end = k_len - q_len + stop if causal else k_len
        inputs = (q[:, :, start:stop], k[:, :, :end], v[:, :, :end], blocks[:, :, start:stop], block_size,
                  keep[:, :end], query_positions[start:stop], causal, scale)
        if recompute:
            outputs.append(checkpoint(_masked_chunk, *inputs, use_reentrant=False))
        else:
            outputs.append(_masked_chunk(*inputs))
    return torch.cat(outputs, dim=2)


def _masked_chunk(
    q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, block_size: int, keep: Tensor, query_positions: Tensor,
    causal: bool, scale: Optional[float],
) -> Tensor:
    """One chunk of :func:`_masked_chunks`: queries (batch, heads, chunk, dim) over the keys (batch, heads, end,
    dim) of the blocks in ``chosen`` (batch, heads, chunk, S)."""
    key_positions = torch.arange(k.shape[2], device=q.device)
    every_block = torch.arange(-(-k.shape[2] // block_size), device=q.device)
    picked = (chosen.unsqueeze(-1) == every_block).any(-2)  # (batch, heads, chunk, n_blocks); -1 matches none
    allowed = picked[..., key_positions // block_size] & keep[:, None, None, :]
    if causal:
        allowed = allowed & (key_positions <= query_positions.view(-1, 1))
    return masked_sdpa(q, k, v, allowed, scale)


def _gathered_blocks(
    q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block_size: int, query_positions: Tensor, causal: bool,
    keep: Tensor, scale: Optional[float],
) -> Tensor:
    """Each query's chosen blocks gathered (one ``index_select`` per chunk of queries) and attended."""
    batch, heads, q_len, dim = q.shape
    k_len, width = k.shape[2], blocks.shape[3]
    n_blocks = -(-k_len // block_size)
    extra = n_blocks * block_size - k_len
    key_rows = F.pad(k, (0, 0, 0, extra)).reshape(batch * heads * n_blocks, block_size, dim)
    value_rows = F.pad(v, (0, 0, 0, extra)).reshape(batch * heads * n_blocks, block_size, v.shape[3])
    keep = F.pad(keep, (0, extra), value=False)  # (batch, n_blocks * block_size)
    row_base = (torch.arange(batch * heads, device=q.device) * n_blocks).view(batch, heads, 1, 1)
    in_block = torch.arange(block_size, device=q.device)
    batch_index = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    chunk = max(1, GATHERED_KEYS // (width * block_size))
    outputs = []
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        chosen = blocks[:, :, start:stop]
        used = chosen >= 0
        safe = chosen.clamp_min(0)
        rows = (row_base + safe).reshape(-1)
        size = stop - start
        keys = key_rows.index_select(0, rows).view(batch * heads, size, width * block_size, dim)
        values = value_rows.index_select(0, rows).view(batch * heads, size, width * block_size, v.shape[3])
        positions = (safe.unsqueeze(-1) * block_size + in_block).flatten(-2)  # (batch, heads, size, S * bs)
        allowed = used.repeat_interleave(block_size, dim=-1) & keep[batch_index, positions]
        if causal:
            allowed = allowed & (positions <= query_positions[start:stop].view(1, 1, -1, 1))
        queries = q[:, :, start:stop].reshape(batch * heads, size, 1, dim)
        allowed = allowed.reshape(batch * heads, size, 1, -1)
        outputs.append(masked_sdpa(queries, keys, values, allowed, scale).view(batch, heads, size, -1))
    return torch.cat(outputs, dim=2)

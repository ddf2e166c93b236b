"""Attention over key blocks chosen per query (data-dependent block sparsity, as NSA's selected branch): each
query row of each batch element and head lists the key blocks it reads, the blocks are gathered and one exact
softmax runs over them under an element mask (slot in use, causality by positions, key padding).

Unlike the fixed patterns of this package (one index table for every batch element and head, made once per
length), the table here is an input, ``(batch, heads, seq_q, blocks_per_query)``. The keys are cut into
blocks of ``block_size`` in natural order (the last padded), gathered by one ``index_select`` over the
flattened (batch, head, block) rows per chunk of queries, so memory stays O(chunk * blocks_per_query *
block_size * dim) whatever the length; nothing N x N is made."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..softmax import masked_sdpa

GATHERED_KEYS = 1 << 16
"""Keys gathered per (batch, head) in one chunk of queries: the chunk holds ``GATHERED_KEYS // (blocks per
query * block_size)`` queries (at least one)."""


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
    batch, heads, q_len, dim = q.shape
    k_len, width = k.shape[2], blocks.shape[3]
    n_blocks = -(-k_len // block_size)
    extra = n_blocks * block_size - k_len
    key_rows = F.pad(k, (0, 0, 0, extra)).reshape(batch * heads * n_blocks, block_size, dim)
    value_rows = F.pad(v, (0, 0, 0, extra)).reshape(batch * heads * n_blocks, block_size, v.shape[3])
    keep = torch.ones(batch, k_len, dtype=torch.bool, device=q.device) if key_padding_mask is None \
        else ~key_padding_mask
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

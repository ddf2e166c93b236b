"""The blockwise core of block-sparse attention: queries and keys gathered block by block from a
:class:`~.plan.BlockPlan`, one exact softmax over each query block's key blocks, parts merged into one
softmax, global query rows computed densely beside the blocks. Nothing N x N is made.

Grouped-query inputs (k, v with ``kv_heads`` dividing q's heads) are native: keys and values are gathered with
their own heads, and the query heads sharing a key/value head are stacked along the rows of one product
(:func:`grouped_sdpa`), so the repeated keys and values are never made."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._dtypes import working_dtype
from ..._validation import check_bool, check_key_padding_mask, check_number, check_qkv
from ..grouped import grouped_rows, ungrouped_rows
from ..masks import zero_padded
from ..softmax import masked_sdpa
from .layout import BlockLayout, BlockPattern
from .plan import BlockPlan, blocksparse_plan


def blocksparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Exact softmax attention restricted to a fixed sparsity ``pattern``, computed blockwise.

    Args:
        q: (batch, heads, seq, head_dim); k: (batch, kv_heads, seq, head_dim); v: (batch, kv_heads, seq,
            head_dim_v), ``kv_heads`` dividing ``heads`` (query head h reads key/value head ``h // (heads //
            kv_heads)``). Self-attention: one sequence.
        pattern: a :class:`BlockPattern`.
        causal: key j visible to query i only if j <= i.
        key_padding_mask: (batch, seq) bool, True marks padding.
        scale: logit scale (> 0), ``1/sqrt(head_dim)`` by default.

    Returns:
        (batch, heads, seq, head_dim_v); rows that may see no key are zeros. Memory O(N * blocks_per_row *
        block_size).
    """
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v, grouped=True)
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"pattern must be a BlockPattern, got {type(pattern).__name__}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"block-sparse patterns pair positions of one sequence: q seq={q.shape[2]} and "
                         f"k seq={k.shape[2]} must be equal")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    return blocksparse_attention_unchecked(q, k, v, pattern, causal, key_padding_mask, scale)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: Optional[float], *,
                 empty_rows: bool = True) -> Tensor:
    """Softmax attention of q (n, heads, rows, dim) over k, v (n, kv_heads, S, dim) under ``allowed`` (bool,
    (n or 1, 1, rows or 1, S), or None), the query heads of each key/value head stacked along the rows of one
    call: only the (small) mask is repeated, never k or v. ``empty_rows``: a row that may see no key outputs
    zeros (:func:`masked_sdpa`); False when every row sees one (plain SDPA). Returns (n, heads, rows, dim_v)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        q = grouped_rows(q, kv_heads)
        if allowed is not None and allowed.shape[2] != 1:
            allowed = allowed.repeat(1, 1, heads // kv_heads, 1)
    if empty_rows:
        out = masked_sdpa(q, k, v, allowed, scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out if heads == kv_heads else ungrouped_rows(out, heads)


def _gather_keys(x: Tensor, layout: BlockLayout, index: Tensor, shared: Optional[Tensor] = None) -> Tensor:
    """(batch * n_query_blocks, heads, S, dim): the key-sequence slots ``index`` (n_query_blocks, S) of ``x``
    (batch, heads, seq, dim), already zero-padded, where index ``seq`` stands for a zero row.

    ``shared``: (batch, heads, G, dim) rows appended to every query block's (S + G slots; e.g. longformer's
    global keys), in the same copy.

    Query blocks lead and heads follow so that the (per-block) mask broadcasts over the heads of a 4-D
    call, which lets ``scaled_dot_product_attention`` pick its fused kernels."""
    batch, heads, length, dim = x.shape
    n_query_blocks, width = index.shape
    bs = layout.block_size
    rows = x.transpose(1, 2)  # (batch, seq, heads, dim)
    if layout.band is not None:
        # A band of consecutive blocks in natural order: overlapping windows of a padded copy, no gather.
        before = -layout.band * bs
        total = (n_query_blocks - 1) * bs + width
        padded = F.pad(rows, (0, 0, 0, 0, before, total - before - length))
        blocks = padded.unfold(1, width, bs).permute(0, 1, 2, 4, 3)  # (batch, nqb, heads, width, dim), a view
    else:
        extended = F.pad(rows, (0, 0, 0, 0, 0, 1))
        blocks = extended.index_select(1, index.reshape(-1)).view(batch, n_query_blocks, width, heads, dim)
        blocks = blocks.transpose(2, 3)
    if shared is not None:
        extra = shared.unsqueeze(1).expand(batch, n_query_blocks, heads, shared.shape[2], dim)
        blocks = torch.cat([blocks, extra], dim=3)
    return blocks.reshape(batch * n_query_blocks, heads, -1, dim)


def _gather_queries(q: Tensor, plan: BlockPlan) -> Tensor:
    """(batch * n_query_blocks, heads, block_size, dim): the query slots of ``plan``."""
    batch, heads, length, dim = q.shape
    n_query_blocks, bs = plan.query_positions.shape
    rows = q.transpose(1, 2)  # (batch, seq, heads, dim)
    if plan.order is None:
        rows = F.pad(rows, (0, 0, 0, 0, 0, n_query_blocks * bs - length))
    else:
        slots = torch.where(plan.query_positions >= 0, plan.query_positions, length).reshape(-1)
        rows = F.pad(rows, (0, 0, 0, 0, 0, 1)).index_select(1, slots)
    blocks = rows.reshape(batch, n_query_blocks, bs, heads, dim).transpose(2, 3)
    return blocks.reshape(batch * n_query_blocks, heads, bs, dim)


def _gathered(q: Tensor, k0: Tensor, v0: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor]) -> tuple:
    """The query blocks, gathered key and value blocks of ``plan`` (keys and values already zero-padded) and
    the element mask, (batch * n_query_blocks, 1, block_size, S), key padding included."""
    batch = q.shape[0]
    n_query_blocks, bs = plan.query_positions.shape
    width = plan.index.shape[1]
    q_blocks = _gather_queries(q, plan)
    k_blocks = _gather_keys(k0, plan.layout, plan.index)
    v_blocks = _gather_keys(v0, plan.layout, plan.index)
    if key_padding_mask is None:
        allowed = plan.allowed.repeat(batch, 1, 1, 1) if batch > 1 else plan.allowed
    else:
        keep = ~F.pad(key_padding_mask, (0, 1), value=True)[:, plan.index]  # (batch, nqb, S)
        allowed = (plan.allowed.unsqueeze(0) & keep.view(batch, n_query_blocks, 1, 1, width))
        allowed = allowed.reshape(batch * n_query_blocks, 1, bs, width)
    return q_blocks, k_blocks, v_blocks, allowed


def _to_positions(x: Tensor, plan: BlockPlan, batch: int, heads: int, length: int) -> Tensor:
    """(batch * n_query_blocks, heads, block_size, d) per query slot -> (batch, heads, length, d) by position."""
    n_query_blocks, bs = plan.query_positions.shape
    x = x.reshape(batch, n_query_blocks, heads, bs, x.shape[-1]).transpose(1, 2)
    x = x.reshape(batch, heads, n_query_blocks * bs, x.shape[-1])
    return x[:, :, :length] if plan.order is None else x.index_select(2, plan.order)


def masked_block_logits(q: Tensor, k0: Tensor, v1: Tensor, plan: BlockPlan, allowed: Tensor,
                        sink_k: Optional[Tensor] = None, sink_v: Optional[Tensor] = None
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query block of ``plan``, in plain differentiable operations: (the queries (B * nqb, H, bs, d), their
    logits against the block's keys and the ``sink_k`` appended to every block, -inf where ``allowed`` is False,
    each row's largest logit (0 for a row that sees no key, whose weights ``exp(logits - top)`` are then 0), the
    values (with ``sink_v``) in the keys' order). q already scaled."""
    q_blocks = _gather_queries(q, plan)
    k_blocks = _gather_keys(k0, plan.layout, plan.index, sink_k)
    v_blocks = _gather_keys(v1, plan.layout, plan.index, sink_v)
    logits = (q_blocks @ k_blocks.transpose(-1, -2)).masked_fill(~allowed, -math.inf)
    top = logits.amax(-1, keepdim=True)
    return q_blocks, logits, torch.where(torch.isfinite(top), top, torch.zeros_like(top)), v_blocks


def _merged_parts(q: Tensor, k0: Tensor, v0: Tensor, parts: Tuple[BlockPlan, ...],
                  key_padding_mask: Optional[Tensor], scale: Optional[float]) -> Tensor:
    """One softmax over the union of disjoint parts: each part's unnormalised sums (exp(logit - its row
    max) against the values, and alone) by position, rescaled to a common max and divided once. A row no part
    lets see a key is zeros. The maxima are detached: they cancel, and only keep exp() in range."""
    batch, heads, length, dim = q.shape
    out_dtype, dtype = q.dtype, working_dtype(q.dtype)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q, k0, v0 = q.to(dtype), k0.to(dtype), v0.to(dtype)
    kv_heads = k0.shape[1]
    terms = []
    for plan in parts:
        q_blocks, k_blocks, v_blocks, allowed = _gathered(q, k0, v0, plan, key_padding_mask)
        # Grouped queries stacked along the rows: (n, kv_heads, groups * bs, S), shown per group to the mask.
        logits = grouped_rows(q_blocks, kv_heads) @ k_blocks.transpose(-1, -2) * scale
        logits = logits.unflatten(2, (heads // kv_heads, -1)).masked_fill(~allowed.unsqueeze(2), -math.inf)
        top = logits.detach().amax(-1, keepdim=True)  # -inf on a row that sees no key of this part
        weights = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))).flatten(2, 3)
        numerator = ungrouped_rows(weights @ v_blocks, heads)
        total = ungrouped_rows(weights.sum(-1, keepdim=True), heads)
        top = ungrouped_rows(top.flatten(2, 3), heads)
        terms.append(tuple(_to_positions(x, plan, batch, heads, length) for x in (numerator, total, top)))
    top = torch.stack([t[2] for t in terms]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    numerator, total = 0.0, 0.0
    for part_numerator, part_total, part_top in terms:
        factor = torch.exp(part_top - top)  # 0 for a part whose row is empty
        numerator = numerator + part_numerator * factor
        total = total + part_total * factor
    out = numerator / torch.where(total > 0, total, torch.ones_like(total))
    return out.to(out_dtype)


def blockwise_rows(q: Tensor, k0: Tensor, v0: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor],
                   scale: Optional[float]) -> Tensor:
    """The blocks of ``plan`` (its parts merged into one softmax), by position: (batch, heads, seq, dim_v).
    Keys and values already zero-padded; the dense rows of global queries are the caller's."""
    batch, heads, length, _ = q.shape
    if plan.parts:
        return _merged_parts(q, k0, v0, plan.parts, key_padding_mask, scale)
    q_blocks, k_blocks, v_blocks, allowed = _gathered(q, k0, v0, plan, key_padding_mask)
    # Without padding, when every row sees a key (fixed by the shapes, not by input values): plain SDPA.
    out = grouped_sdpa(q_blocks, k_blocks, v_blocks, allowed, scale,
                       empty_rows=key_padding_mask is not None or not plan.full_rows)  # (batch * nqb, heads, bs, dv)
    return _to_positions(out, plan, batch, heads, length)


def blocksparse_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float],
    plan: Optional[BlockPlan] = None,
) -> Tensor:
    """:func:`blocksparse_attention` for callers that validated the arguments (the mechanisms). ``plan``: a
    :func:`blocksparse_plan` of this pattern, length and causality to reuse; one with a ``dense`` mask runs as
    a dense masked softmax. None: a blockwise plan is made here."""
    batch, heads, length, _ = q.shape
    if plan is None:
        plan = blocksparse_plan(pattern, length, causal, q.device, dense_when_cheaper=False)

    k0, v0 = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    if plan.dense is not None:  # short sequence: one dense pass under the pattern's mask is faster
        allowed = plan.dense
        if key_padding_mask is not None:
            allowed = allowed & ~key_padding_mask.view(batch, 1, 1, length)
        return grouped_sdpa(q, k0, v0, allowed, scale)
    out = blockwise_rows(q, k0, v0, plan, key_padding_mask, scale)
    g = plan.layout.global_queries
    if g:
        # Global queries see every key: a dense (g x N) pass replaces their rows.
        device = q.device
        rows_allowed = torch.ones(g, length, dtype=torch.bool, device=device)
        if causal:
            rows_allowed = torch.arange(length, device=device)[None, :] <= torch.arange(g, device=device)[:, None]
        rows_allowed = rows_allowed.view(1, 1, g, length)
        if key_padding_mask is not None:
            rows_allowed = rows_allowed & ~key_padding_mask.view(batch, 1, 1, length)
        dense_rows = grouped_sdpa(q[:, :, :g], k0, v0, rows_allowed, scale)
        out = torch.cat([dense_rows, out[:, :, g:]], dim=2)
    return out

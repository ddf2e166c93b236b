"""Grouped-query attention: query heads sharing key/value heads, without repeating the keys and values.

With ``heads`` query heads and ``kv_heads`` key/value heads (``kv_heads`` dividing ``heads``), query head h
uses key/value head ``h // (heads // kv_heads)``, as in Llama; ``kv_heads=1`` is multi-query attention. The
query heads of one key/value head form a group of ``groups = heads // kv_heads`` consecutive heads.

An attention whose per-head maths reads keys and values only through that head's q, k, v runs grouped in one
of two ways, neither making a (batch, heads, seq_kv, dim) copy of the keys or values:

* :func:`grouped_rows`: the group's queries stacked along the sequence, ``(batch, kv_heads, groups * seq_q,
  dim)``, one call. Exact when every query row sees the same keys (no causal mask, or one query position).
* :func:`per_query_group`: one call per member of the group, each on ``(batch, kv_heads, seq_q, dim)`` strided
  views of the queries, the outputs stacked. Exact for any mask (causal included).

:func:`repeat_kv` makes the copy, for mechanisms that need keys and values per query head.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def query_groups(heads: int, kv_heads: int) -> int:
    """How many query heads share one key/value head (``kv_heads`` divides ``heads``: checked by callers)."""
    return heads // kv_heads


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * groups, seq, dim), head h holding ``x[:, h // groups]``
    (Llama's ``repeat_kv``): the explicit copy that grouped attention otherwise avoids."""
    return x if groups == 1 else torch.repeat_interleave(x, groups, dim=1)


def grouped_rows(q: Tensor, kv_heads: int) -> Tensor:
    """(batch, heads, seq_q, dim) -> (batch, kv_heads, groups * seq_q, dim): each key/value head's query heads
    stacked along the sequence (a view where q's layout allows, else a copy of q: never of k or v)."""
    batch, heads, q_len, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)


def ungrouped_rows(out: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`grouped_rows` on an output (batch, kv_heads, groups * seq_q, dim_v)."""
    batch, kv_heads, rows, dim = out.shape
    return out.reshape(batch, heads, rows * kv_heads // heads, dim)


def per_query_group(attend: Callable[[Tensor], Tensor], q: Tensor, kv_heads: int) -> Tensor:
    """``attend`` once per member of each query group, on the (batch, kv_heads, seq_q, dim) view of the queries
    that share key/value heads with it, the outputs (batch, kv_heads, seq_q, dim_v) stacked back into
    (batch, heads, seq_q, dim_v)."""
    batch, heads, q_len, _ = q.shape
    members = q.unflatten(1, (kv_heads, heads // kv_heads))
    outputs = [attend(members[:, :, g]) for g in range(members.shape[2])]
    return torch.stack(outputs, dim=2).flatten(1, 2)


def grouped_query_attention(attend: Callable[[Tensor, bool], Tensor], q: Tensor, kv_heads: int, causal: bool) -> Tensor:
    """Attention of queries q (batch, heads, seq_q, dim) on keys/values of ``kv_heads`` heads, where
    ``attend(queries, causal)`` computes it for queries of ``kv_heads`` heads: one call on the stacked rows
    where no causal mask tells the rows apart (:func:`grouped_rows`; a single query position sees every key
    under a bottom-right causal mask), else one call per group member (:func:`per_query_group`)."""
    heads, q_len = q.shape[1], q.shape[2]
    if not causal or q_len == 1:
        return ungrouped_rows(attend(grouped_rows(q, kv_heads), False), heads)
    return per_query_group(lambda member: attend(member, True), q, kv_heads)

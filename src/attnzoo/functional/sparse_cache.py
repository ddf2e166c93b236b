"""LoLA's sparse cache (McDermott et al. 2025, "LoLA: Low-Rank Linear Attention With Sparse Caching") for
sliding-window-plus-linear attention: keys leaving the window that the linear state would recall badly are kept
as exact keys in a cache of fixed size, the others join the linear state.

A linear state ``H = sum_j phi_k(k_j) [v_j, 1]^T`` answers a key ``k`` with ``v_hat = (phi_k(k)^T H)[:d] /
(phi_k(k)^T H)[d]``; the pair's self-recall error is ``||v - v_hat||`` (``||v||`` while ``phi_k(k)^T H`` has no
weight). A pair whose value the state already returns adds little to it; a pair it returns badly (a number said
once among thousands of filler tokens) is what a linear state cannot hold and what a long-context question
needs. Per head, at every position ``i`` the key ``j = i - w`` leaves the window (sinks aside) and becomes a
candidate beside the ``size`` cached keys: while the cache has room it is cached, else the candidate with the
smallest self-recall error against the current state (ties: the cached one in the lowest slot, then the new
key) moves into the state and the others stay. So a query ``i`` sees exactly its window, the sinks and the
cache ``C_i``, and linearly the keys beyond the window that are not cached. The attention, as the window's
terms ``f_h exp(s_ij - m_i)``, keeps ``m_i`` the largest logit of the window and the sinks: a cached key's term
is the exact one the linear term approximated (LoLA scores window and cache in one softmax without a
maximum).

Decisions are taken per position in reading order (the cache of position i depends on every earlier decision),
so the parallel form first runs them (:func:`sparse_cache_schedule`, one :func:`admit_leaving_` per position,
the same step decoding takes, so that a prefill and its steps decide as the whole sequence does), recording
when each key moves into the state; then the cached keys' exact terms are added and their linear terms taken out
per block of queries (:func:`sparse_cache_sums`). To keep the errors current without a product of every cached
key's features with the state at every position, each cached key keeps its recall ``phi_k(k)^T H`` and adds the
evicted key's share to it. Decisions are not differentiated (they are a choice of keys; the terms chosen are).

State tensors (batch, heads first): ``cache_k`` (size, head_dim) the window's keys as the logits take them,
``cache_v`` (size, head_dim_v), ``cache_phi`` (size, 2 feature_dim) their features, ``cache_recall`` (size,
head_dim_v + 1) their ``phi^T H``, ``cache_positions`` (size,) long, -1 for an empty slot.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .blocksparse import BlockPlan
from .blocksparse.core import _gather_queries, _to_positions, masked_block_logits

CACHE_TENSORS = ("cache_k", "cache_v", "cache_phi", "cache_recall", "cache_positions")


def sparse_cache_layout(heads: int, size: int, head_dim: int, value_width: int, features: int,
                        dtype: torch.dtype, working: torch.dtype) -> dict:
    """The cache's state tensors: name -> (shape after the batch dim, dtype); ``features`` = 2 * feature_dim."""
    return {
        "cache_k": ((heads, size, head_dim), dtype),
        "cache_v": ((heads, size, value_width), dtype),
        "cache_phi": ((heads, size, features), working),
        "cache_recall": ((heads, size, value_width + 1), working),
        "cache_positions": ((heads, size), torch.long),
    }


def empty_sparse_cache(batch: int, heads: int, size: int, k: Tensor, v: Tensor, features: int,
                       working: torch.dtype) -> Dict[str, Tensor]:
    """An empty cache for keys like ``k`` (..., head_dim) and values like ``v`` (..., head_dim_v)."""
    return {
        "cache_k": k.new_zeros(batch, heads, size, k.shape[-1]),
        "cache_v": v.new_zeros(batch, heads, size, v.shape[-1]),
        "cache_phi": k.new_zeros(batch, heads, size, features, dtype=working),
        "cache_recall": k.new_zeros(batch, heads, size, v.shape[-1] + 1, dtype=working),
        "cache_positions": torch.full((batch, heads, size), -1, dtype=torch.long, device=k.device),
    }


def recall_errors(values: Tensor, recall: Tensor) -> Tensor:
    """``||v - recall[:d] / recall[d]||`` per row (values (..., n, d), recall (..., n, d + 1)); the recalled
    value is zero where ``recall[d]`` is: a state with no weight on a key (every feature product zero, features
    being positive) has a zero numerator too, so the weight is only kept off zero."""
    weight = recall[..., -1:].clamp_min(torch.finfo(recall.dtype).tiny)
    return torch.linalg.vector_norm(values - recall[..., :-1] / weight, dim=-1)


def admit_leaving_(kv: Tensor, cache: Dict[str, Tensor], k: Tensor, v: Tensor, phi: Tensor, position: int,
                   time: int, window: int, decay: Optional[Tensor], padded: Optional[Tensor] = None) -> Tensor:
    """The key at ``position`` leaving the window at position ``time`` (= position + window): cached, or the
    candidate recalled best moved into the linear state ``kv`` (batch, heads, 2 m, d_v + 1), already aged to
    ``time``. ``kv`` and the ``cache`` tensors are updated in place (a caller that keeps the previous ones
    passes copies). ``k`` (batch, heads, 1, head_dim) as the logits take it, ``v`` (batch, heads, 1, d_v), both
    in the cache's dtype, ``phi`` (batch, heads, 1, 2 m) its features in kv's; ``decay`` (1, heads, 1, 1) or
    None: a key moving into the state at ``time`` enters with weight ``decay^(time - window - its position)``;
    ``padded`` (batch,) bool or None: the key is padding (it moves into the state, its features and value being
    zero, and never takes a slot). Returns the position moved into the state, (batch, heads) long (-1 for an
    empty slot).

    In place, because a copy of the cache per position would cost more than the decision: the errors are
    those of the slots and of the newcomer side by side, the one moved out is read back as one row, and the
    newcomer is written into its slot (or nowhere, when it is the one moved out)."""
    dtype, size = kv.dtype, cache["cache_positions"].shape[-1]
    recall = cache["cache_recall"]
    if decay is not None:
        recall.mul_(decay)
    new_recall = phi @ kv  # (batch, heads, 1, d_v + 1)
    errors = torch.cat([recall_errors(cache["cache_v"].to(dtype), recall).masked_fill(cache["cache_positions"] < 0,
                                                                                      -1.0),  # empty slots first
                        recall_errors(v.to(dtype), new_recall)], -1)
    if padded is not None:
        errors[..., -1] = torch.where(padded.view(-1, 1), -2.0, errors[..., -1])
    out = errors.argmin(-1, keepdim=True)  # (batch, heads, 1); size: the newcomer
    newcomer = out == size
    slot = out.clamp_max(size - 1)

    def row(name: str, own: Tensor) -> Tensor:  # the candidate moved out: a slot's row or the newcomer's
        stored = cache[name].gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, own.shape[-1]))
        return torch.where(newcomer.unsqueeze(-1), own, stored)

    gone_phi = row("cache_phi", phi)
    gone_v1 = F.pad(row("cache_v", v).to(dtype), (0, 1), value=1.0)
    gone = torch.where(newcomer, position, cache["cache_positions"].gather(2, slot))  # (batch, heads, 1)
    weight = (gone >= 0).to(dtype).unsqueeze(-1)  # an empty slot's ones column adds nothing either
    if decay is not None:
        weight = weight * decay ** (time - window - gone).clamp_min(0).unsqueeze(-1).to(dtype)
    gone_v1 = gone_v1 * weight
    kv.addcmul_(gone_phi.transpose(-1, -2), gone_v1)  # an outer product: broadcast, not a matmul of a column
    recall.addcmul_(cache["cache_phi"] @ gone_phi.transpose(-1, -2), gone_v1)
    new_recall = new_recall.addcmul_((phi * gone_phi).sum(-1, keepdim=True), gone_v1)
    for name, own in (("cache_k", k), ("cache_v", v), ("cache_phi", phi), ("cache_recall", new_recall),
                      ("cache_positions", torch.full_like(gone, position))):
        index = slot if own.dim() == 3 else slot.unsqueeze(-1).expand(-1, -1, -1, own.shape[-1])
        kept = cache[name].gather(2, index)
        cache[name].scatter_(2, index, torch.where(newcomer if own.dim() == 3 else newcomer.unsqueeze(-1), kept,
                                                   own.to(cache[name].dtype)))
    return gone.squeeze(-1)


@torch.no_grad()
def sparse_cache_schedule(k: Tensor, v: Tensor, phi_k: Tensor, window: int, sinks: int, size: int,
                          decay: Optional[Tensor], key_padding_mask: Optional[Tensor],
                          snapshot_at: Sequence[int] = (),
                          ) -> Tuple[Tensor, Tensor, Dict[str, Tensor], Tensor]:
    """The cache's decisions over a whole sequence: k (batch, heads, seq, head_dim) as the logits take them, v
    (batch, heads, seq, d_v), phi_k (batch, heads, seq, 2 m) the keys' features (zero where padded), all
    zero-padded; ``decay`` (1, heads, 1, 1) or None. Returns ``moved`` (batch, heads, seq) long: the position
    at which each key moved into the linear state (``seq`` for a key still cached at the end, or never
    beyond the window; a key in ``j + window <= i < moved_j`` is cached for query i), the linear state after the
    sequence (batch, heads, 2 m, d_v + 1), the cache after it, and the cache's positions as query ``t`` reads
    them for each ``t`` of ``snapshot_at`` (batch, heads, len(snapshot_at), size), -1 in empty slots."""
    batch, heads, length, _ = k.shape
    dtype = phi_k.dtype
    kv = phi_k.new_zeros(batch, heads, phi_k.shape[-1], v.shape[-1] + 1)
    cache = empty_sparse_cache(batch, heads, size, k, v, phi_k.shape[-1], dtype)
    moved = torch.full((batch, heads, length), length, dtype=torch.long, device=k.device)
    snapshots = cache["cache_positions"].unsqueeze(2).repeat(1, 1, len(snapshot_at), 1)  # empty until taken
    taken_at = {t: n for n, t in enumerate(snapshot_at) if t >= window + sinks}
    for time in range(window + sinks, length):
        position = time - window
        if decay is not None:
            kv.mul_(decay)
        padded = None if key_padding_mask is None else key_padding_mask[:, position]
        gone = admit_leaving_(kv, cache, k[:, :, position:position + 1], v[:, :, position:position + 1],
                              phi_k[:, :, position:position + 1], position, time, window, decay, padded)
        at = gone.clamp_min(0).unsqueeze(-1)  # an empty slot (-1) writes position 0's entry back unchanged
        moved.scatter_(2, at, torch.where(gone.unsqueeze(-1) >= 0, time, moved.gather(2, at)))
        if time in taken_at:
            snapshots[:, :, taken_at[time]] = cache["cache_positions"]
    return moved, kv, cache, snapshots


def _first_queries(plan: BlockPlan) -> Tensor:
    """The first query position of each query block of ``plan``, (n_query_blocks,)."""
    queries = plan.query_positions  # -1 marks a padding slot
    return torch.where(queries >= 0, queries, plan.length).amin(-1)


def block_starts(plan: BlockPlan) -> List[int]:
    """The first query position of each query block of ``plan``: where :func:`sparse_cache_schedule` takes the
    snapshots :func:`sparse_cache_sums` reads."""
    return _first_queries(plan).tolist()


def _cached_index(moved: Tensor, snapshots: Tensor, plan: BlockPlan, window: int, sinks: int,
                  key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Per query block, the keys cached for any of its queries: ``index`` (batch, heads, n_query_blocks, E)
    into the sequence and whether each entry is one (same shape), E = size + block_size - 1: the cache its first
    query reads (the snapshot) and the keys leaving the window during the block. Linear in the length: no
    block looks at the whole sequence."""
    batch, heads, _ = moved.shape
    queries = plan.query_positions  # (nqb, bs), -1 padding slots
    first, last = _first_queries(plan), queries.amax(-1)
    entering = first.view(-1, 1) + 1 - window + torch.arange(queries.shape[1] - 1, device=moved.device)
    entering = torch.where(entering + window <= last.view(-1, 1), entering, -1)  # (nqb, bs - 1)
    index = torch.cat([snapshots, entering.expand(batch, heads, -1, -1)], -1)
    valid = index >= sinks
    if key_padding_mask is not None:
        valid = valid & ~key_padding_mask.gather(1, index.clamp_min(0).flatten(1)).view_as(index)
    return index.clamp_min(0), valid


def _blocks_of(x: Tensor, index: Tensor) -> Tensor:
    """x (batch, heads, seq, c) at ``index`` (batch, heads, nqb, E), as (batch * nqb, heads, E, c)."""
    batch, heads, nqb, width = index.shape
    picked = x.gather(2, index.reshape(batch, heads, -1, 1).expand(-1, -1, -1, x.shape[-1]))
    return picked.view(batch, heads, nqb, width, -1).transpose(1, 2).reshape(batch * nqb, heads, width, -1)


def sparse_cache_sums(q: Tensor, k0: Tensor, v1: Tensor, phi_q: Tensor, phi_k: Tensor, moved: Tensor,
                      snapshots: Tensor, plan: BlockPlan, allowed: Tensor, sink_k: Optional[Tensor],
                      sink_v: Optional[Tensor], window: int, sinks: int, log_decay: Optional[Tensor],
                      key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The window's and the cache's exact sums and the cached keys' linear terms, by position: ``(sum over
    the window, sinks and C_i of exp(s_ij - m_i) [v_j, 1], sum over C_i of w_ij phi_q(q_i) . phi_k(k_j) [v_j,
    1])`` (batch, heads, seq, d_v + 1) each, ``m_i`` the largest logit of the window and sinks, ``w_ij`` the
    decay's ``lambda_h^(i - w - j)`` (1 without). q (already scaled), k0, v1 (with its ones column) as the
    window takes them; ``moved`` and ``snapshots`` (taken at :func:`block_starts`) from
    :func:`sparse_cache_schedule`; ``allowed`` the window's element mask (with the sinks' columns). In plain
    differentiable operations: the blockwise window of the mechanism without a cache, plus E cache columns per
    query block (:func:`_cached_index`)."""
    batch, heads, length, _ = q.shape
    index, valid = _cached_index(moved, snapshots, plan, window, sinks, key_padding_mask)
    q_blocks, logits, top, v_blocks = masked_block_logits(q, k0, v1, plan, allowed, sink_k, sink_v)
    exact = torch.exp(logits - top) @ v_blocks  # the window's and sinks' terms; q_blocks (batch * nqb, heads, bs, d)
    query_pos = plan.query_positions  # (nqb, bs)
    key_pos = index.unsqueeze(-2)  # (batch, heads, nqb, 1, E)
    cached = valid.unsqueeze(-2) & (key_pos + window <= query_pos.view(1, 1, *query_pos.shape, 1)) & (
        query_pos.view(1, 1, *query_pos.shape, 1) < moved.gather(2, index.flatten(2)).view_as(index).unsqueeze(-2))
    cached = cached.transpose(1, 2).reshape(batch * index.shape[2], heads, query_pos.shape[1], -1)
    cache_k, cache_v1 = _blocks_of(k0, index), _blocks_of(v1, index)
    cache_logits = (q_blocks @ cache_k.transpose(-1, -2)).masked_fill(~cached, -math.inf)
    exact = exact + torch.exp(cache_logits - top) @ cache_v1
    kernel = (_gather_queries(phi_q, plan) @ _blocks_of(phi_k, index).transpose(-1, -2)).masked_fill(~cached, 0.0)
    if log_decay is not None:
        age = (query_pos.view(1, 1, *query_pos.shape, 1) - window - key_pos).clamp_min(0)
        age = age.transpose(1, 2).reshape(batch * index.shape[2], heads, query_pos.shape[1], -1)
        kernel = kernel * torch.exp(log_decay.view(1, -1, 1, 1) * age.to(kernel.dtype))
    linear = kernel @ cache_v1
    return _to_positions(exact, plan, batch, heads, length), _to_positions(linear, plan, batch, heads, length)


# -- float64 reference ---------------------------------------------------------------------------------------
def sparse_cache_members_reference(k: Tensor, v: Tensor, phi_k: Tensor, window: int, sinks: int, size: int,
                                   log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor]) -> Tensor:
    """The cached keys of every query, (batch, heads, seq, seq) bool (query i, key j), written from the
    definition: a plain simulation per sequence and head that keeps the cache as a list of positions and forms
    the linear state anew from the keys moved into it at every position (float64; small sizes)."""
    batch, heads, length, _ = k.shape
    k, v, phi_k = k.detach().double(), v.detach().double(), phi_k.detach().double()
    members = torch.zeros(batch, heads, length, length, dtype=torch.bool, device=k.device)
    for b in range(batch):
        for h in range(heads):
            cached: List[int] = []
            moved: List[int] = []
            for time in range(window + sinks, length):
                new = time - window
                if key_padding_mask is None or not bool(key_padding_mask[b, new]):
                    if len(cached) < size:
                        cached.append(new)
                    else:
                        cached.append(new)
                        state = sum((_decayed(phi_k[b, h, j], v[b, h, j], time - window - j, log_decay, h)
                                     for j in moved), torch.zeros(phi_k.shape[-1], v.shape[-1] + 1,
                                                                  dtype=torch.float64, device=k.device))
                        errors = [float(recall_errors(v[b, h, j], phi_k[b, h, j] @ state)) for j in cached]
                        moved.append(cached.pop(min(range(len(cached)), key=lambda n: errors[n])))
                members[b, h, time, cached] = True
    return members


def _decayed(phi: Tensor, value: Tensor, age: int, log_decay: Optional[Tensor], head: int) -> Tensor:
    term = torch.outer(phi, F.pad(value, (0, 1), value=1.0))
    return term if log_decay is None else term * math.exp(float(log_decay[head].detach()) * age)

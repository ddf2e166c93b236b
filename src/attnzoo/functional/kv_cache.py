"""The growing KV cache of exact decoding (softmax, forgetting, differential): every key and value seen so far,
with room preallocated for more, so that a step writes one position instead of copying the cache.

A cache is a dict of tensors (batch, heads, capacity, ...) of which the first ``length`` positions are in use
(``length`` is the decoding state's), plus ``filled`` (batch,) long: how far the shared buffers have been
written. Beside ``k`` and ``v`` a mechanism may keep more per-position entries in the same cache (forgetting's
cumulative log gate, of its own heads and dtype); they are grown and copied alike.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

CACHE_BLOCK = 256
"""A cache grows in whole blocks of this many positions (and at least doubles), so decoding T tokens copies it
O(log T) times instead of once per token."""


def kv_cache_layout(kv_heads: int, head_dim: int, dtype: torch.dtype, value_width: Optional[int] = None) -> dict:
    """The ``k``, ``v`` and ``filled`` tensors of a cache: name -> (shape after the batch dim, None for the
    capacity; dtype), as a mechanism's ``state_layout`` declares them; ``v`` has ``value_width`` channels
    (``head_dim`` when None)."""
    return {
        "k": ((kv_heads, None, head_dim), dtype),
        "v": ((kv_heads, None, head_dim if value_width is None else value_width), dtype),
        "filled": ((), torch.long),
    }


def cache_capacity(needed: int, current: int = 0) -> int:
    """Room for ``needed`` positions: at least double ``current``, rounded up to whole blocks."""
    wanted = max(needed, 2 * current)
    return -(-wanted // CACHE_BLOCK) * CACHE_BLOCK


def new_cache(entries: Dict[str, Tensor], capacity: int) -> Dict[str, Tensor]:
    """A cache of ``capacity`` positions holding ``entries`` (batch, heads, t, ...) at its start, and
    ``filled`` (batch,): how far the shared buffers have been written."""
    cache = {}
    for name, x in entries.items():
        buffer = x.new_empty(x.shape[0], x.shape[1], capacity, *x.shape[3:])
        buffer[:, :, : x.shape[2]] = x
        cache[name] = buffer
    batch, _, length = x.shape[:3]
    cache["filled"] = torch.full((batch,), length, dtype=torch.long, device=x.device)
    return cache


def prefilled_cache(entries: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The cache after a prompt: ``entries`` (batch, heads, prompt, ...), with room for at least one step."""
    length = next(iter(entries.values())).shape[2]
    return new_cache(entries, cache_capacity(length + 1))


def cache_append(tensors: Optional[Dict[str, Tensor]], entries: Dict[str, Tensor], length: int) -> Dict[str, Tensor]:
    """``tensors`` (a cache of :func:`new_cache` holding ``length`` positions, or None) with one position
    more, ``entries`` (batch, heads, 1, ...) written into its free room. A cache that another state sharing its
    buffers has written past ``length`` (stepping twice from one state, to branch) is copied first, so every
    state stays valid however it is reused; a full one grows by :func:`cache_capacity`."""
    if tensors is None:
        return new_cache(entries, cache_capacity(1))
    cache = tensors
    capacity = next(x for name, x in cache.items() if name != "filled").shape[2]
    shared_ahead = int(cache["filled"][0]) != length
    if shared_ahead or length == capacity:
        grown = cache_capacity(length + 1, capacity if length == capacity else 0)
        kept = {name: x[:, :, :length] for name, x in cache.items() if name != "filled"}
        cache = new_cache(kept, max(grown, capacity))
    for name, x in entries.items():
        cache[name][:, :, length] = x[:, :, 0]
    cache["filled"].fill_(length + 1)
    return cache

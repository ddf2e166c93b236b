"""What mechanisms and their callers make before a call: a seeded generator for an option's random buffers, and
shape-only inputs for asking a mechanism about a call (both importable from :mod:`.base`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_number


def seeded_generator(seed: Optional[int]) -> Optional[torch.Generator]:
    """For a mechanism's ``seed`` option (an int >= 0, checked here): a generator seeded with it, or None to draw
    from the global RNG. Mechanisms draw their random buffers from it at construction, never in a forward."""
    seed = check_number("seed", seed, integer=True, minimum=0, optional=True)
    return None if seed is None else torch.Generator().manual_seed(seed)


def shapes_only(
    batch: int, heads: int, q_len: int, k_len: int, head_dim: int, dtype: torch.dtype = torch.float32, *,
    kv_heads: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v of the given shapes on the ``meta`` device: no memory, no data. For asking
    :meth:`Mechanism.unsupported_reasons` about a call before making its inputs. k and v have ``kv_heads``
    heads (``heads`` when None)."""
    kv_heads = heads if kv_heads is None else kv_heads
    make = lambda n, length: torch.empty(batch, n, length, head_dim, dtype=dtype, device="meta")  # noqa: E731
    return make(heads, q_len), make(kv_heads, k_len), make(kv_heads, k_len)

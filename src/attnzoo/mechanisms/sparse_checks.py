"""Checks shared by the fixed sparse patterns (:mod:`.sparse`, :mod:`.longformer`): a packed call, whose
``max_length`` binds each document, and the ``block_size`` option."""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch import Tensor

from .._validation import check_bool, check_number
from .base import Mechanism


def check_packed_call(mechanism: Mechanism, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      key_padding_mask: Optional[Tensor], cross: bool, cu_seqlens: object) -> List[Tuple[int, int]]:
    """Check a packed call (errors name the argument, before any computation) and return its documents'
    (start, end). As :meth:`Mechanism.forward` checks it, except that ``max_length`` binds each document, not
    the row: a pattern runs on each document alone, counting its positions from the document's start."""
    check_bool("causal", causal)
    check_bool("cross", cross)
    mechanism.check_grouping(q, k, v, refuse=False)
    if k.shape[2] != q.shape[2] or cross:  # refused there, naming what
        mechanism.check_inputs(q, k, v, causal, key_padding_mask, cross)
    spans = mechanism.check_packing(q, key_padding_mask, cross, cu_seqlens)
    longest = max(end - start for start, end in spans)
    mechanism.check_inputs(q[:, :, :longest], k[:, :, :longest], v[:, :, :longest], causal, None, cross)
    return spans


def check_block_size(block_size: Optional[int]) -> Optional[int]:
    """The ``block_size`` option of the fixed patterns: an int >= 1, or None for the default."""
    return check_number("block_size", block_size, integer=True, minimum=1, optional=True)

"""The dense float64 reference of block-sparse attention, on each pattern's (N, N) mask."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..._validation import check_bool, check_positive_int
from ..softmax import masked_softmax_reference
from .layout import BlockPattern


def pattern_dense_mask(pattern: BlockPattern, length: int, causal: bool = False,
                       device: Optional[torch.device] = None) -> Tensor:
    """The (length, length) bool mask of ``pattern`` (True: query i may attend to key j), with causality if
    asked. Quadratic: for tests and the reference."""
    check_positive_int("length", length)
    check_bool("causal", causal)
    allowed = pattern.dense(length, device)
    if causal:
        i = torch.arange(length, device=device)
        allowed = allowed & (i[None, :] <= i[:, None])
    return allowed


def blocksparse_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Dense float64 softmax under the pattern's (N, N) boolean mask: obviously correct and quadratic, for
    tests. Same arguments as :func:`blocksparse_attention`; returns float64."""
    length = q.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    if key_padding_mask is not None:
        k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    allowed = pattern_dense_mask(pattern, length, causal, q.device).view(1, 1, length, length)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.view(-1, 1, 1, length)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    return masked_softmax_reference(logits, allowed) @ v

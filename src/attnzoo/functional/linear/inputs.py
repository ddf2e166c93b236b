"""Inputs of every form of kernelized attention, made ready: cast to the working dtype, padded keys zeroed,
the values given the column of ones whose sums are the normaliser, sequences padded to whole chunks."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _masked_keys(
    phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """Cast, and zero padded keys (features and values, so that neither an infinite feature nor an infinite
    padded value can turn into NaN). Copies nothing that needs no change: in float32 without padding the
    causal path keeps the caller's v instead of a copy."""
    phi_k, v = phi_k.to(dtype), v.to(dtype)
    if key_padding_mask is not None:
        padded = key_padding_mask[:, None, :, None]
        phi_k = phi_k.masked_fill(padded, 0.0)
        v = v.masked_fill(padded, 0.0)
    return phi_k, v


def _with_ones(v: Tensor) -> Tensor:
    """(..., d) -> (..., d + 1): the values with the ones column that carries the normaliser."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _prepare_keys(
    phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """:func:`_masked_keys`, with the ones column appended to v: (phi_k, (..., d_v + 1)). The ones column is
    zero at padded keys too, so that it counts the unpadded keys (:mod:`attnzoo.functional.shrinkage`
    averages the values with it)."""
    phi_k, v = _masked_keys(phi_k, v, key_padding_mask, dtype)
    v1 = _with_ones(v)
    if key_padding_mask is not None:
        v1[..., -1:].masked_fill_(key_padding_mask[:, None, :, None], 0.0)
    return phi_k, v1


def _pad_seq(x: Tensor, pad: int, dim_from_end: int) -> Tensor:
    return F.pad(x, (0, 0) * (dim_from_end - 1) + (0, pad)) if pad else x


def _masked_log_decay(
    log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Optional[Tensor]:
    if log_decay is None:
        return None
    log_decay = log_decay.to(dtype)
    if key_padding_mask is not None:
        log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
    return log_decay

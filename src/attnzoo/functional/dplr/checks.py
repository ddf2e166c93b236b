"""Argument checks and input preparation shared by every form of the DPLR delta rule
(:mod:`attnzoo.functional.dplr`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..._dtypes import working_dtype
from ..._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int, check_qkv
from ..delta.checks import check_state, resolve_scale

VECTORS = ("a", "b", "log_decay")
"""The per-position, per-key-channel inputs besides q, k, v, in the order every form takes them."""


def check_vectors(k: Tensor, a: Tensor, b: Tensor, log_decay: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    """``a``, ``b`` and ``log_decay`` shaped (batch, heads, seq, d_k) like the keys, on their device, finite,
    and ``log_decay <= 0`` (a decay ``exp(log_decay)`` in (0, 1] per channel), at every position the padding
    mask keeps (a padded position may hold anything, NaN included)."""
    for name, x in zip(VECTORS, (a, b, log_decay)):
        check_floating(name, x)
        if x.shape != k.shape:
            raise ValueError(f"{name} must have the keys' shape (batch, heads, seq, d_k) = {tuple(k.shape)}, "
                             f"got {tuple(x.shape)}")
        if x.device != k.device:
            raise ValueError(f"{name} must be on {k.device} with the keys, got {x.device}")
        kept = x if key_padding_mask is None else x.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        if not bool(torch.isfinite(kept).all()):
            raise ValueError(f"{name} must be finite at every unpadded position (it holds NaN or inf)")
        if name == "log_decay" and bool((kept > 0).any()):
            raise ValueError("log_decay must be <= 0 (a decay exp(log_decay) in (0, 1] per channel), "
                             "got a positive value")


def check_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    key_padding_mask: Optional[Tensor],
    initial_state: Optional[Tensor],
    causal: bool,
    scale: Optional[float],
) -> None:
    """Every check of a self-attention call of the DPLR delta rule (queries and keys from one sequence)."""
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share the sequence length (the DPLR delta rule is self-attention), got "
                         f"{q.shape[2]} and {k.shape[2]}")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_vectors(k, a, b, log_decay, key_padding_mask)
    check_state("initial_state", initial_state, k, v)
    check_bool("causal", causal)
    resolve_scale(scale, q.shape[3])


def prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    key_padding_mask: Optional[Tensor],
    scale: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cast to the working dtype, scale the queries, and make padded positions inert whatever they hold: their
    q, k, v, a and b zeroed (they write nothing, and their own output is 0), their log decay zeroed (they do
    not decay the state). ``masked_fill``, not a product, so that a NaN or inf there cannot leak."""
    dtype = working_dtype(q.dtype)
    q, k, v, a, b, log_decay = (x.to(dtype) for x in (q, k, v, a, b, log_decay))
    q = q * scale
    if key_padding_mask is not None:
        padded = key_padding_mask[:, None, :, None]
        q, k, v, a, b, log_decay = (x.masked_fill(padded, 0.0) for x in (q, k, v, a, b, log_decay))
    return q, k, v, a, b, log_decay


def check_chunk_size(chunk_size: int) -> int:
    """A positive power of two: the chunked form halves each chunk level by level (:mod:`.chunk`)."""
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two (1, 2, 4, ..., 32, 64, ...), got {chunk_size}")
    return chunk_size


__all__ = ["check_call", "check_chunk_size", "check_vectors", "prepared", "resolve_scale"]

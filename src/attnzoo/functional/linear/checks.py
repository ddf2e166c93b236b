"""Argument checks shared by every form of kernelized attention (:mod:`attnzoo.functional.linear`)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..._validation import check_floating, check_positive_int
from .normalize import NORMALIZERS


def _check_features(phi_q: Tensor, phi_k: Tensor, v: Tensor) -> None:
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, dim), got {tuple(x.shape)}")
    if phi_q.shape[:2] != phi_k.shape[:2] or phi_k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"phi_q, phi_k and v must share (batch, heads), got {tuple(phi_q.shape[:2])}, {tuple(phi_k.shape[:2])}, "
            f"{tuple(v.shape[:2])}"
        )
    if phi_q.shape[3] != phi_k.shape[3]:
        raise ValueError(
            f"phi_q and phi_k must have the same number of features, got {phi_q.shape[3]} and {phi_k.shape[3]}"
        )
    if phi_k.shape[2] != v.shape[2]:
        raise ValueError(f"phi_k and v must share the sequence length, got {phi_k.shape[2]} and {v.shape[2]}")
    if phi_q.shape[2] == 0 or phi_k.shape[2] == 0:
        raise ValueError("sequence lengths must be at least 1")


def _check_options(normalizer: str, chunk_size: int, denominator_eps: float) -> None:
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r}")
    check_positive_int("chunk_size", chunk_size)
    if not denominator_eps >= 0.0:
        raise ValueError(f"denominator_eps must be >= 0, got {denominator_eps!r}")


def _check_log_decay(log_decay: Optional[Tensor], batch: int, heads: int, seq: int, name: str = "log_decay") -> None:
    if log_decay is None:
        return
    check_floating(name, log_decay)
    if log_decay.shape != (batch, heads, seq):
        raise ValueError(
            f"{name} must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}), got {tuple(log_decay.shape)}"
        )

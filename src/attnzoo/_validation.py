"""Input checks shared by the functional cores and the modules.

Every check raises a ``ValueError`` (or ``TypeError`` for dtypes) whose message names the argument and
what was expected, so that bad input never turns into silent broadcasting or a NaN further down.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_floating(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Check q, k, v of shape (batch, heads, seq, head_dim) for rank, matching sizes, dtype and device.

    Keys and values may have a sequence length different from the queries (cross-attention) and a value
    head dim different from the query/key head dim.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {x.dim()} dims: {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k and v must share the number of heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share head_dim, got q head_dim={q.shape[3]} and k head_dim={k.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share the sequence length, got k seq={k.shape[2]} and v seq={v.shape[2]}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be at least 1, got q seq={q.shape[2]}, k seq={k.shape[2]}")


def check_key_padding_mask(mask: Optional[Tensor], batch: int, kv_len: int, device: torch.device) -> None:
    """A key padding mask is a bool tensor (batch, kv_len); True marks a padded key that is ignored."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}")
    if mask.shape != (batch, kv_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_kv) = ({batch}, {kv_len}), got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, got {mask.device}")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value

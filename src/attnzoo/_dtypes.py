"""The dtype sums run in: float32 for half-precision inputs (half-precision sums over long sequences
overflow or lose their small terms), the input's own dtype for float32 and float64."""

from __future__ import annotations

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

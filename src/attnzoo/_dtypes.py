"""The dtype features and sums are computed in: float32 for half-precision inputs (exp() of half-precision
logits overflows, and half-precision sums over long sequences lose their small terms), the input's own dtype
for float32 and float64. One helper for the functional cores, the feature maps and the mechanisms."""

from __future__ import annotations

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

"""``exp`` of log decays without the slow subnormal path.

A CPU computes ``exp`` into the subnormal range (below the dtype's smallest normal number, e^-87.3 in float32,
e^-708 in float64), and of ``-inf``, many times slower than into the normal range: on the development machine
``exp`` of a million float32 numbers spread over [-250, 0] took 9.2 ms against 0.64 ms over [-10, 0]. Log decays
reach those values whenever a head forgets fast (a cumulative log decay of -250 within a chunk is common at the
initial gates of ``gated_delta`` and ``kda``), so the chunked rules raise every exponent to a floor first: half a
unit above the log of the smallest normal number (one clamp, 0.1 ms for those million numbers). A decay factor
that would have been below about 1.6 times the smallest normal number (1.9e-38 in float32, 3.7e-308 in float64)
is that number instead, an absolute change far below the resolution of any sum it enters.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def exp_floor(dtype: torch.dtype) -> float:
    """The floor :func:`exp_nonpositive` raises exponents to: half a unit above log of the smallest normal."""
    return math.log(torch.finfo(dtype).tiny) + 0.5


def exp_nonpositive(x: Tensor) -> Tensor:
    """``exp(x)`` for exponents x <= 0 (log decays and their differences), each raised to :func:`exp_floor` of
    its dtype first (module docstring); a new tensor."""
    return x.clamp(min=exp_floor(x.dtype)).exp_()


def exp_nonpositive_(x: Tensor) -> Tensor:
    """:func:`exp_nonpositive` in place, for an x the caller owns."""
    return x.clamp_(min=exp_floor(x.dtype)).exp_()


__all__ = ["exp_floor", "exp_nonpositive", "exp_nonpositive_"]

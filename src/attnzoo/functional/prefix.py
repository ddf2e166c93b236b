"""Prefix sums over blocks (dimension 2 of (batch, heads, blocks, ...)), lagged: block g gets the sum of the
blocks up to g - lag. The causal caches of chunked attentions (the codeword cache of ``vq``, the chunk states of
FLASH) are such sums.

The fast form writes running sums in place into one buffer, block by block, forward and backward: ``cumsum``
along a middle dimension, or a loop of out-of-place additions under autograd, costs several times more on CPU.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def lagged_prefix_sums_reference(per_block: Tensor, lag: int) -> Tensor:
    """:func:`lagged_prefix_sums` written out with ``cumsum``: block g gets the sum of blocks 0 .. g - lag."""
    cumulative = per_block.cumsum(dim=2)
    return F.pad(cumulative, [0, 0] * (per_block.dim() - 3) + [lag, 0])[:, :, : per_block.shape[2]]


def lagged_prefix_sums(per_block: Tensor, lag: int) -> Tensor:
    """Block g of the result is the sum of ``per_block`` (batch, heads, blocks, ...) over blocks 0 .. g - lag
    (zeros for g < lag); ``lag`` 1 gives exclusive prefix sums. Differentiable."""
    return _LaggedPrefixSums.apply(per_block, lag)


class _LaggedPrefixSums(torch.autograd.Function):
    """Block g of the result is the sum of ``per_block`` (batch, heads, blocks, ...) over blocks 0 .. g - lag.

    Forward and backward are running sums written in place into one buffer, block by block: ``cumsum``
    along a middle dimension, or a loop of out-of-place additions under autograd, costs several times more
    on CPU (one full-size gradient per block)."""

    @staticmethod
    def forward(ctx, per_block: Tensor, lag: int) -> Tensor:  # type: ignore[override]
        ctx.lag = lag
        blocks = per_block.shape[2]
        out = torch.empty_like(per_block)
        out[:, :, :lag].zero_()
        out[:, :, lag:].copy_(per_block[:, :, : max(blocks - lag, 0)])
        for g in range(lag + 1, blocks):  # in place on block views (``out=`` on a view does not compile)
            out[:, :, g].add_(out[:, :, g - 1])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        # Block b enters the sums of blocks b + lag .. last: its gradient is their sum, a running sum from the end.
        lag, blocks = ctx.lag, grad.shape[2]
        out = torch.empty_like(grad)
        out[:, :, max(blocks - lag, 0):].zero_()
        out[:, :, : max(blocks - lag, 0)].copy_(grad[:, :, lag:])
        for b in range(blocks - lag - 2, -1, -1):
            out[:, :, b].add_(out[:, :, b + 1])
        return out, None


__all__ = ["lagged_prefix_sums", "lagged_prefix_sums_reference"]

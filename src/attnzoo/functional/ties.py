"""Autograd helper for mechanisms that ignore some of their inputs (FNet ignores q and k, a synthesizer without
the dot-product mixture ignores them too).

Every mechanism gives every input a gradient; one that does not read an input ties it in with exact zeros,
so that gradient checks, optimisers and hooks see the same structure whatever the mechanism.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor


class _TiedToUnused(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives zero gradients to the inputs it does not depend on."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *unused: Tensor) -> Tensor:
        ctx.unused = [(x.shape, x.dtype, x.device) for x in unused]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.unused))


def tied_to_unused(out: Tensor, *unused: Tensor) -> Tensor:
    """``out`` unchanged, tied into the autograd graph of inputs it does not depend on, so that their gradient
    is exactly zero instead of None, as for any input of any other mechanism (and what they hold, NaN and inf
    included, reaches nothing). Free in the forward pass: no arithmetic on ``out``."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in unused):
        return out
    return _TiedToUnused.apply(out, *unused)

"""The normaliser of kernelized attention: the packed (..., d_v + 1) numerator and normaliser combined into
outputs, with the guards that keep a tiny or zero normaliser from turning into inf or NaN."""

from __future__ import annotations

import math

import torch
from torch import Tensor

NORMALIZERS = ("sum", "max_abs", "none")
"""The ways :func:`normalize_output` combines numerator and normaliser."""

SIGNED_DENOMINATOR_EPS = 1e-6
"""Smallest normaliser magnitude allowed for feature maps with negative features (trigonometric ones), whose
normaliser can cross zero; positive feature maps get no such guard."""


def normalize_output(num_den: Tensor, normalizer: str, denominator_eps: float = 0.0) -> Tensor:
    """Split (..., d_v + 1) into numerator and normaliser and combine them.

    ``"sum"``: ``num / den`` (softmax-like; a row with a zero normaliser, e.g. whose keys are all padding,
    outputs zeros); with ``denominator_eps > 0`` the normaliser's magnitude is kept >= eps, sign preserved.
    ``"max_abs"``: ``num / max(|den|, 1)`` (RetNet), for features of either sign. ``"none"``: ``num``.
    """
    if normalizer == "sum":
        if torch.is_grad_enabled() and num_den.requires_grad:
            return _SumNormalise.apply(num_den, denominator_eps)
        # No gradient: the same division without an autograd Function's overhead (a decoding step's share).
        return num_den[..., :-1] / _guarded_denominator(num_den[..., -1:], denominator_eps)
    num, den = num_den[..., :-1], num_den[..., -1:]
    if normalizer == "none":
        return num
    return num / den.abs().clamp_min(1.0)


def denominator_floor(dtype: torch.dtype) -> float:
    """sqrt of the smallest normal number (1e-19 in float32): the smallest divisor a backward pass divides by.

    A normaliser can be far smaller and still exact (its numerator is as small; FAVOR+ at logit standard
    deviations of 30 and more gets there), so the forward divides by it as it is; but the backward's
    ``grad / den``, multiplied on by features near 1, would overflow into inf and then inf * 0 = NaN."""
    return math.sqrt(torch.finfo(dtype).tiny)


def _at_least(den: Tensor, floor: float) -> Tensor:
    """``den`` with magnitudes below ``floor`` raised to it, sign kept."""
    return torch.where(den.abs() < floor, torch.copysign(torch.full_like(den, floor), den), den)


def _guarded_denominator(den: Tensor, denominator_eps: float) -> Tensor:
    if denominator_eps > 0.0:
        return _at_least(den, denominator_eps)
    return torch.where(den == 0, torch.ones_like(den), den)


class _SumNormalise(torch.autograd.Function):
    """``num / den`` from the packed (..., d + 1) tensor, with the guard of :func:`normalize_output`.

    Hand-written so that the backward writes the packed gradient once, instead of two zero-filled slice
    gradients, their sum, and the five passes of a broadcast division's backward. The backward divides by
    the normaliser raised to :func:`denominator_floor`: rows whose normaliser is below it (an estimate that
    sees almost nothing of its keys) get their gradient scaled down by ``den / floor`` instead of overflowing.
    """

    @staticmethod
    def forward(ctx, num_den: Tensor, denominator_eps: float) -> Tensor:  # type: ignore[override]
        den = num_den[..., -1:]
        safe = _guarded_denominator(den, denominator_eps)
        # Divide rather than multiply by a reciprocal: a tiny (even subnormal) normaliser comes with an
        # equally tiny numerator, and only the reciprocal alone would overflow.
        out = num_den[..., :-1] / safe
        ctx.save_for_backward(out, safe, safe == den)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        out, safe, live = ctx.saved_tensors
        safe = _at_least(safe, denominator_floor(safe.dtype))
        # d(num / den) / d den = -out / den; a guarded (constant) denominator gets no gradient.
        grad_den = (grad * out).sum(-1, keepdim=True).div_(safe).neg_()
        if torch.compiler.is_compiling():
            # Dynamo does not trace out= into a slice; a compiled graph fuses the concatenation anyway.
            return torch.cat([grad / safe, grad_den * live], dim=-1), None
        grad_num_den = grad.new_empty(*grad.shape[:-1], grad.shape[-1] + 1)
        torch.div(grad, safe, out=grad_num_den[..., :-1])
        grad_num_den[..., -1:] = grad_den * live
        return grad_num_den, None

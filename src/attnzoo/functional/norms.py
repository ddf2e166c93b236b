"""Normalizations of the models built on the mechanisms (pure tensor maths, no parameters of their own)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Root-mean-square norm (Zhang and Sennrich 2019) over the last dim, as Llama computes it.

    ``weight * x / sqrt(mean(x^2) + eps)``: x (..., dim), weight (dim,) -> (..., dim), in x's dtype. The mean
    and the division are taken in at least float32 and the result cast back before the weight multiplies it,
    the order of Llama's reference (and of transformers' ``LlamaRMSNorm``), so that a pretrained model's
    outputs are reproduced to the last bits rather than merely approximated in bfloat16 or float16.
    """
    working = torch.promote_types(x.dtype, torch.float32)
    hidden = x.to(working)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)

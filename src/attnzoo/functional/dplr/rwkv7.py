"""RWKV-7's inputs to the DPLR delta rule (Peng et al. 2025), computed from the keys: the per-channel decay,
the removal key and its in-context learning rate, and the replacement key. Pure tensor maths; the learned
maps are passed in (:class:`attnzoo.mechanisms.rwkv7.RWKV7Attention` holds them)."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from .._autocast import without_autocast
from ..norms import unit_rows

DECAY_CEILING = math.exp(-0.5)
"""RWKV-7's ``w = exp(-exp(-0.5) sigmoid(z))``: every step keeps at least exp(-0.607) = 0.545 of a channel."""


def low_rank_map(x: Tensor, bias: Tensor, down: Tensor, up: Tensor, squash: bool) -> Tensor:
    """``bias_h + act(x W_down_h) W_up_h`` per head (RWKV-7's LoRA), act tanh when ``squash`` else identity.
    x (B, H, N, d); bias (H, d); down (H, d, r); up (H, r, d). Returns (B, H, N, d)."""
    hidden = torch.einsum("bhnd,hdr->bhnr", x, down.to(x.dtype))
    if squash:
        hidden = torch.tanh(hidden)
    return torch.einsum("bhnr,hrd->bhnd", hidden, up.to(x.dtype)) + bias.to(x.dtype)[:, None, :]


@without_autocast  # its precision is the working dtype (functional/_autocast.py)
def rwkv7_vectors(
    k: Tensor,
    decay_maps: Tuple[Tensor, Tensor, Tensor],
    rate_maps: Tuple[Tensor, Tensor, Tensor],
    removal_scale: Tensor,
    replacement_mix: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """From raw keys k (B, H, N, d), in their dtype (the caller casts to the working dtype and zeroes padded
    keys first): (replacement key, a, b, log_decay), each (B, H, N, d), for
    :func:`attnzoo.functional.dplr_delta_rule`:

    * ``log_decay = -exp(-0.5) * sigmoid(w0 + tanh(k W1) W2)`` (``decay_maps = (w0, W1, W2)``), in
      (-0.607, 0);
    * ``alpha = sigmoid(a0 + (k A1) A2)`` (``rate_maps``), the in-context learning rate per channel;
    * ``kappa = normalize(k * removal_scale)``, the removal key; ``a = -kappa``, ``b = kappa * alpha``, so the
      transition is ``diag(w) - (kappa * alpha) kappa^T`` (in (d_k, d_v) orientation);
    * the replacement key ``k * (1 + (alpha - 1) * replacement_mix)``.

    removal_scale, replacement_mix: (H, d), RWKV-7's ``k_k`` and ``k_a``.
    """
    log_decay = -DECAY_CEILING * torch.sigmoid(low_rank_map(k, *decay_maps, squash=True))
    alpha = torch.sigmoid(low_rank_map(k, *rate_maps, squash=False))
    kappa = unit_rows(k * removal_scale.to(k.dtype)[:, None, :])
    replacement = k * (1 + (alpha - 1) * replacement_mix.to(k.dtype)[:, None, :])
    return replacement, -kappa, kappa * alpha, log_decay


__all__ = ["DECAY_CEILING", "low_rank_map", "rwkv7_vectors"]

"""RWKV-7's inputs to the DPLR delta rule (Peng et al. 2025), computed from the keys: the per-channel decay,
the removal key and its in-context learning rate, and the replacement key. Pure tensor maths; the learned
maps are passed in (:class:`attnzoo.mechanisms.rwkv7.RWKV7Attention` holds them).

:func:`rwkv7_vectors` is one :class:`torch.autograd.Function` with a hand-written backward: the maps are a
dozen elementwise steps over (B, H, N, d), and autograd, taking them one at a time, spends more on its own
passes and temporaries than on the maths (73 ms against 59 forward and backward at N = 16384, 4 heads, head dim
64, one CPU thread: ``scripts/profile_delta_parts.py``, docs/rwkv7.md). :func:`rwkv7_vectors_reference` is the same maths op by op, which the tests compare it
with in float64."""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._autocast import outside_autocast, without_autocast
from ..norms import unit_rows

DECAY_CEILING = math.exp(-0.5)
"""RWKV-7's ``w = exp(-exp(-0.5) sigmoid(z))``: every step keeps at least exp(-0.607) = 0.545 of a channel."""

_NORM_EPS = 1e-12  # F.normalize's, as unit_rows takes it

Maps = Tuple[Tensor, Tensor, Tensor]
Vectors = Tuple[Tensor, Tensor, Tensor, Tensor]


def low_rank_map(x: Tensor, bias: Tensor, down: Tensor, up: Tensor, squash: bool) -> Tensor:
    """``bias_h + act(x W_down_h) W_up_h`` per head (RWKV-7's LoRA), act tanh when ``squash`` else identity.
    x (B, H, N, d); bias (H, d); down (H, d, r); up (H, r, d). Returns (B, H, N, d)."""
    hidden = torch.einsum("bhnd,hdr->bhnr", x, down.to(x.dtype))
    if squash:
        hidden = torch.tanh(hidden)
    return torch.einsum("bhnr,hrd->bhnd", hidden, up.to(x.dtype)) + bias.to(x.dtype)[:, None, :]


@without_autocast  # its precision is the working dtype (functional/_autocast.py)
def rwkv7_vectors_reference(k: Tensor, decay_maps: Maps, rate_maps: Maps, removal_scale: Tensor,
                            replacement_mix: Tensor) -> Vectors:
    """:func:`rwkv7_vectors` op by op under autograd (its docstring has the maths)."""
    log_decay = -DECAY_CEILING * torch.sigmoid(low_rank_map(k, *decay_maps, squash=True))
    alpha = torch.sigmoid(low_rank_map(k, *rate_maps, squash=False))
    kappa = unit_rows(k * removal_scale.to(k.dtype)[:, None, :])
    replacement = k * (1 + (alpha - 1) * replacement_mix.to(k.dtype)[:, None, :])
    return replacement, -kappa, kappa * alpha, log_decay


def _tanh(x: Tensor) -> Tensor:
    """``tanh(x)`` as ``2 sigmoid(2 x) - 1``: on the development machine's CPU torch's ``tanh`` ran 5.5 times
    slower than this (2.2 against 0.40 ms for a million float32 numbers; docs/rwkv7.md has the command), for an
    absolute error within 2e-7 in float32 (a few units in the last place of the hidden units it feeds a rank-16
    sum with)."""
    return torch.mul(x, 2.0).sigmoid_().mul_(2.0).sub_(1.0)


def _per_channel(x: Tensor) -> Tensor:
    """(H, d) -> (H, 1, d), to broadcast over (B, H, N, d)."""
    return x[:, None, :]


def _summed_per_channel(x: Tensor) -> Tensor:
    """(B, H, N, d) summed over B and N -> (H, d), a parameter's gradient."""
    return x.sum((0, 2))


class _Vectors(torch.autograd.Function):
    """:func:`rwkv7_vectors`'s maths with a hand-written backward (first order only).

    The low-rank hidden units are held transposed, (B, H, r, N): each map's units are then a contiguous block
    of rows (an elementwise pass over a strided slice runs slower), and the products into and out of them ran
    faster on the development machine's CPU with that layout. ``sigmoid_backward`` and ``tanh_backward`` are the derivatives autograd itself
    uses, one pass each from the saved output."""

    @staticmethod
    @outside_autocast
    def forward(ctx, k: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, a0: Tensor, a1: Tensor,  # type: ignore[override]
                a2: Tensor, removal_scale: Tensor, replacement_mix: Tensor) -> Vectors:
        w0, w1, w2, a0, a1, a2, removal_scale, replacement_mix = (
            p.to(k.dtype) for p in (w0, w1, w2, a0, a1, a2, removal_scale, replacement_mix))
        rank = w1.shape[-1]
        # Both maps' down projections in one product, k read once: (B, H, r_w + r_a, N).
        down = torch.cat([w1, a1], dim=-1)
        hidden = torch.matmul(down.transpose(-1, -2).contiguous(), k.transpose(-1, -2))
        squashed, rate_hidden = _tanh(hidden[..., :rank, :]), hidden[..., rank:, :]
        decay_gate = torch.matmul(squashed.transpose(-1, -2), w2).add_(_per_channel(w0)).sigmoid_()
        alpha = torch.matmul(rate_hidden.transpose(-1, -2), a2).add_(_per_channel(a0)).sigmoid_()
        scaled = k * _per_channel(removal_scale)
        norm = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)
        denominator = norm.clamp_min(_NORM_EPS)
        kappa = scaled.div_(denominator)
        # k (1 + (alpha - 1) m) = k ((1 - m) + alpha m): one pass for the factor, one for the product.
        factor = torch.addcmul(_per_channel(1 - replacement_mix), alpha, _per_channel(replacement_mix))
        ctx.save_for_backward(k, down, w2, a2, removal_scale, replacement_mix, squashed, rate_hidden, decay_gate,
                              alpha, kappa, denominator, norm > _NORM_EPS, factor)
        return factor * k, kappa.neg(), kappa * alpha, decay_gate * -DECAY_CEILING

    @staticmethod
    @once_differentiable
    @outside_autocast
    def backward(ctx, grad_replacement: Tensor, grad_a: Tensor, grad_b: Tensor,  # type: ignore[override]
                 grad_log_decay: Tensor):
        saved = ctx.saved_tensors
        k = saved[0]
        grad_k = torch.empty_like(k)
        totals: List[Tensor] = []
        # Tile by tile of positions: a tile's dozen temporaries stay in cache, where over a long sequence at once
        # each would go to memory and back.
        for start in range(0, max(k.shape[2], 1), _BACKWARD_TILE):  # one empty tile for an empty sequence
            tile = slice(start, start + _BACKWARD_TILE)
            grad_k[:, :, tile], *parameter_grads = _backward_tile(
                saved, tuple(grad[:, :, tile] for grad in (grad_replacement, grad_a, grad_b, grad_log_decay)), tile)
            totals = [total.add_(part) for total, part in zip(totals, parameter_grads)] if totals else parameter_grads
        return (grad_k, *totals)


_BACKWARD_TILE = 1024
"""Positions per step of :class:`_Vectors`' backward: 1024 x 4 heads x 64 channels of float32 is 1 MiB a tensor."""


def _backward_tile(saved: Tuple[Tensor, ...], grads: Vectors, tile: slice) -> Tuple[Tensor, ...]:
    """:class:`_Vectors`' backward for the positions ``tile``, from the gradients of its outputs there: (the
    gradient of k there, then each parameter's share from these positions, in the forward's argument order)."""
    (k, down, w2, a2, removal_scale, replacement_mix, squashed, rate_hidden, decay_gate, alpha, kappa, denominator,
     above, factor) = saved
    k, decay_gate, alpha, kappa, denominator, above, factor = (
        x[:, :, tile] for x in (k, decay_gate, alpha, kappa, denominator, above, factor))
    squashed, rate_hidden = squashed[..., tile], rate_hidden[..., tile]  # held (B, H, r, N)
    grad_replacement, grad_a, grad_b, grad_log_decay = grads
    rank = w2.shape[-2]
    grad_k = grad_replacement * factor
    # replacement = k ((1 - m) + alpha m): d/dalpha = grad k m, d/dm = grad k (alpha - 1), with alpha - 1 formed
    # first (exact near 1, where summing grad k alpha and grad k apart would cancel).
    through_k = grad_replacement * k
    grad_mix = _summed_per_channel(through_k * (alpha - 1))
    grad_alpha = torch.mul(grad_b, kappa).addcmul_(through_k, _per_channel(replacement_mix))
    # b = kappa alpha, a = -kappa; kappa = s / |s|: d s = (g - kappa (kappa . g)) / |s| (g / eps where clamped).
    grad_kappa = torch.mul(grad_b, alpha).sub_(grad_a)
    along = (kappa * grad_kappa).sum(-1, keepdim=True)
    grad_scaled = grad_kappa.addcmul_(kappa, along.mul_(above), value=-1.0).div_(denominator)
    grad_removal_scale = _summed_per_channel(grad_scaled * k)
    grad_k.addcmul_(grad_scaled, _per_channel(removal_scale))
    # log_decay = -c gate: the -c is folded into the small products of the gate's gradient below.
    grad_rate_z = torch.ops.aten.sigmoid_backward(grad_alpha, alpha)
    grad_gate_z = torch.ops.aten.sigmoid_backward(grad_log_decay, decay_gate)
    grad_squashed = torch.matmul(w2 * -DECAY_CEILING, grad_gate_z.transpose(-1, -2))
    grad_hidden = torch.cat([torch.ops.aten.tanh_backward(grad_squashed, squashed),
                             torch.matmul(a2, grad_rate_z.transpose(-1, -2))], dim=-2)
    grad_k += torch.matmul(grad_hidden.transpose(-1, -2), down.transpose(-1, -2).contiguous())
    grad_down = torch.matmul(grad_hidden, k).sum(0).transpose(-1, -2)
    grad_w2 = torch.matmul(squashed, grad_gate_z).sum(0).mul_(-DECAY_CEILING)
    grad_a2 = torch.matmul(rate_hidden, grad_rate_z).sum(0)
    return (grad_k, _summed_per_channel(grad_gate_z).mul_(-DECAY_CEILING), grad_down[..., :rank], grad_w2,
            _summed_per_channel(grad_rate_z), grad_down[..., rank:], grad_a2, grad_removal_scale, grad_mix)


@without_autocast  # its precision is the working dtype (functional/_autocast.py)
def rwkv7_vectors(k: Tensor, decay_maps: Maps, rate_maps: Maps, removal_scale: Tensor, replacement_mix: Tensor
                  ) -> Vectors:
    """From raw keys k (B, H, N, d), in their dtype (the caller casts to the working dtype and zeroes padded
    keys first): (replacement key, a, b, log_decay), each (B, H, N, d), for
    :func:`attnzoo.functional.dplr_delta_rule`:

    * ``log_decay = -exp(-0.5) * sigmoid(w0 + tanh(k W1) W2)`` (``decay_maps = (w0, W1, W2)``), in
      (-0.607, 0);
    * ``alpha = sigmoid(a0 + (k A1) A2)`` (``rate_maps``), the in-context learning rate per channel;
    * ``kappa = normalize(k * removal_scale)``, the removal key; ``a = -kappa``, ``b = kappa * alpha``, so the
      transition is ``diag(w) - (kappa * alpha) kappa^T`` (in (d_k, d_v) orientation);
    * the replacement key ``k * (1 + (alpha - 1) * replacement_mix)``.

    removal_scale, replacement_mix: (H, d), RWKV-7's ``k_k`` and ``k_a``. First order only: a second derivative
    raises (:func:`rwkv7_vectors_reference` has one).
    """
    return _Vectors.apply(k, *decay_maps, *rate_maps, removal_scale, replacement_mix)


__all__ = ["DECAY_CEILING", "low_rank_map", "rwkv7_vectors", "rwkv7_vectors_reference"]

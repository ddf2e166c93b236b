"""Noise-aware shrinkage of a random-feature attention estimate towards the mean of the values.

A random-feature estimate ``o_i`` of softmax attention is unbiased in its kernel, but at higher temperatures
its variance can exceed the whole signal: each query's output is then further from exact attention than the
plain mean of the values (uniform attention) is. Shrinkage trades a little bias for much less variance, per
query row, by the positive-part James-Stein rule

    out_i = vbar + lambda_i (o_i - vbar),   lambda_i = max(0, 1 - noise_i / |o_i - vbar|^2),

where ``vbar`` is the mean of the (unpadded) values and ``noise_i`` estimates ``E|o_i - E o_i|^2`` from the
features themselves. The features are split into two halves, two independent estimators ``o_a`` and ``o_b``
of the same attention; the whole estimate is their average weighted by their normalisers,
``o = s o_a + (1 - s) o_b`` with ``s = den_a / (den_a + den_b)``. If the halves carry independent errors of
equal variance, ``E|o_a - o_b|^2`` is twice that variance and the error of ``o`` has ``s^2 + (1 - s)^2`` times
it, hence ``noise = |o_a - o_b|^2 (s^2 + (1 - s)^2) / 2``. The weighting matters: random-feature estimates
are heavy-tailed, and when one feature dominates a row, the whole estimate follows that feature's half, whose
error is the whole difference, not half of it.

Where the estimate is sharp, ``lambda`` is near 1 and the output is the plain estimate; where it is noise,
the output falls back towards uniform attention. The rule reads the whole key sequence, so it is non-causal
only.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._autocast import without_autocast
from .._validation import check_key_padding_mask
from .._dtypes import working_dtype
from .linear.checks import _check_features
from .linear.inputs import _prepare_keys
from .linear.normalize import denominator_floor, normalize_output
from .masks import zero_padded


def _check_halves(second_half: Tensor, nb_features: int) -> None:
    if second_half.dtype != torch.bool or second_half.shape != (nb_features,):
        raise ValueError(
            f"second_half must be a bool tensor of shape ({nb_features},), one flag per feature, got "
            f"{second_half.dtype} of shape {tuple(second_half.shape)}"
        )
    halves = int(second_half.sum())
    if halves == 0 or halves == nb_features:
        raise ValueError("second_half must split the features into two non-empty halves")


def shrink_towards_mean(estimate: Tensor, half_a: Tensor, half_b: Tensor, share_a: Tensor, mean_v: Tensor) -> Tensor:
    """The positive-part James-Stein combination of the module docstring.

    Args:
        estimate: (..., seq_q, d) the estimate from all features.
        half_a, half_b: (..., seq_q, d) the estimates from each half of the features.
        share_a: (..., seq_q, 1) the first half's share ``s`` of the normaliser.
        mean_v: (..., 1, d) the mean of the unpadded values.
    """
    signal = (estimate - mean_v).pow(2).sum(-1, keepdim=True)
    spread = share_a.pow(2) + (1.0 - share_a).pow(2)
    noise = 0.5 * spread * (half_a - half_b).pow(2).sum(-1, keepdim=True)
    # A row equal to the mean needs no shrinking; the floor keeps the division and its gradient finite there.
    weight = (1.0 - noise / signal.clamp_min(denominator_floor(signal.dtype))).clamp(0.0, 1.0)
    return mean_v + weight * (estimate - mean_v)


def _mean_values(v1: Tensor) -> Tensor:
    """(B, H, 1, d) mean of the unpadded values from the packed [v, 1] (padded rows already zeroed)."""
    totals = v1.sum(dim=-2, keepdim=True)
    return totals[..., :-1] / totals[..., -1:].clamp_min(1.0)


def shrunk_kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    second_half: Tensor,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Non-causal kernelized attention shrunk towards the mean of the values (see the module docstring).

    Args:
        phi_q: (batch, heads, seq_q, m) positive query features (each row may carry its own positive factor).
        phi_k: (batch, heads, seq_kv, m) positive key features.
        v: (batch, heads, seq_kv, d_v)
        second_half: (m,) bool, which features form the second of two independent estimators (for paired
            features such as FAVOR+'s ``w, -w``, both members of a pair must be in the same half).
        key_padding_mask: (batch, seq_kv) bool, True marks padding.

    Returns:
        (batch, heads, seq_q, d_v) in the dtype of ``v``. Costs one more (seq_q, m, d_v) product than
        :func:`attnzoo.functional.kernel_attention`.
    """
    _check_features(phi_q, phi_k, v)
    _check_halves(second_half, phi_q.shape[-1])
    check_key_padding_mask(key_padding_mask, phi_q.shape[0], phi_k.shape[2], phi_q.device)
    return shrunk_kernel_attention_unchecked(phi_q, phi_k, v, second_half, key_padding_mask)


@without_autocast
def shrunk_kernel_attention_unchecked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, second_half: Tensor, key_padding_mask: Optional[Tensor]
) -> Tensor:
    """:func:`shrunk_kernel_attention` for callers that validated its arguments themselves."""
    dtype = working_dtype(v.dtype)
    phi_q = phi_q.to(dtype)
    phi_k, v1 = _prepare_keys(phi_k, v, key_padding_mask, dtype)
    kv = phi_k.transpose(-1, -2) @ v1  # (B, H, m, d + 1)
    # Zeroing the state rows of the other half restricts the product to one half without copying features.
    kv_a = kv.masked_fill(second_half.to(kv.device).unsqueeze(-1), 0.0)
    num_den = phi_q @ kv
    num_den_a = phi_q @ kv_a
    estimate = normalize_output(num_den, "sum")
    half_a = normalize_output(num_den_a, "sum")
    half_b = normalize_output(num_den - num_den_a, "sum")
    share_a = _share(num_den_a[..., -1:], num_den[..., -1:])
    return shrink_towards_mean(estimate, half_a, half_b, share_a, _mean_values(v1)).to(v.dtype)


def _share(part: Tensor, whole: Tensor) -> Tensor:
    """``part / whole``, and 1/2 where ``whole`` is below :func:`denominator_floor` (a row that sees no key,
    whose output is about 0 anyway)."""
    live = whole.abs() >= denominator_floor(whole.dtype)
    return torch.where(live, part / torch.where(live, whole, 1.0), 0.5)


def shrunk_kernel_attention_reference(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    second_half: Tensor,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Quadratic float64 form of :func:`shrunk_kernel_attention`: the (seq_q, seq_kv) weight matrices of each
    half, masked and normalised row by row. Returns float64."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    # A zero weight times a padded key's NaN or inf is still NaN: the padded keys and values are zeroed first.
    phi_k, v = zero_padded(phi_k, key_padding_mask), zero_padded(v, key_padding_mask)
    keep = torch.ones(phi_k.shape[:3], dtype=torch.float64, device=phi_k.device)
    if key_padding_mask is not None:
        keep = keep.masked_fill(key_padding_mask[:, None, :], 0.0)

    def attend(features: Tensor) -> Tuple[Tensor, Tensor]:
        """(output, normaliser) of the features selected by ``features`` (a 0/1 vector over them)."""
        weights = (phi_q * features) @ phi_k.transpose(-1, -2) * keep.unsqueeze(-2)
        totals = weights.sum(-1, keepdim=True)
        return torch.where(totals > 0, (weights @ v) / torch.where(totals > 0, totals, 1.0), 0.0), totals

    second = second_half.to(torch.float64)
    (estimate, total), (half_a, total_a), (half_b, _) = (attend(f) for f in (torch.ones_like(second), 1.0 - second, second))
    mean_v = (keep.unsqueeze(-1) * v).sum(-2, keepdim=True) / keep.sum(-1)[..., None, None].clamp_min(1.0)
    return shrink_towards_mean(estimate, half_a, half_b, _share(total_a, total), mean_v)

"""Obviously-correct float64 references of kernelized attention: the full (seq_q, seq_kv) weight matrix,
against which the chunked and recurrent forms are tested."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..masks import allowed_mask, zero_padded
from .normalize import SIGNED_DENOMINATOR_EPS, normalize_output
from .protocol import FeatureMapArg, resolve_features


def kernel_attention_reference(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tensor:
    """Obviously-correct quadratic form of :func:`kernel_attention` in float64: the (seq_q, seq_kv) weight
    matrix ``(phi_q phi_k^T) * decay`` with masked entries zeroed. Returns float64."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    # A zero weight times a padded key's NaN or inf is still NaN: the padded keys and values are zeroed first.
    phi_k, v = zero_padded(phi_k, key_padding_mask), zero_padded(v, key_padding_mask)
    batch, _, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    weights = phi_q @ phi_k.transpose(-1, -2)
    if log_decay is not None:
        log_decay = log_decay.double()
        if key_padding_mask is not None:
            log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
        cumulative = log_decay.cumsum(-1)
        later = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)  # L_i - L_j: decays j+1..i, for j <= i
        rows = torch.arange(q_len, device=phi_q.device).unsqueeze(1)
        cols = torch.arange(k_len, device=phi_q.device).unsqueeze(0)
        # A key after the query (non-causal) is reached through the decays i+1..j, i.e. L_j - L_i.
        weights = weights * torch.exp(torch.where(cols <= rows, later, -later))
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, phi_q.device)
    if allowed is not None:
        weights = weights.masked_fill(~allowed, 0.0)
    num_den = torch.cat([weights @ v, weights.sum(-1, keepdim=True)], dim=-1)
    return normalize_output(num_den, normalizer, denominator_eps)


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMapArg = "elu",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Quadratic float64 reference of :func:`linear_attention`, on the map's unstabilised features
    (``feature_map(x)``), so it also checks that the stabilisers cancel. Returns float64."""
    phi_map = resolve_features(feature_map)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention_reference(
        phi_map(q.double()), phi_map(k.double()), v, causal, key_padding_mask, denominator_eps=eps
    )

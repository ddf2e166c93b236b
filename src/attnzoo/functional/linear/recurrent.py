"""The recurrent form of kernelized attention: a prompt's outputs with the state they leave
(:func:`kernel_attention_prefill`), then one token at a time from that state (:func:`kernel_attention_step`),
O(m d) per token whatever the context length. Step after prefill equals the causal parallel form."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._autocast import without_autocast
from ..._dtypes import working_dtype
from .checks import _check_features, _check_log_decay, _check_options
from .chunk import DEFAULT_CHUNK_SIZE, _chunked_causal
from .inputs import _masked_keys, _prepare_keys
from .normalize import normalize_output

KernelState = Dict[str, Tensor]
"""Recurrent state: ``{"kv": (batch, heads, m, d_v + 1), "log_scale": (batch, heads, 1, 1)}``. The true state
``exp(log_scale) * kv`` holds ``sum_j decay * phi_k_j [v_j, 1]^T``; the separate scale lets feature maps whose
keys are stabilised by a shift (FAVOR+) merge new keys exactly."""


def kernel_attention_prefill(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """Causal :func:`kernel_attention` over a prompt (seq_q == seq_kv) that also returns the recurrent state.

    ``key_log_scale`` (batch, heads, 1, 1): the true key features are ``phi_k * exp(key_log_scale)`` (see
    :meth:`attnzoo.feature_maps.FeatureMap.key_features`); None means 0.
    """
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    if phi_k.shape[2] != q_len:
        raise ValueError(
            f"prefill needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={phi_k.shape[2]}"
        )
    _check_log_decay(log_decay, batch, heads, q_len)
    return kernel_attention_prefill_unchecked(
        phi_q, phi_k, v, key_log_scale, log_decay, normalizer, chunk_size, denominator_eps
    )


@without_autocast
def kernel_attention_prefill_unchecked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    key_log_scale: Optional[Tensor],
    log_decay: Optional[Tensor],
    normalizer: str,
    chunk_size: int,
    denominator_eps: float,
) -> Tuple[Tensor, KernelState]:
    """:func:`kernel_attention_prefill` for callers that validated its arguments themselves."""
    batch, heads = phi_q.shape[:2]
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    phi_k, v = _masked_keys(phi_k, v, None, dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    num_den, kv = _chunked_causal(phi_q.to(dtype), phi_k, v, log_decay, chunk_size, None)
    log_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q.device)
    return normalize_output(num_den, normalizer, denominator_eps).to(out_dtype), {"kv": kv, "log_scale": log_scale}


def _log_scale_or_zero(
    key_log_scale: Optional[Tensor], batch: int, heads: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    if key_log_scale is None:
        return torch.zeros(batch, heads, 1, 1, dtype=dtype, device=device)
    if key_log_scale.shape != (batch, heads, 1, 1):
        raise ValueError(f"key_log_scale must have shape (batch, heads, 1, 1), got {tuple(key_log_scale.shape)}")
    return key_log_scale.to(dtype)


def kernel_attention_step(
    phi_q_t: Tensor,
    phi_k_t: Tensor,
    v_t: Tensor,
    state: Optional[KernelState],
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay_t: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """One recurrent step, O(m d) whatever the context length.

    Args:
        phi_q_t, phi_k_t: (batch, heads, 1, m); v_t: (batch, heads, 1, d_v).
        state: from :func:`kernel_attention_prefill` or a previous step, or None at the start.
        key_log_scale: (batch, heads, 1, 1) scale of this key's features, or None for 0.
        log_decay_t: (batch, heads, 1) log decay applied to the state before adding this key.

    Returns:
        ((batch, heads, 1, d_v), new state); equals the last row of the causal parallel form.
    """
    _check_features(phi_q_t, phi_k_t, v_t)
    _check_options(normalizer, 1, denominator_eps)
    batch, heads = phi_q_t.shape[:2]
    if phi_q_t.shape[2] != 1 or phi_k_t.shape[2] != 1:
        raise ValueError("kernel_attention_step takes one position: phi_q_t and phi_k_t of shape (batch, heads, 1, m)")
    _check_log_decay(log_decay_t, batch, heads, 1, "log_decay_t")
    return kernel_attention_step_unchecked(
        phi_q_t, phi_k_t, v_t, state, key_log_scale, log_decay_t, normalizer, denominator_eps
    )


@without_autocast
def kernel_attention_step_unchecked(
    phi_q_t: Tensor,
    phi_k_t: Tensor,
    v_t: Tensor,
    state: Optional[KernelState],
    key_log_scale: Optional[Tensor],
    log_decay_t: Optional[Tensor],
    normalizer: str,
    denominator_eps: float,
) -> Tuple[Tensor, KernelState]:
    """:func:`kernel_attention_step` for callers that validated its arguments themselves (the mechanisms,
    whose decoding states are checked against their declared layout)."""
    batch, heads = phi_q_t.shape[:2]
    dtype = working_dtype(v_t.dtype)
    phi_k_t, v1 = _prepare_keys(phi_k_t, v_t, None, dtype)
    token_kv = phi_k_t.transpose(-1, -2) @ v1
    token_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q_t.device)
    if state is None:
        kv, log_scale = token_kv, token_scale
    else:
        old_scale = state["log_scale"]
        log_scale = torch.maximum(old_scale, token_scale)
        carry = old_scale - log_scale
        if log_decay_t is not None:
            carry = carry + log_decay_t.to(dtype).unsqueeze(-1)
        kv = torch.exp(carry) * state["kv"] + torch.exp(token_scale - log_scale) * token_kv
    out = normalize_output(phi_q_t.to(dtype) @ kv, normalizer, denominator_eps)
    return out.to(v_t.dtype), {"kv": kv, "log_scale": log_scale}

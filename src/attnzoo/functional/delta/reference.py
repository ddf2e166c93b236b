"""The obviously-correct float64 delta rule: the recurrence, one position at a time, against which the
chunked and recurrent forms are tested."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_call, check_product_call, interleaved, resolve_scale


def delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """``S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T`` (``a_t = exp(log_decay_t)``, one
    value per head (``log_decay`` (B, H, N)) or per key channel ((B, H, N, d_k), Kimi Delta Attention), 1 when
    ``log_decay`` is None), written as it reads, in float64; ``o_t = S_t^T q_t * scale`` (causal), or
    ``S_N^T q_t * scale`` for every t (non-causal). A padded position is skipped. Returns float64
    (batch, heads, seq, d_v)."""
    check_call(q, k, v, beta, log_decay, key_padding_mask, initial_state, causal, scale)
    scale = resolve_scale(scale, q.shape[3])
    q, k, v, beta = q.double() * scale, k.double(), v.double(), beta.double()
    if key_padding_mask is not None:  # a padded position: a = 1, beta = 0, nothing written, whatever it held
        padded = key_padding_mask[:, None, :]
        k, v = k.masked_fill(padded[..., None], 0.0), v.masked_fill(padded[..., None], 0.0)
        beta = beta.masked_fill(padded, 0.0)
        if log_decay is not None:
            log_decay = log_decay.masked_fill(padded if log_decay.dim() == 3 else padded[..., None], 0.0)
    batch, heads, length, d_k = k.shape
    eye = torch.eye(d_k, dtype=torch.float64, device=k.device)
    state = k.new_zeros(batch, heads, d_k, v.shape[3]) if initial_state is None else initial_state.double()
    outputs = []
    for t in range(length):
        k_t, v_t = k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-1)  # columns (B, H, d, 1)
        beta_t = beta[:, :, t, None, None]
        if log_decay is not None:  # Diag(a_t) S_{t-1}: a scalar per head, or one per key channel (a row of S)
            decay_t = log_decay[:, :, t].double().exp()
            state = state * (decay_t[..., None, None] if log_decay.dim() == 3 else decay_t[..., :, None])
        state = (eye - beta_t * k_t @ k_t.transpose(-1, -2)) @ state + beta_t * k_t @ v_t.transpose(-1, -2)
        outputs.append(state.transpose(-1, -2) @ q[:, :, t].unsqueeze(-1))
    if not causal:
        return q @ state
    return torch.cat(outputs, dim=-1).transpose(-1, -2)


def delta_product_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """Gated DeltaProduct (:func:`attnzoo.functional.delta.product.delta_product`, same arguments) in float64:
    :func:`delta_rule_reference` on the n_h steps of every position in order, the decay on each position's
    first step, each query read after its position's last step (its query given to every step, the others'
    outputs dropped). Returns float64 (batch, heads, seq, d_v)."""
    check_product_call(q, k, v, beta, log_decay, key_padding_mask, initial_state, causal, scale)
    steps = k.shape[3]
    k_steps, v_steps, beta_steps, decay_steps, mask_steps = interleaved(k, v, beta, log_decay, key_padding_mask)
    out = delta_rule_reference(q.repeat_interleave(steps, dim=2), k_steps, v_steps, beta_steps, decay_steps,
                               scale=scale, causal=causal, key_padding_mask=mask_steps, initial_state=initial_state)
    return out[:, :, steps - 1::steps]


__all__ = ["delta_product_reference", "delta_rule_reference"]

"""The obviously-correct float64 DPLR delta rule: the recurrence, one position at a time, against which the
chunked and recurrent forms are tested."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_call, resolve_scale


def dplr_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """``S_t = (diag(exp(log_decay_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T`` written as it reads, in float64;
    ``o_t = S_t^T q_t * scale`` (causal), or ``S_N^T q_t * scale`` for every t (non-causal). A padded position
    is skipped and its output is 0. Shapes as :func:`attnzoo.functional.dplr_delta_rule`; returns float64
    (batch, heads, seq, d_v)."""
    check_call(q, k, v, a, b, log_decay, key_padding_mask, initial_state, causal, scale)
    scale = resolve_scale(scale, q.shape[3])
    q, k, v, a, b, log_decay = (x.double() for x in (q, k, v, a, b, log_decay))
    q = q * scale
    if key_padding_mask is not None:  # a padded position: identity transition, nothing written, whatever it held
        padded = key_padding_mask[:, None, :, None]
        q, k, v, a, b, log_decay = (x.masked_fill(padded, 0.0) for x in (q, k, v, a, b, log_decay))
    batch, heads, length, d_k = k.shape
    state = k.new_zeros(batch, heads, d_k, v.shape[3]) if initial_state is None else initial_state.double()
    outputs = []
    for t in range(length):
        column = [x[:, :, t].unsqueeze(-1) for x in (k, v, a, b)]  # (B, H, d, 1)
        k_t, v_t, a_t, b_t = column
        transition = torch.diag_embed(log_decay[:, :, t].exp()) + b_t @ a_t.transpose(-1, -2)
        state = transition @ state + k_t @ v_t.transpose(-1, -2)
        outputs.append(state.transpose(-1, -2) @ q[:, :, t].unsqueeze(-1))
    if not causal:
        return q @ state
    return torch.cat(outputs, dim=-1).transpose(-1, -2)


__all__ = ["dplr_delta_rule_reference"]

"""Decays and gates of the decayed/gated linear-attention family, as log decays for
:func:`attnzoo.functional.linear.kernel_attention`.

A log decay ``log a_t`` (batch, heads, seq) makes the recurrent state ``S_t = a_t S_{t-1} + k_t v_t^T`` forget
at position t. Working in log space keeps products of many decays exact and stable.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def retention_log_decays(heads: int) -> Tensor:
    """RetNet's fixed per-head decays ``gamma_h = 1 - 2^(-5 - h)``, as logs: (heads,) float64.

    Heads range from short memory (gamma = 31/32, about 32 positions) to long (about 2^(4 + heads)).
    """
    exponents = -5.0 - torch.arange(heads, dtype=torch.float64)
    return torch.log1p(-torch.exp2(exponents))


def key_gate_logits(k: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Per-head scalar gate logits from the keys: ``k_t . weight_h + bias_h``.

    Args:
        k: (batch, heads, seq, head_dim); weight: (heads, head_dim); bias: (heads,).

    Returns:
        (batch, heads, seq), in at least float32.
    """
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    logits = torch.einsum("bhnd,hd->bhn", k.to(dtype), weight.to(dtype))
    return logits + bias.to(dtype).unsqueeze(-1)


def gla_log_gates(logits: Tensor, temperature: float) -> Tensor:
    """Gated linear attention's forget gates ``a_t = sigmoid(logits)^(1 / temperature)`` as logs.

    A temperature above 1 (16 in Yang et al. 2024) keeps the gates close to 1 at initialisation, so the state
    starts with a long memory and learns where to forget.
    """
    return F.logsigmoid(logits) / temperature


def rfa_gates(logits: Tensor) -> Tuple[Tensor, Tensor]:
    """Random feature attention's gate ``g_t = sigmoid(logits)``: ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``.

    Returns:
        (log g_t, 1 - g_t): the log decay and the weight of the new key, both (batch, heads, seq).
    """
    return F.logsigmoid(logits), torch.sigmoid(-logits)


def constant_log_decay(log_decays: Tensor, batch: int, seq: int) -> Tensor:
    """Expand per-head log decays (heads,) to the (batch, heads, seq) form the attention core takes."""
    return log_decays.view(1, -1, 1).expand(batch, -1, seq)


__all__ = ["constant_log_decay", "gla_log_gates", "key_gate_logits", "retention_log_decays", "rfa_gates"]

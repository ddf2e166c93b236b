"""The delta rule: ``delta`` (DeltaNet) and ``gated_delta`` (Gated DeltaNet).

A linear-attention state ``S`` (d_k x d_v) that each position *corrects*: the key reads what the state holds
for it and the state moves a fraction beta of the way to the new value (Schlag et al. 2021, Yang et al.
2024)::

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(d)

with ``a_t = 1`` for ``delta`` and a data-dependent decay for ``gated_delta`` (Yang et al. 2025). Queries and
keys are L2-normalised, as in the papers, so ``I - beta k k^T`` is a contraction for beta in [0, 1].

The mechanism sees only q, k and v (not the layer input the papers project beta and the gate from), so beta
and the decay are computed from the (raw, unnormalised) keys, as ``gla`` computes its gate:
``beta_t = sigmoid(k_t . w_beta + b_beta)``, one scalar per head and position.

Capabilities: causal (each query reads the state after its own position) and non-causal (every query reads
the state after the whole sequence, as non-causal linear attention reads the sum over every key; the writes
still happen in sequence order). Self-attention only (the order of the writes is the keys' sequence order).
Padded positions write nothing and do not decay the state. Decoding carries the (d_k x d_v) state.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_positive_int
from ..functional.delta import (
    DEFAULT_CHUNK_SIZE,
    delta_rule_reference,
    delta_rule_step_unchecked,
    delta_rule_unchecked,
)
from ..functional.gated import key_gate_logits
from .base import OWN, PACKED_SPLIT, REPEAT_KV, Capabilities, Mechanism, StateLayout, register

_COMPLEXITY = "time O(N c d + N d^2), memory O(N c + N d^2 / c); c = chunk_size; decoding O(d^2) per token"


class _DeltaRuleMechanism(Mechanism):
    """Shared wiring: L2-normalised q and k, beta (and a decay) from the keys, the chunked, step and prefill
    forms of :mod:`attnzoo.functional.delta`. Decoding state: ``{"state": (batch, heads, head_dim, head_dim)}``
    in the working dtype (float32 for half-precision inputs)."""

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int) -> None:
        super().__init__(heads, head_dim)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.beta_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.beta_bias = nn.Parameter(torch.zeros(heads))

    def log_decay(self, k: Tensor) -> Optional[Tensor]:
        """(B, H, N) log decay from the (masked, raw) keys, or None for the plain delta rule."""
        return None

    def _gated_inputs(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """(unit q, unit k, beta, log decay) in the working dtype. Padded keys are zeroed first, so that a NaN
        or inf they hold reaches neither beta, nor the decay, nor a gradient."""
        dtype = working_dtype(q.dtype)
        q, k = q.to(dtype), k.to(dtype)
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        beta = torch.sigmoid(key_gate_logits(k, self.beta_weight, self.beta_bias))
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), beta, self.log_decay(k)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        unit_q, unit_k, beta, log_decay = self._gated_inputs(q, k, key_padding_mask)
        out, _ = delta_rule_unchecked(unit_q, unit_k, v, beta, log_decay, key_padding_mask, None, causal,
                                      self.chunk_size)
        return out.to(q.dtype)

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> Tensor:
        """The per-position recurrence in float64 (:func:`attnzoo.functional.delta.delta_rule_reference`),
        with beta and the decay computed from the float64 keys by the same definitions."""
        self.check_inputs(q, k, v, causal, key_padding_mask, cross)
        unit_q, unit_k, beta, log_decay = self._gated_inputs(q.double(), k.double(), key_padding_mask)
        return delta_rule_reference(unit_q, unit_k, v.double(), beta, log_decay, causal=causal,
                                    key_padding_mask=key_padding_mask)

    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        return {"state": ((self.heads, self.head_dim, self.head_dim), working_dtype(dtype))}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        unit_q, unit_k, beta, log_decay = self._gated_inputs(q, k, None)
        out, state = delta_rule_unchecked(unit_q, unit_k, v, beta, log_decay, None, None, True, self.chunk_size)
        return out.to(q.dtype), {"state": state}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        unit_q, unit_k, beta, log_decay = self._gated_inputs(q_t, k_t, None)
        previous = None if tensors is None else tensors["state"]
        out, state = delta_rule_step_unchecked(unit_q, unit_k, v_t, beta, log_decay, previous)
        return out.to(q_t.dtype), {"state": state}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"


@register
class DeltaNetAttention(_DeltaRuleMechanism):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule on L2-normalised queries and keys, with
    ``beta_t = sigmoid(k_t . w_h + b_h)`` from the key (see the module docstring), chunked by the WY / UT
    representation, O(d^2) per decoded token.

    Options:
        chunk_size: chunk length of the parallel form.
    """

    name = "delta"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity=_COMPLEXITY,
        summary="DeltaNet: the delta rule on a linear-attention state, chunked WY form (Yang et al. 2024)",
        # beta is learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)


@register
class GatedDeltaNetAttention(_DeltaRuleMechanism):
    """Gated DeltaNet (Yang et al. 2025): the delta rule with a data-dependent scalar decay per head and
    position, ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    The decay follows Mamba-2's parametrisation, as Gated DeltaNet does, computed from the raw key (the
    mechanism sees only q, k, v): ``log a_t = -exp(A_log_h) * softplus(k_t . w_h + dt_bias_h)``, so
    ``a_t`` is in (0, 1] for any parameters. ``A_log`` starts at ``log(linspace(1, 16))`` over the heads and
    ``dt_bias`` at the inverse softplus of steps from 0.001 to 0.1 (geometric over the heads), so heads start
    with memories from about a thousand positions down to a few; both are learned. beta as in ``delta``.

    Options:
        chunk_size: chunk length of the parallel form.
    """

    name = "gated_delta"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity=_COMPLEXITY,
        summary="Gated DeltaNet: the delta rule with a data-dependent decay, chunked WY form (Yang et al. 2025)",
        # beta and the decay are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.decay_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, heads).log())
        steps = torch.logspace(math.log10(0.001), math.log10(0.1), heads)
        self.dt_bias = nn.Parameter(steps + torch.log(-torch.expm1(-steps)))  # softplus(dt_bias) = steps

    def log_decay(self, k: Tensor) -> Tensor:
        # softplus(z) written as -logsigmoid(-z) (the same numbers): softplus's backward fails under
        # torch.compile's AOTAutograd for gates computed from permuted keys.
        minus_step = F.logsigmoid(-key_gate_logits(k, self.decay_weight, self.dt_bias))
        return self.A_log.to(minus_step.dtype).exp().unsqueeze(-1) * minus_step

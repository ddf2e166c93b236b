"""``ssd``: Mamba-2's state-space duality (Dao & Gu 2024) as an attention mechanism.

The SSD layer is linear attention with a data-dependent scalar decay per head and position and no
normaliser (:mod:`attnzoo.functional.ssd`)::

    o_i = sum_{j <= i} exp(sum_{s=j+1..i} dt_s A_h) (q_i . k_j) dt_j v_j

with queries in C's place, keys in B's, values in x's. A mechanism sees only q, k and v, not the layer input
Mamba-2 projects its step size from, so the step size is computed from the (raw) key, as ``gla`` computes its
gate: ``dt_t = softplus(k_t . w_h + dt_bias_h)``, and ``A_h = -exp(A_log_h)``, all learned, one scalar per
head and position. The full architecture, with the step size, B and C projected from the input, the short
convolution, the skip ``D x`` and the gated norm, is ``block="mamba2"`` of the models
(:mod:`attnzoo.models.mamba2`).

Everything runs on the shared decayed path of :class:`~attnzoo.mechanisms.kernelized.KernelizedMechanism`,
as ``retention`` and ``gla`` do: the chunked causal form, the bidirectional form (``causal=False``), the packed
form, prefill and the O(d^2)-per-token step. What differs from ``gla``: no 1/sqrt(d) on the queries and no
row normaliser (the paper's ``y = C^T h``), keys weighted by the step size (Euler's ``dt B``), and the decay
``exp(-exp(A_log) dt)`` instead of a sigmoid gate.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from ..functional.gated import key_gate_logits
from ..functional.linear import DEFAULT_CHUNK_SIZE
from ..functional.ssd import mamba2_log_rates, mamba2_step_bias, step_sizes
from .base import OWN, PACKED_NATIVE, REPEAT_KV, Capabilities
from .registry import register
from .kernelized import KernelizedMechanism


@register
class StateSpaceDualityAttention(KernelizedMechanism):
    """Mamba-2's SSD as attention (module docstring): a scalar decay ``exp(-exp(A_log_h) dt_t)`` and key weight
    ``dt_t`` per head and position, ``dt_t = softplus(k_t . w_h + dt_bias_h)`` from the key; queries and keys
    unscaled, no normaliser. Chunked, bidirectional, packed and recurrent paths give the same output.

    ``A_log`` starts at ``log(linspace(1, 16))`` over the heads and ``dt_bias`` at the inverse softplus of steps
    from 0.001 to 0.1 (geometric over the heads): spread over the ranges Mamba-2 draws them from at random;
    ``w`` starts random with rows of norm about 1.

    Options:
        chunk_size: chunk length of the causal path.
    """

    name = "ssd"
    normalizer = "none"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2 + N c d), memory O(N d); c = chunk_size; decoding O(d^2) per token",
        summary="Mamba-2's state-space duality: linear attention with a per-head step-size decay (Dao & Gu 2024)",
        # The step sizes are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_NATIVE,
        causal_rows=True,
        linear_recurrence=True,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.dt_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.dt_bias = nn.Parameter(mamba2_step_bias(heads))
        self.A_log = nn.Parameter(mamba2_log_rates(heads))

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        dtype = working_dtype(q.dtype)
        return q.to(dtype), k.to(dtype), None

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        return q, k

    def step_size(self, k: Tensor) -> Tensor:
        """dt (B, H, N) from the raw keys (B, H, N, d), in at least float32."""
        return step_sizes(key_gate_logits(k, self.dt_weight, self.dt_bias))

    def _keys(self, k: Tensor, phi_k: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        # SSD on the linear-attention path: keys dt B, log decay dt A (attnzoo.functional.ssd).
        dt = self.step_size(k)
        rates = -torch.exp(self.A_log.to(dt.dtype)).unsqueeze(-1)  # A = -exp(A_log), (H, 1)
        return phi_k * dt.to(phi_k.dtype).unsqueeze(-1), dt * rates

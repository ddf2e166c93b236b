"""Decayed and gated linear attention: ``retention`` (RetNet) and ``gla`` (gated linear attention).

Both use the raw scaled dot product ``(q_i . k_j) / sqrt(d)`` as kernel (no feature map) and a recurrent state
that forgets: ``S_t = a_t S_{t-1} + k_t v_t^T``. They are attentions of their own, not approximations of
softmax (``kind="own"``), so their distance from softmax is not reported as an approximation error.
Normalisation (``normalize=True``, the default) follows RetNet: each output row is divided by
``max(|sum_j w_ij|, 1)`` where ``w_ij`` are its decayed scores, which tames rows of large scores without the
positivity a softmax-style normaliser needs, and is computed from the same state in every path.
RetNet's extra per-row rescaling of the decay matrix and its GroupNorm are left to the surrounding model.

The decay weights keys by their distance to the query, so queries and keys must come from one sequence
(no cross-attention). ``causal=False`` applies the decays in both directions (``gamma^|i - j|``). Padded
positions are skipped: they add no key and do not decay the state.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_number, check_numbers
from ..functional.gated import constant_log_decay, gla_log_gates, key_gate_logits, retention_log_decays
from ..functional.linear import DEFAULT_CHUNK_SIZE
from .base import OWN, PACKED_NATIVE, REPEAT_KV, Capabilities
from .registry import register
from .kernelized import KernelizedMechanism


class _DotProductDecayed(KernelizedMechanism):
    """Identity features with the 1/sqrt(d) scale on the queries, RetNet normalisation."""

    def __init__(self, heads: int, head_dim: int, *, normalize: bool, chunk_size: int) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.normalize = check_bool("normalize", normalize)
        self.normalizer = "max_abs" if self.normalize else "none"

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        dtype = working_dtype(q.dtype)
        return q.to(dtype) / math.sqrt(self.head_dim), k.to(dtype), None

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        return q / math.sqrt(self.head_dim), k

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalize={self.normalize}"


@register
class RetentionAttention(_DotProductDecayed):
    """Retention (Sun et al. 2023, RetNet): a fixed decay ``gamma_h`` per head.

    ``o_i = sum_{j <= i} gamma^(i - j) (q_i . k_j / sqrt(d)) v_j``, normalised as described in the module
    docstring. Parallel, chunked (RetNet's chunkwise form) and recurrent paths give the same output.

    Options:
        decays: one gamma in (0, 1) per head; RetNet's ``1 - 2^(-5 - h)`` by default.
        normalize: divide each row by ``max(|sum of its decayed scores|, 1)``.
        chunk_size: chunk length of the causal path.
    """

    name = "retention"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2 + N c d), memory O(N d); c = chunk_size; decoding O(d^2) per token",
        summary="retention with a fixed per-head decay, chunkwise and recurrent (Sun et al. 2023, RetNet)",
        # Each query head decays at its own rate, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_NATIVE,
        causal_rows=True,
        linear_recurrence=True,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"normalize": False, "chunk_size": 4},)

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        decays: Optional[Sequence[float]] = None,
        normalize: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim, normalize=normalize, chunk_size=chunk_size)
        if decays is None:
            log_decays = retention_log_decays(heads)
        else:
            in_unit_interval = dict(minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True)
            values = check_numbers("decays", decays, heads, **in_unit_interval)
            log_decays = torch.log(torch.tensor(values, dtype=torch.float64))
        # The decays are options, not learned state: kept as exact float64 numbers and made into a tensor of the
        # inputs' working dtype on each call, so a float64 model has float64 decays (a float32 buffer made it only
        # float32-accurate) and the reference, which calls the same method on float64 inputs, computes from the
        # definition. Nothing to save: the options rebuild them.
        self.log_decay_values: Tuple[float, ...] = tuple(log_decays.tolist())
        self._register_load_state_dict_pre_hook(_drop_saved_log_decays)

    def log_decay(self, k: Tensor) -> Tensor:
        log_decays = torch.tensor(self.log_decay_values, dtype=working_dtype(k.dtype), device=k.device)
        return constant_log_decay(log_decays, k.shape[0], k.shape[2])


def _drop_saved_log_decays(state_dict, prefix, *args) -> None:
    """Checkpoints written while the decays were a float32 buffer hold them under ``log_decays``; the options
    define them now, so the saved copy is dropped instead of failing a strict load."""
    state_dict.pop(prefix + "log_decays", None)


@register
class GatedLinearAttention(_DotProductDecayed):
    """Gated linear attention (Yang et al. 2024): data-dependent forget gates.

    The gate is computed from the key (the mechanism sees only q, k, v): ``a_t = sigmoid(k_t . w_h +
    b_h)^(1 / gate_temperature)``, one scalar per head and position, with learned ``w`` (heads, head_dim) and
    ``b`` (heads,). The paper uses one gate per key dimension; a scalar gate per head (as in Mamba-2 and
    gated RetNet variants) keeps the chunked algorithm exact and stable in log space for any gate value.

    Options:
        gate_temperature: the ``1 / temperature`` power keeps gates near 1 at initialisation (16 in the paper).
        normalize: RetNet-style row normalisation (see the module docstring).
        chunk_size: chunk length of the causal path.
    """

    name = "gla"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2 + N c d), memory O(N d); c = chunk_size; decoding O(d^2) per token",
        summary="gated linear attention with data-dependent per-head forget gates (Yang et al. 2024)",
        # The gates are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_NATIVE,
        causal_rows=True,
        linear_recurrence=True,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"normalize": False, "chunk_size": 4},)

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        gate_temperature: float = 16.0,
        normalize: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim, normalize=normalize, chunk_size=chunk_size)
        self.gate_temperature = check_number("gate_temperature", gate_temperature, minimum=0.0, exclusive_minimum=True)
        self.gate_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.gate_bias = nn.Parameter(torch.zeros(heads))

    def log_decay(self, k: Tensor) -> Tensor:
        return gla_log_gates(key_gate_logits(k, self.gate_weight, self.gate_bias), self.gate_temperature)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate_temperature={self.gate_temperature}"

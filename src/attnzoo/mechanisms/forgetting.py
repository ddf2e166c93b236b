"""Forgetting attention (Lin et al. 2025, the Forgetting Transformer, FoX) as a mechanism, with a KV cache
that also holds the cumulative log forget gate for decoding. The maths is in
:mod:`attnzoo.functional.forgetting`.

The paper computes the forget gate from the layer input, ``f_t = sigmoid(w^T x_t + b)``. A mechanism sees only
q, k and v, so the gate is computed from the key, as ``gla`` computes its gate: ``f_t = sigmoid(k_t . w_h +
b_h)``, with a learned ``w`` (heads, head_dim) and ``b`` (heads,), one gate per query head and position (with
grouped keys, query head h reads the key of its key/value head).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_number, check_positive_int
from ..functional.forgetting import (
    DEFAULT_BLOCK_SIZE,
    cumulative_log_forget,
    forget_gate_logs,
    forgetting_attention_reference,
    forgetting_attention_step_unchecked,
    forgetting_attention_unchecked,
)
from ..functional.kv_cache import cache_append, kv_cache_layout, prefilled_cache
from ..functional.masks import zero_padded
from .base import NATIVE_KV, OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .registry import register

DEFAULT_GATE_BIAS = 5.0
"""The forget gate bias's starting value: gates start near 1, a long memory (see ``gate_bias_init``)."""

@register
class ForgettingAttention(Mechanism):
    """Forgetting attention: softmax attention whose logits gain ``D_ij = sum_{l=j+1..i} log f_l``, the log
    forget gates between key and query, ``f_t = sigmoid(k_t . w_h + b_h)`` from the key (see the module
    docstring). Exact softmax over the gated logits, computed blockwise with an online softmax and a
    hand-written backward, never an (N, N) tensor; ``causal=False`` applies the gates in both directions.

    Options:
        block_size: key positions per block of the blockwise kernel.
        scale: logit scale, a finite number > 0; ``1/sqrt(head_dim)`` by default.
        gate_bias_init: the gate bias's starting value, a finite number; 5 by default, so that gates start
            near 1 (``f = sigmoid(5 +- 1)``, ``log f`` about -0.01: a key 100 positions back keeps about 0.3 of its weight)
            and every key gets the gradient that teaches a head where to forget. 0, what a default-initialised
            linear layer's bias is near, starts with ``f`` about 0.5: each position halves the weight of
            everything before it, and far keys get too little weight for their gradient to open the gates
            (on associative recall such a model stayed at chance; see docs/softmax_family.md).

    Decoding state: a KV cache ``{"k": (batch, kv_heads, capacity, head_dim), "v": (batch, kv_heads, capacity,
    head_dim_v), "log_gate": (batch, heads, capacity) float64, "filled": (batch,)}``, of which the first
    ``state.length`` positions are in use; ``log_gate`` holds the cumulative log gate ``c_t`` of every position
    (a new one adds its gate to the last), kept in float64 so that a long decode loses nothing to its size. It
    is ``softmax``'s cache (:mod:`attnzoo.functional.kv_cache`), growing in blocks, with the gates kept beside.

    Grouped-query attention is native: the keys and values of ``kv_heads`` heads are never repeated, and the
    cache holds ``kv_heads`` heads of them (the gates are per query head). Packed batches run each document
    alone (its cumulative gates starting afresh), equal lengths batched.
    """

    name = "forgetting"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N^2), memory O(N b) (blockwise; b = block_size); decoding O(N) per token",
        summary="softmax attention with a data-dependent forget gate on the logits (Lin et al. 2025, FoX)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"block_size": 4}  # the suite's lengths cross several blocks
    test_variants = ({"block_size": 4, "gate_bias_init": 0.0},)  # strong gates at the start: f about 0.5

    def __init__(self, heads: int, head_dim: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale: Optional[float] = None, gate_bias_init: float = DEFAULT_GATE_BIAS) -> None:
        super().__init__(heads, head_dim)
        self.block_size = check_positive_int("block_size", block_size)
        self.scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
        self.gate_bias_init = check_number("gate_bias_init", gate_bias_init)
        self.gate_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.gate_bias = nn.Parameter(torch.full((heads,), float(self.gate_bias_init)))

    def log_forget(self, k: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """(batch, heads, seq) log forget gates from the keys; padded keys are zeroed first, so that a NaN or
        inf they hold reaches no gate and no gradient (their gates are then taken as 1)."""
        return forget_gate_logs(zero_padded(k, key_padding_mask), self.gate_weight, self.gate_bias)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        log_forget = self.log_forget(k, key_padding_mask)
        return forgetting_attention_unchecked(q, k, v, log_forget, causal, key_padding_mask, self.scale,
                                              self.block_size)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """The (N, N) bias written out in float64 (:func:`attnzoo.functional.forgetting_attention_reference`),
        the gates computed from the float64 keys by the same definition."""
        log_forget = self.log_forget(k.double(), key_padding_mask)
        return forgetting_attention_reference(q, k, v, log_forget, causal, key_padding_mask, scale=self.scale)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        kv_heads = self.heads if kv_heads is None else kv_heads
        cache = kv_cache_layout(kv_heads, self.head_dim, dtype, value_width)
        return {**cache, "log_gate": ((self.heads, None), torch.float64)}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        gate = self.log_forget(k_t, None).to(torch.float64)  # (batch, heads, 1)
        cumulative = gate if tensors is None else tensors["log_gate"][:, :, length - 1 : length] + gate
        cache = cache_append(tensors, {"k": k_t, "v": v_t, "log_gate": cumulative}, length)
        seen = length + 1
        out = forgetting_attention_step_unchecked(
            q_t, cache["k"][:, :, :seen], cache["v"][:, :, :seen], cache["log_gate"][:, :, :seen], self.scale
        )
        return out, cache

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        log_forget = self.log_forget(k, None)
        out = forgetting_attention_unchecked(q, k, v, log_forget, True, None, self.scale, self.block_size)
        entries = {"k": k, "v": v, "log_gate": cumulative_log_forget(log_forget, None)}
        return out, prefilled_cache(entries)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, scale={self.scale}, " \
               f"gate_bias_init={self.gate_bias_init}"

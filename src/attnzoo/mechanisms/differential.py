"""Differential attention (Ye et al. 2024, the Differential Transformer) as a mechanism: two softmax maps from
the halves of the queries and keys, the second weighted by a learned lambda and subtracted, the difference
RMS-normalised per head and scaled by ``1 - lambda_init``. The maths is in
:mod:`attnzoo.functional.differential`; decoding keeps a KV cache as ``softmax`` does.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_number
from ..functional.differential import (
    check_even_head_dim,
    differential_attention_reference,
    differential_attention_unchecked,
    lambda_init_for,
    packed_differential_attention_unchecked,
    reparametrised_lambda,
)
from ..functional.kv_cache import cache_append, kv_cache_layout, prefilled_cache
from .base import NATIVE_KV, OWN, PACKED_NATIVE, Capabilities, Mechanism, StateLayout
from .registry import register


@register
class DifferentialAttention(Mechanism):
    """Differential attention: ``(1 - lambda_init) * rms_norm(softmax(Q1 K1^T s) V - lambda softmax(Q2 K2^T s)
    V)``, q and k split into halves of ``head_dim / 2`` (head_dim must be even), v whole, ``s = (head_dim / 2)
    ** -0.5``.

    ``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init``, one scalar for the layer
    (as the paper's code shares it across heads), its four vectors of ``head_dim / 2`` learned and initialised
    from N(0, 0.1^2), as the paper's are. ``lambda_init = 0.8 - 0.6 exp(-0.3 (layer_index - 1))``.

    Options:
        layer_index: the layer's depth, 1-based (the paper counts from 1), which sets ``lambda_init``; 1 by
            default (``lambda_init = 0.2``). A model passes each layer's own.
        scale: logit scale of both maps, a finite number > 0; ``(head_dim / 2) ** -0.5`` by default.

    Decoding state: a KV cache ``{"k": (batch, kv_heads, capacity, head_dim), "v": (batch, kv_heads, capacity,
    head_dim_v), "filled": (batch,)}`` (both maps read the one cache, each its half of the keys), grown in blocks
    as ``softmax``'s is. Grouped-query keys and values are used without repeats (both maps on softmax's grouped
    path) and packed batches run on softmax's block-diagonal path.
    """

    name = "differential"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N^2), memory O(N) (two fused softmax kernels)",
        summary="differential attention: the difference of two softmax maps, per-head RMS norm (Ye et al. 2024)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_NATIVE,
    )
    test_variants = ({"layer_index": 4},)

    def __init__(self, heads: int, head_dim: int, *, layer_index: int = 1, scale: Optional[float] = None) -> None:
        super().__init__(heads, head_dim)
        check_even_head_dim(self.head_dim)
        self.layer_index = check_number("layer_index", layer_index, integer=True, minimum=1)
        self.scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
        self.lambda_init = lambda_init_for(self.layer_index)
        half = head_dim // 2
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(half) * 0.1) for _ in range(4)
        )

    def lambda_(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The current lambda, a 0-d tensor with a gradient path to its four vectors, computed in ``dtype`` (the
        vectors' own when None): the working dtype of the inputs it weights, so that float64 inputs on a float32
        module get no float32 rounding of lambda."""
        vectors = (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)
        return reparametrised_lambda(*(p if dtype is None else p.to(dtype) for p in vectors), self.lambda_init)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        return differential_attention_unchecked(q, k, v, self.lambda_(working_dtype(q.dtype)), self.lambda_init,
                                                causal, key_padding_mask, self.scale)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        return packed_differential_attention_unchecked(q, k, v, self.lambda_(working_dtype(q.dtype)), self.lambda_init,
                                                       spans, causal, self.scale)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Two quadratic float64 softmax maps, their lambda-weighted difference and the RMS norm, lambda computed
        in float64 from this instance's vectors."""
        return differential_attention_reference(q, k, v, self.lambda_(torch.float64), self.lambda_init, causal,
                                                key_padding_mask, scale=self.scale)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        return kv_cache_layout(self.heads if kv_heads is None else kv_heads, self.head_dim, dtype, value_width)

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        cache = cache_append(tensors, {"k": k_t, "v": v_t}, length)
        keys, values = cache["k"][:, :, : length + 1], cache["v"][:, :, : length + 1]
        # The new position sees the whole cache and itself: no mask.
        return self.attend(q_t, keys, values, False, None, True), cache

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        out = self.attend(q, k, v, True, None, False)
        return out, prefilled_cache({"k": k, "v": v})

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer_index={self.layer_index}, lambda_init={self.lambda_init:.4f}, " \
               f"scale={self.scale}"

"""Exact softmax attention as a mechanism, with a KV cache for decoding."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..functional.softmax import softmax_attention, softmax_attention_reference
from .base import Capabilities, Mechanism, State, register


@register
class SoftmaxAttention(Mechanism):
    """Exact scaled dot-product attention (``torch.nn.functional.scaled_dot_product_attention``).

    Options:
        quiet: "quiet" softmax with one added to the denominator, so a head can attend to nothing.
        scale: logit scale, ``1/sqrt(head_dim)`` by default.

    Decoding state: ``{"k": (batch, heads, t, head_dim), "v": (batch, heads, t, head_dim_v)}``, the KV cache.
    """

    name = "softmax"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        approximate=False,
        complexity="time O(N^2), memory O(N) (fused kernel)",
        summary="exact scaled dot-product attention (Vaswani et al. 2017)",
    )

    def __init__(self, heads: int, head_dim: int, *, quiet: bool = False, scale: Optional[float] = None) -> None:
        super().__init__(heads, head_dim)
        self.quiet = quiet
        self.scale = scale

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
        return softmax_attention(q, k, v, causal, key_padding_mask, quiet=self.quiet, scale=self.scale)

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None
    ) -> Tensor:
        return softmax_attention_reference(q, k, v, causal, key_padding_mask, quiet=self.quiet, scale=self.scale)

    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor, state: State) -> Tuple[Tensor, State]:
        self.check_step_inputs(q_t, k_t, v_t)
        if state is None:
            keys, values = k_t, v_t
        else:
            keys = torch.cat([state["k"], k_t], dim=2)
            values = torch.cat([state["v"], v_t], dim=2)
        # The new position sees the whole cache and itself: no mask needed.
        out = softmax_attention(q_t, keys, values, quiet=self.quiet, scale=self.scale)
        return out, {"k": keys, "v": values}

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, State]:
        return self.attend(q, k, v, True, None), {"k": k, "v": v}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quiet={self.quiet}"

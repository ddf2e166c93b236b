"""Exact softmax attention as a mechanism, with a preallocated KV cache for decoding."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_bool, check_number
from ..functional.blocksparse import (
    SinkLocalPattern,
    check_sink_tokens,
    window_cache_layout,
    window_cache_prefill,
    window_cache_step,
)
from ..functional.grouped import grouped_query_attention
from ..functional.kv_cache import (  # noqa: F401 - CACHE_BLOCK is also public here
    CACHE_BLOCK,
    cache_append,
    kv_cache_layout,
    prefilled_cache,
)
from ..functional.softmax import (
    masked_sdpa,
    masked_softmax_reference,
    packed_softmax_attention_unchecked,
    softmax_attention_reference,
    softmax_weights,
    softmax_attention_unchecked,
)
from .base import EXACT, NATIVE_KV, OWN, PACKED_NATIVE, REPEAT_KV, Capabilities, Mechanism, StateLayout
from .capabilities import PADDED_RIGHT
from .registry import register

@register
class SoftmaxAttention(Mechanism):
    """Exact scaled dot-product attention (``torch.nn.functional.scaled_dot_product_attention``).

    Options:
        quiet: "quiet" softmax with one added to the denominator, so a head can attend to nothing.
        scale: logit scale, a finite number > 0; ``1/sqrt(head_dim)`` by default.
        window: None (the default): every key. An int >= 1: a sliding window, query i sees keys j with ``|i -
            j| < window`` (causally the last ``window`` up to itself), plus the sinks; exact softmax over them
            in one fused call under a dense (N, N) mask, and decoding keeps a bounded cache of ``sink_tokens +
            window`` positions (StreamingLLM's cache). Self-attention only. The ``local`` mechanism computes
            the same blockwise in O(N window); this form is the exact kernel with a mask (as Mistral's
            sliding window runs in SDPA).
        sink_tokens: attention sinks (Xiao et al. 2023): the first ``sink_tokens`` keys stay visible to every
            query (causally, to those at or after them) however far the window has moved; ``0 <= sink_tokens
            <= window``, 0 by default. Needs ``window``: with every key visible, sinks would change nothing.

    Decoding state: a KV cache ``{"k": (batch, heads, capacity, head_dim), "v": (batch, heads, capacity,
    head_dim), "filled": (batch,)}`` of which the first ``state.length`` positions are in use. It grows in
    blocks of :data:`CACHE_BLOCK` positions (at least doubling), and a step writes the new key and value into
    the free room instead of copying the whole cache. ``filled`` records how far the shared buffers have been
    written: a step from a state that is no longer the newest on its buffers (stepping twice from one state,
    to branch) copies them first, so every state stays valid however it is reused.

    Grouped-query attention is native: keys and values of ``kv_heads`` heads are never repeated (see
    :func:`attnzoo.functional.grouped.grouped_query_attention`), and the KV cache holds ``kv_heads`` heads.
    """

    name = "softmax"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=EXACT,
        complexity="time O(N^2), memory O(N) (fused kernel)",
        summary="exact scaled dot-product attention (Vaswani et al. 2017)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_NATIVE,
        scale_option="scale",
        window_option="window",
        quiet_option="quiet",
        attention_weights=True,
    )
    test_variants = ({"quiet": True},)
    test_variants += ({"window": 3, "sink_tokens": 2}, {"window": 2})

    def __init__(self, heads: int, head_dim: int, *, quiet: bool = False, scale: Optional[float] = None,
                 window: Optional[int] = None, sink_tokens: int = 0) -> None:
        super().__init__(heads, head_dim)
        self.quiet = check_bool("quiet", quiet)
        if self.quiet:
            # The null key makes the output differ from exact softmax attention (on purpose).
            self.capabilities = self.capabilities.narrowed("quiet=True", kind=OWN)
        self.scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
        self.window, self.sink_tokens = _window_and_sinks(window, sink_tokens, self.quiet)
        if self.window is not None:
            # Positions of one sequence are compared: no cross-attention; the window is not exact softmax.
            # Its masked kernel takes as many key/value heads as query heads: grouped inputs are repeated.
            # Its weights would need the window's pattern: not offered.
            self.capabilities = self.capabilities.narrowed(f"window={self.window}", kind=OWN, cross=False,
                                                           grouped_kv=REPEAT_KV, attention_weights=False)
        if self.sink_tokens:
            # The sinks are the row's first positions, padding on the left included.
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        if self.window is not None:
            # pattern.dense, unchecked: under tracing the length is a traced size.
            allowed = SinkLocalPattern(self.window, self.sink_tokens, 1).dense(q.shape[2], q.device)
            if causal:
                allowed = allowed & torch.ones_like(allowed).tril()
            if key_padding_mask is not None:
                allowed = allowed & ~key_padding_mask[:, None, None, :]
            k, v = (x if key_padding_mask is None else x.masked_fill(key_padding_mask[:, None, :, None], 0.0)
                    for x in (k, v))
            return masked_sdpa(q, k, v, allowed, self.scale)
        # forward() checked the inputs and __init__ the options: validate once.
        return self._softmax(q, k, v, causal, key_padding_mask)

    def _softmax(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
        """Softmax attention on checked inputs, k and v with as many heads as q or fewer (never repeated)."""
        if k.shape[1] != q.shape[1]:
            return grouped_query_attention(
                lambda queries, masked: softmax_attention_unchecked(
                    queries, k, v, masked, key_padding_mask, self.quiet, self.scale
                ),
                q, k.shape[1], causal,
            )
        return softmax_attention_unchecked(q, k, v, causal, key_padding_mask, self.quiet, self.scale)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        # Block-diagonal without an (N, N) mask: one fused call per distinct document length. A window is
        # applied within each document by the windowed form, run per document likewise.
        if self.window is not None:
            return super().attend_packed(q, k, v, causal, spans)
        return packed_softmax_attention_unchecked(q, k, v, spans, causal, self.quiet, self.scale)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        if self.window is not None:
            return _windowed_reference(q, k, v, causal, key_padding_mask, self.window, self.sink_tokens, self.scale)
        return softmax_attention_reference(q, k, v, causal, key_padding_mask, quiet=self.quiet, scale=self.scale)

    # -- decoding ------------------------------------------------------------------------------------------

    def attend_weights(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], causal: bool, bias: Optional[Tensor]
    ) -> Tensor:
        return softmax_weights(q, k, causal, key_padding_mask, quiet=self.quiet, scale=self.scale, bias=bias)
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        kv_heads = self.heads if kv_heads is None else kv_heads
        if self.window is not None:
            return window_cache_layout(kv_heads, self.window, self.sink_tokens, self.head_dim, dtype, value_width)
        return kv_cache_layout(kv_heads, self.head_dim, dtype, value_width)

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        if self.window is not None:  # a bounded cache: the sinks and the window's ring buffer
            return window_cache_step(q_t, k_t, v_t, tensors, length, self.window, self.sink_tokens, self.scale)
        cache = cache_append(tensors, {"k": k_t, "v": v_t}, length)
        # The new position sees the whole cache and itself: no mask needed.
        keys, values = cache["k"][:, :, : length + 1], cache["v"][:, :, : length + 1]
        return self._softmax(q_t, keys, values, False, None), cache

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        if self.window is not None:
            return self.attend(q, k, v, True, None, False), window_cache_prefill(k, v, self.window, self.sink_tokens)
        return self.attend(q, k, v, True, None, False), prefilled_cache({"k": k, "v": v})

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quiet={self.quiet}, scale={self.scale}" + (
            "" if self.window is None else f", window={self.window}, sink_tokens={self.sink_tokens}")


def _window_and_sinks(window: object, sink_tokens: object, quiet: bool) -> Tuple[Optional[int], int]:
    """``window`` and ``sink_tokens`` checked together (errors name the argument at fault)."""
    window = check_number("window", window, integer=True, minimum=1, optional=True)
    if window is None:
        sinks = check_number("sink_tokens", sink_tokens, integer=True, minimum=0)
        if sinks:
            raise ValueError(f"sink_tokens={sinks} needs a window (e.g. window=1024): with every key visible, "
                             "sinks change nothing")
        return None, 0
    if quiet:
        raise ValueError("window needs quiet=False: the windowed form runs the plain softmax kernel")
    return window, check_sink_tokens(sink_tokens, window)


def _windowed_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
                        window: int, sinks: int, scale: Optional[float]) -> Tensor:
    """Float64 softmax over the keys within the window or among the sinks, its mask written out densely."""
    q, k, v = q.double(), k.double(), v.double()
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    allowed = ((i - j).abs() < window) | (j < sinks)
    if causal:
        allowed = allowed & (j <= i)
    allowed = allowed.view(1, 1, *allowed.shape)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
        k, v = (x.masked_fill(key_padding_mask[:, None, :, None], 0.0) for x in (k, v))
    logits = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return masked_softmax_reference(logits, allowed) @ v

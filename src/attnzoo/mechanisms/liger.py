"""``liger`` (Lan et al. 2025): gated linear attention from a pretrained model's own queries and keys, with no
parameters of its own, averaged with an exact sliding window; the target Liger converts pretrained softmax
models to. The maths is in :mod:`attnzoo.functional.liger`."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_bool, check_number, check_positive_int
from ..functional.blocksparse import BlockPlan, blocksparse_plan, check_sink_tokens, window_pattern
from ..functional.linear import DEFAULT_CHUNK_SIZE
from ..functional.liger import (
    liger_attention_reference,
    liger_attention_unchecked,
    liger_prefill_unchecked,
    liger_state_layout,
    liger_step_unchecked,
)
from .base import NATIVE_KV, OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .capabilities import PADDED_RIGHT
from .plan_cache import last_plan
from .registry import register
from .window_rotary import RotatedWindow


@register
class LigerAttention(RotatedWindow, Mechanism):
    """Liger attention (Lan et al. 2025, "Liger: Linearizing Large Language Models to Gated Recurrent
    Structures"): ``y = (window + gated) / 2``, where ``gated`` is gated linear attention on
    ``softmax(q)``, ``softmax(k)`` (over the channels) with the per-channel decay ``logsigmoid(k) /
    gate_normalizer`` and no normaliser, and ``window`` is exact softmax over the ``window`` nearest keys.

    Nothing is learned here: a converted model keeps the teacher's q, k, v projections (Liger trains low-rank
    adapters on them). With a layer's rotary embedding (``MultiHeadAttention(rotary=True)``, as in
    :class:`~attnzoo.pretrained.CausalLM`), only the window's queries and keys are rotated, as in Liger: the
    mechanism rotates them itself (capability ``own_rotary``); alone, it takes q and k as given for both parts.

    Options:
        window: keys of the exact window (itself included; also ahead when non-causal); Liger's is 64.
        sink_tokens: the first positions, visible to every query besides its window (StreamingLLM's sinks; not
            in Liger), ``0 <= sink_tokens <= window``.
        gate_normalizer: divides ``logsigmoid(k)`` (16 in Liger): larger keeps the decays nearer 1.
        normalize: divide the linear part by the sum of its weights (not in Liger, whose linear part is a sum):
            both parts are then weighted averages of the values.
        chunk_size: chunk length of the causal linear path.

    Grouped keys and values are native: the linear state is one per key/value head (the decay and features
    come from the key), shared by its query heads. Packed batches: each document alone. Decoding state
    (constant size): ``kv`` (kv_heads, head_dim, head_dim_v) and the window's ring and sinks.
    """

    name = "liger"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2 + N w d + N c d), memory O(N (d + w)); w = window, c = chunk_size; decoding "
                   "O(d^2 + w d) per token",
        summary="Liger: parameter-free gated linear attention from the model's q and k, averaged with an exact "
                "window (Lan et al. 2025)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_SPLIT,
        causal_rows=True,
        own_rotary=True,
    )
    # Small settings; the suite's lengths (up to 11) cross chunk and window-block boundaries. The variant: sinks,
    # the normalised linear part, and a gate normaliser of 1, whose strong decays send some chunks through the
    # decayed products' split form.
    test_options = {"window": 3, "chunk_size": 4}
    test_variants = ({"window": 2, "sink_tokens": 1, "chunk_size": 3, "gate_normalizer": 1.0, "normalize": True},)

    def __init__(self, heads: int, head_dim: int, *, window: int = 64, sink_tokens: int = 0,
                 gate_normalizer: float = 16.0, normalize: bool = False,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)
        self.gate_normalizer = check_number("gate_normalizer", gate_normalizer, minimum=0.0, exclusive_minimum=True)
        self.normalize = check_bool("normalize", normalize)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        if self.sink_tokens:  # the sinks are the row's first positions, padding on the left included
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The window's block plan, the last one kept while the length, causality and device stay."""
        pattern = window_pattern(self.window, self.sink_tokens)
        return last_plan(self, "_plan", (pattern, length, causal, device),
                         lambda: blocksparse_plan(pattern, length, causal, device))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        out, _ = liger_attention_unchecked(q, k, v, *self._window_inputs(q, k, 0), self.window, self.sink_tokens,
                                           self.gate_normalizer, self.normalize, causal, key_padding_mask,
                                           self.chunk_size, plan)
        return out

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Float64 quadratic maths (:func:`~attnzoo.functional.liger.liger_attention_reference`)."""
        return liger_attention_reference(q, k, v, *self._window_inputs(q, k, 0), self.window, self.sink_tokens,
                                         self.gate_normalizer, self.normalize, causal, key_padding_mask)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        heads = self.heads if kv_heads is None else kv_heads  # the key/value heads the state holds
        return liger_state_layout(heads, self.head_dim, self.window, self.sink_tokens, self.normalize, dtype,
                                  value_width)

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        plan = self.plan(q.shape[2], True, q.device)
        return liger_prefill_unchecked(q, k, v, *self._window_inputs(q, k, 0), self.window, self.sink_tokens,
                                       self.gate_normalizer, self.normalize, self.chunk_size, plan)

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        return liger_step_unchecked(q_t, k_t, v_t, *self._window_inputs(q_t, k_t, length), self.window,
                                    self.sink_tokens, self.gate_normalizer, self.normalize, tensors, length)

    def extra_repr(self) -> str:
        sinks = f", sink_tokens={self.sink_tokens}" if self.sink_tokens else ""
        normalized = ", normalize=True" if self.normalize else ""
        return (f"{super().extra_repr()}, window={self.window}{sinks}, gate_normalizer={self.gate_normalizer}"
                f"{normalized}, chunk_size={self.chunk_size}")

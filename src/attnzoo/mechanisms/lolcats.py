"""``lolcats`` (Zhang et al. 2024): exact softmax over a sliding window plus Hedgehog linear attention beyond it,
in one normalisation, the attention LoLCATs converts pretrained softmax models to. The maths is in
:mod:`attnzoo.functional.lolcats`."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_number, check_positive_int
from ..feature_maps import HedgehogFeatureMap
from ..functional.blocksparse import BlockPlan, check_sink_tokens
from ..functional.linear import DEFAULT_CHUNK_SIZE
from ..functional.lolcats import LolcatsWeights, lolcats_attention_reference, lolcats_attention_unchecked, window_plan
from ..functional.lolcats_decoding import (
    LolcatsStepWeights,
    lolcats_prefill_unchecked,
    lolcats_state_layout,
    lolcats_step_unchecked,
    lolcats_step_weights,
)
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .capabilities import PADDED_RIGHT
from .plan_cache import last_plan
from .registry import register
from .window_rotary import RotatedWindow


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@register
class LolcatsAttention(RotatedWindow, Mechanism):
    """LoLCATs' sliding-window-plus-linear attention (Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of
    Large Language Models"): query i takes exact softmax terms ``exp(s_ij - m_i)`` over the ``window`` keys
    ``i - window < j <= i`` (``m_i`` their largest logit) and Hedgehog linear terms ``phi_q(q_i) . phi_k(k_j)``
    over the keys before them, weighs the softmax terms by ``f_h = sigmoid(window_factor_h)`` and normalises
    both with one sum (:mod:`attnzoo.functional.lolcats`). Non-causal: the window is ``|i - j| < window``, the
    linear terms every key beyond it.

    Learned parameters, all trained by attention transfer: ``query_map`` and ``key_map``, one
    :class:`~attnzoo.feature_maps.HedgehogFeatureMap` each (``weight`` (heads, head_dim, feature_dim), the
    identity when ``feature_dim == head_dim``, else ``N(0, 1/head_dim)``; ``bias`` (heads, feature_dim), zeros),
    ``window_factor`` (heads,), and with a ``decay``, ``decay_logit`` (heads,).

    The window factor is LoLCATs' ``window_factors``: a logit per head whose sigmoid multiplies the softmax
    terms, the linear terms keeping weight 1 (their ``affine_attention_factors=False``). It starts at
    ``logit(window_weight)``, 0.1 by default: the value of LoLCATs' released Llama 3 and Mistral conversion
    configs (``init_window_factor: -2.197``, the ``_w01`` in their names), rather than their class default of
    0 (0.5), because those configs are the ones the paper's results come from.

    Options:
        window: keys of the exact window (itself included; also ahead when non-causal).
        feature_dim: projections per head of each Hedgehog map (None: head_dim); 2 * feature_dim features.
        window_weight: the initial ``f_h``, in (0, 1).
        scale: logit scale of the window (None: ``1/sqrt(head_dim)``, as LoLCATs and the models it converts).
        chunk_size: chunk length of the linear part's causal pass.
        sink_tokens: attention sinks (Xiao et al. 2023, StreamingLLM): the first ``sink_tokens`` positions are
            exact keys for every query, in the window's softmax terms (one maximum with the window) and not in
            the linear part; ``0 <= sink_tokens <= window``, 0 (the default): none. A pretrained model puts
            much of each row's weight on its first tokens, which the feature maps approximate badly (see
            docs/conversion.md). The sinks are the row's first positions, padding included: padded on the
            left, a sequence gives other outputs.
        decay: the initial decay ``lambda_h`` of the linear terms, in (0, 1), learned per head as
            ``decay_logit`` (heads,), ``lambda_h = sigmoid(decay_logit_h)``: a key's linear weight is
            multiplied by ``lambda_h`` for every position past the window (not in LoLCATs). None (the default):
            no decay and no such parameter. Bounds the linear part's sum to about ``1 / (1 - lambda_h)`` keys,
            so its balance with the window holds past the lengths a conversion trained on.
        rotate_features: in a layer with a rotary embedding (``MultiHeadAttention(rotary=True)``, as in
            :class:`~attnzoo.pretrained.CausalLM`), whether the feature maps take the rotated queries and keys
            (True, the default, as LoLCATs) or the projected ones (False, as Liger's linear part: the mechanism
            then rotates the window's itself, capability ``own_rotary``, and a feature no longer depends on its
            absolute position, whose angles past the lengths a conversion trained on it never saw). Alone, or
            where the caller rotates, it changes nothing (the Hugging Face drop-in refuses False).
        sparse_cache: LoLA's sparse cache (McDermott et al. 2025): per head, up to ``sparse_cache`` keys that
            have left the window stay exact keys, those the linear state recalls worst (the self-recall error
            ``||v - phi_k(k)^T H / phi_k(k)^T s||``), decided position by position as they leave; the others
            join the linear part (:mod:`attnzoo.functional.sparse_cache`). No parameters: a converted model
            takes it at inference (LoLA's use), its decoding state staying constant in size. 0 (the default):
            none. Causal only (the cache is filled in reading order; ``causal=False`` is refused, naming it). The
            parallel form decides position by position in a loop, so it costs about a decoding step's cache work
            per position.

    Self-attention only (the window pairs positions of one sequence). Grouped keys and values are repeated
    (the maps are per query head, as LoLCATs applies them after repeating). Packed batches: each document
    alone. Decoding state (constant size): the linear state ``kv`` (heads, 2 * feature_dim, head_dim_v + 1) of
    the keys that have left the window, and the window's ring ``k`` (heads, window, head_dim), ``v`` (heads,
    window, head_dim_v) with ``positions`` (window,); with sinks, ``sink_k`` (heads, sink_tokens, head_dim) and
    ``sink_v`` (heads, sink_tokens, head_dim_v); with a sparse cache, its keys, values, features and recalls
    (:func:`~attnzoo.functional.sparse_cache.sparse_cache_layout`), ``kv`` then summing the keys moved out of it.
    """

    name = "lolcats"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N w d + N m d), memory O(N (w + m + d)); w = window, m = 2 feature_dim; "
                   "decoding O(w d + m d) per token",
        summary="LoLCATs: exact sliding-window softmax plus Hedgehog linear attention beyond it, one normalisation "
                "(Zhang et al. 2024)",
        packing=PACKED_SPLIT,
        scale_option="scale",
        causal_rows=True,
    )
    # Small settings; the suite's lengths (up to 11) cross chunk and window-block boundaries.
    test_options = {"window": 3, "feature_dim": 4, "chunk_size": 4}
    test_variants = ({"window": 1, "chunk_size": 3, "window_weight": 0.6, "scale": 0.5},
                     {"window": 3, "sink_tokens": 2, "feature_dim": 4, "chunk_size": 4, "decay": 0.8,
                      "rotate_features": False},
                     {"window": 2, "sink_tokens": 1, "feature_dim": 4, "sparse_cache": 2, "decay": 0.9})

    def __init__(self, heads: int, head_dim: int, *, window: int = 64, feature_dim: Optional[int] = None,
                 window_weight: float = 0.1, scale: Optional[float] = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, sink_tokens: int = 0, decay: Optional[float] = None,
                 rotate_features: bool = True, sparse_cache: int = 0) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        feature_dim = check_number("feature_dim", feature_dim, integer=True, minimum=1, optional=True)
        self.feature_dim = head_dim if feature_dim is None else feature_dim
        weight = check_number("window_weight", window_weight, minimum=0.0, maximum=1.0, exclusive_minimum=True,
                              exclusive_maximum=True)
        self.scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)
        if self.sink_tokens:
            # The sinks are the row's first positions, padding on the left included.
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)
        self.query_map = HedgehogFeatureMap(heads, head_dim, self.feature_dim)
        self.key_map = HedgehogFeatureMap(heads, head_dim, self.feature_dim)
        self.rotate_features = check_bool("rotate_features", rotate_features)
        if not self.rotate_features:
            self.capabilities = replace(self.capabilities, own_rotary=True)
        self.window_factor = nn.Parameter(torch.full((heads,), _logit(weight)))
        decay = check_number("decay", decay, minimum=0.0, maximum=1.0, exclusive_minimum=True,
                             exclusive_maximum=True, optional=True)
        self.decay_logit = None if decay is None else nn.Parameter(torch.full((heads,), _logit(decay)))
        self.sparse_cache = check_number("sparse_cache", sparse_cache, integer=True, minimum=0)
        if self.sparse_cache:
            self.capabilities = self.capabilities.narrowed("sparse_cache", non_causal=False)

    def weights(self) -> LolcatsWeights:
        """The learned parameters as the functional core takes them."""
        return LolcatsWeights(self.query_map.weight, self.query_map.bias, self.key_map.weight, self.key_map.bias,
                              self.window_factor, self.decay_logit)

    def step_weights(self, dtype: torch.dtype) -> LolcatsStepWeights:
        """The parameters as a decoding step takes them, in the working dtype of ``dtype`` inputs: kept while
        no parameter changes (each one's identity, storage, version and device), remade each step when they
        may carry a gradient or have no version (made under ``torch.inference_mode``)."""
        weights, dtype = self.weights(), working_dtype(dtype)
        present = [w for w in weights if w is not None]
        # Parameters made under inference_mode have no version to key on: those are remade each step too.
        if (torch.is_grad_enabled() and any(w.requires_grad for w in present)) or torch.compiler.is_compiling() \
                or any(w.is_inference() for w in present):
            return lolcats_step_weights(weights, dtype)
        key = (dtype, *((id(w), w.data_ptr(), w._version, w.device) for w in present))
        return last_plan(self, "_step_weights", key, lambda: lolcats_step_weights(weights, dtype))

    def _apart(self, q: Tensor, k: Tensor, start: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The window's queries and keys when they differ from the features' (rotated here), else (None, None)."""
        return self._window_inputs(q, k, start) if self.rotates_window else (None, None)

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The window's block plan, the last one kept while the length, causality and device stay."""
        return last_plan(self, "_plan", (length, causal, device),
                         lambda: window_plan(self.window, length, causal, device))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        return lolcats_attention_unchecked(q, k, v, self.weights(), self.window, causal, key_padding_mask,
                                           self.scale, self.chunk_size, plan, self.sink_tokens,
                                           *self._apart(q, k, 0), self.sparse_cache)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Float64 quadratic maths (:func:`~attnzoo.functional.lolcats.lolcats_attention_reference`)."""
        return lolcats_attention_reference(q, k, v, self.weights(), self.window, causal, key_padding_mask,
                                           self.scale, self.sink_tokens, *self._apart(q, k, 0), self.sparse_cache)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        return lolcats_state_layout(self.heads, self.head_dim, self.feature_dim, self.window, dtype, value_width,
                                    self.sink_tokens, self.rotates_window, self.sparse_cache)

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        plan = self.plan(q.shape[2], True, q.device)
        return lolcats_prefill_unchecked(q, k, v, self.weights(), self.window, self.scale, self.chunk_size, plan,
                                         self.sink_tokens, *self._apart(q, k, 0), self.sparse_cache)

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        return lolcats_step_unchecked(q_t, k_t, v_t, self.step_weights(v_t.dtype), self.window, self.scale,
                                      tensors, length, self.sink_tokens, *self._apart(q_t, k_t, length),
                                      self.sparse_cache)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}, feature_dim={self.feature_dim}, scale={self.scale}, "
                f"chunk_size={self.chunk_size}" + (f", sink_tokens={self.sink_tokens}" if self.sink_tokens else "")
                + ("" if self.decay_logit is None else ", decay=learned")
                + ("" if self.rotate_features else ", rotate_features=False")
                + (f", sparse_cache={self.sparse_cache}" if self.sparse_cache else ""))

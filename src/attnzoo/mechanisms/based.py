"""``based`` (Arora et al. 2024): second-order Taylor linear attention on projected features plus a small
exact sliding window, summed. The maths is in :mod:`attnzoo.functional.based`."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_positive_int
from ..functional.based import (
    based_attention_reference,
    based_attention_unchecked,
    based_prefill_unchecked,
    based_state_layout,
    based_step_unchecked,
)
from ..functional.blocksparse import BlockPlan, blocksparse_plan, window_pattern
from ..functional.linear import DEFAULT_CHUNK_SIZE
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .plan_cache import last_plan
from .registry import register


@register
class BasedAttention(Mechanism):
    """Based (Arora et al. 2024): ``phi(q') . phi(k)`` linear attention with the Taylor map ``phi(x) = [1, x,
    vec(x x^T) / sqrt(2)]`` on queries and keys projected per head to ``feature_dim`` features (``q'`` scaled by
    ``feature_dim ** -0.5``), normalised, plus exact softmax over a sliding window of ``window`` keys; the two
    outputs are summed (the paper's hybrid stacks them as layers; see :mod:`attnzoo.functional.based`).

    The projections are learned, ``(heads, head_dim, feature_dim)`` for queries and keys each, initialised
    ``N(0, 1 / head_dim)``: the paper projects the layer input to 16 features, a mechanism sees only q and k, so
    it projects those.

    Options:
        feature_dim: projected features per head (m; the linear state holds 1 + m + m^2 rows).
        window: keys of the exact sliding window (itself included; also ahead when non-causal).
        chunk_size: chunk length of the causal linear path.

    Self-attention only (the window pairs positions of one sequence). Grouped keys and values are repeated
    (each query head projects its keys with its own map). Packed batches: each document alone. Decoding state
    (constant size): the linear part's ``kv`` (heads, 1 + m + m^2, head_dim_v + 1) and ``log_scale``, and the
    window's ring ``k`` (heads, window, head_dim), ``v`` (heads, window, head_dim_v) with ``positions`` (window,).
    """

    name = "based"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N m^2 d + N w d), memory O(N (m^2 + w)); m = feature_dim, w = window; "
                   "decoding O(m^2 d + w d) per token",
        summary="Based: 2nd-order Taylor linear attention plus a small exact sliding window (Arora et al. 2024)",
        packing=PACKED_SPLIT,
    )
    # Small settings; the suite's lengths (up to 11) cross chunk and window-block boundaries.
    test_options = {"feature_dim": 4, "window": 3, "chunk_size": 4}
    test_variants = ({"feature_dim": 2, "window": 1, "chunk_size": 3},)

    def __init__(self, heads: int, head_dim: int, *, feature_dim: int = 16, window: int = 64,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim)
        self.feature_dim = check_positive_int("feature_dim", feature_dim)
        self.window = check_positive_int("window", window)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        std = 1.0 / math.sqrt(head_dim)
        self.q_proj = nn.Parameter(torch.randn(heads, head_dim, self.feature_dim) * std)
        self.k_proj = nn.Parameter(torch.randn(heads, head_dim, self.feature_dim) * std)

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The window's block plan, the last one kept while the length, causality and device stay."""
        return last_plan(self, "_plan", (length, causal, device),
                         lambda: blocksparse_plan(window_pattern(self.window), length, causal, device))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        out = based_attention_unchecked(q, k, v, self.q_proj, self.k_proj, self.window, causal, key_padding_mask,
                                        self.chunk_size, plan)
        return out.to(q.dtype)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Float64 quadratic maths (:func:`~attnzoo.functional.based.based_attention_reference`)."""
        return based_attention_reference(q, k, v, self.q_proj, self.k_proj, self.window, causal, key_padding_mask)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        return based_state_layout(self.heads, self.head_dim, self.feature_dim, self.window, dtype, value_width)

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        plan = self.plan(q.shape[2], True, q.device)
        out, state = based_prefill_unchecked(q, k, v, self.q_proj, self.k_proj, self.window, self.chunk_size, plan)
        return out.to(q.dtype), state

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        out, state = based_step_unchecked(q_t, k_t, v_t, self.q_proj, self.k_proj, self.window, tensors, length)
        return out.to(q_t.dtype), state

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, feature_dim={self.feature_dim}, window={self.window}, "
                f"chunk_size={self.chunk_size}")

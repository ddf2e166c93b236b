"""Nyström attention (Xiong et al. 2021): softmax attention through segment-mean landmarks and an iterative
pseudo-inverse, O(N m) instead of O(N^2). The maths lives in :mod:`attnzoo.functional.nystrom`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .._validation import check_number, check_positive_int
from ..functional.nystrom import (
    DEFAULT_LANDMARKS,
    DEFAULT_PINV_ITERATIONS,
    nystrom_attention_reference,
    nystrom_attention_unchecked,
)
from .base import APPROXIMATE, PACKED_SPLIT, Capabilities, Mechanism
from .capabilities import PADDED_NEITHER
from .registry import register


@register
class NystromAttention(Mechanism):
    """Nyström approximation of softmax attention: ``softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V``
    with landmarks ``Q~``, ``K~`` the means of m contiguous segments of the queries and keys.

    Takes q, k (batch, heads, seq, head_dim) and v (batch, heads, seq_kv, head_dim_v); returns (batch, heads,
    seq_q, head_dim_v). Non-causal only (a segment mean mixes later positions into earlier ones). Cross-attention
    takes the query landmarks from the queries and the key landmarks from the keys. In self-attention the key
    padding mask is also the query padding: padded positions are left out of both landmark sets.

    Options:
        landmarks: m, the number of landmarks per sequence (one per position when the sequence is shorter, which
            makes the output exact softmax attention up to the pseudo-inverse iteration's error).
        pinv_iterations: iterations of the paper's Moore-Penrose iteration (computed in float32 at least).
        conv_kernel: None, or an odd kernel length: adds a learned depthwise convolution over the sequence of
            each head's values to the output (the paper's residual). Self-attention only.
    """

    name = "nystrom"
    capabilities = Capabilities(
        # The landmarks are means of segments of the padded row, whose length sets the segments.
        padding_invariance=PADDED_NEITHER,
        causal=False,
        cross=True,
        key_padding=True,
        recurrent_step=False,
        kind=APPROXIMATE,
        complexity="time O(N m d + m^3) for m landmarks, memory O(N d + m^2) (fused kernels)",
        summary="Nyström landmarks (segment means) with an iterative pseudo-inverse (Xiong et al. 2021)",
        packing=PACKED_SPLIT,
    )
    sweep_option = "landmarks"
    # 4 landmarks over the suite's 11 positions make uneven segments (3, 3, 3, 2), and its padding pattern
    # leaves one of them empty; 16 > 11 gives one landmark per position.
    test_options = {"landmarks": 4}
    test_variants = ({"landmarks": 16, "pinv_iterations": 3}, {"landmarks": 4, "conv_kernel": 3})

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        landmarks: int = DEFAULT_LANDMARKS,
        pinv_iterations: int = DEFAULT_PINV_ITERATIONS,
        conv_kernel: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.landmarks = check_positive_int("landmarks", landmarks)
        self.pinv_iterations = check_positive_int("pinv_iterations", pinv_iterations)
        self.conv_kernel = check_number("conv_kernel", conv_kernel, integer=True, minimum=1, optional=True)
        if self.conv_kernel is not None and self.conv_kernel % 2 == 0:
            raise ValueError(f"conv_kernel must be odd (the output keeps the sequence length), got {conv_kernel!r}")
        if self.conv_kernel is None:
            self.register_parameter("conv_weight", None)
        else:
            # One kernel per head, shared by the head's channels; nn.Conv2d's default initialisation
            # (uniform in +-1/sqrt(fan_in), fan_in = kernel), drawn from the global RNG.
            bound = 1.0 / math.sqrt(self.conv_kernel)
            self.conv_weight = nn.Parameter(torch.empty(heads, self.conv_kernel).uniform_(-bound, bound))
            # The residual adds each query position's own values: the queries and values of one sequence.
            self.capabilities = self.capabilities.narrowed(f"conv_kernel={self.conv_kernel}", cross=False)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs and __init__ the options: validate once. In self-attention a padded
        # key is a padded query too, left out of the query landmarks.
        query_padding_mask = None if cross else key_padding_mask
        return nystrom_attention_unchecked(
            q, k, v, key_padding_mask, query_padding_mask, self.landmarks, self.pinv_iterations, self.conv_weight
        )

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Dense float64 maths, one (batch, head) at a time, with the pseudo-inverse by the same number of
        iterations of the paper's method: the exact ``torch.linalg.pinv`` differs from a few iterations by far
        more than the float64 comparison allows (the iteration is the method, not a rounding of it); the
        functional reference takes ``pinv_iterations=None`` for the exact pseudo-inverse."""
        return nystrom_attention_reference(
            q,
            k,
            v,
            key_padding_mask,
            landmarks=self.landmarks,
            pinv_iterations=self.pinv_iterations,
            query_padding_mask=None if cross else key_padding_mask,
            conv_weight=self.conv_weight,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, landmarks={self.landmarks}, pinv_iterations={self.pinv_iterations}, "
            f"conv_kernel={self.conv_kernel}"
        )

"""Attention Free Transformer (Zhai et al. 2021): each feature of the values averaged by a softmax over positions
of the keys plus learned position biases, gated by the sigmoid of the query. No query-key dot product."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_choice, check_positive_int
from ..functional.aft import (
    DEFAULT_CHUNK_SIZE,
    aft_full_unchecked,
    aft_local_unchecked,
    aft_reference,
    aft_simple_prefill_unchecked,
    aft_simple_step_unchecked,
    aft_simple_unchecked,
    local_position_bias,
)
from .base import NO_GROUPED_KV, OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .capabilities import PADDED_RIGHT
from .registry import register

VARIANTS = ("simple", "full", "local")

POSITION_BIAS_INIT_STD = 0.02
"""Standard deviation of the initial position biases: small, so that a fresh AFT-full or AFT-local starts
close to AFT-simple and learns its position preferences from there."""


@register
class AttentionFreeTransformer(Mechanism):
    """AFT (Zhai et al. 2021, "An Attention Free Transformer"), per head on q, k, v of head_dim d:

        Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt')   (elementwise over d)

    An attention of its own (``kind="own"``). Shapes: q, k, v (batch, heads, seq, head_dim) -> (batch, heads,
    seq_q, head_dim). Padded keys leave every sum; a query that sees no key outputs zeros.

    Options:
        variant: ``"simple"`` (``w = 0``: O(N d), causal by running sums with a recurrent step, cross-attention
            too), ``"full"`` (a learned (max_seq_len, max_seq_len) bias matrix per head: O(N^2 d) time, O(N^2)
            memory) or ``"local"`` (biases learned only where ``|t - t'| < window``, 0 beyond, as in the
            paper: distant keys still count, with weight ``exp(K_t')``; O(N b d) time, b = max(chunk_size,
            window)). full and local weigh pairs of positions of one sequence: no cross-attention, no
            recurrent step.
        max_seq_len: the longest sequence full and local accept (their bias matrices' size; the instance's
            ``max_length``); unused by simple.
        window: local's band half-width: biases for ``|t - t'| < window`` (``window=1``: the diagonal only).
        chunk_size: chunk length of the causal paths (see :mod:`attnzoo.functional.aft`); full: query rows
            per block of the causal path; local: the least block length.

    Parameters: ``position_bias``, (heads, max_seq_len, max_seq_len) for full, (heads, max_seq_len,
    2 * min(window, max_seq_len) - 1) for local (row t holds ``w[t, t - window + 1 .. t + window - 1]``),
    none for simple; initialised from a normal of standard deviation :data:`POSITION_BIAS_INIT_STD`.

    Decoding state (simple): ``{"num": (batch, heads, head_dim), "den": (batch, heads, head_dim), "max":
    (batch, heads, head_dim)}`` (float32 for half-precision inputs): the running sums of ``exp(K - max) V``
    and ``exp(K - max)`` and the running maximum of the keys, O(d) per token.
    """

    name = "aft"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="simple: O(N d), decoding O(d) per token; full: time O(N^2 d), memory O(N^2); local: "
                   "O(N b d), b = max(chunk_size, window)",
        summary="attention free transformer: sigmoid(q) gates a per-feature softmax over positions of k + w "
                "(Zhai et al. 2021)",
        # Learned per-head position biases along the sequence act on each head's keys: no sharing.
        grouped_kv=NO_GROUPED_KV,
        packing=PACKED_SPLIT,
        # Each value feature is gated by the query feature of the same index: no other value width fits.
        any_value_width=False,
    )
    length_option = "max_seq_len"
    # chunk_size 4: the suite's lengths (up to 11) cross several chunk boundaries of the causal paths.
    test_options: ClassVar[Dict[str, object]] = {"chunk_size": 4}
    test_variants: ClassVar[Tuple[Dict[str, object], ...]] = (
        {"variant": "full", "max_seq_len": 12, "chunk_size": 4},
        {"variant": "local", "max_seq_len": 12, "window": 3, "chunk_size": 4},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        variant: str = "simple",
        max_seq_len: int = 512,
        window: int = 32,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim)
        self.variant = check_choice("variant", variant, VARIANTS)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self.window = check_positive_int("window", window)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.position_bias: Optional[nn.Parameter]
        if self.variant == "simple":
            self.register_parameter("position_bias", None)
            return
        # Offsets beyond the sequence cannot occur: the band is at most as wide as the full matrix.
        width = self.max_seq_len if self.variant == "full" else 2 * self.band_radius - 1
        self.position_bias = nn.Parameter(torch.randn(heads, self.max_seq_len, width) * POSITION_BIAS_INIT_STD)
        self.capabilities = self.capabilities.narrowed(f"variant={self.variant!r}", cross=False, recurrent_step=False)
        # Its biases are learned per position counted from the row's start: padding on the left moves them.
        self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)

    @property
    def band_radius(self) -> int:
        """local: the window that can occur in a sequence of at most max_seq_len positions."""
        return min(self.window, self.max_seq_len)

    @property
    def max_length(self) -> Optional[int]:
        return None if self.variant == "simple" else self.max_seq_len

    def dense_position_bias(self, length: int) -> Tensor:
        """full, local: the (heads, length, length) bias matrix ``w`` of the first ``length`` positions."""
        if self.position_bias is None:
            raise ValueError(f"{self.name} with variant={self.variant!r} has no position biases")
        if self.variant == "full":
            return self.position_bias[:, :length, :length]
        return local_position_bias(self.position_bias, length, self.band_radius)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs and __init__ the options: the unchecked cores validate nothing twice.
        if self.variant == "simple":
            return aft_simple_unchecked(q, k, v, causal, key_padding_mask, self.chunk_size)
        if self.variant == "local":
            return aft_local_unchecked(
                q, k, v, self.position_bias, self.band_radius, causal, key_padding_mask, self.chunk_size
            )
        return aft_full_unchecked(q, k, v, self.dense_position_bias(q.shape[2]), causal, key_padding_mask,
                                  self.chunk_size)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Dense float64 form (:func:`attnzoo.functional.aft.aft_reference`) with ``w`` written out entry by
        entry from this instance's parameters."""
        bias = None
        if self.position_bias is not None:
            n = q.shape[2]
            learned = self.position_bias.double()
            bias = torch.zeros(self.heads, n, n, dtype=torch.float64, device=learned.device)
            for t in range(n):
                for u in range(n):
                    if self.variant == "full":
                        bias[:, t, u] = learned[:, t, u]
                    elif abs(t - u) < self.window:
                        bias[:, t, u] = learned[:, t, u - t + self.band_radius - 1]
        return aft_reference(q, k, v, bias, causal, key_padding_mask)

    # -- decoding (simple) ---------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        work = working_dtype(dtype)
        return {name: ((self.heads, self.head_dim), work) for name in ("num", "den", "max")}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        return aft_simple_step_unchecked(q_t, k_t, v_t, tensors)

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        return aft_simple_prefill_unchecked(q, k, v, self.chunk_size)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, variant={self.variant!r}, max_seq_len={self.max_seq_len}, "
            f"window={self.window}, chunk_size={self.chunk_size}"
        )

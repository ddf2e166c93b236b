"""Efficient attention (Shen et al. 2021): softmax of the queries over their features, of the keys over the
positions, and ``K^T V`` first, in time and memory linear in the sequence length."""

from __future__ import annotations

from typing import Callable, ClassVar, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_positive_int
from ..functional.grouped import grouped_query_attention, per_query_group
from ..functional.efficient import (
    DEFAULT_CHUNK_SIZE,
    efficient_attention_prefill_unchecked,
    efficient_attention_reference,
    efficient_attention_step_unchecked,
    efficient_attention_unchecked,
)
from .base import NATIVE_KV, OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .registry import register


@register
class EfficientAttention(Mechanism):
    """Efficient attention (Shen et al. 2021, "Efficient Attention: Attention with Linear Complexities").

    ``out = rho_q(Q) (rho_k(K)^T V)``: each query's softmax over its head_dim features mixes d global context
    vectors, row j of ``rho_k(K)^T V`` being the values averaged with the softmax of key feature j over the
    positions. An attention of its own (``kind="own"``), not an approximation of softmax attention; no
    ``1/sqrt(d)`` scale (the paper's softmax normalisation has none).

    Shapes: q, k (batch, heads, seq, head_dim), v (batch, heads, seq_kv, head_dim) -> (batch, heads, seq_q,
    head_dim). Causal: each key feature's softmax runs over the query's prefix (chunked, see
    :mod:`attnzoo.functional.efficient`). Padded keys leave every softmax; a query seeing no key outputs zeros.

    Options:
        chunk_size: chunk length of the causal path (speed only; see the module above for the extreme keys,
            a running maximum rising by ~80 within one chunk in float32, where it matters).

    Decoding state: ``{"num": (batch, heads, head_dim, head_dim_v), "den": (batch, heads, head_dim), "max":
    (batch, heads, head_dim)}`` (float32 for half-precision inputs): each feature's running numerator and
    normaliser, shifted by its running maximum. O(d^2) per token whatever the context length.

    Grouped keys/values (``kv_heads`` < ``heads``) are native: the key softmaxes and ``rho_k(K)^T V`` depend on
    the key/value head alone, so its query heads read one summary (:mod:`attnzoo.functional.grouped`) and the
    decoding state holds ``kv_heads`` heads.
    """

    name = "efficient"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2), memory O(N d); decoding O(d^2) per token",
        summary="softmax of queries over features, of keys over positions, K^T V first (Shen et al. 2021)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_SPLIT,
    )
    # chunk_size 4: the suite's lengths (up to 11) cross several chunk boundaries of the causal path.
    test_options: ClassVar[Dict[str, object]] = {"chunk_size": 4}

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs and __init__ the options: the unchecked core validates nothing twice.
        def attend_queries(queries: Tensor, masked: bool) -> Tensor:
            return efficient_attention_unchecked(queries, k, v, masked, key_padding_mask, self.chunk_size)

        if k.shape[1] != q.shape[1]:
            return grouped_query_attention(attend_queries, q, k.shape[1], causal)
        return attend_queries(q, causal)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Dense float64 form: the (seq_q, seq_kv) attention matrix from explicit softmaxes
        (:func:`attnzoo.functional.efficient.efficient_attention_reference`)."""
        return efficient_attention_reference(q, k, v, causal, key_padding_mask)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        work = working_dtype(dtype)
        heads = self.heads if kv_heads is None else kv_heads  # the key/value heads the summaries belong to
        return {
            "num": ((heads, self.head_dim, self.value_width(value_width)), work),
            "den": ((heads, self.head_dim), work),
            "max": ((heads, self.head_dim), work),
        }

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        return self._per_query_group(
            lambda queries: efficient_attention_step_unchecked(queries, k_t, v_t, tensors), q_t, k_t.shape[1])

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        return self._per_query_group(
            lambda queries: efficient_attention_prefill_unchecked(queries, k, v, self.chunk_size), q, k.shape[1])

    @staticmethod
    def _per_query_group(
        run: Callable[[Tensor], Tuple[Tensor, Dict[str, Tensor]]], q: Tensor, kv_heads: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        """``run`` (queries of ``kv_heads`` heads -> output, state) for every query head: once, or once per
        member of each query group; the state, which reads the keys alone, is the same for every member."""
        if kv_heads == q.shape[1]:
            return run(q)
        states = []

        def output(queries: Tensor) -> Tensor:
            out, state = run(queries)
            states.append(state)
            return out

        return per_query_group(output, q, kv_heads), states[-1]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"

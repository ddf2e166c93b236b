"""Sparse Sinkhorn attention (Tay et al. 2020) as a mechanism: the learned sorting layer and the wiring; the
maths is in :mod:`attnzoo.functional.sinkhorn`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .._validation import check_number, check_positive_int
from ..functional.sinkhorn import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_ITERATIONS,
    DEFAULT_TEMPERATURE,
    sinkhorn_attention_reference,
    sinkhorn_attention_unchecked,
)
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism
from .capabilities import PADDED_NEITHER
from .registry import register


@register
class SinkhornAttention(Mechanism):
    """Sparse Sinkhorn attention: each query block attends to its own block and to a softly sorted block.

    Keys are cut into blocks of ``block_size`` positions. A sorting network scores every (query block, key
    block) pair from block summaries (the mean unpadded query of the query block through a learned per-head
    linear layer, dotted with the mean unpadded key of the key block); Sinkhorn balancing in log space turns
    the scores into a soft block permutation ``P`` (approximately doubly stochastic). Slot ``t`` of query block
    ``i``'s sorted block is the ``P[i]``-weighted average of the ``t``-th keys (and values) of the blocks, and
    each query attends, by softmax, to ``[sorted block, local block]``: ``2 * block_size`` keys.

    Options:
        block_size: positions per block. A length that is not a multiple is padded internally (the padding is
            invisible); a block at least as long as the sequence makes this exact softmax attention.
        sinkhorn_iterations: rounds of row and column normalisation.
        temperature: divides the sorting logits (> 0); lower is closer to a hard permutation. No Gumbel noise
            is added: nothing is random at call time.
        sortcut: SortCut: every query attends only to the keys of the first ``sortcut`` sorted blocks (no local
            block); non-causal only. None: the plain form.

    Causal: a query block sorts among strictly earlier blocks only, its row summary is the mean of the queries
    before it, and row ``i`` of ``P`` is balanced over the ``i x i`` past alone (causal Sinkhorn balancing, see
    the functional module); the local block is causally masked. Self-attention only (blocks pair query and key
    positions of one sequence). No decoding state: the sorting of a block is fixed only once it is complete.

    Parameters: ``sort_weight`` (heads, head_dim, head_dim) and ``sort_bias`` (heads, head_dim), drawn like
    ``nn.Linear``'s from the global generator.

    Shapes: q, k (batch, heads, seq, head_dim), v (batch, heads, seq, head_dim_v) -> (batch, heads, seq,
    head_dim_v).
    """

    name = "sinkhorn"
    capabilities = Capabilities(
        # Its block grid starts at the row's start and the sorting normalises over every block of the row.
        padding_invariance=PADDED_NEITHER,
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N b d + N^2 d / b), memory O(N d + N b); causal balancing adds time O((N/b)^3) per "
        "Sinkhorn round and memory O((N/b)^3) (b = block_size)",
        summary="sparse Sinkhorn attention: learned soft block sorting plus local blocks (Tay et al. 2020)",
        packing=PACKED_SPLIT,
    )
    test_options = {"block_size": 4, "sinkhorn_iterations": 3}
    test_variants = (
        {"block_size": 4, "sinkhorn_iterations": 3, "sortcut": 2},
        {"block_size": 3, "sinkhorn_iterations": 5, "temperature": 0.3},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        sinkhorn_iterations: int = DEFAULT_ITERATIONS,
        temperature: float = DEFAULT_TEMPERATURE,
        sortcut: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.block_size = check_positive_int("block_size", block_size)
        self.sinkhorn_iterations = check_positive_int("sinkhorn_iterations", sinkhorn_iterations)
        self.temperature = check_number("temperature", temperature, minimum=0.0, exclusive_minimum=True)
        self.sortcut = check_number("sortcut", sortcut, integer=True, minimum=1, optional=True)
        if self.sortcut is not None:
            # Every query attends to the first sorted blocks, which mix in keys from anywhere in the sequence.
            self.capabilities = self.capabilities.narrowed(f"sortcut={self.sortcut}", causal=False)
        # The sorting network's per-head linear layer, initialised as nn.Linear initialises its weights.
        bound = 1.0 / math.sqrt(head_dim)
        self.sort_weight = nn.Parameter(torch.empty(heads, head_dim, head_dim).uniform_(-bound, bound))
        self.sort_bias = nn.Parameter(torch.empty(heads, head_dim).uniform_(-bound, bound))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs (self-attention, equal lengths) and __init__ the options: validate once.
        return sinkhorn_attention_unchecked(
            q, k, v, self.sort_weight, self.sort_bias, self.block_size, self.sinkhorn_iterations, self.temperature,
            causal, key_padding_mask, self.sortcut,
        )

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        return sinkhorn_attention_reference(
            q, k, v, self.sort_weight, self.sort_bias, block_size=self.block_size,
            iterations=self.sinkhorn_iterations, temperature=self.temperature, causal=causal,
            key_padding_mask=key_padding_mask, sortcut=self.sortcut,
        )

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, sinkhorn_iterations={self.sinkhorn_iterations}, "
                f"temperature={self.temperature}, sortcut={self.sortcut}")

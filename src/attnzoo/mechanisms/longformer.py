"""Longformer attention (Beltagy et al. 2020) as a mechanism: a sliding window on the blockwise core of the
fixed sparse patterns (:mod:`.sparse`), plus global positions beside it, which may differ between the elements
of a batch (:mod:`attnzoo.functional.longformer`)."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_indices, check_number, check_positive_int
from ..functional.blocksparse import BlockPlan, PackedBlockPlan, default_block
from ..functional.longformer import (
    GlobalPositions,
    gather_global_positions,
    longformer_attention_reference,
    longformer_attention_unchecked,
    longformer_block_mask,
    out_of_range,
    packed_longformer_attention_unchecked,
    packed_static_global_mask,
    packed_window_plan,
    static_global_mask,
    window_plan,
)
from .base import NATIVE_KV, OWN, PACKED_NATIVE, REPEAT_KV, CallInput, Capabilities, Mechanism
from .capabilities import PADDED_NEITHER, PADDED_RIGHT
from .registry import register
from .plan_cache import last_plan
from .sparse_checks import check_block_size


@register
class LongformerAttention(Mechanism):
    """Longformer attention (Beltagy et al. 2020): a sliding window plus global positions.

    Query i attends to keys j with ``|i - j| < window`` (causally the ``window`` positions up to itself) and to
    every global position; a global position's query attends to every key. Causally a global position is seen
    only by the queries at or after it, and a global query sees the keys up to itself. A padded key is never
    attended, even at a global position (padding wins). See :mod:`attnzoo.functional.longformer`.

    Which positions are global: the union of

    * the first ``global_tokens`` positions (e.g. a [CLS] token at position 0),
    * the positions ``global_indices`` (a negative index counts from the end: ``-1`` is the last position,
      e.g. a summary token), fixed at construction,
    * and, per call, ``forward(..., global_mask=...)``: a (batch, seq) bool tensor, True marking a global
      position of that batch element (so each element may have its own; build with ``global_tokens=0`` to let
      the mask alone decide). ``MultiHeadAttention.forward`` passes it on (``global_mask`` is in
      :attr:`call_inputs`).

    An index of ``global_indices`` outside ``[-seq, seq)`` for a call's sequence length is refused
    (:class:`~attnzoo.UnsupportedOptionError` naming ``global_indices``), never dropped; two indices that name
    the same position at some length (``0`` and ``-seq``) simply name it once.

    Options:
        window: as :class:`LocalAttention`'s (>= 1).
        global_tokens: how many leading positions are global (>= 0; 0 with no other global position is plain
            local attention).
        global_indices: further global positions, a tuple of distinct ints, or None for none.
        global_projections: separate projections for the global attention, as in the paper: learned per-head
            (head_dim x head_dim) maps ``query_global``, ``key_global``, ``value_global`` (parameters of shape
            (heads, head_dim, head_dim), initialised to the identity, so the option starts equal to the plain
            form). A global query's row is ``softmax((q_i Wq)(K Wk)^T / sqrt(head_dim)) (V Wv)`` over every
            key, with q_i, K, V the given per-head tensors and ``x @ W[h]`` per head; every other row uses the
            plain q, k, v, for its window and for the global keys alike. The values' head_dim must then equal
            head_dim.
        block_size: positions per block of the window part (a speed knob; the output does not depend on it).
            None: ``min(window, 64)`` (:data:`attnzoo.functional.blocksparse.DEFAULT_BLOCK`).

    Time and memory O(N (window + G)) for G global positions (the most of any batch element), nothing N x N.
    The count G of a ``global_mask`` is read from its values (one host synchronisation per call), so a call
    with ``global_mask`` cannot be traced by ``torch.jit.trace`` (refused) though ``global_tokens`` and
    ``global_indices`` can. Self-attention only; no decoding state.
    """

    name = "longformer"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N (w + g)), memory O(N (w + g))",
        summary="sliding window plus global positions by count, index or per-call mask, optional separate "
                "global projections (Beltagy et al. 2020)",
        packing=PACKED_NATIVE,
        grouped_kv=NATIVE_KV,
        dot_product_logits=True,
    )
    call_inputs = (CallInput(
        "global_mask", "further global positions of each batch element for this call",
        untraceable="the number of global positions is read from its values",
    ),)
    # Index -1 is in range at every length: the property tests run test_options from one position up.
    test_options = {"window": 2, "global_tokens": 1, "global_indices": (-1,), "block_size": 2}
    test_variants = (
        {"window": 3, "global_tokens": 0, "block_size": 4},
        {"window": 4, "global_tokens": 5, "block_size": 3},
        {"window": 2, "global_tokens": 0, "global_indices": (2, -2), "block_size": 2},
        {"window": 3, "global_tokens": 1, "global_indices": (-1, 3), "global_projections": True, "block_size": 2},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        window: int = 128,
        global_tokens: int = 1,
        global_indices: Optional[Tuple[int, ...]] = None,
        global_projections: bool = False,
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.window = check_positive_int("window", window)
        self.global_tokens = check_number("global_tokens", global_tokens, integer=True, minimum=0)
        self.global_indices = () if global_indices is None else check_indices("global_indices", global_indices)
        self.global_projections = check_bool("global_projections", global_projections)
        self.block_size = check_block_size(block_size)
        # Global positions are counted in the row: from its start (global_tokens, indices >= 0), moved by padding
        # on the left, or from its end (indices < 0), moved by padding on either side.
        if any(index < 0 for index in self.global_indices):
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_NEITHER)
        elif self.global_tokens or self.global_indices:
            self.capabilities = replace(self.capabilities, padding_invariance=PADDED_RIGHT)
        if self.global_projections:
            # Per query head maps of the keys and values: grouped keys and values are repeated for them, and
            # the value map is (head_dim x head_dim).
            self.capabilities = self.capabilities.narrowed("global_projections=True", grouped_kv=REPEAT_KV,
                                                           any_value_width=False)
            identity = torch.eye(head_dim).expand(heads, head_dim, head_dim)
            self.query_global = nn.Parameter(identity.clone())
            self.key_global = nn.Parameter(identity.clone())
            self.value_global = nn.Parameter(identity.clone())

    def projections(self) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """(Wq, Wk, Wv) of the global attention, each (heads, head_dim, head_dim), or None without them."""
        if not self.global_projections:
            return None
        return self.query_global, self.key_global, self.value_global

    def plan(self, length: int, causal: bool, device: torch.device) -> Tuple[BlockPlan, GlobalPositions, Tensor]:
        """The window's block plan, the fixed global positions (``global_tokens``, ``global_indices``) and the
        block mask of a call without ``key_padding_mask`` or ``global_mask``, reused while the length, causality
        and device stay the same (the last ones are kept: O(N (window + G)) bools)."""

        def make() -> Tuple[BlockPlan, GlobalPositions, Tensor]:
            plan = window_plan(self.window, default_block(self.window, self.block_size), length, causal, device)
            fixed = static_global_mask(length, self.global_tokens, self.global_indices, device)
            fixed = gather_global_positions(fixed.view(1, length))
            return plan, fixed, longformer_block_mask(plan, self.window, fixed, causal, None)

        return last_plan(self, "_plan", (length, causal, device), make)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool, *,
        global_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """The window and the global positions: those of the options, plus ``global_mask``'s (the per-call input)."""
        return self._attend(q, k, v, causal, key_padding_mask, global_mask)

    def attend_packed(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]], *,
        global_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Each document with the global positions it has alone, plus those ``global_mask`` (1, seq) marks in the
        row."""
        return self._attend_packed(q, k, v, causal, spans, global_mask)

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]],
                       global_mask: Optional[Tensor]) -> Tensor:
        def make() -> Tuple[PackedBlockPlan, Tensor]:
            block = default_block(self.window, self.block_size)
            fixed = packed_static_global_mask(spans, self.global_tokens, self.global_indices, q.device)
            return packed_window_plan(self.window, block, spans, causal, q.device), fixed

        plan, fixed = last_plan(self, "_packed_plan", (tuple(spans), causal, q.device), make)
        mask = fixed if global_mask is None else fixed | global_mask
        return packed_longformer_attention_unchecked(q, k, v, self.window, plan, spans, mask, causal, None,
                                                     self.projections())

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
        global_mask: Optional[Tensor],
    ) -> Tensor:
        plan, fixed, block_mask = self.plan(q.shape[2], causal, q.device)
        if global_mask is not None or key_padding_mask is not None:
            block_mask = None  # made for this call's masks
        if global_mask is not None:
            fixed = gather_global_positions(fixed.mask | global_mask)
        return longformer_attention_unchecked(q, k, v, self.window, plan, fixed, causal, key_padding_mask, None,
                                              self.projections(), block_mask)

    def global_positions(self, batch: int, length: int, global_mask: Optional[Tensor] = None,
                         device: Optional[torch.device] = None) -> Tensor:
        """(batch, length) bool: the global positions of a call (the options' and ``global_mask``'s)."""
        fixed = static_global_mask(length, self.global_tokens, self.global_indices, device)
        mask = fixed.expand(batch, length)
        return mask if global_mask is None else mask | global_mask

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool, *,
        global_mask: Optional[Tensor] = None,
    ) -> Tensor:
        mask = self.global_positions(q.shape[0], q.shape[2], global_mask, q.device)
        return longformer_attention_reference(q, k, v, self.window, mask, causal, key_padding_mask,
                                              global_projections=self.projections())

    def unsupported_reasons(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> List[str]:
        reasons = super().unsupported_reasons(q, k, v, causal, key_padding_mask, cross=cross)
        length = q.shape[2]
        outside = out_of_range(self.global_indices, length)
        if outside:
            reasons.append(f"{self.name}: global_indices {list(outside)} name no position of a sequence of length "
                           f"{length} (an index i needs {-length} <= i < {length})")
        return reasons

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}, global_tokens={self.global_tokens}, "
                f"global_indices={self.global_indices}, global_projections={self.global_projections}, "
                f"block_size={self.block_size}")

"""``nsa``: native sparse attention (Yuan et al. 2025): compressed blocks, top-k selected blocks and a sliding
window, gated per head and position. The maths is in :mod:`attnzoo.functional.nsa`."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ..functional.blocksparse import BlockPlan, blocksparse_plan, window_pattern
from ..functional.nsa import (
    NSABlocks,
    compress,
    nsa_attention_reference,
    nsa_attention_unchecked,
    nsa_branches,
)
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .plan_cache import last_plan
from .registry import register


@register
class NativeSparseAttention(Mechanism):
    """Native sparse attention (Yuan et al. 2025): the gated sum of softmax over compressed block summaries,
    over the ``top_k`` key blocks the compressed scores select, and over a sliding window
    (:mod:`attnzoo.functional.nsa` has the definitions and where they follow the paper).

    Gates: ``sigmoid(q_t . w_{h,b} + c_{h,b})`` per head h and branch b, from the query: the paper computes them
    from the layer input by an MLP, a mechanism sees only q, k and v. Compression: the mean of each block,
    then a learned linear map (dim x dim, shared by the heads, one for keys and one for values), initialised to
    the identity (mean pooling).

    Options:
        compress_block: positions per compressed block (the paper's l = 32).
        compress_stride: positions between compressed blocks (d = 16); must divide compress_block.
        select_block: positions per selectable block (l' = 64); a multiple of compress_stride.
        top_k: blocks each query reads in full (n = 16; its own, the first and the previous always among them).
            Sequences of fewer blocks read all of theirs (the functional form refuses a top_k above the
            sequence's blocks, naming it).
        window: keys of the sliding window (w = 512).
        selection_group: consecutive heads sharing one selection (the paper shares it among the query heads
            of a key/value group); must divide heads.

    Self-attention only (the blocks pair positions of one sequence). Grouped keys and values are repeated.
    With a key padding mask, blocks, the window and causal order are counted over each sequence's unpadded
    positions, so a sequence's output does not depend on the padding of the batch it is in; padded positions
    output zeros.
    Decoding state (growing: each step concatenates its key and value, an O(N) copy, where softmax's cache grows
    in blocks and writes in place): the keys and values ``k``, ``v`` (heads, seq, head_dim) and
    the compressed summaries ``ck``, ``cv`` (heads, n_blocks, head_dim), one appended per ``compress_stride``
    steps; a step costs O(N / d + n l' + w) with the selected blocks gathered (contexts over 128 n l'), O(N)
    below (:mod:`attnzoo.functional.blocksparse.selected`).
    """

    name = "nsa"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N^2 d) (the selected blocks by masked matrix products; O(N n l' d) gathered), "
                   "memory O(N^2 / d + N w); d = compress_stride, n = top_k, l' = select_block, w = window",
        summary="native sparse attention: gated compressed, top-k selected and window branches (Yuan et al. 2025)",
        packing=PACKED_SPLIT,
        # The compression MLP learns weights over the head_dim channels of each block of values.
        any_value_width=False,
    )
    # The suite's lengths (up to 11) hold several compressed and selectable blocks, more than top_k of them.
    test_options = {"compress_block": 4, "compress_stride": 2, "select_block": 2, "top_k": 2, "window": 3}
    test_variants = (
        {"compress_block": 2, "compress_stride": 1, "select_block": 3, "top_k": 1, "window": 1,
         "selection_group": 2},
        {"compress_block": 4, "compress_stride": 4, "select_block": 4, "top_k": 3, "window": 2},
    )

    def __init__(self, heads: int, head_dim: int, *, compress_block: int = 32, compress_stride: int = 16,
                 select_block: int = 64, top_k: int = 16, window: int = 512, selection_group: int = 1) -> None:
        super().__init__(heads, head_dim)
        self.blocks = NSABlocks(compress_block, compress_stride, select_block, top_k, window,
                                selection_group).checked()
        self.blocks.check_heads(heads)
        self.gate_weight = nn.Parameter(torch.randn(heads, 3, head_dim) / math.sqrt(head_dim))
        self.gate_bias = nn.Parameter(torch.zeros(heads, 3))
        self.k_compress = nn.Parameter(torch.eye(head_dim))
        self.v_compress = nn.Parameter(torch.eye(head_dim))

    def gates(self, q: Tensor) -> Tensor:
        """(batch, heads, seq, 3) branch weights in (0, 1) from the queries."""
        logits = torch.einsum("bhnd,hgd->bhng", q, self.gate_weight.to(q.dtype))
        return torch.sigmoid(logits + self.gate_bias.to(q.dtype)[None, :, None, :])

    def plan(self, length: int, causal: bool, device: torch.device) -> BlockPlan:
        """The window's block plan, the last one kept while the length, causality and device stay."""
        pattern = window_pattern(self.blocks.window)
        return last_plan(self, "_plan", (length, causal, device),
                         lambda: blocksparse_plan(pattern, length, causal, device))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        plan = self.plan(q.shape[2], causal, q.device)
        return nsa_attention_unchecked(q, k, v, self.gates(q), self.blocks, self.k_compress, self.v_compress,
                                       causal, key_padding_mask, None, plan)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Float64 with dense masks (:func:`~attnzoo.functional.nsa.nsa_attention_reference`)."""
        gates = self.gates(q.double())
        return nsa_attention_reference(q, k, v, gates, self.blocks, k_weight=self.k_compress,
                                       v_weight=self.v_compress, causal=causal, key_padding_mask=key_padding_mask)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        shape = (self.heads, None, self.head_dim)
        return {name: (shape, dtype) for name in ("k", "v", "ck", "cv")}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        out = self.attend(q, k, v, True, None, False)
        ck, _ = compress(k, self.k_compress, self.blocks, None)
        cv, _ = compress(v, self.v_compress, self.blocks, None)
        return out, {"k": k, "v": v, "ck": ck, "cv": cv}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        if tensors is None:
            tensors = {"k": k_t[:, :, :0], "v": v_t[:, :, :0]}
            tensors["ck"], _ = compress(tensors["k"], self.k_compress, self.blocks, None)
            tensors["cv"], _ = compress(tensors["v"], self.v_compress, self.blocks, None)
        k = torch.cat([tensors["k"], k_t], dim=2)
        v = torch.cat([tensors["v"], v_t], dim=2)
        ck, cv = tensors["ck"], tensors["cv"]
        block_start = length + 1 - self.blocks.compress_block
        if block_start >= 0 and block_start % self.blocks.compress_stride == 0:  # a block completes here
            ck = torch.cat([ck, compress(k[:, :, block_start:], self.k_compress, self.blocks, None)[0]], dim=2)
            cv = torch.cat([cv, compress(v[:, :, block_start:], self.v_compress, self.blocks, None)[0]], dim=2)
        positions = torch.full((1,), length, dtype=torch.long, device=q_t.device)
        out = nsa_branches(q_t, k, v, ck, cv, None, self.gates(q_t), self.blocks, positions, True, None, None)
        return out, {"k": k, "v": v, "ck": ck, "cv": cv}

    def extra_repr(self) -> str:
        b = self.blocks
        return (f"{super().extra_repr()}, compress_block={b.compress_block}, compress_stride={b.compress_stride}, "
                f"select_block={b.select_block}, top_k={b.top_k}, window={b.window}, "
                f"selection_group={b.selection_group}")

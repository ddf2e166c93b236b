"""FLASH's mixed chunk attention (``flash_gau``, Hua et al. 2022, "Transformer Quality in Linear Time"): exact
attention inside chunks plus linear attention across them, on the scale-offset forms of
:class:`attnzoo.mechanisms.gau.ScaleOffsetForms`. Not Dao et al.'s FlashAttention, an exact softmax kernel (the
``softmax`` mechanism runs PyTorch's ``scaled_dot_product_attention``, which uses such kernels where it can);
the name was ``flash`` until it was renamed to say so.

The exact scaling is in :mod:`attnzoo.functional.mixed_chunk`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_positive_int
from ..functional._autocast import without_autocast
from ..functional.mixed_chunk import mixed_chunk_attention_reference, mixed_chunk_attention_unchecked
from .base import OWN, PACKED_SPLIT, Capabilities, StateLayout
from .capabilities import PADDED_RIGHT
from .registry import register
from .gau import ScaleOffsetForms


@without_autocast
def _linear_state(k_lin: Tensor, v: Tensor) -> Tensor:
    """``sum_j k_lin_j v_j^T`` over the positions of (batch, heads, seq, d) ``k_lin`` and (.., seq, e) ``v`` in
    their dtype, the working dtype that :meth:`MixedChunkAttention.state_layout` declares, also under autocast
    (whose matmul would give bfloat16 and the next step would refuse the state)."""
    return torch.matmul(k_lin.transpose(-1, -2), v)


@register
class MixedChunkAttention(ScaleOffsetForms):
    """FLASH's mixed chunk attention (Hua et al. 2022): exact attention inside chunks of ``chunk_size``
    positions plus linear attention across chunks.

    Four scale-offset forms: quadratic query and key (inside the chunk: squared-ReLU weights divided by
    ``chunk_size``, or a softmax), linear query and key (across chunks, no feature map: ``q_lin . (sum_j k_lin_j
    v_j^T)`` divided by ``sqrt(d)`` and by the number of keys summed). Non-causal: the linear part sums every
    key of the sequence; causal: the keys of the previous chunks (prefix sums of the chunk states), with the
    causal mask inside the chunk.

    Options:
        chunk_size: c, positions per chunk (256 in the paper).
        scores: "relu2" (the paper's) or "softmax" inside the chunks.
        rotary: rotary positions on every query and key form.

    Decoding state, of constant size whatever the context: ``{"kv": (batch, heads, head_dim, head_dim_v)``
    (the linear state of the chunks before the current one), ``"chunk_kv"`` (same shape, the current
    chunk's), ``"k": (batch, heads, chunk_size, head_dim)`` and ``"v": (batch, heads, chunk_size,
    head_dim_v)}`` (the current chunk's quadratic key forms and values, slot ``position % chunk_size``).
    """

    name = "flash_gau"
    capabilities = Capabilities(
        # Its chunk grid starts at the row's start: padding on the left moves every chunk boundary.
        padding_invariance=PADDED_RIGHT,
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N c d + N d^2), memory O(N c + (N / c) d^2); c = chunk_size; decoding O(c d + d^2) "
                   "per token",
        summary="FLASH mixed chunk attention: squared-ReLU attention inside chunks plus linear attention across "
                "them, scale-offset forms of shared q/k (Hua et al. 2022)",
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"chunk_size": 3, "scores": "softmax"}, {"chunk_size": 4, "rotary": True})
    forms = (("q_quad", "q"), ("k_quad", "k"), ("q_lin", "q"), ("k_lin", "k"))

    def __init__(
        self, heads: int, head_dim: int, *, chunk_size: int = 256, scores: str = "relu2", rotary: bool = False
    ) -> None:
        super().__init__(heads, head_dim, scores=scores, rotary=rotary)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        f = self.make_forms(q, k, key_padding_mask)
        out = mixed_chunk_attention_unchecked(
            f["q_quad"], f["k_quad"], f["q_lin"], f["k_lin"], v, self.chunk_size, causal, key_padding_mask,
            self.scores,
        )
        return out.to(q.dtype)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        f = self.make_forms(q, k, key_padding_mask, reference=True)
        return mixed_chunk_attention_reference(
            f["q_quad"], f["k_quad"], f["q_lin"], f["k_lin"], v, self.chunk_size, causal, key_padding_mask,
            scores=self.scores,
        )

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        compute = working_dtype(dtype)
        h, c, d, dv = self.heads, self.chunk_size, self.head_dim, self.value_width(value_width)
        return {
            "kv": ((h, d, dv), compute),
            "chunk_kv": ((h, d, dv), compute),
            "k": ((h, c, d), compute),
            "v": ((h, c, dv), compute),
        }

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        f = self.make_forms(q_t, k_t, None, start=length)
        compute = f["q_quad"].dtype
        v_t = v_t.to(compute)
        batch, heads, _, dim = f["q_quad"].shape
        width, c = v_t.shape[3], self.chunk_size
        slot = length % c
        if tensors is None:
            kv = f["k_lin"].new_zeros(batch, heads, dim, width)
            chunk_kv, keys, values = kv, kv.new_zeros(batch, heads, c, dim), kv.new_zeros(batch, heads, c, width)
        else:
            kv, chunk_kv, keys, values = tensors["kv"], tensors["chunk_kv"], tensors["k"], tensors["v"]
            if slot == 0:  # a new chunk starts: the finished one joins the linear state
                kv, chunk_kv = kv + chunk_kv, torch.zeros_like(chunk_kv)
        # Fresh buffers (an O(c) copy, like the attention itself): the previous state stays valid.
        keys, values = keys.clone(), values.clone()
        keys[:, :, slot] = f["k_quad"][:, :, 0]
        values[:, :, slot] = v_t[:, :, 0]
        # Slots after this one hold the previous chunk's positions (or nothing): masked by slot.
        seen = (torch.arange(c, device=keys.device) <= slot).view(1, 1, 1, c)
        quadratic = self._chunk_step(f["q_quad"], keys, values, seen)
        summed = length - slot  # keys in the chunks before this one
        linear = torch.matmul(f["q_lin"], kv) / (max(summed, 1) * dim ** 0.5)
        chunk_kv = chunk_kv + _linear_state(f["k_lin"], v_t)
        state = {"kv": kv, "chunk_kv": chunk_kv, "k": keys, "v": values}
        return (quadratic + linear).to(q_t.dtype), state

    def _chunk_step(self, q: Tensor, keys: Tensor, values: Tensor, seen: Tensor) -> Tensor:
        """One query (batch, heads, 1, d) over the ``seen`` slots of the chunk buffers."""
        if self.scores == "softmax":
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=seen)
        weights = torch.relu(torch.matmul(q, keys.transpose(-1, -2)) / q.shape[3] ** 0.5).square()
        weights = torch.where(seen, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
        return torch.matmul(weights, values) / self.chunk_size

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        out = self.attend(q, k, v, True, None, False)
        f = self.make_forms(q, k, None)
        compute = f["k_lin"].dtype
        v = v.to(compute)
        batch, heads, length, dim = k.shape
        c = self.chunk_size
        start = (length - 1) // c * c  # the last chunk, complete or not, is the state's current chunk
        kv = _linear_state(f["k_lin"][:, :, :start], v[:, :, :start])
        chunk_kv = _linear_state(f["k_lin"][:, :, start:], v[:, :, start:])
        keys = f["k_quad"].new_zeros(batch, heads, c, dim)
        values = v.new_zeros(batch, heads, c, v.shape[3])
        keys[:, :, : length - start] = f["k_quad"][:, :, start:]
        values[:, :, : length - start] = v[:, :, start:]
        return out, {"kv": kv, "chunk_kv": chunk_kv, "k": keys, "v": values}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"

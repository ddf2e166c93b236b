"""The gated attention unit's attention (``gau``) and FLASH's mixed chunk attention (``flash``), Hua et al. 2022,
"Transformer Quality in Linear Time".

The paper projects its input once to a small shared representation Z and derives every query and key form
from it by a cheap per-dimension scale and offset. As mechanisms on per-head q, k, v, both keep that trick on
their inputs: each form is ``q * gamma + beta`` or ``k * gamma + beta`` with learned ``gamma`` (initially 1)
and ``beta`` (initially 0) per head and dimension, so passing q = k = Z (as :class:`attnzoo.models.gau.
GatedAttentionUnit` does) gives the paper's forms. ``rotary=True`` then rotates every form by its position
(RoPE, as in the paper), inside the mechanism because rotating before the offset would lose the relative
property. Both are attentions of their own (``kind="own"``): squared-ReLU weights are not a softmax.

The exact scaling of each part is in :mod:`attnzoo.functional.flash`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_choice, check_positive_int
from ..functional.flash import (
    SCORES,
    gau_attention_reference,
    gau_attention_unchecked,
    mixed_chunk_attention_reference,
    mixed_chunk_attention_unchecked,
    rotate,
    rotate_reference,
    scale_offset,
)
from ..functional.masks import zero_padded
from .base import OWN, Capabilities, Mechanism, StateLayout, register


class _ScaleOffsetForms(Mechanism):
    """Learned per-dimension scale and offset forms of q and k, optionally rotated: what ``gau`` and ``flash``
    share. ``forms`` names each form and whether it is made from q or from k."""

    forms: Tuple[Tuple[str, str], ...] = ()

    def __init__(self, heads: int, head_dim: int, *, scores: str, rotary: bool) -> None:
        super().__init__(heads, head_dim)
        self.scores = check_choice("scores", scores, SCORES)
        self.rotary = check_bool("rotary", rotary)
        if self.rotary and head_dim % 2:
            raise ValueError(f"rotary=True rotates pairs of dimensions: head_dim must be even, got {head_dim}")
        count = len(self.forms)
        self.gamma = nn.Parameter(torch.ones(count, heads, head_dim))
        self.beta = nn.Parameter(torch.zeros(count, heads, head_dim))

    def make_forms(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], start: int = 0, reference: bool = False
    ) -> Dict[str, Tensor]:
        """Every form, (batch, heads, seq, head_dim) each, for positions ``start ..``: in the working dtype, or
        in float64 through the obviously-correct rotation when ``reference``."""
        dtype = torch.float64 if reference else working_dtype(q.dtype)
        sources = {"q": q.to(dtype), "k": zero_padded(k, key_padding_mask).to(dtype)}
        out = {}
        for index, (label, source) in enumerate(self.forms):
            form = scale_offset(sources[source], self.gamma[index].to(dtype), self.beta[index].to(dtype))
            if self.rotary:
                form = rotate_reference(form, start) if reference else rotate(form, start)
            out[label] = form
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scores={self.scores!r}, rotary={self.rotary}"


@register
class GauAttention(_ScaleOffsetForms):
    """The gated attention unit's single-head quadratic attention (Hua et al. 2022).

    ``out_i = sum_j relu(qf_i . kf_j / sqrt(d))^2 v_j / n_i`` over the keys query i sees, with ``qf``, ``kf``
    the scale-offset forms of q and k and ``n_i`` the number of those keys (N for an unpadded non-causal
    sequence, the paper's 1/N; ``i + 1`` when causal, so that decoding equals the parallel form). With
    ``scores="softmax"``, a softmax over the same keys instead.

    Options:
        scores: "relu2" (squared ReLU, the paper's) or "softmax".
        rotary: rotary positions on the query and key forms.

    Decoding state: the key forms and values seen so far, ``{"k": (batch, heads, t, head_dim), "v": (batch,
    heads, t, head_dim_v)}`` (a cache growing with the context, as for softmax attention).
    """

    name = "gau"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N^2 d), memory O(N^2)",
        summary="gated attention unit's attention: squared-ReLU scores of per-dimension scale-offset forms of "
                "shared q/k, scaled by the keys seen (Hua et al. 2022)",
    )
    test_variants = ({"scores": "softmax"}, {"rotary": True})
    forms = (("q", "q"), ("k", "k"))

    def __init__(self, heads: int, head_dim: int, *, scores: str = "relu2", rotary: bool = False) -> None:
        super().__init__(heads, head_dim, scores=scores, rotary=rotary)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        forms = self.make_forms(q, k, key_padding_mask)
        out = gau_attention_unchecked(forms["q"], forms["k"], v, causal, key_padding_mask, self.scores)
        return out.to(q.dtype)

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> Tensor:
        forms = self.make_forms(q, k, key_padding_mask, reference=True)
        return gau_attention_reference(forms["q"], forms["k"], v, causal, key_padding_mask, scores=self.scores)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        compute = working_dtype(dtype)
        return {"k": ((self.heads, None, self.head_dim), compute), "v": ((self.heads, None, None), compute)}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        forms = self.make_forms(q_t, k_t, None, start=length)
        v_t = v_t.to(forms["k"].dtype)
        if tensors is None:
            keys, values = forms["k"], v_t
        else:
            # A new tensor each step (never written in place), so an earlier state stays valid for branching.
            keys, values = torch.cat([tensors["k"], forms["k"]], dim=2), torch.cat([tensors["v"], v_t], dim=2)
        out = gau_attention_unchecked(forms["q"], keys, values, False, None, self.scores)
        return out.to(q_t.dtype), {"k": keys, "v": values}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        forms = self.make_forms(q, k, None)
        out = gau_attention_unchecked(forms["q"], forms["k"], v, True, None, self.scores)
        return out.to(q.dtype), {"k": forms["k"], "v": v.to(forms["k"].dtype)}


@register
class FlashAttention(_ScaleOffsetForms):
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

    name = "flash"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N c d + N d^2), memory O(N c + (N / c) d^2); c = chunk_size; decoding O(c d + d^2) "
                   "per token",
        summary="FLASH mixed chunk attention: squared-ReLU attention inside chunks plus linear attention across "
                "them, scale-offset forms of shared q/k (Hua et al. 2022)",
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

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> Tensor:
        f = self.make_forms(q, k, key_padding_mask, reference=True)
        return mixed_chunk_attention_reference(
            f["q_quad"], f["k_quad"], f["q_lin"], f["k_lin"], v, self.chunk_size, causal, key_padding_mask,
            scores=self.scores,
        )

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        compute = working_dtype(dtype)
        h, c, d = self.heads, self.chunk_size, self.head_dim
        return {
            "kv": ((h, d, None), compute),
            "chunk_kv": ((h, d, None), compute),
            "k": ((h, c, d), compute),
            "v": ((h, c, None), compute),
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
        chunk_kv = chunk_kv + torch.matmul(f["k_lin"].transpose(-1, -2), v_t)
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
        kv = torch.matmul(f["k_lin"][:, :, :start].transpose(-1, -2), v[:, :, :start])
        chunk_kv = torch.matmul(f["k_lin"][:, :, start:].transpose(-1, -2), v[:, :, start:])
        keys = f["k_quad"].new_zeros(batch, heads, c, dim)
        values = v.new_zeros(batch, heads, c, v.shape[3])
        keys[:, :, : length - start] = f["k_quad"][:, :, start:]
        values[:, :, : length - start] = v[:, :, start:]
        return out, {"kv": kv, "chunk_kv": chunk_kv, "k": keys, "v": values}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"

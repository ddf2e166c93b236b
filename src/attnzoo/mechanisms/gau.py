"""The gated attention unit's attention (``gau``, Hua et al. 2022, "Transformer Quality in Linear Time"), and
the scale-offset forms it shares with FLASH's mixed chunk attention (``flash_gau``,
:mod:`attnzoo.mechanisms.mixed_chunk`).

The paper projects its input once to a small shared representation Z and derives every query and key form
from it by a cheap per-dimension scale and offset. As mechanisms on per-head q, k, v, both keep that trick on
their inputs: each form is ``q * gamma + beta`` or ``k * gamma + beta`` with learned ``gamma`` (initially 1)
and ``beta`` (initially 0) per head and dimension, so passing q = k = Z (as :class:`attnzoo.models.gau.
GatedAttentionUnit` does) gives the paper's forms. ``rotary=True`` then rotates every form by its position
(RoPE, as in the paper), inside the mechanism because rotating before the offset would lose the relative
property. Both are attentions of their own (``kind="own"``): squared-ReLU weights are not a softmax.

The exact scaling is in :mod:`attnzoo.functional.gau`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_choice
from ..functional.gau import (
    SCORES,
    gau_attention_reference,
    gau_attention_unchecked,
    rotate,
    rotate_reference,
    scale_offset,
)
from ..functional.masks import zero_padded
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism, StateLayout
from .registry import register


class ScaleOffsetForms(Mechanism):
    """Learned per-dimension scale and offset forms of q and k, optionally rotated: what ``gau`` and ``flash_gau``
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
class GauAttention(ScaleOffsetForms):
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
        packing=PACKED_SPLIT,
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

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        forms = self.make_forms(q, k, key_padding_mask, reference=True)
        return gau_attention_reference(forms["q"], forms["k"], v, causal, key_padding_mask, scores=self.scores)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        compute = working_dtype(dtype)
        return {"k": ((self.heads, None, self.head_dim), compute),
                "v": ((self.heads, None, self.value_width(value_width)), compute)}

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

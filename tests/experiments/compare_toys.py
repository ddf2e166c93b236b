"""Toy mechanisms for the ``attnzoo compare`` tests, imported by path (``--import tests/experiments/compare_toys.py``).

Only the compare tests' worker and CLI processes import this file: it never registers into the test process,
so the conformance suite over ``attnzoo.available()`` never sees these toys.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from attnzoo import Capabilities, Mechanism, register
from attnzoo.functional import softmax_attention


@register
class ToyBroken(Mechanism):
    """Raises on every call: a mechanism with a bug must become a row with a reason, not a crash."""

    name = "toy_broken"
    capabilities = Capabilities(causal=True, cross=False, key_padding=False, recurrent_step=False,
                                kind="exact", complexity="-", summary="always raises")

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        raise RuntimeError("toy mechanism always fails")


@register
class ToyNonCausal(Mechanism):
    """Exact softmax that declares no causal support: with --causal it is an "unsupported" row."""

    name = "toy_noncausal"
    capabilities = Capabilities(causal=False, cross=False, key_padding=False, recurrent_step=False,
                                kind="exact", complexity="O(N^2)", summary="softmax, non-causal only")

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        return softmax_attention(q, k, v)


@register
class ToyTruncated(Mechanism):
    """Approximate: exact softmax over the first ``nb_features`` keys only, so error falls as it grows."""

    name = "toy_truncated"
    capabilities = Capabilities(causal=False, cross=False, key_padding=False, recurrent_step=False,
                                kind="approximate", complexity="O(N m)", summary="first m keys only")

    sweep_option = "nb_features"

    def __init__(self, heads: int, head_dim: int, *, nb_features: int = 8) -> None:
        super().__init__(heads, head_dim)
        self.nb_features = nb_features

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        m = self.nb_features
        return softmax_attention(q, k[:, :, :m], v[:, :, :m])

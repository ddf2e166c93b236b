"""FNet (Lee-Thorp et al. 2022, "FNet: Mixing Tokens with Fourier Transforms"): the attention-free baseline
that replaces attention by an unparameterised Fourier transform of the token sequence."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .._validation import check_bool
from ..functional.fnet import fourier_mixing_reference, fourier_mixing_unchecked
from ..functional.ties import tied_to_unused
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism
from .capabilities import PADDED_NEITHER
from .registry import register


@register
class FNetMixing(Mechanism):
    """FNet token mixing per head: ``Re(FFT_seq(FFT_hidden(v)))`` over (sequence, head_dim).

    Shapes: ``v`` (batch, heads, N, head_dim) -> (batch, heads, N, head_dim). The queries and keys are not
    used: the mixing weights are the fixed Fourier ones, the same for every input. They still receive (zero)
    gradients, so the mechanism drops into ``MultiHeadAttention`` like any other; their projections simply
    learn nothing from it.

    Key padding: padded positions of ``v`` are zeroed before the transform. They still count in its length N,
    so the result differs from that of the unpadded sequence (the transform is over all N positions, and
    padded output rows are mixtures too); what is guaranteed is that whatever a padded position holds changes
    no output. No causal form (every output mixes every position) and no cross-attention (the transform is
    over one sequence). No parameters.

    Options:
        normalized: divide by ``sqrt(N * head_dim)`` (the orthonormal transform), so the output scale does
            not grow with the length; the paper's transform is unnormalised (False).
    """

    name = "fnet"
    capabilities = Capabilities(
        # The Fourier transform runs over the whole padded row: its length sets every frequency.
        padding_invariance=PADDED_NEITHER,
        causal=False,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N log N), memory O(N)",
        summary="FNet: real part of the 2-D Fourier transform of the values over (sequence, head_dim), "
        "no attention weights (Lee-Thorp et al. 2022)",
        packing=PACKED_SPLIT,
    )
    test_variants = ({"normalized": True},)

    def __init__(self, heads: int, head_dim: int, *, normalized: bool = False) -> None:
        super().__init__(heads, head_dim)
        self.normalized = check_bool("normalized", normalized)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs: the unchecked core validates nothing twice.
        return tied_to_unused(fourier_mixing_unchecked(v, key_padding_mask, self.normalized), q, k)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Explicit float64 DFT matrices (:func:`attnzoo.functional.fnet.fourier_mixing_reference`)."""
        out = fourier_mixing_reference(v, key_padding_mask, normalized=self.normalized)
        return tied_to_unused(out, q, k)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalized={self.normalized}"

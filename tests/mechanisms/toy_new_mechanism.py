"""A new mechanism in one class: everything attnzoo needs to list it, compare it and hold it to the suite.

Imported by tests/mechanisms/test_adding_a_mechanism.py (and by ``attnzoo compare --import`` there); nothing else in the
library knows about it.
"""

import torch

from attnzoo import Capabilities, Mechanism, register
from attnzoo._validation import check_positive_int
from attnzoo.functional import softmax_attention_reference, softmax_attention_unchecked


@register
class QuantizedQueries(Mechanism):
    """Exact softmax attention on queries rounded to multiples of ``1 / levels``: an approximation of softmax
    whose error falls as ``levels`` grows."""

    name = "toy-quantized"
    capabilities = Capabilities(causal=True, cross=True, key_padding=True, recurrent_step=False,
                                kind="approximate", complexity="time O(N^2), memory O(N)",
                                summary="softmax attention on rounded queries (a test toy)")
    sweep_option = "levels"
    test_options = {"levels": 4}

    def __init__(self, heads: int, head_dim: int, *, levels: int = 8) -> None:
        super().__init__(heads, head_dim)
        self.levels = check_positive_int("levels", levels)

    def _rounded(self, q: torch.Tensor) -> torch.Tensor:
        return torch.round(q * self.levels) / self.levels

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        # forward() has checked the inputs: the unchecked core validates nothing twice.
        return softmax_attention_unchecked(self._rounded(q), k, v, causal, key_padding_mask, False, None)

    def attend_reference(self, q, k, v, causal, key_padding_mask, cross):
        return softmax_attention_reference(self._rounded(q.double()), k, v, causal, key_padding_mask)

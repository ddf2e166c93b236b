"""A new mechanism with training-time state, in one class: an auxiliary loss and an update after every optimiser
step, declared through the training hooks of the mechanism contract.

Imported by tests/mechanisms/test_adding_a_mechanism.py (in this process, and by each rank of a data-parallel run there);
``attnzoo train`` and DDP read its hooks, and nothing else in the library knows about it.
"""

import torch

from attnzoo import Capabilities, Mechanism, register
from attnzoo._validation import check_number
from attnzoo.functional import softmax_attention_reference, softmax_attention_unchecked


@register
class TemperedAttention(Mechanism):
    """Softmax attention with a learned temperature per head, ``exp(log_temperature)`` on the queries, held near
    1 by an auxiliary loss ``penalty * mean(log_temperature^2)``; after each optimiser step the temperature's
    exponential moving average ``temperature_ema`` follows it (``updates`` counts the steps, ``last_step`` is
    the latest). Every rank holds the same parameters after a step, so the update is alike on every rank."""

    name = "toy-tempered"
    capabilities = Capabilities(causal=True, cross=True, key_padding=True, recurrent_step=False, kind="own",
                                complexity="time O(N^2), memory O(N)",
                                summary="softmax attention at a learned, penalised temperature (a test toy)")
    test_options = {"penalty": 0.5}

    def __init__(self, heads: int, head_dim: int, *, penalty: float = 0.1, decay: float = 0.9) -> None:
        super().__init__(heads, head_dim)
        self.penalty = check_number("penalty", penalty, minimum=0.0)
        self.decay = check_number("decay", decay, minimum=0.0, maximum=1.0)
        self.log_temperature = torch.nn.Parameter(torch.full((heads,), 0.25))
        self.register_buffer("temperature_ema", torch.ones(heads))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        self.register_buffer("last_step", torch.full((), -1, dtype=torch.long))
        self.pending_loss = None

    def _tempered(self, q):
        return q * self.log_temperature.exp().to(q.dtype).view(1, -1, 1, 1)

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if self.training:  # the loss of this forward, for the training loop to take once
            self.pending_loss = self.penalty * self.log_temperature.pow(2).mean().to(q.dtype)
        return softmax_attention_unchecked(self._tempered(q), k, v, causal, key_padding_mask, False, None)

    def attend_reference(self, q, k, v, causal, key_padding_mask, cross):
        tempered = self._tempered(q.double())
        return softmax_attention_reference(tempered, k.double(), v.double(), causal, key_padding_mask)

    def auxiliary_loss(self):
        loss, self.pending_loss = self.pending_loss, None
        return loss

    @torch.no_grad()
    def update_after_step(self, step, seed):
        temperature = self.log_temperature.exp().to(self.temperature_ema.dtype)
        self.temperature_ema.mul_(self.decay).add_(temperature, alpha=1 - self.decay)
        self.updates += 1
        self.last_step.fill_(step)

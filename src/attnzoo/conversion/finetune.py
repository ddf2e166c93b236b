"""Stage 2 of a conversion: low-rank adapters trained on the whole model's output, and the perplexity that
judges the result.

``next_token``: cross-entropy of the student's next-token predictions on the text (LoLCATs' stage 2).
``teacher_logits``: the KL divergence from the teacher's next-token distribution to the student's, which asks
the student to predict as the teacher does everywhere, not only at the observed token.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..pretrained import CausalLM


def finetune_loss(student: CausalLM, tokens: Tensor, loss: str, teacher: Optional[CausalLM] = None) -> Tensor:
    """The stage 2 loss of ``tokens`` (batch, seq) with gradients: ``"next_token"`` or ``"teacher_logits"``
    (which needs ``teacher``)."""
    logits = student(tokens)[:, :-1]
    if loss == "next_token":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    if teacher is None:
        raise ValueError("finetune_loss='teacher_logits' needs the teacher")
    with torch.no_grad():
        teacher_log_probs = F.log_softmax(teacher(tokens)[:, :-1].float(), dim=-1)
    student_log_probs = F.log_softmax(logits.float(), dim=-1)
    return F.kl_div(student_log_probs.reshape(-1, logits.shape[-1]), teacher_log_probs.reshape(-1, logits.shape[-1]),
                    log_target=True, reduction="batchmean")


@torch.no_grad()
def mean_token_nll(model: CausalLM, windows: Tensor) -> float:
    """Mean negative log-likelihood (nats) of every token but the first of each window (n, seq), one window at
    a time: ``exp`` of it is the perplexity."""
    total, count = 0.0, 0
    for window in windows:
        logits = model(window[None])[0, :-1]
        total += F.cross_entropy(logits.float(), window[1:], reduction="sum").item()
        count += window.numel() - 1
    return total / count


def perplexity(model: CausalLM, windows: Tensor) -> float:
    """``exp`` of :func:`mean_token_nll`."""
    return math.exp(mean_token_nll(model, windows))

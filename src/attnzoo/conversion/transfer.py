"""Stage 1 of a conversion, attention transfer (LoLCATs, Zhang et al. 2024): each converted layer's new
attention is trained to give the output the frozen teacher's softmax attention gives, layer by layer.

Every layer is fed the teacher's own hidden states (the teacher's stream is what flows from layer to layer), so
the layers' losses are independent and each is back-propagated as soon as it is computed: memory stays that of
one layer. The loss of a layer is the mean squared error of its attention output (after the output projection)
relative to the mean square of the teacher's, so layers of different scale are comparable, and the same number,
measured on held-out text, chooses which layers a hybrid keeps in softmax.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from ..pretrained import CausalLM


def relative_error(output: Tensor, target: Tensor) -> Tensor:
    """``mean((output - target)^2) / mean(target^2)``: 0 for a perfect copy, 1 for an output of zeros."""
    return (output - target).pow(2).mean() / target.pow(2).mean().clamp_min(torch.finfo(target.dtype).tiny)


def transfer_losses(
    teacher: CausalLM, student: CausalLM, tokens: Tensor, layers: Sequence[int], *, backward: bool
) -> List[float]:
    """Each of ``layers``' relative attention-output error on ``tokens`` (batch, seq), the teacher's hidden
    states fed to both; with ``backward``, each loss is back-propagated into the student's parameters that
    require gradients (accumulating in ``.grad``). Returns the losses in the order of ``layers``."""
    chosen = set(layers)
    losses = {}
    with torch.no_grad():
        x = teacher.embedding(tokens)
    for index, (teacher_layer, student_layer) in enumerate(zip(teacher.layers, student.layers)):
        with torch.no_grad():
            h = teacher_layer.attention_norm(x)
            target = teacher_layer.attention(h, causal=True)
        if index in chosen:
            with torch.set_grad_enabled(backward):
                loss = relative_error(student_layer.attention(h, causal=True), target)
                if backward:
                    loss.backward()
            losses[index] = loss.item()
        with torch.no_grad():
            x = x + target
            x = x + teacher_layer.feed_forward(teacher_layer.feed_forward_norm(x))
    return [losses[index] for index in layers]


def held_out_errors(
    teacher: CausalLM, student: CausalLM, windows: Tensor, layers: Sequence[int]
) -> List[float]:
    """Each layer's relative transfer error averaged over held-out ``windows`` (n, seq), one at a time."""
    totals = [0.0] * len(layers)
    for window in windows:
        for position, loss in enumerate(transfer_losses(teacher, student, window[None], layers, backward=False)):
            totals[position] += loss
    return [total / len(windows) for total in totals]


def layers_to_keep(errors: Sequence[float], layers: Sequence[int], count: int) -> List[int]:
    """The ``count`` layers with the largest transfer error (ties: the earlier layer), ascending."""
    ranked = sorted(zip(errors, layers), key=lambda pair: (-pair[0], pair[1]))
    return sorted(layer for _, layer in ranked[:count])


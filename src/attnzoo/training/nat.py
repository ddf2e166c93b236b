"""Training and scoring a non-autoregressive :class:`~attnzoo.Seq2SeqTransformer` (``decoding="non-autoregressive"``).

* The loss is the token cross-entropy over the target positions of one parallel pass over placeholders
  (the decoder never reads a target token), plus ``length_loss`` times the length head's cross-entropy
  (``length_mode="predicted"``). With the predicted length, the decoder reads each target's true length
  (END included) in training, so the two parts learn apart; with ``"max"`` it reads every position and
  learns to put END where the target ends (the padding after it is not scored).
* Evaluation decodes in one pass (:func:`~attnzoo.decoding.nat_decode`) and reports the same decoded metrics
  as autoregressive decoding.

Settings that feed or steer the decoder token by token (scheduled sampling) or that read a teacher-forced
pass (the guide loss on cross-attention) are refused in this mode, naming them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_number
from ..decoding import nat_decode
from ..models import Seq2SeqTransformer
from ..models.nat import DECODING_MODES, LENGTH_MODES, length_loss
from ..tasks import IGNORE_INDEX, Seq2SeqSplit, Task
from .seq2seq import strip_output

DEFAULT_LENGTH_MODE = "predicted"
DEFAULT_LENGTH_LOSS = 0.1
"""The weight of the length head's loss beside the token loss, unless a config gives one."""


def check_decoding_settings(
    decoding: str, length_mode: Optional[str], length_loss_weight: Optional[float], scheduled_sampling: str,
    guide_loss: float,
) -> None:
    """Refuse, naming it, a training setting that does not fit the decoding mode."""
    check_choice("decoding", decoding, DECODING_MODES)
    if length_mode is not None:
        check_choice("length_mode", length_mode, LENGTH_MODES)
    check_number("length_loss", length_loss_weight, minimum=0.0, optional=True)
    if decoding == "autoregressive":
        for name, value in (("length_mode", length_mode), ("length_loss", length_loss_weight)):
            if value is not None:
                raise ValueError(f"{name} {value!r} is a setting of decoding 'non-autoregressive'; an "
                                 "autoregressive decoder has no length head")
        return
    if scheduled_sampling != "none":
        raise ValueError(f"scheduled_sampling {scheduled_sampling!r} feeds the decoder its own tokens; decoding "
                         "'non-autoregressive' feeds it none (use scheduled_sampling 'none')")
    if guide_loss > 0:
        raise ValueError(f"guide_loss {guide_loss!r} is measured on a teacher-forced pass; decoding "
                         "'non-autoregressive' has none (use guide_loss 0)")
    if length_mode == "max" and length_loss_weight is not None:
        raise ValueError(f"length_loss {length_loss_weight!r} weighs the length head, which length_mode 'max' "
                         "does not have")


def is_non_autoregressive(model: nn.Module) -> bool:
    """Whether ``model`` is a Seq2SeqTransformer built for one-pass decoding."""
    return isinstance(model, Seq2SeqTransformer) and model.nat is not None


def target_lengths(targets: Tensor) -> Tensor:
    """The length (END included) of each target row (batch, target_len): its scored positions, (batch,)."""
    return (targets != IGNORE_INDEX).sum(dim=1)


def nat_logits(
    model: Seq2SeqTransformer, split: Seq2SeqSplit, index: Tensor, source: Tensor, source_mask: Tensor
) -> Tuple[Tensor, Optional[Tensor]]:
    """The parallel pass for the examples ``index``: logits (batch, target_len, vocab) scored against
    ``split.targets[index]``, and the length head's mean cross-entropy (None with ``length="max"``)."""
    targets = split.targets[index]
    lengths = target_lengths(targets)
    predicted = model.nat.length_mode == "predicted"
    logits, length_logits = model.forward_nat(source, src_padding_mask=source_mask, width=targets.shape[1],
                                              target_lengths=lengths if predicted else None)
    return logits, None if length_logits is None else length_loss(length_logits, lengths)


@torch.no_grad()
def nat_outputs(model: Seq2SeqTransformer, task: Task, source: Tensor, source_mask: Tensor) -> List[List[int]]:
    """One-pass decodes of a batch of sources, each cut at its END."""
    decoded = nat_decode(model, source, eos_id=task.eos_id, source_padding_mask=source_mask)
    return [strip_output(row.tolist(), task.eos_id) for row in decoded]

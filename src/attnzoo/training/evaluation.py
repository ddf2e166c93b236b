"""Loss, metrics and evaluation: the cross-entropy of every task kind and its tallies, the model's logits for
each kind (a seq2seq model's with its decoder inputs and auxiliary losses), and :func:`evaluate` on a split.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mechanisms.base import UnsupportedOptionError
from ..tasks import IGNORE_INDEX, Split, Task
from .config import TrainConfig
from .decoders import GREEDY, DecoderSettings, corpus_bleu, timed_outputs
from .nat import is_non_autoregressive, nat_logits, nat_outputs
from .packing import take_packed
from .seq2seq import (
    DEFAULT_GUIDE_WIDTH,
    decoded_metrics,
    decoder_inputs,
    seq2seq_logits,
    smoothed_cross_entropy,
    strip_output,
)

LN2 = math.log(2.0)


# -- examples of a split -------------------------------------------------------------------------------------
def take(split: Split, index: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    mask = None if split.padding_mask is None else split.padding_mask[index]
    return split.inputs[index], split.targets[index], mask


def take_batch(
    split: Split, index: Tensor, pack: bool, device: torch.device
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The examples ``index`` on ``device``: (inputs, targets, padding mask, None), or with ``pack`` one packed
    row (inputs, targets, None, cu_seqlens) (:func:`~attnzoo.training.packing.take_packed`)."""
    if pack:
        inputs, targets, offsets = take_packed(split, index)
        return inputs.to(device), targets.to(device), None, offsets.to(device)
    inputs, targets, mask = on_device(device, *take(split, index))
    return inputs, targets, mask, None


def split_of(task: Task, name: str, pack: bool) -> Split:
    """The split ``name`` as a run reads it: packed (:meth:`~attnzoo.tasks.Task.packed_split`) or as it is."""
    return task.packed_split(name) if pack else task.split(name)


def scored_targets(split: Split, index: Tensor) -> int:
    """Scored targets of the examples ``index``: what the mean loss of their batch divides by."""
    return int((split.targets[index] != IGNORE_INDEX).sum())


def input_tokens(split: Split, index: Tensor) -> int:
    """Input tokens (padding left out) of the examples ``index``."""
    if split.padding_mask is None:
        return split.inputs[index].numel()
    return int((~split.padding_mask[index]).sum())


# -- loss and metrics ----------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Sums over an evaluation: loss (nats) and counts, so that batches of any size average correctly."""

    loss_sum: float = 0.0
    scored: int = 0      # examples (classify) or scored positions (tag, lm)
    correct: int = 0

    def add(self, other: "Tally") -> None:
        self.loss_sum += other.loss_sum
        self.scored += other.scored
        self.correct += other.correct

    def metrics(self, task: Task) -> Dict[str, float]:
        loss = self.loss_sum / max(self.scored, 1)
        result = {"loss": loss, "scored": float(self.scored)}
        if task.metric == "bits_per_byte":
            result["bits_per_byte"] = loss / LN2
        else:
            result["accuracy"] = self.correct / max(self.scored, 1)
        return result


def loss_and_tally(
    kind: str, logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0
) -> Tuple[Tensor, Tally]:
    """Mean cross-entropy over the scored targets and its :class:`Tally`.

    kind "classify": logits (batch, classes), targets (batch,); "tag", "lm" and "seq2seq": logits
    (batch, seq, classes), targets (batch, seq) with :data:`IGNORE_INDEX` where nothing is scored.
    ``label_smoothing`` > 0: the label-smoothed loss (:func:`~attnzoo.training.seq2seq.smoothed_cross_entropy`)."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    scored = targets != IGNORE_INDEX
    count = int(scored.sum())
    if label_smoothing > 0:
        total = smoothed_cross_entropy(logits, targets, label_smoothing)
    else:
        total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = int(((logits.argmax(dim=-1) == targets) & scored).sum())
    tally = Tally(float(total.detach()), count, correct)
    return total / max(count, 1), tally


def model_logits(
    model: nn.Module, task: Task, data: Split, index: Tensor, inputs: Tensor, mask: Optional[Tensor], *,
    config: Optional[TrainConfig] = None, step: int = 0, cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The model's logits for the examples ``index`` of ``data`` (inputs and mask already taken), and an
    auxiliary loss or None: the one call that differs per kind. A seq2seq model reads the decoder inputs
    too, mixed with its own predictions under scheduled sampling when ``config`` (training only) asks for it;
    its auxiliary loss is the (unweighted) guide loss of its cross-attention, in evaluation always (a measure
    of how diagonal the attention is) and in training when ``config.guide_loss`` > 0. A non-autoregressive
    model runs its one parallel pass instead; its auxiliary loss is the length head's (None without one).
    ``cu_seqlens``: inputs are one packed row of documents at these offsets (a classify, tag or lm task)."""
    if cu_seqlens is not None:
        return model(inputs, cu_seqlens=cu_seqlens), None
    if task.kind != "seq2seq":
        return model(inputs, padding_mask=mask), None
    if is_non_autoregressive(model):
        return nat_logits(model, data, index, inputs, mask)
    mode = "none" if config is None else config.scheduled_sampling
    teacher = 1.0 if config is None else config.teacher_probability(step)
    seed = 0 if config is None else config.seed
    target_inputs = decoder_inputs(model, data, index, inputs, mask, mode=mode, teacher=teacher, seed=seed,
                                   step=step)
    guide_width = None
    if config is None or config.guide_loss > 0:
        guide_width = DEFAULT_GUIDE_WIDTH if config is None else config.guide_width
    return seq2seq_logits(model, data, index, inputs, mask, target_inputs, guide_width)


def autocast(precision: str, device: torch.device = torch.device("cpu")) -> contextlib.AbstractContextManager:
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def on_device(device: torch.device, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """The tensors on ``device`` (a no-op on the CPU, where the splits live)."""
    return tuple(None if t is None else t.to(device) for t in tensors)


@torch.no_grad()
def _evaluation_bar(enabled: bool, batches: int, split: str) -> Any:
    """A tqdm bar of the evaluation's batches (disabled: a no-op one), left off the screen when done."""
    from tqdm import tqdm

    return tqdm(total=batches, desc=f"evaluating the {split} split", unit="batch", leave=False, disable=not enabled,
                dynamic_ncols=True, mininterval=0.5)


def evaluate(
    model: nn.Module, task: Task, split: str = "validation", *, batch_size: int = 64,
    max_batches: Optional[int] = None, precision: str = "float32", decoding: DecoderSettings = GREEDY,
    pack: bool = False, progress: bool = False,
) -> Dict[str, float]:
    """Loss and the task's metric (accuracy, or bits per byte) of ``model`` on a split, in order, over its
    first ``max_batches`` batches (None: all of it). The model is put back in its training mode afterwards.
    A seq2seq task adds the decoded metrics of the decoder ``decoding`` (greedy by default): ``exact_match``,
    ``token_error_rate``, corpus ``bleu`` (0-100) and the decoding time ``ms_per_sentence``
    (:mod:`attnzoo.training.decoders`, the batch decoded at once), and the cross-attention's ``guide_loss`` at
    width 0.2 (0 when the attention is on the diagonal: how monotonic it has become); one with rare tokens to
    copy (``rare_ids``, as copy-names) also their ``rare_token_recall``. A non-autoregressive model decodes in
    one pass (``decoding`` must be greedy) and reports its ``length_loss`` instead of the guide loss.
    ``pack``: the split packed, a batch of ``batch_size`` examples (or packed rows) one packed row
    (:mod:`attnzoo.training.packing`), as a run trained with ``pack`` reads it. ``progress``: a bar of the
    batches on stderr (gone when done)."""
    data = split_of(task, split, pack)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tally = Tally()
    predictions: List[List[int]] = []
    references: List[List[int]] = []
    auxiliary_sum, decode_seconds = 0.0, 0.0
    nat = is_non_autoregressive(model)
    if nat and decoding != GREEDY:
        raise UnsupportedOptionError(f"decoder {decoding.describe()}: a non-autoregressive model decodes in one "
                                     "parallel pass; leave the decoder options at greedy")
    generator = decoding.generator()
    batches = -(-len(data) // batch_size) if max_batches is None else min(max_batches, -(-len(data) // batch_size))
    bar = _evaluation_bar(progress, batches, split)
    try:
        for number, start in enumerate(range(0, len(data), batch_size)):
            if max_batches is not None and number >= max_batches:
                break
            bar.update(1)
            index = torch.arange(start, min(start + batch_size, len(data)))
            inputs, targets, mask, offsets = take_batch(data, index, pack, device)
            with autocast(precision, device):
                logits, auxiliary = model_logits(model, task, data, index, inputs, mask, cu_seqlens=offsets)
                if task.kind == "seq2seq":
                    auxiliary_sum += 0.0 if auxiliary is None else float(auxiliary) * len(index)
                    if nat:
                        began = time.perf_counter()
                        outputs = nat_outputs(model, task, inputs, mask)
                        seconds = time.perf_counter() - began
                    else:
                        outputs, seconds = timed_outputs(model, inputs, mask, bos_id=task.bos_id,
                                                         eos_id=task.eos_id, max_new_tokens=task.target_len,
                                                         settings=decoding, generator=generator)
                    predictions += outputs
                    decode_seconds += seconds
                    references += [strip_output(row.tolist(), task.eos_id) for row in targets]
            tally.add(loss_and_tally(task.kind, logits, targets)[1])
    finally:
        bar.close()
        model.train(was_training)
    metrics = tally.metrics(task)
    if task.kind == "seq2seq":
        metrics.update(decoded_metrics(predictions, references, getattr(task, "rare_ids", None)))
        if not nat or model.nat.length_head is not None:
            metrics["length_loss" if nat else "guide_loss"] = auxiliary_sum / max(len(references), 1)
        # Extended ids (source tokens outside the target vocabulary, produced by copying) are named too.
        metrics["bleu"] = corpus_bleu(predictions, references, (*task.target_tokens, *task.extended_tokens))
        metrics["ms_per_sentence"] = 1000.0 * decode_seconds / max(len(references), 1)
    return metrics

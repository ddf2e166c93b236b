"""Training and scoring a :class:`~attnzoo.Seq2SeqTransformer` on a ``"seq2seq"`` task.

* Teacher forcing (the default): the decoder reads the gold target shifted right.
* Scheduled sampling (Bengio et al. 2015), with the probability of feeding the gold token decaying over
  training (:func:`teacher_probability`: linear, exponential or inverse sigmoid). Two forms:

  - ``"token"``, the original per-token form: the decoder input at position t is the gold token y_{t-1}
    with the teacher probability, else the model's own prediction of position t-1 *given the mixed inputs
    before it*. The predictions are made left to right by incremental decoding without gradient (as in the
    original, no gradient flows through the choice of a token); the loss is then one pass over the mixed
    inputs, whose logits are those the left-to-right pass would give.
  - ``"two-pass"`` (Mihaylova & Martins 2019), the form made for Transformers: a first teacher-forced pass
    without gradient predicts every position at once; each decoder input is then the gold token with the
    teacher probability, else the first pass's prediction of the position before; the second pass, with
    gradient, reads the mixture.

  Predictions are the argmax of the model (dropout off). Which positions get the gold token is drawn from a
  generator seeded by ``(seed, step)`` alone, so a resumed run mixes exactly as an uninterrupted one and
  dropout's random stream is not disturbed: with teacher probability 1 both forms *are* teacher forcing.
* Label smoothing (:func:`smoothed_cross_entropy`).
* Guided attention (Tachibana et al. 2018): :func:`guide_loss` on the cross-attention weights, which
  :class:`CrossAttentionRecorder` recomputes from the queries and keys of the softmax cross-attention.

Decoded metrics (:func:`decoded_metrics`): exact match (word accuracy for g2p), the token error rate
(edit distance over reference length: phoneme error rate for g2p) and, for a task with rare tokens to copy,
the share of them reproduced (:func:`rare_token_recall`), of outputs decoded as
:mod:`attnzoo.training.decoders` chooses (greedy by default).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models import Seq2SeqTransformer
from ..models.cross_attention import CrossAttentionWeights
from ..tasks import IGNORE_INDEX, Seq2SeqSplit

SCHEDULED_SAMPLING = ("none", "token", "two-pass")
SAMPLING_DECAYS = ("linear", "exponential", "inverse-sigmoid")
DEFAULT_GUIDE_WIDTH = 0.2
"""g of the guide (Tachibana et al. 2018 use 0.2); evaluation measures diagonality with it."""


# -- teacher probability -----------------------------------------------------------------------------------
def default_sampling_k(decay: str, steps: int) -> float:
    """The decay constant used when none is given, so that the schedule spans the run of ``steps`` steps:
    linear reaches 0 at the last step; exponential reaches 0.01 there; inverse sigmoid passes 1/2 halfway."""
    if decay == "linear":
        return float(steps)
    if decay == "exponential":
        return 0.01 ** (1.0 / steps)
    # inverse sigmoid: k / (k + exp(i / k)) = 1/2 where exp(i / k) = k, i.e. i = k ln k; solve k ln k = steps / 2.
    low, high = 1.0, max(float(steps), math.e)
    for _ in range(100):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if middle * math.log(middle) < steps / 2 else (low, middle)
    return 0.5 * (low + high)


def teacher_probability(decay: str, step: int, k: float, minimum: float = 0.0) -> float:
    """The probability of feeding the gold token at optimiser step ``step`` (0-based), Bengio et al. 2015:

    * ``"linear"``: ``max(minimum, 1 - step / k)`` (k: the steps to reach 0; their ``k=1, c=1/k``);
    * ``"exponential"``: ``max(minimum, k ** step)``, 0 < k < 1;
    * ``"inverse-sigmoid"``: ``max(minimum, k / (k + exp(step / k)))``, k >= 1.
    """
    if decay == "linear":
        value = 1.0 - step / k
    elif decay == "exponential":
        value = k**step
    elif decay == "inverse-sigmoid":
        value = k / (k + math.exp(min(step / k, 700.0)))  # exp overflows past ~709; the value is 0 there anyway
    else:
        raise ValueError(f"sampling_decay must be one of {', '.join(map(repr, SAMPLING_DECAYS))}, got {decay!r}")
    return max(minimum, value)


def check_sampling_k(decay: str, k: Optional[float]) -> None:
    """k's range per decay: > 0 (linear), in (0, 1) (exponential), >= 1 (inverse sigmoid); None is fine."""
    if k is None:
        return
    if decay == "linear" and k <= 0:
        raise ValueError(f"sampling_k must be > 0 for the linear decay, got {k!r}")
    if decay == "exponential" and not 0 < k < 1:
        raise ValueError(f"sampling_k must be in (0, 1) for the exponential decay, got {k!r}")
    if decay == "inverse-sigmoid" and k < 1:
        raise ValueError(f"sampling_k must be >= 1 for the inverse-sigmoid decay, got {k!r}")


# -- label smoothing ---------------------------------------------------------------------------------------
def smoothed_cross_entropy(logits: Tensor, targets: Tensor, smoothing: float) -> Tensor:
    """Summed label-smoothed cross-entropy over the targets other than :data:`IGNORE_INDEX`.

    logits (n, classes), targets (n,). Each target's distribution is ``1 - smoothing`` on the gold class
    plus ``smoothing / classes`` on every class (Szegedy et al. 2016), so the loss per target is
    ``(1 - smoothing) * -log p_gold + smoothing * mean_c(-log p_c)``."""
    scored = targets != IGNORE_INDEX
    log_probs = logits[scored].float().log_softmax(dim=-1)
    gold = log_probs.gather(1, targets[scored][:, None])[:, 0]
    return -((1.0 - smoothing) * gold + smoothing * log_probs.mean(dim=-1)).sum()


# -- the decoder's inputs --------------------------------------------------------------------------------
def _mixing_mask(shape: torch.Size, teacher: float, seed: int, step: int) -> Tensor:
    """True where the gold token is fed: Bernoulli(teacher) per position from a generator of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 7_919)
    return torch.rand(shape, generator=generator) < teacher


@torch.no_grad()
def _predictions_two_pass(model: Seq2SeqTransformer, source: Tensor, source_mask: Tensor, gold: Tensor) -> Tensor:
    """The teacher-forced argmax at every position (batch, tgt_len), dropout off."""
    was_training = model.training
    model.eval()
    try:
        return model(source, gold, src_padding_mask=source_mask).argmax(dim=-1)
    finally:
        model.train(was_training)


@torch.no_grad()
def _mixed_inputs_token(
    model: Seq2SeqTransformer, source: Tensor, source_mask: Tensor, gold: Tensor, use_gold: Tensor
) -> Tensor:
    """Per-token scheduled sampling: build the decoder inputs left to right, position t the gold token
    where ``use_gold[:, t]``, else the argmax the model predicts from the inputs chosen before it."""
    was_training = model.training
    model.eval()
    try:
        mixed = gold.clone()
        logits, state = model.prefill(source, mixed[:, :1], src_padding_mask=source_mask)
        last = logits[:, -1]  # (batch, vocab): the prediction of the token after the inputs so far
        for t in range(1, gold.shape[1]):
            mixed[:, t] = torch.where(use_gold[:, t], gold[:, t], last.argmax(dim=-1))
            if t + 1 < gold.shape[1]:
                last, state = model.step(mixed[:, t], state)
        return mixed
    finally:
        model.train(was_training)


def decoder_inputs(
    model: Seq2SeqTransformer, split: Seq2SeqSplit, index: Tensor, source: Tensor, source_mask: Tensor, *,
    mode: str = "none", teacher: float = 1.0, seed: int = 0, step: int = 0,
) -> Tensor:
    """The decoder inputs (batch, tgt_len) of the examples ``index`` for one training step (see the module
    docstring); ``mode="none"`` or evaluation: the gold inputs. Position 0 (BOS) and padding stay gold."""
    gold = split.decoder_inputs[index]
    if mode == "none":
        return gold
    use_gold = _mixing_mask(gold.shape, teacher, seed, step) | (split.targets[index] == IGNORE_INDEX)
    use_gold[:, 0] = True
    if mode == "two-pass":
        predicted = _predictions_two_pass(model, source, source_mask, gold)
        # The input at t stands for the token of position t-1: the first pass's prediction there.
        shifted = torch.cat([gold[:, :1], predicted[:, :-1]], dim=1)
        return torch.where(use_gold, gold, shifted)
    if mode == "token":
        return _mixed_inputs_token(model, source, source_mask, gold, use_gold)
    raise ValueError(f"scheduled_sampling must be one of {', '.join(map(repr, SCHEDULED_SAMPLING))}, got {mode!r}")


# -- decoded metrics ---------------------------------------------------------------------------------------
def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance (insertions, deletions, substitutions, each 1) between two token lists."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def strip_output(tokens: Sequence[int], eos_id: int) -> List[int]:
    """A decoded or reference sequence up to (not including) its first EOS."""
    out: List[int] = []
    for token in tokens:
        if token == eos_id:
            break
        out.append(int(token))
    return out


def rare_token_recall(
    predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]], rare_ids: AbstractSet[int]
) -> float:
    """The share of the rare tokens (ids in ``rare_ids``) of the references that their predictions
    reproduce, anywhere in the output: a token a reference holds twice must be predicted twice (multiset
    intersection). 1.0 when the references hold none."""
    found = total = 0
    for prediction, reference in zip(predictions, references):
        wanted = Counter(t for t in reference if t in rare_ids)
        total += sum(wanted.values())
        found += sum((wanted & Counter(prediction)).values())
    return found / total if total else 1.0


def decoded_metrics(
    predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
    rare_ids: Optional[AbstractSet[int]] = None,
) -> Dict[str, float]:
    """``exact_match`` (share of sequences decoded exactly) and ``token_error_rate`` (edit distances over
    the references' total length) of token lists without BOS or EOS; with ``rare_ids``, also
    ``rare_token_recall`` (:func:`rare_token_recall`)."""
    exact = sum(list(p) == list(r) for p, r in zip(predictions, references))
    errors = sum(edit_distance(p, r) for p, r in zip(predictions, references))
    length = sum(len(r) for r in references)
    metrics = {"exact_match": exact / max(len(references), 1), "token_error_rate": errors / max(length, 1)}
    if rare_ids is not None:
        metrics["rare_token_recall"] = rare_token_recall(predictions, references, rare_ids)
    return metrics


# -- guided attention (Tachibana et al. 2018) ----------------------------------------------------------------
def guide_penalties(target_length: int, source_length: int, width: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """The diagonal guide ``W[t, n] = 1 - exp(-(n/N - t/T)^2 / (2 g^2))`` (target_length T, source_length N,
    0-based positions t and n, g = ``width``): near 0 on the diagonal, near 1 far from it. (T, N)."""
    t = torch.arange(target_length, dtype=dtype)[:, None] / target_length
    n = torch.arange(source_length, dtype=dtype)[None, :] / source_length
    return 1.0 - torch.exp(-((n - t) ** 2) / (2.0 * width**2))


def guide_loss(
    attention: Sequence[Tensor], source_lengths: Tensor, target_lengths: Tensor, width: float
) -> Tensor:
    """The guided-attention loss: the penalty ``sum_n A[t, n] * W[t, n]`` that the attention of target
    position t pays (the expected ``W`` under its distribution over the source, in [0, 1)), averaged over
    every target position inside each example's true length, every head and every layer.

    Tachibana et al. average ``A * W`` over all (n, t) pairs instead, which is this divided by the source
    length: summing over the source keeps the loss's scale (and so a good weight) the same for short and long
    sources. Padding is excluded on both sides (the weights on padded source positions are 0 anyway).

    attention: one (batch, heads, seq_tgt, seq_src) tensor of cross-attention weights per decoder layer;
    source_lengths, target_lengths: (batch,) int64, the unpadded lengths (the target's counts its EOS)."""
    batch, _, seq_tgt, seq_src = attention[0].shape
    t = torch.arange(seq_tgt, device=attention[0].device)[:, None]
    n = torch.arange(seq_src, device=attention[0].device)[None, :]
    T = target_lengths.to(attention[0].dtype)[:, None, None]
    N = source_lengths.to(attention[0].dtype)[:, None, None]
    penalties = 1.0 - torch.exp(-((n / N - t / T) ** 2) / (2.0 * width**2))  # (batch, seq_tgt, seq_src)
    inside = (t < target_lengths[:, None, None]) & (n < source_lengths[:, None, None])
    penalties = penalties * inside
    total = sum((weights * penalties[:, None]).sum() for weights in attention)
    count = target_lengths.sum() * attention[0].shape[1] * len(attention)  # scored target positions
    return total / count


class CrossAttentionRecorder(CrossAttentionWeights):
    """Records the cross-attention weights (batch, heads, seq_tgt, seq_src) of every decoder layer of a
    :class:`Seq2SeqTransformer` during one forward pass, recomputed from the queries and keys its softmax
    cross-attention receives (with gradient), so that a loss can be put on them. Use as a context manager::

        with CrossAttentionRecorder(model) as recorder:
            logits = model(src, tgt, src_padding_mask=mask)
        recorder.weights  # one tensor per decoder layer
    """

    def __init__(self, model: Seq2SeqTransformer) -> None:
        super().__init__(model, "the guide loss")


def seq2seq_logits(
    model: Seq2SeqTransformer, split: Seq2SeqSplit, index: Tensor, source: Tensor, source_mask: Tensor,
    target_inputs: Tensor, guide_width: Optional[float],
) -> Tuple[Tensor, Optional[Tensor]]:
    """The teacher-forced pass over ``target_inputs``: logits (batch, tgt_len, vocab) and, when
    ``guide_width`` is given, the guide loss of its cross-attention (else None)."""
    if guide_width is None:
        return model(source, target_inputs, src_padding_mask=source_mask), None
    with CrossAttentionRecorder(model) as recorder:
        logits = model(source, target_inputs, src_padding_mask=source_mask)
    source_lengths = (~source_mask).sum(dim=1)
    target_lengths = (split.targets[index] != IGNORE_INDEX).sum(dim=1)
    return logits, guide_loss(recorder.weights, source_lengths, target_lengths, guide_width)

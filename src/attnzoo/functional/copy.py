"""The pointer-generator output (See et al. 2017): a vocabulary distribution and a copy distribution over the
source positions, mixed by a generation probability into one distribution over an *extended vocabulary*.

Ids: the target vocabulary is ``[0, vocab)``; the extended vocabulary ``[0, extended)`` appends ids for tokens
that only the source has, so that copying can produce them although the vocabulary distribution cannot.
Every source position carries the extended id that copying it produces, or ``-1`` where it may not be copied
(padding, special tokens): those positions get no copy weight.

Shapes: vocab_logits (batch, seq_tgt, vocab); copy_scores (batch, seq_tgt, seq_src), the unnormalised scores
of the copy attention; gate_logits (batch, seq_tgt), the logit of p_gen; source_ids (batch, seq_src) int64.

For a batch row whose source has no copyable position the copy distribution is empty: p_gen is taken as 1
there, so the result is the vocabulary distribution alone and still sums to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_floating

__all__ = [
    "check_copy_inputs",
    "copy_weights",
    "pointer_generator_log_probs",
    "pointer_generator_log_probs_reference",
    "scatter_copy",
]


def check_copy_inputs(
    vocab_logits: Tensor, copy_scores: Tensor, gate_logits: Tensor, source_ids: Tensor, extended_vocab_size: int
) -> None:
    """Shapes, dtypes and id ranges of the pointer-generator inputs; errors name the argument."""
    for name, x in (("vocab_logits", vocab_logits), ("copy_scores", copy_scores), ("gate_logits", gate_logits)):
        check_floating(name, x)
    if vocab_logits.dim() != 3:
        raise ValueError(f"vocab_logits must have shape (batch, seq_tgt, vocab), got {tuple(vocab_logits.shape)}")
    batch, seq_tgt, vocab = vocab_logits.shape
    if not isinstance(source_ids, Tensor) or source_ids.dtype != torch.int64 or source_ids.dim() != 2:
        got = f"{source_ids.dtype}, {source_ids.dim()} dims" if isinstance(source_ids, Tensor) else type(source_ids)
        raise TypeError(f"source_ids must be an int64 tensor (batch, seq_src), got {got}")
    seq_src = source_ids.shape[1]
    if copy_scores.shape != (batch, seq_tgt, seq_src):
        raise ValueError(f"copy_scores must have shape (batch, seq_tgt, seq_src) = {(batch, seq_tgt, seq_src)}, "
                         f"got {tuple(copy_scores.shape)}")
    if gate_logits.shape != (batch, seq_tgt):
        raise ValueError(f"gate_logits must have shape (batch, seq_tgt) = {(batch, seq_tgt)}, "
                         f"got {tuple(gate_logits.shape)}")
    if source_ids.shape[0] != batch:
        raise ValueError(f"source_ids batch {source_ids.shape[0]} does not match vocab_logits batch {batch}")
    if isinstance(extended_vocab_size, bool) or not isinstance(extended_vocab_size, int) \
            or extended_vocab_size < vocab:
        raise ValueError(f"extended_vocab_size must be an int >= the vocabulary ({vocab}), got {extended_vocab_size!r}")
    if source_ids.numel() and (int(source_ids.min()) < -1 or int(source_ids.max()) >= extended_vocab_size):
        raise ValueError(f"source_ids holds ids in [{int(source_ids.min())}, {int(source_ids.max())}], outside "
                         f"[-1, {extended_vocab_size}) (-1 = not copyable)")
    if not (vocab_logits.device == copy_scores.device == gate_logits.device == source_ids.device):
        raise ValueError("vocab_logits, copy_scores, gate_logits and source_ids must be on one device")


def copy_weights(copy_scores: Tensor, source_ids: Tensor) -> Tensor:
    """The copy attention: softmax of ``copy_scores`` (batch, seq_tgt, seq_src) over the copyable positions
    (``source_ids >= 0``); 0 elsewhere, and all 0 in a row whose source has none. Same shape."""
    copyable = (source_ids >= 0)[:, None, :]
    # A fully blocked row would be softmax over nothing (NaN): give it zero scores, then zero weights.
    scores = copy_scores.masked_fill(~copyable, float("-inf"))
    scores = scores.masked_fill(~copyable.any(dim=-1, keepdim=True), 0.0)
    return scores.softmax(dim=-1) * copyable


def scatter_copy(weights: Tensor, source_ids: Tensor, extended_vocab_size: int) -> Tensor:
    """The copy distribution over the extended vocabulary: the weights (batch, seq_tgt, seq_src) of the
    positions holding each id summed onto that id, (batch, seq_tgt, extended_vocab_size). Positions with id
    -1 add nothing. (To inspect what a model copies; the mixing itself only touches the ids a source holds.)"""
    batch, seq_tgt, _ = weights.shape
    # Blocked positions are sent to id 0 with their weight zeroed, so the scatter needs no mask of its own.
    ids = source_ids.clamp(min=0)[:, None, :].expand(batch, seq_tgt, -1)
    weights = weights * (source_ids >= 0)[:, None, :]
    out = weights.new_zeros(batch, seq_tgt, extended_vocab_size)
    return out.scatter_add(-1, ids, weights)


def _log_or_minus_inf(x: Tensor) -> Tensor:
    """log(x) for x >= 0, -inf where x == 0, with a finite (zero) gradient there instead of NaN."""
    positive = x > 0
    return torch.where(positive, torch.log(torch.where(positive, x, torch.ones_like(x))), float("-inf"))


def _log_add_exp(a: Tensor, b: Tensor) -> Tensor:
    """log(exp(a) + exp(b)), -inf where both are -inf, with zero gradients there (torch.logaddexp's are NaN)."""
    shift = torch.maximum(a, b).detach()  # any finite shift gives the same value; the larger one is stable
    shift = torch.where(shift.isfinite(), shift, torch.zeros_like(shift))
    return shift + _log_or_minus_inf(torch.exp(a - shift) + torch.exp(b - shift))


def _first_occurrences(source_ids: Tensor, same: Tensor) -> Tensor:
    """(batch, seq_src) bool: True at the first copyable position holding each id of its row, given
    ``same`` (batch, seq_src, seq_src), True where two positions hold one id."""
    earlier = torch.ones_like(same[0]).tril(diagonal=-1)  # [j, j'] True for j' < j
    return (source_ids >= 0) & ~(same & earlier).any(dim=-1)


def pointer_generator_log_probs(
    vocab_logits: Tensor, copy_scores: Tensor, gate_logits: Tensor, source_ids: Tensor, extended_vocab_size: int
) -> Tensor:
    """log P(w) = log(p_gen P_vocab(w) + (1 - p_gen) sum_{j: source_ids_j = w} a_j) over the extended
    vocabulary: (batch, seq_tgt, extended_vocab_size), ``-inf`` for an extended id the source does not hold.

    p_gen = sigmoid(gate_logits); P_vocab = softmax(vocab_logits) (0 past the vocabulary); a = the copy
    attention, :func:`copy_weights`. Computed in log space (log-sigmoid, log-softmax, log-add-exp) so that a
    confident gate or vocabulary keeps its precision; in the dtype of the inputs, float32 at least.

    Only the ids the source holds get a copy term, so the full-width work is the generation term alone: the
    copy mass of each id is summed over the positions holding it (a seq_src x seq_src match, small), mixed
    in at those positions and written over the generation term at the id, once per id (the first position
    holding it; blocked and repeated positions write to one spare column, dropped at the end).
    """
    check_copy_inputs(vocab_logits, copy_scores, gate_logits, source_ids, extended_vocab_size)
    dtype = torch.promote_types(vocab_logits.dtype, torch.float32)
    batch, seq_tgt, vocab = vocab_logits.shape
    has_copy = (source_ids >= 0).any(dim=-1)[:, None, None]  # (batch, 1, 1): rows without a copy keep p_gen = 1
    gate = gate_logits.to(dtype)[..., None]
    log_gen = torch.where(has_copy, F.logsigmoid(gate), torch.zeros_like(gate))
    log_not_gen = torch.where(has_copy, F.logsigmoid(-gate), torch.full_like(gate, float("-inf")))
    generated = F.pad(log_gen + vocab_logits.to(dtype).log_softmax(dim=-1),
                      (0, extended_vocab_size - vocab + 1), value=float("-inf"))  # + the spare column
    weights = copy_weights(copy_scores.to(dtype), source_ids)  # (batch, seq_tgt, seq_src), 0 where blocked
    same = source_ids[:, :, None] == source_ids[:, None, :]  # (batch, seq_src, seq_src)
    mass = weights @ same.to(dtype)  # the copy mass of the id at each position, over all positions holding it
    spare = extended_vocab_size
    ids = torch.where(_first_occurrences(source_ids, same), source_ids, spare)[:, None, :].expand(batch, seq_tgt, -1)
    mixed = _log_add_exp(generated.gather(-1, ids), log_not_gen + _log_or_minus_inf(mass))
    return generated.scatter(-1, ids, mixed)[..., :extended_vocab_size]


def pointer_generator_log_probs_reference(
    vocab_logits: Tensor, copy_scores: Tensor, gate_logits: Tensor, source_ids: Tensor, extended_vocab_size: int
) -> Tensor:
    """Float64 reference of :func:`pointer_generator_log_probs`: the mixture written out per batch row and
    target position, in probability space, with one loop over the source positions."""
    check_copy_inputs(vocab_logits, copy_scores, gate_logits, source_ids, extended_vocab_size)
    batch, seq_tgt, vocab = vocab_logits.shape
    out = torch.zeros(batch, seq_tgt, extended_vocab_size, dtype=torch.float64)
    for b in range(batch):
        copyable = [j for j in range(source_ids.shape[1]) if int(source_ids[b, j]) >= 0]
        for t in range(seq_tgt):
            p_vocab = torch.softmax(vocab_logits[b, t].double(), dim=0)
            if not copyable:
                out[b, t, :vocab] = p_vocab
                continue
            p_gen = torch.sigmoid(gate_logits[b, t].double())
            scores = copy_scores[b, t, copyable].double()
            attention = torch.exp(scores - scores.max())
            attention = attention / attention.sum()
            out[b, t, :vocab] = p_gen * p_vocab
            for weight, j in zip(attention, copyable):
                out[b, t, int(source_ids[b, j])] += (1 - p_gen) * weight
    return out.log()

"""What non-autoregressive decoding (NAT, Gu et al. 2018) adds to a :class:`~attnzoo.Seq2SeqTransformer`.

A model built with ``decoding="non-autoregressive"`` predicts every target position in one decoder pass:
the decoder reads a row of placeholders (one learned vector at every position, plus the target side's
positional encoding) instead of the shifted target, and its self-attention is bidirectional. The length of
the output comes from one of two places (``length``):

* ``"predicted"`` (the default): a small head classifies the target length (1..``max_target_length``) from
  the encoder output averaged over the non-padding source positions; it is trained jointly
  (:func:`length_loss`). The decoder reads that many placeholders (the positions after them are padding).
* ``"max"``: the decoder always reads ``max_target_length`` placeholders, and whatever follows the first
  END token of the output is ignored.

Lengths count the END token: a target of n tokens has length n + 1, the number of scored positions of a
target row as the tasks build it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_bool, check_choice, check_positive_int

DECODING_MODES = ("autoregressive", "non-autoregressive")
LENGTH_MODES = ("predicted", "max")


def mean_over_positions(hidden: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
    """The mean of hidden (batch, seq, dim) over each row's non-padding positions -> (batch, dim);
    padding_mask (batch, seq) bool, True = padding, or None (every position counts)."""
    if padding_mask is None:
        return hidden.mean(dim=1)
    keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
    # A row of padding only pools to zeros instead of 0/0.
    return (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


class LengthHead(nn.Module):
    """Target-length classifier: memory (batch, seq_src, dim) and its padding mask -> logits
    (batch, max_target_length), class i standing for length i + 1 (END included)."""

    def __init__(self, dim: int, max_target_length: int) -> None:
        super().__init__()
        self.max_target_length = check_positive_int("max_target_length", max_target_length)
        self.layers = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, max_target_length))

    def forward(self, memory: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        return self.layers(mean_over_positions(memory, padding_mask))


def length_loss(length_logits: Tensor, lengths: Tensor) -> Tensor:
    """Mean cross-entropy of the length head: length_logits (batch, max_target_length), lengths (batch,)
    integers in [1, max_target_length] (END included)."""
    check_lengths("lengths", lengths, length_logits.shape[0], length_logits.shape[1])
    return F.cross_entropy(length_logits.float(), lengths - 1)


def predicted_lengths(length_logits: Tensor) -> Tensor:
    """The most likely length of each row, (batch, max_target_length) logits -> (batch,) int64 in [1, max]."""
    return length_logits.argmax(dim=-1) + 1


def check_lengths(name: str, lengths: object, batch: int, maximum: int) -> Tensor:
    """Target lengths: an integer tensor (batch,) of values in [1, maximum]."""
    if not isinstance(lengths, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of lengths (batch,), got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
    low, high = int(lengths.min()), int(lengths.max())
    if low < 1 or high > maximum:
        raise ValueError(f"{name} must be in [1, {maximum}] (END included), got values in [{low}, {high}]")
    return lengths


class NonAutoregressiveParts(nn.Module):
    """The placeholder vector (dim,) the decoder reads at every position and, with ``length="predicted"``,
    the :class:`LengthHead`. ``max_target_length`` is the widest row a pass decodes (END included)."""

    def __init__(self, dim: int, length: str, max_target_length: int) -> None:
        super().__init__()
        self.length_mode = check_choice("length", length, LENGTH_MODES)
        self.max_target_length = check_positive_int("max_target_length", max_target_length)
        # Small, like the token embeddings' scale after their positional encoding is added.
        self.placeholder = nn.Parameter(torch.randn(dim) * 0.02)
        self.length_head = LengthHead(dim, max_target_length) if length == "predicted" else None

    def placeholders(self, batch: int, width: int) -> Tensor:
        """The decoder's input before positions: (batch, width, dim), the placeholder everywhere."""
        return self.placeholder.expand(batch, width, -1)


def build_nat_parts(
    decoding: str, length: Optional[str], max_target_length: Optional[int], *, dim: int, positional: str,
    reversible: bool,
) -> Optional[NonAutoregressiveParts]:
    """The NAT parts of a model with these arguments (None for an autoregressive one), every argument that
    does not fit the decoding mode refused by name."""
    check_choice("decoding", decoding, DECODING_MODES)
    if decoding == "autoregressive":
        for name, value in (("length", length), ("max_target_length", max_target_length)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is an option of decoding='non-autoregressive'; an "
                                 "autoregressive model ends its output with END and takes no length")
        return None
    if max_target_length is None:
        raise ValueError("decoding='non-autoregressive' needs max_target_length (the widest target, END "
                         "included), got None")
    if positional == "none":
        raise ValueError("decoding='non-autoregressive' needs target positions (the placeholders are otherwise "
                         "identical); positional='none' gives none")
    if check_bool("reversible", reversible):
        raise ValueError("reversible=True is for autoregressive decoders; decoding='non-autoregressive' runs a "
                         "plain bidirectional decoder")
    return NonAutoregressiveParts(dim, "predicted" if length is None else length, max_target_length)

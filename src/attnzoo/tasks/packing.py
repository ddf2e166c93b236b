"""Packed training data: documents of different lengths laid back to back in rows, with no padding.

A :class:`PackedSplit` is a :class:`~attnzoo.tasks.base.Split` whose rows hold whole documents or pieces of
them, marked by ``document_starts``: a model reads a batch of rows as one packed row whose ``cu_seqlens``
(document offsets) come from the marks, each document attending only within itself. The targets of a
language-modelling split are each position's next token within its document; the last position of a document
predicts nothing (:data:`~attnzoo.tasks.base.IGNORE_INDEX`), so no document's first token is predicted from
the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .._validation import check_positive_int
from .base import IGNORE_INDEX, Split


@dataclass(frozen=True)
class PackedSplit(Split):
    """A split of packed rows.

    Attributes:
        inputs: (n, seq_len) int64 token ids, documents back to back, no padding.
        targets: (n, seq_len) int64: the next token of the same document, :data:`IGNORE_INDEX` at a
            document's last token.
        padding_mask: None (nothing is padded).
        document_starts: (n, seq_len) bool, True where a document (or the piece of one that a row begins
            with) starts; every row starts one.
    """

    document_starts: Optional[Tensor] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        starts = self.document_starts
        if not isinstance(starts, Tensor) or starts.dtype != torch.bool or starts.shape != self.inputs.shape:
            raise TypeError(f"document_starts must be a bool tensor of shape {tuple(self.inputs.shape)}")
        if self.padding_mask is not None:
            raise ValueError("a packed split has no padding: padding_mask must be None")
        if len(self) and not bool(starts[:, 0].all()):
            raise ValueError("every row of a packed split starts a document (document_starts[:, 0] all True)")


def pack_documents(tokens: Tensor, lengths: Sequence[int], seq_len: int) -> PackedSplit:
    """Lay documents back to back in rows of ``seq_len`` positions (the last, partial row dropped).

    Args:
        tokens: (total,) int64, the documents concatenated in order.
        lengths: each document's length (>= 1), summing to ``total``.
        seq_len: the row length; a document crossing a row's end continues, as a document of its own, at the
            start of the next row.

    Returns:
        A :class:`PackedSplit` of ``total // seq_len`` rows.
    """
    seq_len = check_positive_int("seq_len", seq_len)
    if tokens.dim() != 1 or sum(lengths) != tokens.numel() or min(lengths, default=1) < 1:
        raise ValueError(f"lengths must be >= 1 and sum to the {tokens.numel()} tokens, got {len(lengths)} lengths "
                         f"summing to {sum(lengths)}")
    rows = tokens.numel() // seq_len
    if rows == 0:
        raise ValueError(f"the {tokens.numel()} tokens do not fill one row of seq_len={seq_len}")
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    same = torch.zeros(tokens.numel(), dtype=torch.bool)  # position i's next token is in i's document
    same[:-1] = document[1:] == document[:-1]
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:-1] = torch.where(same[:-1], tokens[1:], IGNORE_INDEX)
    starts = torch.ones(tokens.numel(), dtype=torch.bool)
    starts[1:] = ~same[:-1]
    used = rows * seq_len
    shaped = [x[:used].reshape(rows, seq_len) for x in (tokens, targets, starts)]
    shaped[2] = shaped[2].clone()
    shaped[2][:, 0] = True  # a row begins a document, or the rest of one
    return PackedSplit(shaped[0].contiguous(), shaped[1].contiguous(), None, document_starts=shaped[2])

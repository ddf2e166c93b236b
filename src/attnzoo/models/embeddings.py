"""The token embedding of the token models: ids -> vectors, with absolute positions where the model has them.

Positional kinds (:data:`~attnzoo.models.config.POSITIONAL_KINDS`): "sinusoidal" and "learned" are added to
the embeddings, "rotary" rotates queries and keys in every self-attention (nothing is added here), "none" adds
nothing.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_choice, check_positive_int, check_probability
from ..positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .config import POSITIONAL_KINDS


class TokenEmbedding(nn.Module):
    """Token embedding plus an absolute positional encoding, then dropout: (batch, seq) -> (batch, seq, dim).

    ``positional`` is one of "sinusoidal", "learned" (needs ``max_length``), "rotary" or "none"; the last two
    add nothing here ("rotary" acts inside attention, see :attr:`rotary`).

    ``token_shift=True``: the last ``dim // 2`` features of each position hold the embedding features of the
    token *before* it (zeros at the first position and after a padded one) instead of its own, as in RWKV's
    token shift and x-transformers' ``shift_tokens``. The first layer then sees each token beside its
    predecessor, so a value can be bound to the key before it without first learning a previous-token
    attention head: the step on which small models trained on associative recall otherwise stall. It looks
    only backwards, so causal models stay causal.
    """

    def __init__(
        self, vocab_size: int, dim: int, positional: str, max_length: Optional[int], dropout: float,
        token_shift: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("dim", dim)
        check_probability("dropout", dropout)
        self.token_shift = check_bool("token_shift", token_shift)
        if token_shift and dim < 2:
            raise ValueError(f"token_shift needs dim >= 2 (half the features are shifted), got dim={dim}")
        self.vocab_size = vocab_size
        self.positional = check_choice("positional", positional, POSITIONAL_KINDS)
        self.embedding = nn.Embedding(vocab_size, dim)
        self.position: Optional[nn.Module] = None
        if positional == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(dim)
        elif positional == "learned":
            if max_length is None:
                raise ValueError("positional='learned' needs max_length (the longest sequence), got None")
            self.position = LearnedPositionalEmbedding(dim, check_positive_int("max_length", max_length))
        self.dropout = nn.Dropout(dropout)

    @property
    def rotary(self) -> bool:
        return self.positional == "rotary"

    def embed_tokens(
        self, tokens: Tensor, padding_mask: Optional[Tensor] = None, previous: Optional[Tensor] = None,
        spans: Optional[List[Tuple[int, int]]] = None,
    ) -> Tensor:
        """(batch, seq) token ids -> (batch, seq, dim), without positions.

        With ``token_shift``: ``padding_mask`` (batch, seq), True = padding, keeps a padded token's features
        out of the position after it; ``previous`` (batch,) ids are the tokens before ``tokens[:, 0]``
        (incremental decoding; None: nothing comes before); ``spans``, the documents (start, end) of a packed
        row, keep a document's last token out of the next document's first position."""
        embedded = self.embedding(tokens)
        if not self.token_shift:
            return embedded
        shifted = embedded.shape[-1] // 2
        before = embedded[:, :-1, -shifted:]
        if padding_mask is not None:
            before = before.masked_fill(padding_mask[:, :-1, None], 0.0)
        if spans is not None:
            last = torch.zeros(tokens.shape[1], dtype=torch.bool, device=tokens.device)
            last[torch.tensor([end - 1 for _, end in spans], device=tokens.device)] = True
            before = before.masked_fill(last[None, :-1, None], 0.0)
        first = (embedded.new_zeros(embedded.shape[0], 1, shifted) if previous is None
                 else self.embedding(previous)[:, None, -shifted:])
        return torch.cat([embedded[..., :-shifted], torch.cat([first, before], dim=1)], dim=-1)

    def add_positions(self, x: Tensor, start: int = 0, spans: Optional[List[Tuple[int, int]]] = None) -> Tensor:
        """Add the encoding of positions start..start+seq-1 to x (batch, seq, dim), then dropout; with
        ``spans``, the documents (start, end) of a packed row, positions count from 0 in each document."""
        if self.position is not None:
            x = self.position(x, start=start) if spans is None else x + self._document_positions(x, spans)
        return self.dropout(x)

    def _document_positions(self, x: Tensor, spans: List[Tuple[int, int]]) -> Tensor:
        """The encoding (1, seq, dim) of each position's place in its document: the table of the longest
        document's positions (what the encoding adds to zeros), read at every position."""
        assert self.position is not None
        lengths = [end - start for start, end in spans]
        table = self.position(x.new_zeros(1, max(lengths), x.shape[-1]))[0]
        within = torch.cat([torch.arange(length, device=x.device) for length in lengths])
        return table[within].unsqueeze(0)

    def forward(
        self, tokens: Tensor, start: int = 0, *, padding_mask: Optional[Tensor] = None,
        previous: Optional[Tensor] = None, spans: Optional[List[Tuple[int, int]]] = None,
    ) -> Tensor:
        """(batch, seq) token ids -> (batch, seq, dim): :meth:`embed_tokens`, then :meth:`add_positions` from
        position ``start`` (from 0 in each document (start, end) of ``spans``, a packed row)."""
        return self.add_positions(self.embed_tokens(tokens, padding_mask, previous, spans), start, spans)


__all__ = ["TokenEmbedding"]

"""The copy mechanism of a :class:`~attnzoo.Seq2SeqTransformer`: a pointer-generator output (See et al. 2017).

The final decoder state s_t attends over the encoder memory with one dedicated single-head attention (its own
query and key projections, so it works whatever mechanism the cross-attention slots use, and decoding step by
step needs only the projected memory kept in the state). Its weights a_t are the copy distribution over the
source positions; its context c_t = sum_j a_tj memory_j, the decoder state and the embedding x_t of the target
input token give the generation probability ``p_gen = sigmoid(w . [s_t, c_t, x_t] + b)``, which mixes the
vocabulary distribution with the copy distribution (maths in :mod:`attnzoo.functional.copy`).

Which target id copying a source token produces is the **copy map**, a (src_vocab_size,) int64 tensor:
``copy_map[i]`` is a target id in ``[0, tgt_vocab_size)`` for a token both vocabularies have, an extended id
``tgt_vocab_size + k`` for a token only the source has (copying is then the only way to produce it), or
``-1`` for a token that is never copied (padding, specials, or every token when the vocabularies share
nothing). The extended ids must be ``tgt_vocab_size .. extended_vocab_size - 1`` without gaps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from ..functional.copy import copy_weights, pointer_generator_log_probs
from .._validation import check_positive_int


def check_copy_map(copy_map: object, src_vocab_size: int, tgt_vocab_size: int) -> int:
    """Validate a copy map (see the module docstring) and return the extended vocabulary size."""
    if not isinstance(copy_map, Tensor) or copy_map.dtype != torch.int64 or copy_map.dim() != 1:
        got = f"{copy_map.dtype} of {copy_map.dim()} dims" if isinstance(copy_map, Tensor) \
            else type(copy_map).__name__
        raise TypeError(f"copy_map must be a 1-D int64 tensor (src_vocab_size,), got {got}")
    if copy_map.shape[0] != src_vocab_size:
        raise ValueError(f"copy_map must give one target id per source token: {src_vocab_size} entries, "
                         f"got {copy_map.shape[0]}")
    if int(copy_map.min()) < -1:
        raise ValueError(f"copy_map holds {int(copy_map.min())}: entries are target ids, extended ids or -1")
    if not bool((copy_map >= 0).any()):
        raise ValueError("copy_map maps no source token to a target id (all -1): there is nothing to copy")
    extended = copy_map[copy_map >= tgt_vocab_size].unique()
    expected = torch.arange(tgt_vocab_size, tgt_vocab_size + extended.numel())
    if not torch.equal(extended.cpu(), expected):
        raise ValueError(f"copy_map's extended ids (those >= tgt_vocab_size {tgt_vocab_size}) must be "
                         f"{tgt_vocab_size}..{tgt_vocab_size}+n-1 without gaps, got {extended.tolist()[:8]}")
    return tgt_vocab_size + extended.numel()


@dataclass
class CopyMemory:
    """What the copy attention needs of the source, computed once per source (batch first, so beam search
    reorders it with :func:`attnzoo.state.select_batch`).

    Attributes:
        keys: (batch, seq_src, dim) the copy attention's keys.
        values: (batch, seq_src, dim) the encoder memory, read as the context.
        source_ids: (batch, seq_src) int64, the extended id copying each position gives, -1 = not copyable
            (padding included).
    """

    keys: Tensor
    values: Tensor
    source_ids: Tensor


class PointerGenerator(nn.Module):
    """The pointer-generator output layer: (decoder states, input embeddings, vocabulary logits, the source's
    :class:`CopyMemory`) -> log-probabilities over the extended vocabulary (batch, seq_tgt, extended).

    Args:
        dim: width of the decoder states, of the memory and of the embeddings.
        src_vocab_size, tgt_vocab_size: the two vocabularies (the target's is the width of the vocabulary
            logits).
        copy_map: (src_vocab_size,) int64, see the module docstring; kept as a buffer (not in the state dict:
            it is an argument, so the model is built with it again).
    """

    def __init__(self, dim: int, src_vocab_size: int, tgt_vocab_size: int, copy_map: Tensor) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        self.tgt_vocab_size = check_positive_int("tgt_vocab_size", tgt_vocab_size)
        self.extended_vocab_size = check_copy_map(copy_map, src_vocab_size, tgt_vocab_size)
        self.register_buffer("copy_map", copy_map.clone(), persistent=False)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.gate = nn.Linear(3 * dim, 1)
        self.scale = dim**-0.5

    def project_memory(self, memory: Tensor, src: Tensor, src_padding_mask: Optional[Tensor]) -> CopyMemory:
        """memory (batch, seq_src, dim) of the source ids src (batch, seq_src) -> its :class:`CopyMemory`."""
        source_ids = self.copy_map[src]
        if src_padding_mask is not None:
            source_ids = source_ids.masked_fill(src_padding_mask, -1)
        return CopyMemory(self.key(memory), memory, source_ids)

    def forward(self, hidden: Tensor, embedded: Tensor, vocab_logits: Tensor, memory: CopyMemory) -> Tensor:
        """hidden (batch, seq_tgt, dim): final decoder states; embedded (batch, seq_tgt, dim): the token
        embeddings of the decoder's inputs (before positions); vocab_logits (batch, seq_tgt, tgt_vocab).
        Returns log-probabilities (batch, seq_tgt, extended_vocab_size), float32 at least."""
        scores = (self.query(hidden) @ memory.keys.transpose(-1, -2)) * self.scale  # (batch, seq_tgt, seq_src)
        context = copy_weights(scores, memory.source_ids).to(memory.values.dtype) @ memory.values
        gate_logits = self.gate(torch.cat([hidden, context, embedded], dim=-1))[..., 0]
        return pointer_generator_log_probs(vocab_logits, scores, gate_logits, memory.source_ids,
                                           self.extended_vocab_size)

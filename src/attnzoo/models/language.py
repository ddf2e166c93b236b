"""The token models on one token sequence: a decoder-only language model, a sequence classifier and a sequence
tagger, each built from one :class:`~attnzoo.models.config.ModelConfig`.

They run: token embedding -> positional encoding -> a stack of layers -> final norm (pre-norm only) -> head.
``Model(config, ...)`` builds one from a config (``Model.from_config(config, ...)`` too); ``Model(vocab_size, ...,
dim=..., kv_heads=...)`` takes the config's fields instead and makes the config, so both check every option in
one place. The fields are listed once, in ModelConfig: :func:`~attnzoo.models.config.takes_model_config` makes
the constructors' signatures from it. Padding masks are (batch, seq) bool tensors, True marking padding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_choice, check_positive_int
from .config import ModelConfig, check_model_config, takes_model_config
from .embeddings import TokenEmbedding
from ..mechanisms.base import UnsupportedOptionError
from .inputs import check_padding_mask, check_tokens, packed_spans
from .nat import mean_over_positions
from .reversible import decoder_class, encoder_class
from .stacks import DecoderState, packed_options

POOLING_KINDS = ("mean", "cls")

def _embedding(config: ModelConfig, max_length: Optional[int]) -> TokenEmbedding:
    return TokenEmbedding(config.vocab_size, config.dim, config.positional, max_length, config.dropout,
                          config.token_shift)


class LanguageModel(nn.Module):
    """Decoder-only (GPT-style) language model: tokens (batch, seq) -> next-token logits (batch, seq, vocab).

    Args: the fields of :class:`~attnzoo.models.config.ModelConfig`, in particular:
        vocab_size, dim, heads, depth: vocabulary, width, heads per layer, number of layers.
        ff_dim, activation, norm_first, dropout, layer_norm_eps, ff_chunks: as for :class:`BlockConfig`.
        positional: "sinusoidal", "learned" (needs ``max_length``), "rotary" or "none".
        max_length: the longest sequence, required by ``positional="learned"``.
        self_attention, self_attention_options: mechanism name and options of every self-attention.
        layers: a per-layer schedule in place of self_attention and block (a hybrid stack): a pattern of
            mechanisms with their options and block kinds, repeated to ``depth``; see :class:`ModelConfig`
            and :mod:`attnzoo.models.schedule`. Decoding, packed batches and kv_heads work as for one kind.
        reversible: a :class:`~attnzoo.models.reversible.ReversibleDecoder` (Kitaev et al. 2020) instead of a
            :class:`Decoder`: the same layers coupled reversibly, so training keeps the activations of one
            branch instead of every layer's (pre-norm only). Decoding works the same way.
        block, block_options: "attention" (attention + feed-forward layers, the default), or gated attention
            units in their place (Hua et al. 2022): "gau" (quadratic) or "flash_gau" (mixed chunk attention,
            linear time, constant-size decoding state); see :class:`BlockConfig` and :mod:`attnzoo.models.gau`.
            A unit has about half the parameters of an attention + feed-forward layer, so ``depth`` counts units.
        token_shift: half of each position's embedding features come from the token before it (see
            :class:`TokenEmbedding`); the decoding state then keeps the last token.
        kv_heads: key/value heads of every self-attention, dividing ``heads`` (grouped-query attention; the
            decoding state of a native mechanism then holds kv_heads); ``heads`` when None.

    ``LanguageModel(config)`` (or ``LanguageModel.from_config(config)``) builds one from a :class:`ModelConfig`;
    ``model.config`` is its config.

    Decoding: ``logits, state = model.prefill(prompt)`` then ``logits_t, state = model.step(token_t, state)``;
    see :mod:`attnzoo.decoding` for greedy, sampling and beam search.
    """

    @takes_model_config
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = check_model_config(config)
        self.vocab_size = config.vocab_size
        self.embedding = _embedding(config, config.max_length)
        self.decoder = decoder_class(config.reversible).from_config(config.block_config, config.depth,
                                                                    config.layer_configs)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    @classmethod
    def from_config(cls, config: ModelConfig) -> "LanguageModel":
        """The language model of ``config`` (the same as ``LanguageModel(config)``)."""
        return cls(check_model_config(config))

    def forward(
        self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns (batch, seq, vocab).

        ``cu_seqlens``: a packed batch, tokens (1, seq) holding documents back to back at these int64 offsets
        ``[0, ..., seq]``; positions restart at each document and each attends only within itself, so a
        document's logits are those it has alone. Refused (naming the mechanism) if a mechanism cannot pack."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        spans = None if cu_seqlens is None else packed_spans(self, tokens, padding_mask, cu_seqlens)
        x = self.embedding(tokens, padding_mask=padding_mask, spans=spans)
        return self.head(self.decoder(x, padding_mask=padding_mask, **packed_options(cu_seqlens)))

    def _keep_last(self, state: DecoderState, tokens: Tensor) -> DecoderState:
        return replace(state, last_tokens=tokens[:, -1]) if self.embedding.token_shift else state

    def prefill(self, tokens: Tensor) -> Tuple[Tensor, DecoderState]:
        """Run a prompt (batch, seq); returns its logits (batch, seq, vocab) and the decoding state."""
        check_tokens("tokens", tokens, self.vocab_size)
        hidden, state = self.decoder.prefill(self.embedding(tokens))
        return self.head(hidden), self._keep_last(state, tokens)

    def step(self, token_t: Tensor, state: DecoderState) -> Tuple[Tensor, DecoderState]:
        """Feed one token per sequence, token_t (batch,); returns the next logits (batch, vocab) and the state."""
        check_tokens("token_t", token_t, self.vocab_size, rank=1)
        if not isinstance(state, DecoderState):
            raise TypeError(f"state must be the DecoderState returned by prefill or step, got {type(state).__name__}")
        if self.embedding.token_shift and (state.last_tokens is None or state.last_tokens.shape != token_t.shape):
            raise ValueError("state does not hold the last token of each sequence that token_shift needs (shape "
                             f"{tuple(token_t.shape)}): pass the state this model's prefill or step returned")
        x_t = self.embedding(token_t[:, None], start=state.position, previous=state.last_tokens)
        hidden, state = self.decoder.step(x_t, state)
        return self.head(hidden[:, 0]), self._keep_last(state, token_t[:, None])


class SequenceClassifier(nn.Module):
    """Encoder-only classifier: tokens (batch, seq) -> class logits (batch, num_classes).

    ``pooling="mean"`` averages the final vectors of the non-padding positions; ``pooling="cls"`` prepends a
    learned classification vector (at position 0) and reads its final vector. With ``positional="learned"``,
    ``max_length`` counts the tokens only. Other arguments as for :class:`LanguageModel` (``reversible``: a
    :class:`~attnzoo.models.reversible.ReversibleEncoder`; ``block``: bidirectional gated units).
    ``SequenceClassifier(config, num_classes, pooling=...)`` builds one from a :class:`ModelConfig`.
    """

    @takes_model_config
    def __init__(self, config: ModelConfig, num_classes: int, *, pooling: str = "mean") -> None:
        super().__init__()
        self.config = check_model_config(config)
        self.vocab_size = config.vocab_size
        check_positive_int("num_classes", num_classes)
        self.pooling = check_choice("pooling", pooling, POOLING_KINDS)
        use_cls = pooling == "cls"
        if use_cls and set(config.layer_kinds) == {"mamba2"}:
            # Its layers read left to right only: the vector put first would see no token.
            raise UnsupportedOptionError("pooling='cls' needs layers that read the whole sequence; block='mamba2' "
                                         "reads left to right, so the first position sees no token: use "
                                         "pooling='mean'")
        positions = None if config.max_length is None else config.max_length + int(use_cls)
        self.embedding = _embedding(config, positions)
        self.cls = nn.Parameter(torch.randn(1, 1, config.dim) * 0.02) if use_cls else None
        self.encoder = encoder_class(config.reversible).from_config(config.block_config, config.depth,
                                                                    config.layer_configs)
        self.head = nn.Linear(config.dim, num_classes)

    @classmethod
    def from_config(cls, config: ModelConfig, num_classes: int, *, pooling: str = "mean") -> "SequenceClassifier":
        """The classifier of ``config`` into ``num_classes`` classes, pooling its positions by ``pooling``."""
        return cls(check_model_config(config), num_classes, pooling=pooling)

    def forward(
        self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns (batch, classes).

        ``cu_seqlens``: a packed batch, tokens (1, seq) holding documents back to back at these int64 offsets;
        returns one row per document (documents, classes), each what the document gives alone."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        if cu_seqlens is not None:
            return self._forward_packed(tokens, packed_spans(self, tokens, padding_mask, cu_seqlens))
        x = self.embedding.embed_tokens(tokens, padding_mask)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
            if padding_mask is not None:
                padding_mask = torch.cat([padding_mask.new_zeros(x.shape[0], 1), padding_mask], dim=1)
        hidden = self.encoder(self.embedding.add_positions(x), key_padding_mask=padding_mask)
        if self.cls is not None:
            return self.head(hidden[:, 0])
        return self.head(mean_over_positions(hidden, padding_mask))

    def _forward_packed(self, tokens: Tensor, spans: List[Tuple[int, int]]) -> Tensor:
        """One row of class logits per document of a packed row (1, seq): with ``pooling="cls"`` the
        classification vector goes before each document (which shifts the offsets by one per document)."""
        x = self.embedding.embed_tokens(tokens, spans=spans)
        device = tokens.device
        starts = torch.tensor([start for start, _ in spans], device=device)
        lengths = torch.tensor([end - start for start, end in spans], device=device)
        document = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)  # (seq,)
        if self.cls is not None:
            heads = starts + torch.arange(len(spans), device=device)  # where each document's vector goes
            order = torch.argsort(torch.cat([torch.arange(tokens.shape[1], device=device) + document + 1, heads]))
            x = torch.cat([x[0], self.cls[0].to(x.dtype).expand(len(spans), -1)])[order].unsqueeze(0)
            spans = [(start + d, end + d + 1) for d, (start, end) in enumerate(spans)]
        offsets = torch.tensor([0] + [end for _, end in spans], device=device)
        hidden = self.encoder(self.embedding.add_positions(x, spans=spans), cu_seqlens=offsets)[0]
        if self.cls is not None:
            return self.head(hidden[heads])
        sums = hidden.new_zeros(len(spans), hidden.shape[-1]).index_add(0, document, hidden)
        return self.head(sums / lengths[:, None].to(hidden.dtype))


class SequenceTagger(nn.Module):
    """Tagger: tokens (batch, seq) -> a label's logits at every position (batch, seq, num_classes).

    By default the stack is bidirectional (an :class:`~attnzoo.models.Encoder`, no causal mask), so every
    mechanism can serve it. ``causal=True`` makes it causal: the stack is then a decoder-only
    :class:`~attnzoo.models.Decoder` (as in :class:`LanguageModel`, without its head), so the logits at
    position t depend on tokens 0..t only; it needs a mechanism with causal support. Padded positions are
    masked as keys and their own logits are meaningless (leave them out of the loss). Used for per-position
    tasks such as associative recall. Arguments as for :class:`SequenceClassifier`, without pooling, plus
    ``causal``; ``SequenceTagger(config, num_classes, causal=...)`` builds one from a
    :class:`ModelConfig`. ``model.causal`` says which it is; ``model.encoder`` is its stack either way.
    """

    @takes_model_config
    def __init__(self, config: ModelConfig, num_classes: int, *, causal: bool = False) -> None:
        super().__init__()
        self.config = check_model_config(config)
        self.vocab_size = config.vocab_size
        check_positive_int("num_classes", num_classes)
        self.causal = check_bool("causal", causal)
        self.embedding = _embedding(config, config.max_length)  # token_shift reads backwards: causal-safe
        # A causal tagger is a decoder-only stack without memory: the same layers, with causal self-attention.
        stack_class = decoder_class(config.reversible) if causal else encoder_class(config.reversible)
        self.encoder = stack_class.from_config(config.block_config, config.depth, config.layer_configs)
        self.head = nn.Linear(config.dim, num_classes)

    @classmethod
    def from_config(cls, config: ModelConfig, num_classes: int, *, causal: bool = False) -> "SequenceTagger":
        """The tagger of ``config`` into ``num_classes`` labels per position; causal if ``causal``."""
        return cls(check_model_config(config), num_classes, causal=causal)

    def forward(
        self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns
        (batch, seq, num_classes); with ``causal`` the logits at position t depend on tokens 0..t only.
        ``cu_seqlens``: a packed batch (1, seq) of documents at these int64 offsets, each tagged as it would be
        alone."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        spans = None if cu_seqlens is None else packed_spans(self, tokens, padding_mask, cu_seqlens)
        x = self.embedding(tokens, padding_mask=padding_mask, spans=spans)  # (batch, seq, dim)
        if self.causal:
            hidden = self.encoder(x, padding_mask=padding_mask, **packed_options(cu_seqlens))
        else:
            hidden = self.encoder(x, key_padding_mask=padding_mask, **packed_options(cu_seqlens))
        return self.head(hidden)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


__all__ = ["LanguageModel", "POOLING_KINDS", "SequenceClassifier", "SequenceTagger"]

"""Transformer models: encoder and decoder stacks, a sequence-to-sequence model, a decoder-only language model
and a sequence classifier.

The token models run: token embedding -> positional encoding -> blocks -> final norm (pre-norm only) -> head.
Positional kinds: "sinusoidal" and "learned" are added to the embeddings, "rotary" rotates queries and keys in
every self-attention, "none" adds nothing. Each attention slot takes its own mechanism name and options, e.g.
``Seq2SeqTransformer(..., encoder_self_attention="performer", cross_attention="softmax")``.

Padding masks are (batch, seq) bool tensors, True marking padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_choice, check_number, check_positive_int, check_probability
from ..mechanisms.base import UnsupportedOptionError
from ..positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .config import AttentionSpec, BlockConfig, attention_slot
from .gau import GatedAttentionUnit, GatedDecoderLayer, GatedEncoderLayer
from .layers import DecoderLayer, EncoderLayer, LayerState, _Block
from .pointer import CopyMemory, PointerGenerator
from .nat import build_nat_parts, check_lengths, mean_over_positions

POSITIONAL_KINDS = ("sinusoidal", "learned", "rotary", "none")
POOLING_KINDS = ("mean", "cls")


# -- input checks --------------------------------------------------------------------------------------------
def check_tokens(name: str, tokens: Tensor, vocab_size: int, rank: int = 2) -> None:
    """Token ids: an integer tensor of the given rank ((batch, seq) or (batch,)), ids in [0, vocab_size)."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got {tokens.dtype}")
    shape = "(batch, seq)" if rank == 2 else "(batch,)"
    if tokens.dim() != rank:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(tokens.shape)}): give at least one token per sequence")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} holds ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})")


def check_padding_mask(name: str, mask: Optional[Tensor], tokens: Tensor) -> None:
    """A padding mask is a bool tensor shaped like the tokens (batch, seq), on their device; True = padding."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = padding), got {got}")
    if mask.shape != tokens.shape:
        raise ValueError(f"{name} must have shape (batch, seq) = {tuple(tokens.shape)}, got {tuple(mask.shape)}")
    if mask.device != tokens.device:
        raise ValueError(f"{name} must be on {tokens.device}, got {mask.device}")


# -- embeddings ----------------------------------------------------------------------------------------------
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
        self, tokens: Tensor, padding_mask: Optional[Tensor] = None, previous: Optional[Tensor] = None
    ) -> Tensor:
        """(batch, seq) token ids -> (batch, seq, dim), without positions.

        With ``token_shift``: ``padding_mask`` (batch, seq), True = padding, keeps a padded token's features
        out of the position after it; ``previous`` (batch,) ids are the tokens before ``tokens[:, 0]``
        (incremental decoding; None: nothing comes before)."""
        embedded = self.embedding(tokens)
        if not self.token_shift:
            return embedded
        shifted = embedded.shape[-1] // 2
        before = embedded[:, :-1, -shifted:]
        if padding_mask is not None:
            before = before.masked_fill(padding_mask[:, :-1, None], 0.0)
        first = (embedded.new_zeros(embedded.shape[0], 1, shifted) if previous is None
                 else self.embedding(previous)[:, None, -shifted:])
        return torch.cat([embedded[..., :-shifted], torch.cat([first, before], dim=1)], dim=-1)

    def add_positions(self, x: Tensor, start: int = 0) -> Tensor:
        """Add the encoding of positions start..start+seq-1 to x (batch, seq, dim), then dropout."""
        if self.position is not None:
            x = self.position(x, start=start)
        return self.dropout(x)

    def forward(
        self, tokens: Tensor, start: int = 0, *, padding_mask: Optional[Tensor] = None,
        previous: Optional[Tensor] = None,
    ) -> Tensor:
        return self.add_positions(self.embed_tokens(tokens, padding_mask, previous), start)


# -- stacks --------------------------------------------------------------------------------------------------
StackT = TypeVar("StackT", bound="_LayerStack")


class _LayerStack(nn.Module):
    """``depth`` layers of ``layer_type`` built from one :class:`BlockConfig` (kept as ``config``), closed by a
    layer norm in a pre-norm stack (post-norm layers already end with one)."""

    layer_type: ClassVar[Type[_Block]]
    gated_layer_type: ClassVar[Type[GatedAttentionUnit]]
    """The layer of a stack whose config says ``block="gau"`` or ``block="flash"``."""

    def __init__(self, config: BlockConfig, depth: int) -> None:
        super().__init__()
        check_positive_int("depth", depth)
        self._check_config(config)
        self.config = config
        layer_type = self.layer_type if config.block == "attention" else self.gated_layer_type
        self.layers = nn.ModuleList(layer_type(config) for _ in range(depth))
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps) if config.norm_first else nn.Identity()

    @classmethod
    def _check_config(cls, config: BlockConfig) -> None:
        """Refuse a config this kind of stack cannot run (naming the option); every config by default."""

    @classmethod
    def from_config(cls: Type[StackT], config: BlockConfig, depth: int) -> StackT:
        """The stack of ``depth`` layers built from ``config``, for callers that hold a config already
        (the token models build theirs once from their own arguments)."""
        # Skips the subclass's keyword constructor: all it does is make the config that is given here.
        stack = cls.__new__(cls)
        _LayerStack.__init__(stack, config, depth)
        return stack


class Encoder(_LayerStack):
    """A stack of :class:`EncoderLayer` on vectors, (batch, seq, dim) -> (batch, seq, dim).

    Like ``torch.nn.TransformerEncoder``: no embedding; with pre-norm a final layer norm closes the stack.
    Arguments are the fields of :class:`BlockConfig` (``self_attention`` and ``self_attention_options`` for
    its ``self_attention`` spec) plus ``depth``, the number of layers. ``Encoder.from_config(config, depth)``
    builds one from a config.
    """

    layer_type = EncoderLayer
    gated_layer_type = GatedEncoderLayer

    def __init__(
        self,
        dim: int,
        heads: int,
        depth: int,
        *,
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        self_attention: str = "softmax",
        self_attention_options: Optional[Dict[str, Any]] = None,
        rotary: bool = False,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        block: str = "attention",
        block_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(self_attention, self_attention_options),
            block=block, block_options=block_options,
        )
        super().__init__(config, depth)

    def forward(self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding."""
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask)
        return self.norm(x)


@dataclass
class DecoderState:
    """Decoding state of a :class:`Decoder`: one :class:`LayerState` per layer, the next position, and the
    memory's padding mask (batch, seq_mem) or None. Reorder beams with :func:`attnzoo.state.select_batch`.

    ``last_tokens`` (batch,): the last token fed, kept by a :class:`LanguageModel` with ``token_shift`` (its
    next embedding needs it); None otherwise."""

    layers: List[LayerState]
    position: int
    memory_padding_mask: Optional[Tensor] = None
    last_tokens: Optional[Tensor] = None


class Decoder(_LayerStack):
    """A stack of :class:`DecoderLayer` on vectors, (batch, seq, dim) -> (batch, seq, dim); causal.

    Arguments are the fields of :class:`BlockConfig` (each attention slot as ``<slot>`` and
    ``<slot>_options``) plus ``depth``; ``cross_attention=None`` gives a decoder-only stack (no memory).
    ``Decoder.from_config(config, depth)`` builds one from a config. Incremental decoding: :meth:`prefill`,
    then :meth:`step`.
    """

    layer_type = DecoderLayer
    gated_layer_type = GatedDecoderLayer

    def __init__(
        self,
        dim: int,
        heads: int,
        depth: int,
        *,
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        self_attention: str = "softmax",
        self_attention_options: Optional[Dict[str, Any]] = None,
        cross_attention: Optional[str] = "softmax",
        cross_attention_options: Optional[Dict[str, Any]] = None,
        memory_dim: Optional[int] = None,
        rotary: bool = False,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        block: str = "attention",
        block_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(self_attention, self_attention_options),
            cross_attention=attention_slot("cross_attention", cross_attention, cross_attention_options),
            memory_dim=memory_dim, block=block, block_options=block_options,
        )
        super().__init__(config, depth)

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        memory_padding_mask: Optional[Tensor] = None,
        causal: bool = True,
    ) -> Tensor:
        """x: (batch, seq, dim); memory: (batch, seq_mem, memory_dim) or None without cross-attention;
        padding_mask (batch, seq), memory_padding_mask (batch, seq_mem): bool, True = padding.
        ``causal=False``: bidirectional self-attention (non-autoregressive decoding)."""
        if not check_bool("causal", causal) and self.config.block != "attention":
            raise ValueError(f"causal=False needs attention layers; block={self.config.block!r} units are causal")
        # Gated units take no causal argument (they are causal only, refused above).
        bidirectional = {} if causal else {"causal": False}
        for layer in self.layers:
            x = layer(x, memory, padding_mask=padding_mask, memory_padding_mask=memory_padding_mask, **bidirectional)
        return self.norm(x)

    def prefill(
        self, x: Tensor, memory: Optional[Tensor] = None, *, memory_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, DecoderState]:
        """Causal pass over a prefix x (batch, seq, dim), projecting the memory once for the later steps.

        Returns the output (batch, seq, dim) and the :class:`DecoderState` after the prefix.
        """
        states = []
        for layer in self.layers:
            x, layer_state = layer.prefill(x, layer.project_memory(memory), memory_padding_mask)
            states.append(layer_state)
        return self.norm(x), DecoderState(states, x.shape[1], memory_padding_mask)

    def step(self, x_t: Tensor, state: DecoderState) -> Tuple[Tensor, DecoderState]:
        """One position: x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        if not isinstance(state, DecoderState):
            raise TypeError(f"state must be the DecoderState returned by prefill or step, got {type(state).__name__}")
        states = []
        for layer, layer_state in zip(self.layers, state.layers):
            x_t, layer_state = layer.step(x_t, layer_state, state.memory_padding_mask)
            states.append(layer_state)
        return self.norm(x_t), DecoderState(states, state.position + 1, state.memory_padding_mask)


# -- token models --------------------------------------------------------------------------------------------
def _encoder_type(reversible: bool) -> Type[Encoder]:
    # Imported here: the reversible stacks are subclasses of the ones above, in a module that imports this one.
    from .reversible import ReversibleEncoder

    return ReversibleEncoder if reversible else Encoder


def _decoder_type(reversible: bool) -> Type[Decoder]:
    from .reversible import ReversibleDecoder

    return ReversibleDecoder if reversible else Decoder


def _check_step_token(token_t: Tensor, state: Any, vocab_size: int) -> None:
    check_tokens("token_t", token_t, vocab_size, rank=1)
    if not isinstance(state, DecoderState):
        raise TypeError(f"state must be the DecoderState returned by prefill or step, got {type(state).__name__}")


class LanguageModel(nn.Module):
    """Decoder-only (GPT-style) language model: tokens (batch, seq) -> next-token logits (batch, seq, vocab).

    Args:
        vocab_size, dim, heads, depth: vocabulary, width, heads per layer, number of layers.
        ff_dim, activation, norm_first, dropout, layer_norm_eps, ff_chunks: as for :class:`BlockConfig`.
        positional: "sinusoidal", "learned" (needs ``max_length``), "rotary" or "none".
        max_length: the longest sequence, required by ``positional="learned"``.
        self_attention, self_attention_options: mechanism name and options of every self-attention.
        reversible: a :class:`~attnzoo.models.reversible.ReversibleDecoder` (Kitaev et al. 2020) instead of a
            :class:`Decoder`: the same layers coupled reversibly, so training keeps the activations of one
            branch instead of every layer's (pre-norm only). Decoding works the same way.
        block, block_options: "attention" (attention + feed-forward layers, the default), or gated attention
            units in their place (Hua et al. 2022): "gau" (quadratic) or "flash" (mixed chunk attention, linear
            time, constant-size decoding state); see :class:`BlockConfig` and :mod:`attnzoo.models.gau`. A unit
            has about half the parameters of an attention + feed-forward layer, so ``depth`` counts units.
        token_shift: half of each position's embedding features come from the token before it (see
            :class:`TokenEmbedding`); the decoding state then keeps the last token.

    Decoding: ``logits, state = model.prefill(prompt)`` then ``logits_t, state = model.step(token_t, state)``;
    see :mod:`attnzoo.decoding` for greedy, sampling and beam search.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int = 128,
        heads: int = 4,
        depth: int = 2,
        *,
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        positional: str = "sinusoidal",
        max_length: Optional[int] = None,
        self_attention: str = "softmax",
        self_attention_options: Optional[Dict[str, Any]] = None,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        reversible: bool = False,
        block: str = "attention",
        block_options: Optional[Dict[str, Any]] = None,
        token_shift: bool = False,
    ) -> None:
        super().__init__()
        check_bool("reversible", reversible)
        self.vocab_size = vocab_size
        self.embedding = TokenEmbedding(vocab_size, dim, positional, max_length, dropout, token_shift)
        config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=self.embedding.rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(self_attention, self_attention_options),
            block=block, block_options=block_options,
        )
        self.decoder = _decoder_type(reversible).from_config(config, depth)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns (batch, seq, vocab)."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        x = self.embedding(tokens, padding_mask=padding_mask)
        return self.head(self.decoder(x, padding_mask=padding_mask))

    def _keep_last(self, state: DecoderState, tokens: Tensor) -> DecoderState:
        return replace(state, last_tokens=tokens[:, -1]) if self.embedding.token_shift else state

    def prefill(self, tokens: Tensor) -> Tuple[Tensor, DecoderState]:
        """Run a prompt (batch, seq); returns its logits (batch, seq, vocab) and the decoding state."""
        check_tokens("tokens", tokens, self.vocab_size)
        hidden, state = self.decoder.prefill(self.embedding(tokens))
        return self.head(hidden), self._keep_last(state, tokens)

    def step(self, token_t: Tensor, state: DecoderState) -> Tuple[Tensor, DecoderState]:
        """Feed one token per sequence, token_t (batch,); returns the next logits (batch, vocab) and the state."""
        _check_step_token(token_t, state, self.vocab_size)
        if self.embedding.token_shift and (state.last_tokens is None or state.last_tokens.shape != token_t.shape):
            raise ValueError("state does not hold the last token of each sequence that token_shift needs (shape "
                             f"{tuple(token_t.shape)}): pass the state this model's prefill or step returned")
        x_t = self.embedding(token_t[:, None], start=state.position, previous=state.last_tokens)
        hidden, state = self.decoder.step(x_t, state)
        return self.head(hidden[:, 0]), self._keep_last(state, token_t[:, None])


@dataclass
class CopyDecoderState:
    """Decoding state of a :class:`Seq2SeqTransformer` with the copy mechanism: the decoder's state and what
    the copy attention needs of the source (reordered with :func:`attnzoo.state.select_batch` like it)."""

    decoder: DecoderState
    copy: CopyMemory

    @property
    def position(self) -> int:
        return self.decoder.position


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer: source (batch, seq_src) and target (batch, seq_tgt) -> (batch, seq_tgt, vocab).

    Args:
        src_vocab_size, tgt_vocab_size: vocabularies of source and target.
        dim, heads, encoder_depth, decoder_depth: width, heads and the two stack depths.
        ff_dim, activation, norm_first, dropout, positional, max_length, layer_norm_eps, ff_chunks, reversible:
            as for :class:`LanguageModel` (the positional kind applies to both sides; ``reversible`` makes both
            stacks reversible). A source longer than ``max_length`` is refused, whatever the positions.
        encoder_self_attention, decoder_self_attention, cross_attention (+ ``*_options``): the mechanism
            of each attention slot, e.g. an approximate encoder with exact cross-attention.
        copy_mechanism: a pointer-generator output (See et al. 2017, :mod:`attnzoo.models.pointer`): the
            vocabulary distribution mixed with a copy distribution over the source positions. The outputs are
            then the *log-probabilities* of the mixture over the extended vocabulary (``output_vocab_size``
            wide; they already sum to one, so cross-entropy, argmax and the decoders use them as logits), and
            target ids may be extended ids (a copied source-only token read back by the decoder: all of them
            share one learned embedding).
        copy_map: with ``copy_mechanism`` only, and required there: (src_vocab_size,) int64, the target id
            copying each source token produces (an id >= tgt_vocab_size for a source-only token, -1 for one
            never copied); see :mod:`attnzoo.models.pointer`.
        decoding: "autoregressive" (the default) or "non-autoregressive": every target position in one pass
            over placeholders, with bidirectional decoder self-attention (:mod:`attnzoo.models.nat`).
        length, max_target_length: non-autoregressive only: where the output length comes from,
            "predicted" (a length head, the default) or "max"; the widest target (END included).

    Decoding: ``logits, state = model.prefill(src, tgt_prefix, src_padding_mask=...)`` encodes the source and
    projects its keys and values once; then ``model.step(token_t, state)``. A non-autoregressive model runs
    :meth:`forward_nat` instead (see :func:`attnzoo.decoding.nat_decode`).
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        dim: int = 128,
        heads: int = 4,
        *,
        encoder_depth: int = 2,
        decoder_depth: int = 2,
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        positional: str = "sinusoidal",
        max_length: Optional[int] = None,
        encoder_self_attention: str = "softmax",
        encoder_self_attention_options: Optional[Dict[str, Any]] = None,
        decoder_self_attention: str = "softmax",
        decoder_self_attention_options: Optional[Dict[str, Any]] = None,
        cross_attention: str = "softmax",
        cross_attention_options: Optional[Dict[str, Any]] = None,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        reversible: bool = False,
        copy_mechanism: bool = False,
        copy_map: Optional[Tensor] = None,
        decoding: str = "autoregressive",
        length: Optional[str] = None,
        max_target_length: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_bool("reversible", reversible)
        check_bool("copy_mechanism", copy_mechanism)
        if copy_mechanism and copy_map is None:
            raise ValueError("copy_mechanism=True needs copy_map, the (src_vocab_size,) target id of each source "
                             "token (-1: never copied)")
        if not copy_mechanism and copy_map is not None:
            raise ValueError("copy_map is only used with copy_mechanism=True")
        if copy_mechanism and decoding != "autoregressive":
            raise UnsupportedOptionError(
                "copy_mechanism=True: the copy mechanism is built for autoregressive decoding, "
                f"got decoding={decoding!r}")
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        if max_length is not None:
            check_positive_int("max_length", max_length)
        self.max_length = max_length
        self.decoding = decoding
        self.nat = build_nat_parts(decoding, length, max_target_length, dim=dim, positional=positional,
                                   reversible=reversible)
        self.src_embedding = TokenEmbedding(src_vocab_size, dim, positional, max_length, dropout)
        self.tgt_embedding = TokenEmbedding(tgt_vocab_size, dim, positional, max_length, dropout)
        decoder_config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=self.src_embedding.rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(decoder_self_attention, decoder_self_attention_options),
            cross_attention=attention_slot("cross_attention", cross_attention, cross_attention_options),
        )
        # The encoder differs in its self-attention slot only, and has no memory to attend to.
        encoder_config = replace(
            decoder_config,
            self_attention=AttentionSpec(encoder_self_attention, encoder_self_attention_options),
            cross_attention=None,
        )
        self.encoder = _encoder_type(reversible).from_config(encoder_config, encoder_depth)
        self.decoder = _decoder_type(reversible).from_config(decoder_config, decoder_depth)
        self.head = nn.Linear(dim, tgt_vocab_size, bias=False)
        self.pointer: Optional[PointerGenerator] = None
        self.copied_embedding: Optional[nn.Parameter] = None
        if copy_mechanism:
            self.pointer = PointerGenerator(dim, src_vocab_size, tgt_vocab_size, copy_map)
            if self.pointer.extended_vocab_size > tgt_vocab_size:
                # The decoder reads back the source-only tokens it copied: one shared embedding (See et al.
                # feed an UNK there), initialised like nn.Embedding's rows.
                self.copied_embedding = nn.Parameter(torch.randn(dim))

    @property
    def output_vocab_size(self) -> int:
        """Width of the outputs and range of the target ids: the extended vocabulary with the copy mechanism,
        the target vocabulary without."""
        return self.tgt_vocab_size if self.pointer is None else self.pointer.extended_vocab_size

    def _embed_target(self, tgt: Tensor, start: int = 0) -> Tuple[Tensor, Tensor]:
        """Target ids (batch, seq) -> (embeddings with positions for the decoder, the token embeddings alone
        for the copy gate), both (batch, seq, dim). Extended ids take the shared copied-token embedding."""
        if self.copied_embedding is None:
            tokens = self.tgt_embedding.embed_tokens(tgt)
        else:
            extended = tgt >= self.tgt_vocab_size
            tokens = self.tgt_embedding.embed_tokens(tgt.masked_fill(extended, 0))
            tokens = torch.where(extended[..., None], self.copied_embedding.to(tokens.dtype), tokens)
        return self.tgt_embedding.add_positions(tokens, start), tokens

    def _check_target(self, src: Tensor, tgt: Tensor) -> None:
        check_tokens("tgt", tgt, self.output_vocab_size)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"tgt batch {tgt.shape[0]} does not match src batch {src.shape[0]}")

    def _output(self, hidden: Tensor, tokens: Tensor, copy: Optional[CopyMemory]) -> Tensor:
        """Logits of the head, or with the copy mechanism the mixture's log-probabilities."""
        logits = self.head(hidden)
        if self.pointer is None:
            return logits
        return self.pointer(hidden, tokens, logits, copy)

    def encode(self, src: Tensor, *, src_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Source ids (batch, seq_src) -> memory (batch, seq_src, dim)."""
        check_tokens("src", src, self.src_vocab_size)
        if self.max_length is not None and src.shape[1] > self.max_length:
            # Sinusoidal positions would go on past it silently; a model is only trained up to max_length.
            raise ValueError(f"src has {src.shape[1]} positions, more than this model's max_length "
                             f"{self.max_length}")
        check_padding_mask("src_padding_mask", src_padding_mask, src)
        return self.encoder(self.src_embedding(src), key_padding_mask=src_padding_mask)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_padding_mask: Optional[Tensor] = None,
        tgt_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Teacher-forced logits (batch, seq_tgt, output_vocab_size) for target ids tgt (batch, seq_tgt);
        log-probabilities with the copy mechanism."""
        self._check_autoregressive("forward")
        memory = self.encode(src, src_padding_mask=src_padding_mask)
        self._check_target(src, tgt)
        check_padding_mask("tgt_padding_mask", tgt_padding_mask, tgt)
        x, tokens = self._embed_target(tgt)
        hidden = self.decoder(x, memory, padding_mask=tgt_padding_mask, memory_padding_mask=src_padding_mask)
        copy = None if self.pointer is None else self.pointer.project_memory(memory, src, src_padding_mask)
        return self._output(hidden, tokens, copy)

    def prefill(
        self, src: Tensor, tgt: Tensor, *, src_padding_mask: Optional[Tensor] = None,
        cross_attention_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Union[DecoderState, CopyDecoderState]]:
        """Encode src and run the target prefix tgt (batch, seq_tgt); returns (logits (batch, seq_tgt,
        output_vocab_size), state). The memory's cross-attention keys and values (and the copy attention's
        keys) are projected here, once; the state is a :class:`CopyDecoderState` with the copy mechanism.

        ``cross_attention_mask`` (batch, seq_src) bool, True = hidden: source positions this pass's
        cross-attention does not see besides the padding (the encoder still reads them), e.g. the window of
        monotonic decoding (:mod:`attnzoo.models.monotonic`); the returned state holds the padding alone."""
        self._check_autoregressive("prefill")
        memory = self.encode(src, src_padding_mask=src_padding_mask)
        self._check_target(src, tgt)
        check_padding_mask("cross_attention_mask", cross_attention_mask, src)
        hidden_sources = src_padding_mask
        if cross_attention_mask is not None:
            if self.pointer is not None:
                raise UnsupportedOptionError(
                    "cross_attention_mask: the copy mechanism's own attention reads every source position")
            hidden_sources = (cross_attention_mask if src_padding_mask is None
                              else src_padding_mask | cross_attention_mask)
        x, tokens = self._embed_target(tgt)
        hidden, state = self.decoder.prefill(x, memory, memory_padding_mask=hidden_sources)
        state = replace(state, memory_padding_mask=src_padding_mask)
        if self.pointer is None:
            return self.head(hidden), state
        copy = self.pointer.project_memory(memory, src, src_padding_mask)
        return self._output(hidden, tokens, copy), CopyDecoderState(state, copy)

    def step(
        self, token_t: Tensor, state: Union[DecoderState, CopyDecoderState]
    ) -> Tuple[Tensor, Union[DecoderState, CopyDecoderState]]:
        """Feed one target token per sequence, token_t (batch,); returns logits (batch, output_vocab_size)
        and the state."""
        self._check_autoregressive("step")
        check_tokens("token_t", token_t, self.output_vocab_size, rank=1)
        expected = DecoderState if self.pointer is None else CopyDecoderState
        if not isinstance(state, expected):
            raise TypeError(f"state must be the {expected.__name__} returned by prefill or step, "
                            f"got {type(state).__name__}")
        x, tokens = self._embed_target(token_t[:, None], start=state.position)
        decoder_state = state if self.pointer is None else state.decoder
        hidden, decoder_state = self.decoder.step(x, decoder_state)
        if self.pointer is None:
            return self.head(hidden[:, 0]), decoder_state
        return self._output(hidden, tokens, state.copy)[:, 0], CopyDecoderState(decoder_state, state.copy)

    # -- non-autoregressive decoding ---------------------------------------------------------------------
    def _check_autoregressive(self, method: str) -> None:
        if self.nat is not None:
            raise ValueError(f"{method} feeds target tokens, which a model built with decoding="
                             "'non-autoregressive' does not read: use forward_nat or attnzoo.decoding.nat_decode")

    def _check_non_autoregressive(self) -> None:
        if self.nat is None:
            raise ValueError("forward_nat and decode_nat need a model built with decoding='non-autoregressive'; "
                             f"this one has decoding={self.decoding!r}")

    def forward_nat(
        self,
        src: Tensor,
        *,
        src_padding_mask: Optional[Tensor] = None,
        target_lengths: Optional[Tensor] = None,
        width: Optional[int] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """One parallel pass of a non-autoregressive model over the source ids src (batch, seq_src); no target
        token is read. Arguments as for :meth:`decode_nat`.

        Returns the logits (batch, width, tgt_vocab) and the length head's logits (batch, max_target_length),
        class i for length i + 1 (None with ``length="max"``).
        """
        self._check_non_autoregressive()
        memory = self.encode(src, src_padding_mask=src_padding_mask)
        logits = self.decode_nat(memory, memory_padding_mask=src_padding_mask, target_lengths=target_lengths,
                                 width=width)
        head = self.nat.length_head
        return logits, None if head is None else head(memory, src_padding_mask)

    def decode_nat(
        self,
        memory: Tensor,
        *,
        memory_padding_mask: Optional[Tensor] = None,
        target_lengths: Optional[Tensor] = None,
        width: Optional[int] = None,
    ) -> Tensor:
        """The non-autoregressive decoder on an encoded source: logits (batch, width, tgt_vocab).

        Args:
            memory: (batch, seq_src, dim) from :meth:`encode`; memory_padding_mask: (batch, seq_src) bool.
            target_lengths: (batch,) integers in [1, width] (END included) or None: each row's decoder positions
                from its length on are padding, which the decoder's self-attention ignores (their logits mean
                nothing). None: every position is read.
            width: decoder positions, at most ``max_target_length`` (default: the longest of
                ``target_lengths``, else ``max_target_length``).
        """
        self._check_non_autoregressive()
        batch, maximum = memory.shape[0], self.nat.max_target_length
        if width is None:
            width = maximum if target_lengths is None else int(
                check_lengths("target_lengths", target_lengths, batch, maximum).max())
        check_number("width", width, integer=True, minimum=1, maximum=maximum)
        padding_mask = None
        if target_lengths is not None:
            check_lengths("target_lengths", target_lengths, batch, width)
            positions = torch.arange(width, device=memory.device)
            padding_mask = positions[None, :] >= target_lengths.to(memory.device)[:, None]
        placeholders = self.tgt_embedding.add_positions(self.nat.placeholders(batch, width).to(memory.dtype))
        hidden = self.decoder(placeholders, memory, padding_mask=padding_mask,
                              memory_padding_mask=memory_padding_mask, causal=False)
        return self.head(hidden)


class SequenceClassifier(nn.Module):
    """Encoder-only classifier: tokens (batch, seq) -> class logits (batch, num_classes).

    ``pooling="mean"`` averages the final vectors of the non-padding positions; ``pooling="cls"`` prepends a
    learned classification vector (at position 0) and reads its final vector. With ``positional="learned"``,
    ``max_length`` counts the tokens only. Other arguments as for :class:`LanguageModel` (``reversible``: a
    :class:`~attnzoo.models.reversible.ReversibleEncoder`; ``block``: bidirectional gated units).
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int = 128,
        heads: int = 4,
        depth: int = 2,
        *,
        pooling: str = "mean",
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        positional: str = "sinusoidal",
        max_length: Optional[int] = None,
        self_attention: str = "softmax",
        self_attention_options: Optional[Dict[str, Any]] = None,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        reversible: bool = False,
        block: str = "attention",
        block_options: Optional[Dict[str, Any]] = None,
        token_shift: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_bool("reversible", reversible)
        self.vocab_size = vocab_size
        self.pooling = check_choice("pooling", pooling, POOLING_KINDS)
        use_cls = pooling == "cls"
        positions = None if max_length is None else max_length + int(use_cls)
        self.embedding = TokenEmbedding(vocab_size, dim, positional, positions, dropout, token_shift)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02) if use_cls else None
        config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=self.embedding.rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(self_attention, self_attention_options),
            block=block, block_options=block_options,
        )
        self.encoder = _encoder_type(reversible).from_config(config, depth)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns (batch, classes)."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        x = self.embedding.embed_tokens(tokens, padding_mask)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
            if padding_mask is not None:
                padding_mask = torch.cat([padding_mask.new_zeros(x.shape[0], 1), padding_mask], dim=1)
        hidden = self.encoder(self.embedding.add_positions(x), key_padding_mask=padding_mask)
        if self.cls is not None:
            return self.head(hidden[:, 0])
        return self.head(mean_over_positions(hidden, padding_mask))


class SequenceTagger(nn.Module):
    """Encoder-only tagger: tokens (batch, seq) -> a label's logits at every position (batch, seq, num_classes).

    The encoder is bidirectional (no causal mask), so every mechanism can serve it; padded positions are
    masked as keys and their own logits are meaningless (leave them out of the loss). Used for per-position
    tasks such as associative recall. Arguments as for :class:`SequenceClassifier`, without pooling.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int = 128,
        heads: int = 4,
        depth: int = 2,
        *,
        ff_dim: Optional[int] = None,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        positional: str = "sinusoidal",
        max_length: Optional[int] = None,
        self_attention: str = "softmax",
        self_attention_options: Optional[Dict[str, Any]] = None,
        layer_norm_eps: float = 1e-5,
        ff_chunks: int = 1,
        reversible: bool = False,
        block: str = "attention",
        block_options: Optional[Dict[str, Any]] = None,
        token_shift: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_bool("reversible", reversible)
        self.vocab_size = vocab_size
        self.embedding = TokenEmbedding(vocab_size, dim, positional, max_length, dropout, token_shift)
        config = BlockConfig(
            dim, heads, ff_dim=ff_dim, activation=activation, norm_first=norm_first, dropout=dropout,
            layer_norm_eps=layer_norm_eps, rotary=self.embedding.rotary, ff_chunks=ff_chunks,
            self_attention=AttentionSpec(self_attention, self_attention_options),
            block=block, block_options=block_options,
        )
        self.encoder = _encoder_type(reversible).from_config(config, depth)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns
        (batch, seq, num_classes)."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        x = self.embedding(tokens, padding_mask=padding_mask)
        return self.head(self.encoder(x, key_padding_mask=padding_mask))

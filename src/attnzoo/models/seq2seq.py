"""The encoder-decoder Transformer: source and target token sequences, with the copy mechanism
(:mod:`attnzoo.models.pointer`) and non-autoregressive decoding (:mod:`attnzoo.models.nat`) as options.

It runs: source embedding -> encoder stack -> memory; target embedding -> decoder stack (self-attention, then
cross-attention to the memory) -> head. Each attention slot takes its own mechanism name and options, e.g.
``Seq2SeqTransformer(..., encoder_self_attention="performer", cross_attention="softmax")``. Padding masks are
(batch, seq) bool tensors, True marking padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_number, check_positive_int
from ..mechanisms.base import UnsupportedOptionError
from .config import BLOCKS, AttentionSpec, BlockConfig, attention_slot, scheduled_configs
from .embeddings import TokenEmbedding
from .inputs import check_padding_mask, check_tokens
from .nat import build_nat_parts, check_lengths
from .pointer import CopyMemory, PointerGenerator
from .reversible import decoder_class, encoder_class
from .schedule import LayerSpec, schedule_of
from .stacks import DecoderState


@dataclass
class CopyDecoderState:
    """Decoding state of a :class:`Seq2SeqTransformer` with the copy mechanism: the decoder's state and what
    the copy attention needs of the source (reordered with :func:`attnzoo.state.select_batch` like it)."""

    decoder: DecoderState
    copy: CopyMemory

    @property
    def position(self) -> int:
        return self.decoder.position


def _check_copy_options(copy_mechanism: bool, copy_map: Optional[Tensor], decoding: str) -> None:
    """Refuse, naming them, copy options that do not go together."""
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


def _stack(stack_class: Any, config: BlockConfig, depth: int, layers: Any, name: str, mechanism: str,
           options: Optional[Dict[str, Any]]) -> nn.Module:
    """One side's stack: every layer of ``config``, or the per-layer schedule ``layers`` (named ``name``)."""
    schedule = schedule_of(layers, BLOCKS, name)
    if schedule is None:
        return stack_class.from_config(config, depth)
    side = name.split("_")[0]
    if mechanism != AttentionSpec.mechanism or options:
        raise ValueError(f"{name} gives each {side} layer's mechanism, so {side}_self_attention and its options "
                         f"cannot be used with it: put them in the schedule's items")
    return stack_class.from_config(config, depth, scheduled_configs(config, schedule, depth, name))


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
        kv_heads: key/value heads, dividing ``heads``, of the encoder's self-attention and the decoder's self-
            and cross-attention (grouped-query attention: query head h reads key/value head
            ``h // (heads // kv_heads)``); the decoding state's self-attention cache (for a native mechanism) and
            the memory's projected keys and values then hold kv_heads heads. ``heads`` when None.
        output_gate: gated attention (``MultiHeadAttention(output_gate=True)``) on the encoder's and the
            decoder's self-attention; a schedule's item may set its own (``softmax(output_gate=true)``).
        encoder_layers, decoder_layers: per-layer schedules (hybrid stacks, :mod:`attnzoo.models.schedule`) in
            place of ``encoder_self_attention`` / ``decoder_self_attention`` (left at their defaults): a pattern
            of items, :class:`~attnzoo.models.schedule.LayerSpec` or text (``"gated_delta*3,softmax"``),
            repeated to the side's depth, which its length must divide. Every decoder layer keeps its
            cross-attention, so the decoder's items are mechanisms; the encoder's may be block kinds too.

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
        kv_heads: Optional[int] = None,
        output_gate: bool = False,
        encoder_layers: Optional[Sequence[Union[LayerSpec, str]]] = None,
        decoder_layers: Optional[Sequence[Union[LayerSpec, str]]] = None,
    ) -> None:
        super().__init__()
        check_bool("reversible", reversible)
        _check_copy_options(copy_mechanism, copy_map, decoding)
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
            kv_heads=kv_heads, output_gate=output_gate,
        )
        # The encoder differs in its self-attention slot only, and has no memory to attend to.
        encoder_config = replace(
            decoder_config,
            self_attention=AttentionSpec(encoder_self_attention, encoder_self_attention_options),
            cross_attention=None,
        )
        self.encoder = _stack(encoder_class(reversible), encoder_config, encoder_depth, encoder_layers,
                              "encoder_layers", encoder_self_attention, encoder_self_attention_options)
        self.decoder = _stack(decoder_class(reversible), decoder_config, decoder_depth, decoder_layers,
                              "decoder_layers", decoder_self_attention, decoder_self_attention_options)
        self.head = nn.Linear(dim, tgt_vocab_size, bias=False)
        self._build_copy(copy_map if copy_mechanism else None)

    def _build_copy(self, copy_map: Optional[Tensor]) -> None:
        """The pointer-generator of the copy mechanism and the embedding of copied source-only tokens; None
        for both without ``copy_map`` (no copy mechanism)."""
        self.pointer: Optional[PointerGenerator] = None
        self.copied_embedding: Optional[nn.Parameter] = None
        if copy_map is None:
            return
        dim = self.head.in_features
        self.pointer = PointerGenerator(dim, self.src_vocab_size, self.tgt_vocab_size, copy_map)
        if self.pointer.extended_vocab_size > self.tgt_vocab_size:
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


__all__ = ["CopyDecoderState", "Seq2SeqTransformer"]

"""Monotonic cross-attention at inference for a :class:`~attnzoo.models.seq2seq.Seq2SeqTransformer`.

An explicit option of incremental decoding (``monotonic=MonotonicInference(...)`` in :mod:`attnzoo.decoding`):
every decoding step's cross-attention, in every decoder layer, sees only a window of the source around a
*focus* that moves left to right (Tachibana et al. 2018's forcibly incremental attention, as a window):

* the focus starts at each source's first position;
* a step attends to the positions ``focus - behind .. focus + ahead`` (and never to padding);
* its new focus is the source position with the largest cross-attention weight, averaged over the heads and
  the layers, or the old focus if that lies behind it.

The focus lives in the decoding state (:class:`MonotonicState`, whose tensors all lead with the batch, so beam
search reorders it with :func:`attnzoo.state.select_batch` like any other state), never on a module. The
maths of the window and of the focus is in :mod:`attnzoo.functional.monotonic`.

The weights that move the focus are those of softmax attention, so the decoder's cross-attention must be
exact softmax with its weights (``softmax``, not ``quiet``: capabilities ``exact`` and ``attention_weights``);
any other mechanism is refused with an
:class:`~attnzoo.UnsupportedOptionError` naming ``monotonic``. A prompt of several target tokens is run at
once, all of its positions seeing the window at the initial focus: the constraint is meant for decoding from
one start token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..functional.monotonic import advance_focus, initial_focus, monotonic_window_mask
from ..mechanisms.base import UnsupportedOptionError
from .cross_attention import CrossAttentionWeights, softmax_weights_refusal
from .seq2seq import Seq2SeqTransformer
from .settings import check_declared, number, positive_int, setting
from .stacks import DecoderState

DECODING_COMMANDS = ("train", "eval")
"""The ``attnzoo`` commands that decode a seq2seq model: they take the decoder's flags."""


@dataclass(frozen=True)
class MonotonicInference:
    """The window of monotonic decoding.

    Attributes:
        ahead: how many source positions past the focus a step may attend to (>= 1): the most the focus can
            advance per step.
        behind: how many positions before the focus stay visible (>= 0). With 0 (the default) the attention
            itself never moves backwards; the focus never does in any case.
    """

    ahead: int = setting(3, check=positive_int, flag="--monotonic-ahead", metavar="N", commands=DECODING_COMMANDS,
                         help="monotonic: source positions visible past the focus")
    behind: int = setting(0, check=number(integer=True, minimum=0), flag="--monotonic-behind", metavar="N",
                          commands=DECODING_COMMANDS, help="monotonic: positions visible before the focus")

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass
class MonotonicState:
    """Decoding state of monotonic decoding: the model's own state and the focus.

    Attributes:
        decoder: the :class:`DecoderState` of the model, its ``memory_padding_mask`` the source padding alone.
        focus: (batch,) int64, the source position each sequence attended to most at its last step.
        source_padding_mask: (batch, seq_src) bool, True = padding, or None.
        source_len: seq_src.
    """

    decoder: DecoderState
    focus: Tensor
    source_padding_mask: Optional[Tensor]
    source_len: int

    @property
    def position(self) -> int:
        """The next target position."""
        return self.decoder.position


def check_monotonic(model: Any, monotonic: Any) -> Optional[MonotonicInference]:
    """``monotonic`` if it is None or a :class:`MonotonicInference` that ``model`` can decode with; a clear
    error naming ``monotonic`` otherwise."""
    if monotonic is None:
        return None
    if not isinstance(monotonic, MonotonicInference):
        raise TypeError(f"monotonic must be None or a MonotonicInference, got {type(monotonic).__name__}")
    if not isinstance(model, Seq2SeqTransformer):
        raise UnsupportedOptionError(
            f"monotonic=...: monotonic inference constrains the cross-attention of a Seq2SeqTransformer; "
            f"{type(model).__name__} has none")
    if model.pointer is not None:
        raise UnsupportedOptionError(
            "monotonic=...: the copy mechanism's own attention over the source is not held to the window; "
            "decode a copy-mechanism model without monotonic inference")
    for number, layer in enumerate(model.decoder.layers):
        refused = softmax_weights_refusal(layer.cross_attention.mechanism)
        if refused:
            raise UnsupportedOptionError(
                f"monotonic=...: monotonic inference moves its focus by the softmax cross-attention weights; "
                f"decoder layer {number}'s cross-attention: {refused} (use cross_attention='softmax')")
    return monotonic


def _focus_weights(recorded: CrossAttentionWeights) -> Tensor:
    """The cross-attention weights of the newest target position, averaged over the heads and the decoder
    layers: (batch, seq_src)."""
    return torch.stack([weights[:, :, -1] for weights in recorded.weights]).mean(dim=(0, 2))


def _hidden_sources(padding_mask: Optional[Tensor], window: Tensor) -> Tensor:
    """Source positions a step must not attend to: padding or outside the window, (batch, seq_src) bool."""
    return window if padding_mask is None else padding_mask | window


def monotonic_prefill(
    model: Seq2SeqTransformer,
    monotonic: MonotonicInference,
    src: Tensor,
    tgt: Tensor,
    *,
    src_padding_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, MonotonicState]:
    """``model.prefill`` with the cross-attention held to the window at the initial focus; returns the logits
    (batch, seq_tgt, vocab) and the :class:`MonotonicState` with the focus after the prompt's last position."""
    check_monotonic(model, monotonic)
    batch, source_len = src.shape
    focus = initial_focus(src_padding_mask, batch, source_len, src.device)
    window = monotonic_window_mask(focus, source_len, monotonic.ahead, monotonic.behind)
    with CrossAttentionWeights(model, "monotonic inference") as recorded:
        logits, decoder_state = model.prefill(src, tgt, src_padding_mask=src_padding_mask, cross_attention_mask=window)
    focus = advance_focus(focus, _focus_weights(recorded))
    return logits, MonotonicState(decoder_state, focus, src_padding_mask, source_len)


def monotonic_step(
    model: Seq2SeqTransformer, monotonic: MonotonicInference, token_t: Tensor, state: MonotonicState
) -> Tuple[Tensor, MonotonicState]:
    """``model.step`` with the cross-attention held to the window at ``state.focus``: token_t (batch,) ->
    logits (batch, vocab) and the next :class:`MonotonicState`."""
    if not isinstance(state, MonotonicState):
        raise TypeError(f"state must be the MonotonicState returned by monotonic_prefill or monotonic_step, got "
                        f"{type(state).__name__}")
    window = monotonic_window_mask(state.focus, state.source_len, monotonic.ahead, monotonic.behind)
    # The model's step reads the memory padding mask for its cross-attention only: the window goes there.
    windowed = dataclasses.replace(
        state.decoder, memory_padding_mask=_hidden_sources(state.source_padding_mask, window))
    with CrossAttentionWeights(model, "monotonic inference") as recorded:
        logits, decoder_state = model.step(token_t, windowed)
    decoder_state = dataclasses.replace(decoder_state, memory_padding_mask=state.source_padding_mask)
    focus = advance_focus(state.focus, _focus_weights(recorded))
    return logits, MonotonicState(decoder_state, focus, state.source_padding_mask, state.source_len)

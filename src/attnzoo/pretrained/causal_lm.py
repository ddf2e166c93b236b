"""attnzoo's Llama-type causal language model, built from attnzoo's parts.

The attention of every layer is a :class:`~attnzoo.MultiHeadAttention` with grouped key/value heads and
rotary positions, so any registered mechanism can take its place (``mechanism="softmax"`` reproduces the
pretrained model), and the model decodes, packs and pads as every attnzoo model does. The feed-forward
network is attnzoo's SwiGLU :class:`~attnzoo.models.FeedForward` (its fused ``in_proj`` holds the gate rows,
then the up rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..attention import AttentionState, MultiHeadAttention
from ..mechanisms import UnsupportedOptionError, available, capabilities
from ..functional.norms import rms_norm
from ..models import FeedForward
from ..models.inputs import check_padding_mask, check_tokens, packed_spans
from .config import CausalLMConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, (..., dim) -> (..., dim); see
    :func:`attnzoo.functional.norms.rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


@dataclass
class CausalLMState:
    """Decoding state of a :class:`CausalLM`: one attention state per layer and the next position. Reorder
    beams with :func:`attnzoo.state.select_batch`."""

    layers: List[AttentionState]
    position: int


def windowed_options(config: CausalLMConfig, mechanism: str, options: Mapping[str, Any]) -> Dict[str, Any]:
    """``options`` with the model's sliding window (``config.sliding_window``) as the mechanism's
    ``window_option`` unless they set it; an :class:`~attnzoo.UnsupportedOptionError` naming the window for a
    mechanism that cannot attend within one (it would see what the model's own attention never did)."""
    if config.sliding_window is None:
        return dict(options)
    option = capabilities(mechanism).window_option
    if option is None:
        can = ", ".join(name for name in available() if capabilities(name).window_option is not None)
        raise UnsupportedOptionError(f"the model attends within a sliding window of {config.sliding_window} keys "
                                     f"(sliding_window) and {mechanism} cannot honour one; mechanisms that can: {can}")
    return {option: config.sliding_window, **options}


class CausalLMLayer(nn.Module):
    """One pre-norm layer: ``x + attention(norm(x))``, then ``x + swiglu(norm(x))``; (batch, seq, dim)."""

    def __init__(self, config: CausalLMConfig, mechanism: str, mechanism_options: Mapping[str, Any]) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = MultiHeadAttention(
            config.dim, config.heads, mechanism, head_dim=config.head_dim, kv_heads=config.kv_heads,
            bias=config.attention_bias, rotary=True, rotary_base=config.rope_base, rotary_pairs="halves",
            **windowed_options(config, mechanism, mechanism_options),
        )
        if config.attention_bias:
            # Qwen2 biases the query, key and value projections only; MultiHeadAttention's bias covers all four,
            # so the output projection's is held at zero (it adds nothing and is never trained here).
            nn.init.zeros_(self.attention.out_proj.bias)
            self.attention.out_proj.bias.requires_grad_(False)
        self.feed_forward_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ff_dim, "swiglu", bias=False)

    def forward(
        self, x: Tensor, *, padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1). Returns (batch, seq, dim)."""
        x = x + self.attention(self.attention_norm(x), causal=True, key_padding_mask=padding_mask,
                               cu_seqlens=cu_seqlens)
        return x + self.feed_forward(self.feed_forward_norm(x))

    def prefill(self, x: Tensor) -> Tuple[Tensor, AttentionState]:
        """The causal pass over a prompt x (batch, seq, dim), and the layer's decoding state."""
        attended, state = self.attention.prefill(self.attention_norm(x))
        x = x + attended
        return x + self.feed_forward(self.feed_forward_norm(x)), state

    def step(self, x_t: Tensor, state: AttentionState) -> Tuple[Tensor, AttentionState]:
        """One position x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        attended, state = self.attention.step(self.attention_norm(x_t), state)
        x_t = x_t + attended
        return x_t + self.feed_forward(self.feed_forward_norm(x_t)), state


def check_layer_mechanisms(
    layer_mechanisms: Sequence[Tuple[str, Mapping[str, Any]]], depth: int
) -> List[Tuple[str, Mapping[str, Any]]]:
    """``layer_mechanisms`` as a list of ``(mechanism, options)``, one per layer; errors name the layer."""
    if isinstance(layer_mechanisms, (str, bytes)) or not isinstance(layer_mechanisms, Sequence):
        raise TypeError(f"layer_mechanisms must be a list of (mechanism, options) pairs, one per layer, got "
                        f"{type(layer_mechanisms).__name__}")
    if len(layer_mechanisms) != depth:
        raise ValueError(f"layer_mechanisms has {len(layer_mechanisms)} entries but the model has {depth} layers")
    checked = []
    for index, entry in enumerate(layer_mechanisms):
        if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], Mapping)):
            raise TypeError(f"layer_mechanisms[{index}] must be a (mechanism name, options dict) pair, got {entry!r}")
        checked.append((entry[0], dict(entry[1])))
    return checked


class CausalLM(nn.Module):
    """A Llama-type decoder-only language model: tokens (batch, seq) -> next-token logits (batch, seq, vocab).

    Args:
        config: the network's hyperparameters (:class:`CausalLMConfig`).
        mechanism: the attention mechanism of every layer (see :func:`attnzoo.available`); ``"softmax"``, the
            default, is the attention the pretrained weights were trained with.
        mechanism_options: that mechanism's options (e.g. a window), checked by the mechanism; None: none.
        layer_mechanisms: a hybrid: one ``(mechanism, options)`` pair per layer, ``config.depth`` of them, in
            place of ``mechanism`` and ``mechanism_options`` (which must then be left at their defaults).

    ``vocab_size`` is the vocabulary. Decoding: ``logits, state = model.prefill(prompt)`` then
    ``logits_t, state = model.step(token_t, state)``, or :func:`attnzoo.greedy_decode` and the other decoders of
    :mod:`attnzoo.decoding`. There is no dropout: train and eval mode compute the same.
    """

    def __init__(
        self,
        config: CausalLMConfig,
        mechanism: str = "softmax",
        mechanism_options: Optional[Mapping[str, Any]] = None,
        *,
        layer_mechanisms: Optional[Sequence[Tuple[str, Mapping[str, Any]]]] = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, CausalLMConfig):
            raise TypeError(f"config must be a CausalLMConfig, got {type(config).__name__}")
        if mechanism_options is not None and not isinstance(mechanism_options, Mapping):
            raise TypeError(f"mechanism_options must be a dict of the mechanism's options or None, got "
                            f"{type(mechanism_options).__name__}")
        hybrid = layer_mechanisms is not None
        if not hybrid:
            layer_mechanisms = [(mechanism, dict(mechanism_options or {}))] * config.depth
        else:
            if mechanism != "softmax" or mechanism_options is not None:
                raise ValueError("give either mechanism/mechanism_options (every layer) or layer_mechanisms "
                                 "(one per layer), not both")
            layer_mechanisms = check_layer_mechanisms(layer_mechanisms, config.depth)
        self.config = config
        self.vocab_size = config.vocab_size
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        layers = []
        for index, (name, options) in enumerate(layer_mechanisms):
            try:
                layers.append(CausalLMLayer(config, name, dict(options)))
            except (TypeError, ValueError) as error:
                if not hybrid:
                    raise
                raise type(error)(f"layer_mechanisms[{index}] ({name}): {error}") from None
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.head.weight = self.embedding.weight

    @property
    def mechanism_name(self) -> str:
        """The attention mechanism of the layers (``"a+b"`` for a hybrid: its distinct mechanisms by first use)."""
        return "+".join(dict.fromkeys(self.layer_mechanism_names))

    @property
    def layer_mechanism_names(self) -> List[str]:
        """The attention mechanism of each layer, first layer first."""
        return [layer.attention.mechanism_name for layer in self.layers]

    def forward(
        self, tokens: Tensor, *, padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """tokens: (batch, seq) ids; padding_mask: (batch, seq) bool, True = padding. Returns (batch, seq, vocab).

        ``cu_seqlens``: a packed batch, tokens (1, seq) holding documents back to back at these int64 offsets
        ``[0, ..., seq]``; rotary positions restart at each document and each attends only within itself."""
        check_tokens("tokens", tokens, self.vocab_size)
        check_padding_mask("padding_mask", padding_mask, tokens)
        if cu_seqlens is not None:
            packed_spans(self, tokens, padding_mask, cu_seqlens)  # checks the offsets, naming cu_seqlens
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, padding_mask=padding_mask, cu_seqlens=cu_seqlens)
        return self.head(self.norm(x))

    def prefill(self, tokens: Tensor) -> Tuple[Tensor, CausalLMState]:
        """Run a prompt (batch, seq); returns its logits (batch, seq, vocab) and the decoding state."""
        check_tokens("tokens", tokens, self.vocab_size)
        x = self.embedding(tokens)
        states = []
        for layer in self.layers:
            x, state = layer.prefill(x)
            states.append(state)
        return self.head(self.norm(x)), CausalLMState(states, tokens.shape[1])

    def step(self, token_t: Tensor, state: CausalLMState) -> Tuple[Tensor, CausalLMState]:
        """Feed one token per sequence, token_t (batch,); returns the next logits (batch, vocab) and the state."""
        check_tokens("token_t", token_t, self.vocab_size, rank=1)
        if not isinstance(state, CausalLMState):
            raise TypeError(f"state must be the CausalLMState returned by prefill or step, got {type(state).__name__}")
        x = self.embedding(token_t[:, None])
        states = []
        for layer, layer_state in zip(self.layers, state.layers):
            x, layer_state = layer.step(x, layer_state)
            states.append(layer_state)
        return self.head(self.norm(x))[:, 0], CausalLMState(states, state.position + 1)

    def extra_repr(self) -> str:
        return f"mechanism={self.mechanism_name!r}"

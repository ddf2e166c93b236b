"""Transformer building blocks: feed-forward, encoder layer, decoder layer.

Every layer works on (batch, seq, dim) and supports pre-norm (``norm_first=True``: ``x + f(norm(x))``) and
post-norm (``norm_first=False``: ``norm(x + f(x))``, the original Transformer and
``torch.nn.TransformerEncoderLayer``'s default). The layers are built from one checked :class:`BlockConfig`;
each attention slot takes its own mechanism and options (an :class:`AttentionSpec`), so one model can mix
mechanisms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_bool, check_choice, check_positive_int, check_probability
from ..attention import AttentionState, MultiHeadAttention
from .config import ACTIVATIONS, LATENT_BLOCK, AttentionSpec, BlockConfig
from .latent_attention import MultiHeadLatentAttention, latent_block_options


class FeedForward(nn.Module):
    """Position-wise feed-forward network, (batch, seq, dim) -> (batch, seq, dim).

    ``relu`` / ``gelu``: ``W2 · dropout(act(W1 x))``. ``swiglu`` (Shazeer 2020): ``W2 · dropout(silu(W x) ⊙ V x)``,
    with the two input projections fused into one ``in_proj`` of width ``2 * hidden_dim``.

    ``chunks`` > 1 runs the network on that many slices of the sequence (dimension -2) one after the other and
    joins the outputs (Kitaev et al. 2020): every position is transformed on its own, so the result is that of
    one pass, while the hidden activation is (batch, seq / chunks, hidden_dim) at a time. That bounds the memory
    of inference; under autograd each slice keeps its own activations for the backward pass, which together
    are as large as one pass's, unless the backward pass is chunked as well (the reversible stacks of
    :mod:`attnzoo.models.reversible` recompute and differentiate the network slice by slice).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("hidden_dim", hidden_dim)
        check_probability("dropout", dropout)
        check_bool("bias", bias)
        self.chunks = check_positive_int("chunks", chunks)
        self.activation = check_choice("activation", activation, ACTIVATIONS)
        gated = activation == "swiglu"
        self.in_proj = nn.Linear(dim, 2 * hidden_dim if gated else hidden_dim, bias=bias)
        self.out_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., seq, dim) -> (..., seq, dim), in ``chunks`` slices of the sequence."""
        if self.chunks == 1 or x.dim() < 2:
            return self.transform(x)
        return torch.cat([self.transform(part) for part in x.chunk(self.chunks, dim=-2)], dim=-2)

    def transform(self, x: Tensor) -> Tensor:
        """The network on all of x (..., dim) at once, whatever ``chunks`` says."""
        hidden = self.in_proj(x)
        if self.activation == "swiglu":
            gate, value = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * value
        elif self.activation == "gelu":
            hidden = F.gelu(hidden)
        else:
            hidden = F.relu(hidden)
        return self.out_proj(self.dropout(hidden))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, chunks={self.chunks}"


class _Sublayer(nn.Module):
    """A residual branch with its layer norm and dropout, placed pre- or post-norm: (batch, seq, dim)."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, branch: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + self.dropout(branch(self.norm(x)))
        return self.norm(x + self.dropout(branch(x)))


@dataclass
class LayerState:
    """Decoding state of one decoder layer: its self-attention state and, with cross-attention, the
    encoder memory projected to keys and values once, each (batch, kv_heads, seq_mem, head_dim)."""

    self_attention: AttentionState
    memory_k: Optional[Tensor] = None
    memory_v: Optional[Tensor] = None


class _Block(nn.Module):
    """What encoder and decoder layers share: their :class:`BlockConfig` (kept as ``config``) and the
    construction of their parts from it. Each layer registers the parts in its own order, which fixes the
    order of its parameters and state_dict entries."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        if not isinstance(config, BlockConfig):
            raise TypeError(
                f"config must be a BlockConfig, e.g. BlockConfig(dim=512, heads=8), got {type(config).__name__}"
            )
        self.config = config

    def _attention(
        self, spec: AttentionSpec, *, rotary: bool = False, context_dim: Optional[int] = None,
        kv_heads: Optional[int] = None, output_gate: bool = False,
    ) -> MultiHeadAttention:
        return MultiHeadAttention(
            self.config.dim, self.config.heads, spec.mechanism, rotary=rotary, context_dim=context_dim,
            kv_heads=kv_heads, output_gate=output_gate, **(spec.options or {}),
        )

    def _self_attention(self) -> MultiHeadAttention:
        return self._attention(self.config.self_attention, rotary=self.config.rotary, kv_heads=self.config.kv_heads,
                               output_gate=self.config.output_gate)

    def _feed_forward(self) -> FeedForward:
        config = self.config
        return FeedForward(
            config.dim, config.feed_forward_dim, config.activation, config.dropout, chunks=config.ff_chunks
        )


class EncoderLayer(_Block):
    """Self-attention + feed-forward, (batch, seq, dim) -> (batch, seq, dim).

    Args:
        config: a :class:`BlockConfig` without cross-attention, e.g.
            ``EncoderLayer(BlockConfig(dim=512, heads=8, self_attention=AttentionSpec("performer")))``.
    """

    def __init__(self, config: BlockConfig) -> None:
        super().__init__(config)
        if config.cross_attention is not None:
            raise ValueError("an EncoderLayer has no cross-attention: give it a BlockConfig with cross_attention=None")
        # Both parts before their norms, unlike DecoderLayer: the order saved checkpoints and optimizer states have.
        self.self_attention = self._self_attention()
        self.feed_forward = self._feed_forward()
        self.attention_block = _Sublayer(config)
        self.feed_forward_block = _Sublayer(config)

    def forward(
        self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1), each document attending only within itself. Returns (batch, seq, dim)."""
        x = self.attention_block(
            x, lambda h: self.self_attention(h, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        )
        return self.feed_forward_block(x, self.feed_forward)


class DecoderLayer(_Block):
    """Causal self-attention + cross-attention to an encoder memory + feed-forward, (batch, seq, dim).

    Args:
        config: a :class:`BlockConfig`; with ``cross_attention=None`` the layer has no cross-attention: the
            block of a decoder-only language model. ``config.memory_dim`` is the width of the memory.

    Incremental decoding: :meth:`prefill` over a prefix, then :meth:`step` one position at a time; the
    memory's keys and values are projected once (:meth:`project_memory`) and carried in the state.
    """

    def __init__(self, config: BlockConfig) -> None:
        super().__init__(config)
        self.self_attention = self._self_attention()
        self.attention_block = _Sublayer(config)
        self.cross_attention: Optional[MultiHeadAttention] = None
        self.cross_attention_block: Optional[_Sublayer] = None
        if config.cross_attention is not None:
            # Grouped like the self-attention: the memory's projected keys and values hold kv_heads heads.
            self.cross_attention = self._attention(config.cross_attention, context_dim=config.memory_dim,
                                                   kv_heads=config.kv_heads)
            self.cross_attention_block = _Sublayer(config)
        self.feed_forward = self._feed_forward()
        self.feed_forward_block = _Sublayer(config)

    def _check_memory(self, memory: Optional[Tensor]) -> None:
        if self.cross_attention is None and memory is not None:
            raise ValueError("memory given to a decoder layer built with cross_attention=None")
        if self.cross_attention is not None and memory is None:
            raise ValueError("memory (batch, seq_mem, memory_dim) is required: the layer has cross-attention")

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        memory_padding_mask: Optional[Tensor] = None,
        causal: bool = True,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """x: (batch, seq, dim); memory: (batch, seq_mem, memory_dim); padding_mask: (batch, seq) and
        memory_padding_mask: (batch, seq_mem), bool, True = padding. Returns (batch, seq, dim).
        ``causal=False`` lets every position attend to every other (a non-autoregressive decoder).
        ``cu_seqlens``: the document offsets of a packed row (batch 1, self-attention only)."""
        self._check_memory(memory)
        x = self.attention_block(
            x, lambda h: self.self_attention(h, causal=causal, key_padding_mask=padding_mask, cu_seqlens=cu_seqlens)
        )
        if self.cross_attention is not None:
            x = self.cross_attention_block(
                x, lambda h: self.cross_attention(h, memory, key_padding_mask=memory_padding_mask)
            )
        return self.feed_forward_block(x, self.feed_forward)

    # -- incremental decoding ------------------------------------------------------------------------------
    def project_memory(self, memory: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The memory's cross-attention keys and values, (batch, kv_heads, seq_mem, head_dim) each, or (None, None)."""
        self._check_memory(memory)
        if self.cross_attention is None:
            return None, None
        return self.cross_attention.project_context(memory)

    def _cross(self, x: Tensor, state: LayerState, memory_padding_mask: Optional[Tensor]) -> Tensor:
        if self.cross_attention is None:
            return x
        return self.cross_attention_block(
            x,
            lambda h: self.cross_attention.attend_projected(
                h, state.memory_k, state.memory_v, key_padding_mask=memory_padding_mask
            ),
        )

    def prefill(
        self,
        x: Tensor,
        memory_kv: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
        memory_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, LayerState]:
        """Causal pass over a prefix x (batch, seq, dim) that also returns the decoding state.

        ``memory_kv`` comes from :meth:`project_memory`. Returns (batch, seq, dim) and the state.
        """
        attention_state: Optional[AttentionState] = None

        def self_branch(h: Tensor) -> Tensor:
            nonlocal attention_state
            out, attention_state = self.self_attention.prefill(h)
            return out

        x = self.attention_block(x, self_branch)
        state = LayerState(attention_state, *memory_kv)
        x = self._cross(x, state, memory_padding_mask)
        return self.feed_forward_block(x, self.feed_forward), state

    def step(
        self, x_t: Tensor, state: LayerState, memory_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, LayerState]:
        """One position: x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        attention_state: Optional[AttentionState] = None

        def self_branch(h: Tensor) -> Tensor:
            nonlocal attention_state
            out, attention_state = self.self_attention.step(h, state.self_attention)
            return out

        x_t = self.attention_block(x_t, self_branch)
        state = LayerState(attention_state, state.memory_k, state.memory_v)
        x_t = self._cross(x_t, state, memory_padding_mask)
        return self.feed_forward_block(x_t, self.feed_forward), state


# -- layers whose self-attention is multi-head latent attention (block="mla") ------------------------------------
def _latent_attention(config: BlockConfig) -> MultiHeadLatentAttention:
    """The MLA of a ``block="mla"`` config: its block options, and its output gate."""
    if config.block != LATENT_BLOCK:
        raise ValueError(f"an MLA layer needs a BlockConfig with block={LATENT_BLOCK!r}, got block={config.block!r}")
    options = latent_block_options(config.dim, config.heads, config.block_options)
    return MultiHeadLatentAttention(config.dim, config.heads, output_gate=config.output_gate, **options)


class LatentEncoderLayer(EncoderLayer):
    """:class:`EncoderLayer` whose self-attention is :class:`MultiHeadLatentAttention` (``block="mla"``): the
    same parts, call and state-dict names otherwise."""

    def _self_attention(self) -> MultiHeadLatentAttention:  # type: ignore[override]
        return _latent_attention(self.config)


class LatentDecoderLayer(DecoderLayer):
    """:class:`DecoderLayer` without cross-attention whose self-attention is :class:`MultiHeadLatentAttention`
    (``block="mla"``); its decoding state is a :class:`LayerState` holding the MLA's
    :class:`~attnzoo.models.latent_attention.LatentAttentionState`."""

    def _self_attention(self) -> MultiHeadLatentAttention:  # type: ignore[override]
        return _latent_attention(self.config)

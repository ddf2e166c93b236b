"""Encoder and decoder stacks on vectors, (batch, seq, dim) -> (batch, seq, dim), built from one
:class:`~attnzoo.models.config.BlockConfig`.

Each stack holds ``depth`` layers of one kind, chosen by the config's ``block``: attention + feed-forward layers
(:mod:`attnzoo.models.layers`), gated attention units (:mod:`attnzoo.models.gau`) or Mamba-2 blocks
(:mod:`attnzoo.models.mamba2`); or, given one config per layer (a per-layer schedule,
:mod:`attnzoo.models.schedule`), each layer of the kind and mechanism its own config says. The reversible stacks of
:mod:`attnzoo.models.reversible` are subclasses of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from torch import Tensor, nn

from .._validation import check_bool, check_positive_int
from .config import LATENT_BLOCK, AttentionSpec, BlockConfig, attention_slot, layer_spec
from .schedule import format_item
from .gau import GatedAttentionUnit, GatedDecoderLayer, GatedEncoderLayer
from .layers import DecoderLayer, EncoderLayer, LatentDecoderLayer, LatentEncoderLayer, LayerState, _Block
from .mamba2 import Mamba2Block, Mamba2DecoderLayer, Mamba2EncoderLayer, Mamba2State

StackT = TypeVar("StackT", bound="_LayerStack")


def packed_options(cu_seqlens: Optional[Tensor]) -> Dict[str, Tensor]:
    """The keyword a layer takes a packed row's offsets by; none for an unpacked batch, so a layer is called
    as before. Every kind of layer packs (attention layers, gated units, Mamba-2 blocks); a mechanism that
    cannot refuses the offsets by name itself."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


class _LayerStack(nn.Module):
    """``depth`` layers of ``layer_type`` built from one :class:`BlockConfig` (kept as ``config``), closed by a
    layer norm in a pre-norm stack (post-norm layers already end with one)."""

    layer_type: ClassVar[Type[_Block]]
    gated_layer_type: ClassVar[Type[GatedAttentionUnit]]
    """The layer of a stack whose config names a gated block (``block="gau"`` or ``block="flash_gau"``)."""
    mamba2_layer_type: ClassVar[Type[Mamba2Block]]
    """The layer of a stack whose config says ``block="mamba2"``."""
    latent_layer_type: ClassVar[Type[_Block]]
    """The layer of a stack whose config says ``block="mla"`` (attention + feed-forward, the attention MLA)."""

    def __init__(self, config: BlockConfig, depth: int, layers: Optional[Sequence[BlockConfig]] = None) -> None:
        super().__init__()
        check_positive_int("depth", depth)
        configs = [config] * depth if layers is None else list(layers)
        if len(configs) != depth or not all(isinstance(layer, BlockConfig) for layer in configs):
            raise ValueError(f"layers must hold one BlockConfig per layer, {depth} of them (a ModelConfig's "
                             f"layer_configs), got {len(configs)}")
        for layer in configs:
            self._check_config(layer)
        self.config = config
        scheduled = layers is not None
        self.layers = nn.ModuleList(self._built(layer, index, scheduled) for index, layer in enumerate(configs))
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps) if config.norm_first else nn.Identity()

    def _built(self, config: BlockConfig, index: int, scheduled: bool) -> nn.Module:
        """Layer ``index``, of the kind its config's ``block`` names; in a scheduled stack an error (a mechanism
        option) names the layer and its item of the schedule."""
        layer_type = {"attention": self.layer_type, "mamba2": self.mamba2_layer_type,
                      LATENT_BLOCK: self.latent_layer_type}.get(config.block, self.gated_layer_type)
        try:
            return layer_type(config)
        except (TypeError, ValueError) as error:
            if not scheduled:
                raise
            raise type(error)(f"layers item {format_item(layer_spec(config))!r} (layer {index}): {error}") from None

    @property
    def all_attention(self) -> bool:
        """Whether every layer is attention + feed-forward (no gated unit or Mamba-2 block; MLA is attention)."""
        return all(layer.config.block in ("attention", LATENT_BLOCK) for layer in self.layers)

    @classmethod
    def _check_config(cls, config: BlockConfig) -> None:
        """Refuse a config this kind of stack cannot run (naming the option); every config by default."""

    @classmethod
    def from_config(
        cls: Type[StackT], config: BlockConfig, depth: int, layers: Optional[Sequence[BlockConfig]] = None
    ) -> StackT:
        """The stack of ``depth`` layers built from ``config``, for callers that hold a config already
        (the token models build theirs once from their own arguments). ``layers``: one config per layer (a
        per-layer schedule, :func:`attnzoo.models.config.scheduled_configs`), ``config`` then holding what they
        share; None: every layer is built from ``config``."""
        # Skips the subclass's keyword constructor: all it does is make the config that is given here.
        stack = cls.__new__(cls)
        _LayerStack.__init__(stack, config, depth, layers)
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
    mamba2_layer_type = Mamba2EncoderLayer
    latent_layer_type = LatentEncoderLayer

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

    def forward(
        self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1), each document attending only within itself."""
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask, **packed_options(cu_seqlens))
        return self.norm(x)


@dataclass
class DecoderState:
    """Decoding state of a :class:`Decoder`: one :class:`LayerState` per layer (a :class:`Mamba2State` for
    ``block="mamba2"``), the next position, and the memory's padding mask (batch, seq_mem) or None. Reorder
    beams with :func:`attnzoo.state.select_batch`.

    ``last_tokens`` (batch,): the last token fed, kept by a :class:`LanguageModel` with ``token_shift`` (its
    next embedding needs it); None otherwise."""

    layers: List[Union[LayerState, Mamba2State]]
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
    mamba2_layer_type = Mamba2DecoderLayer
    latent_layer_type = LatentDecoderLayer

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
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """x: (batch, seq, dim); memory: (batch, seq_mem, memory_dim) or None without cross-attention;
        padding_mask (batch, seq), memory_padding_mask (batch, seq_mem): bool, True = padding.
        ``causal=False``: bidirectional self-attention (non-autoregressive decoding). ``cu_seqlens``: the
        document offsets of a packed row (batch 1), each document attending only within itself."""
        if not check_bool("causal", causal) and not self.all_attention:
            kinds = sorted({layer.config.block for layer in self.layers} - {"attention"})
            raise ValueError(f"causal=False needs attention layers; block={kinds[0]!r} units are causal")
        # Gated units take no causal argument (they are causal only, refused above).
        bidirectional = {} if causal else {"causal": False}
        bidirectional.update(packed_options(cu_seqlens))
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


__all__ = ["Decoder", "DecoderState", "Encoder"]

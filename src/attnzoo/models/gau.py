"""The gated attention unit (GAU) and FLASH layers (Hua et al. 2022, "Transformer Quality in Linear Time").

One unit takes the place of attention + feed-forward in a block, (batch, seq, dim) -> (batch, seq, dim):

    h = norm(x)                                    (pre-norm; post-norm normalises x + branch instead)
    U, V, Z = silu(h W_in + b_in)                  widths e, e, s: one projection, split
    A V = attention(q = Z, k = Z, v = V)           single head, head_dim s, value width e
    x + dropout((U * A V) W_out + b_out)

The attention makes its query and key forms from Z by learned per-dimension scales and offsets (the paper's
shared-projection trick, inside the mechanism each block builds, :data:`UNIT_MECHANISMS`),
rotated by their positions when the model uses rotary positions. ``block="gau"`` attends over the whole
sequence with squared-ReLU scores scaled by the number of keys seen (quadratic time); ``block="flash_gau"`` uses
mixed chunk attention: exact inside chunks of ``chunk_size`` positions, linear across them (linear time, and a
decoding state of constant size). The exact scalings are in the functional module of those mechanisms.

With e = 2 * dim, a unit has about 6 dim^2 parameters, half of an attention + feed-forward block with
``ff_dim = 4 * dim`` (12 dim^2): two units stand in for one block, as in the paper.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionState
from ..mechanisms import build_mechanism
from .config import BlockConfig, gated_unit_options
from .layers import LayerState, _Sublayer

# block -> the attention mechanism its unit builds. Each gated block is the architecture that its mechanism was
# published with (Hua et al. 2022: GAU, and FLASH's mixed chunk attention), so the block builds that mechanism
# by name: the one place in this package where a mechanism other than the default is named.
UNIT_MECHANISMS = {"gau": "gau", "flash_gau": "flash_gau"}


class GatedAttentionUnit(nn.Module):
    """One GAU or FLASH layer (see the module docstring), built from a :class:`BlockConfig` with
    ``block="gau"`` or ``block="flash_gau"``; ``causal`` for decoder stacks.

    Args:
        config: the block's options; ``config.block_options`` holds the unit's own (``shared_dim``,
            ``expansion_dim``, ``scores``, ``chunk_size``: see :func:`attnzoo.models.config.gated_unit_options`).
        causal: each position sees only itself and earlier ones.
    """

    def __init__(self, config: BlockConfig, causal: bool) -> None:
        super().__init__()
        if not isinstance(config, BlockConfig):
            raise TypeError(f"config must be a BlockConfig, got {type(config).__name__}")
        if config.block == "attention":
            raise ValueError("a GatedAttentionUnit needs a BlockConfig with block='gau' or block='flash_gau'")
        self.config = config
        self.causal = causal
        options = gated_unit_options(config.block, config.dim, config.rotary, config.block_options)
        self.shared_dim, self.expansion_dim = options["shared_dim"], options["expansion_dim"]
        self.block = _Sublayer(config)
        self.in_proj = nn.Linear(config.dim, 2 * self.expansion_dim + self.shared_dim)
        mechanism_options = {"scores": options["scores"], "rotary": config.rotary}
        if options["chunk_size"] is not None:
            mechanism_options["chunk_size"] = options["chunk_size"]
        self.attention = build_mechanism(UNIT_MECHANISMS[config.block], 1, self.shared_dim, **mechanism_options)
        self.out_proj = nn.Linear(self.expansion_dim, config.dim)

    def _gates(self, h: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """U (batch, seq, e), and V (batch, 1, seq, e) and Z (batch, 1, seq, s) as one head."""
        u, v, z = F.silu(self.in_proj(h)).split([self.expansion_dim, self.expansion_dim, self.shared_dim], dim=-1)
        return u, v.unsqueeze(1), z.unsqueeze(1)

    def _branch(self, h: Tensor, key_padding_mask: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> Tensor:
        u, v, z = self._gates(h)
        attended = self.attention(z, z, v, causal=self.causal, key_padding_mask=key_padding_mask,
                                  cu_seqlens=cu_seqlens)
        return self.out_proj(u * attended.squeeze(1))

    def run(
        self, x: Tensor, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1). Returns (batch, seq, dim)."""
        return self.block(x, lambda h: self._branch(h, key_padding_mask, cu_seqlens))

    # -- incremental decoding (causal units) ---------------------------------------------------------------
    def prefill_unit(self, x: Tensor) -> Tuple[Tensor, AttentionState]:
        """Causal pass over a prefix x (batch, seq, dim); returns the output and the attention's state."""
        state: Optional[AttentionState] = None

        def branch(h: Tensor) -> Tensor:
            nonlocal state
            u, v, z = self._gates(h)
            out, mechanism_state = self.attention.prefill(z, z, v)
            state = AttentionState(mechanism_state)
            return self.out_proj(u * out.squeeze(1))

        out = self.block(x, branch)
        assert state is not None
        return out, state

    def step_unit(self, x_t: Tensor, state: Optional[AttentionState]) -> Tuple[Tensor, AttentionState]:
        """One position x_t (batch, 1, dim) after ``state`` (None at the start)."""
        if state is not None and not isinstance(state, AttentionState):
            raise TypeError(f"state must be the AttentionState that prefill or step returned, got "
                            f"{type(state).__name__}")
        new_state: Optional[AttentionState] = None

        def branch(h: Tensor) -> Tensor:
            nonlocal new_state
            u, v, z = self._gates(h)
            out, mechanism_state = self.attention.step(z, z, v, None if state is None else state.mechanism)
            new_state = AttentionState(mechanism_state)
            return self.out_proj(u * out.squeeze(1))

        out = self.block(x_t, branch)
        assert new_state is not None
        return out, new_state

    def extra_repr(self) -> str:
        return (f"block={self.config.block!r}, causal={self.causal}, shared_dim={self.shared_dim}, "
                f"expansion_dim={self.expansion_dim}")


class GatedEncoderLayer(GatedAttentionUnit):
    """A bidirectional gated unit with the interface of :class:`~attnzoo.models.EncoderLayer`."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__(config, causal=False)

    def forward(
        self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row. Returns (batch, seq, dim)."""
        return self.run(x, key_padding_mask, cu_seqlens)


class GatedDecoderLayer(GatedAttentionUnit):
    """A causal gated unit with the interface of :class:`~attnzoo.models.DecoderLayer` (without memory)."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__(config, causal=True)

    def _check_memory(self, memory: Optional[Tensor]) -> None:
        if memory is not None:
            raise ValueError(f"memory given to a block={self.config.block!r} layer, which has no cross-attention")

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        memory_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """x: (batch, seq, dim); padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row. Returns (batch, seq, dim)."""
        self._check_memory(memory)
        return self.run(x, padding_mask, cu_seqlens)

    def project_memory(self, memory: Optional[Tensor]) -> Tuple[None, None]:
        """No memory to project (the unit has no cross-attention): (None, None)."""
        self._check_memory(memory)
        return None, None

    def prefill(
        self,
        x: Tensor,
        memory_kv: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
        memory_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, LayerState]:
        """Causal pass over a prefix x (batch, seq, dim); returns (batch, seq, dim) and the layer's state."""
        out, state = self.prefill_unit(x)
        return out, LayerState(state)

    def step(
        self, x_t: Tensor, state: LayerState, memory_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, LayerState]:
        """One position: x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        out, attention_state = self.step_unit(x_t, state.self_attention)
        return out, LayerState(attention_state)


__all__ = ["GatedAttentionUnit", "GatedDecoderLayer", "GatedEncoderLayer", "UNIT_MECHANISMS"]

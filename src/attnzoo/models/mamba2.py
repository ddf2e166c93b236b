"""The Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs"): ``block="mamba2"`` of the models.

One block takes the place of attention + feed-forward in a layer, (batch, seq, dim) -> (batch, seq, dim)::

    h = norm(x)                                          (pre-norm; post-norm normalises x + branch instead)
    z, xBC, dt = h W_in                                  widths e, e + 2 g n, H (no bias); e = expansion * dim
    x, B, C = silu(causal depthwise conv(xBC))           widths e, g n, g n; conv of ``conv_size`` taps
    dt = softplus(dt + dt_bias),  A = -exp(A_log)        one step size per head and position, one rate per head
    y = SSD(x, dt, A, B, C) + D x                        H heads of e / H, B and C shared by each of g groups
    x + dropout(rmsnorm(y * silu(z)) W_out)              the gated RMS norm (per group), no bias

The SSD is :func:`attnzoo.functional.ssd.ssd`: linear attention with the decay ``exp(dt A)`` on the chunked
decayed path that ``retention`` and ``gla`` run. The block is causal in every stack (a Mamba-2 layer reads left
to right; an encoder of them is a left-to-right reader whose pooled or per-position outputs a classifier or
tagger uses). Decoding carries a constant-size :class:`Mamba2State`: the convolution's last ``conv_size - 1``
inputs and the SSM state, so each token costs the same whatever the context length.

Padding: a padded position enters the convolution as zeros and neither writes to nor decays the SSM state,
so nothing it holds reaches another position (NaN and inf included); a sequence padded at its end gives what
it gives alone. Packed rows (``cu_seqlens``, batch 1): the convolution's window and the SSM state restart at
every document start, and every other part (projections, step sizes, the gated norm, the stack's layer norm)
works on one position at a time, so each document gives what it gives alone. Parameter names follow
mamba_ssm's ``Mamba2`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import working_dtype
from ..functional.ssd import (
    mamba2_log_rates,
    mamba2_step_bias,
    ssd_prefill_unchecked,
    ssd_step_unchecked,
    ssd_unchecked,
)
from ..functional.packing import check_cu_seqlens
from ..functional.short_convolution import (
    document_positions,
    short_conv_state_unchecked,
    short_conv_step_unchecked,
    short_conv_unchecked,
)
from ..mechanisms.base import UnsupportedOptionError
from .config import BlockConfig
from .layers import _Sublayer
from .mamba2_options import mamba2_options


@dataclass
class Mamba2State:
    """Decoding state of one Mamba-2 block, of constant size: ``conv`` (batch, e + 2 g n, conv_size - 1), the
    convolution's last inputs (zeros before the start), and ``ssm`` (batch, heads, state_dim, head_dim), the
    SSD state in the working dtype. Reorder beams with :func:`attnzoo.state.select_batch`."""

    conv: Tensor
    ssm: Tensor


_PackedRow = Tuple[List[Tuple[int, int]], Tensor]
"""A checked packed row: each document's (start, end) and each position's offset in its document (seq,)."""


def _packed_row(x: Tensor, key_padding_mask: Optional[Tensor], cu_seqlens: object) -> _PackedRow:
    """Check ``cu_seqlens`` for the packed row x (1, seq, dim) before any computation (errors name it)."""
    if key_padding_mask is not None:
        raise ValueError("cu_seqlens and key_padding_mask cannot be used together: a packed row has no padding")
    if torch.jit.is_tracing():
        raise UnsupportedOptionError("block='mamba2': cu_seqlens cannot be traced: the documents are read from its "
                                     "values")
    spans = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], x.device)
    assert isinstance(cu_seqlens, Tensor)
    return spans, document_positions(cu_seqlens, x.shape[1])


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: ``rmsnorm(y * silu(z)) * weight`` over each of ``groups`` equal slices of the
    width (mamba_ssm's ``RMSNormGated`` with ``norm_before_gate=False``), computed in at least float32."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        dtype = working_dtype(y.dtype)
        gated = (y.to(dtype) * F.silu(z.to(dtype))).unflatten(-1, (self.groups, -1))
        normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight.to(dtype)).to(y.dtype)


class Mamba2Block(nn.Module):
    """One Mamba-2 layer (see the module docstring), built from a :class:`BlockConfig` with ``block="mamba2"``.

    ``config.heads`` is the number of SSM heads (mamba_ssm's ``nheads``), each ``expansion * dim // heads``
    wide; ``config.block_options`` holds ``state_dim``, ``expansion``, ``conv_size``, ``groups`` and
    ``chunk_size`` (:func:`attnzoo.models.mamba2_options.mamba2_options`).
    """

    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        if not isinstance(config, BlockConfig):
            raise TypeError(f"config must be a BlockConfig, got {type(config).__name__}")
        if config.block != "mamba2":
            raise ValueError(f"a Mamba2Block needs a BlockConfig with block='mamba2', got block={config.block!r}")
        self.config = config
        options = mamba2_options(config.dim, config.heads, config.block_options)
        self.heads, self.state_dim, self.groups = config.heads, options["state_dim"], options["groups"]
        self.conv_size, self.chunk_size = options["conv_size"], options["chunk_size"]
        self.inner_dim = options["expansion"] * config.dim
        self.head_dim = self.inner_dim // self.heads
        self.conv_dim = self.inner_dim + 2 * self.groups * self.state_dim
        self.block = _Sublayer(config)
        self.in_proj = nn.Linear(config.dim, self.inner_dim + self.conv_dim + self.heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_size, groups=self.conv_dim)
        self.dt_bias = nn.Parameter(mamba2_step_bias(self.heads))
        self.A_log = nn.Parameter(mamba2_log_rates(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner_dim, self.groups, config.layer_norm_eps)
        self.out_proj = nn.Linear(self.inner_dim, config.dim, bias=False)

    # -- the branch's parts ----------------------------------------------------------------------------------
    def _project(self, h: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """z (batch, seq, e), the convolution's input xBC (batch, e + 2 g n, seq), dt (batch, heads, seq)."""
        z, xbc, dt = self.in_proj(h).split([self.inner_dim, self.conv_dim, self.heads], dim=-1)
        dt = dt.to(working_dtype(dt.dtype))  # the step sizes in at least float32, like the SSD's sums
        return z, xbc.transpose(1, 2), F.softplus(dt + self.dt_bias.to(dt.dtype)).transpose(1, 2)

    def _ssd_inputs(self, xbc: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The convolved, activated xBC (batch, e + 2 g n, seq) as x (batch, heads, seq, head_dim) and B, C
        (batch, groups, seq, state_dim)."""
        batch, _, seq = xbc.shape
        x, b, c = xbc.split([self.inner_dim, self.groups * self.state_dim, self.groups * self.state_dim], 1)
        x = x.view(batch, self.heads, self.head_dim, seq).transpose(-1, -2)
        b, c = (t.view(batch, self.groups, self.state_dim, seq).transpose(-1, -2) for t in (b, c))
        return x, b, c

    def _conv(
        self, xbc: Tensor, key_padding_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None
    ) -> Tensor:
        """silu(causal depthwise conv(xBC)), (batch, e + 2 g n, seq) in and out
        (:func:`attnzoo.functional.short_convolution.short_conv`; padded positions enter as zeros, so a NaN or
        inf they hold stays out; ``positions``, each position's offset in its document of a packed row, restarts
        the window at every document)."""
        out = short_conv_unchecked(xbc.transpose(1, 2), self.conv1d.weight[:, 0], self.conv1d.bias, True,
                                   key_padding_mask, positions)
        return out.transpose(1, 2)

    def _rates(self, dtype: torch.dtype) -> Tensor:
        """A = -exp(A_log), (heads,)."""
        return -torch.exp(self.A_log.to(working_dtype(dtype)))

    def _finish(self, y: Tensor, z: Tensor) -> Tensor:
        """The SSD output y (batch, heads, seq, head_dim) through the gated norm and the output projection."""
        y = y.transpose(1, 2).flatten(2)  # (batch, seq, e)
        return self.out_proj(self.norm(y, z))

    def _branch(
        self, h: Tensor, key_padding_mask: Optional[Tensor], packed: Optional[_PackedRow] = None
    ) -> Tensor:
        z, xbc, dt = self._project(h)
        spans, positions = (None, None) if packed is None else packed
        x, b, c = self._ssd_inputs(self._conv(xbc, key_padding_mask, positions))
        y = ssd_unchecked(x, dt, self._rates(x.dtype), b, c, self.D, True, key_padding_mask, spans, self.chunk_size)
        return self._finish(y, z)

    def run(
        self, x: Tensor, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1, int64 ``[0, ..., seq]``), each document run as if alone. Returns
        (batch, seq, dim)."""
        packed = None if cu_seqlens is None else _packed_row(x, key_padding_mask, cu_seqlens)
        return self.block(x, lambda h: self._branch(h, key_padding_mask, packed))

    # -- incremental decoding --------------------------------------------------------------------------------
    def prefill_block(self, x: Tensor) -> Tuple[Tensor, Mamba2State]:
        """Causal pass over a prefix x (batch, seq, dim); returns the output and the state after it."""
        state: Optional[Mamba2State] = None

        def branch(h: Tensor) -> Tensor:
            nonlocal state
            z, xbc, dt = self._project(h)
            x_, b, c = self._ssd_inputs(self._conv(xbc))
            y, ssm = ssd_prefill_unchecked(x_, dt, self._rates(x_.dtype), b, c, self.D, self.chunk_size)
            state = Mamba2State(short_conv_state_unchecked(xbc.transpose(1, 2), self.conv_size).transpose(1, 2), ssm)
            return self._finish(y, z)

        out = self.block(x, branch)
        assert state is not None
        return out, state

    def empty_state(self, x_t: Tensor) -> Mamba2State:
        """The state before the first position, for a batch like x_t (batch, 1, dim)."""
        batch = x_t.shape[0]
        conv = x_t.new_zeros(batch, self.conv_dim, self.conv_size - 1)
        ssm = x_t.new_zeros(batch, self.heads, self.state_dim, self.head_dim, dtype=working_dtype(x_t.dtype))
        return Mamba2State(conv, ssm)

    def step_block(self, x_t: Tensor, state: Optional[Mamba2State]) -> Tuple[Tensor, Mamba2State]:
        """One position x_t (batch, 1, dim) after ``state`` (None at the start): O(1) in the context length."""
        if state is None:
            state = self.empty_state(x_t)
        if not isinstance(state, Mamba2State):
            raise TypeError(f"state must be the Mamba2State that prefill or step returned, got {type(state).__name__}")
        new_state: Optional[Mamba2State] = None

        def branch(h: Tensor) -> Tensor:
            nonlocal new_state
            z, xbc, dt = self._project(h)
            convolved, conv = short_conv_step_unchecked(xbc.transpose(1, 2), state.conv.transpose(1, 2),
                                                        self.conv1d.weight[:, 0], self.conv1d.bias, True)
            x_, b, c = self._ssd_inputs(convolved.transpose(1, 2))
            y, ssm = ssd_step_unchecked(x_, dt, self._rates(x_.dtype), b, c, state.ssm, self.D)
            new_state = Mamba2State(conv.transpose(1, 2), ssm)
            return self._finish(y, z)

        out = self.block(x_t, branch)
        assert new_state is not None
        return out, new_state

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, state_dim={self.state_dim}, groups={self.groups}, "
                f"conv_size={self.conv_size}, chunk_size={self.chunk_size}")


class Mamba2EncoderLayer(Mamba2Block):
    """A Mamba-2 block with the interface of :class:`~attnzoo.models.EncoderLayer` (causal, see the module
    docstring)."""

    def forward(
        self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1). Returns (batch, seq, dim)."""
        return self.run(x, key_padding_mask, cu_seqlens)


class Mamba2DecoderLayer(Mamba2Block):
    """A Mamba-2 block with the interface of :class:`~attnzoo.models.DecoderLayer` (without memory)."""

    def _check_memory(self, memory: Optional[Tensor]) -> None:
        if memory is not None:
            raise ValueError("memory given to a block='mamba2' layer, which has no cross-attention")

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
        offsets of a packed row (batch 1). Returns (batch, seq, dim)."""
        self._check_memory(memory)
        return self.run(x, padding_mask, cu_seqlens)

    def project_memory(self, memory: Optional[Tensor]) -> Tuple[None, None]:
        """No memory to project (the block has no cross-attention): (None, None)."""
        self._check_memory(memory)
        return None, None

    def prefill(
        self,
        x: Tensor,
        memory_kv: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
        memory_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Mamba2State]:
        """Causal pass over a prefix x (batch, seq, dim); returns (batch, seq, dim) and the block's state."""
        return self.prefill_block(x)

    def step(
        self, x_t: Tensor, state: Optional[Mamba2State], memory_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Mamba2State]:
        """One position: x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        return self.step_block(x_t, state)


__all__ = ["GatedRMSNorm", "Mamba2Block", "Mamba2DecoderLayer", "Mamba2EncoderLayer", "Mamba2State"]

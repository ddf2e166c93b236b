"""Positional information: sinusoidal and learned absolute encodings, and rotary embeddings (RoPE).

Absolute encodings are added to token embeddings, (batch, seq, dim) -> (batch, seq, dim). Rotary embeddings
rotate per-head queries and keys inside attention, (batch, heads, seq, head_dim) -> same shape. All take a
``start`` position so that incremental decoding sees the same positions as a full forward pass.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sine/cosine encodings of Vaswani et al. (2017); no length limit."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"sinusoidal encodings need an even dim, got dim={dim}")
        self.dim = dim
        self.register_buffer(
            "inv_freq", torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim)),
            persistent=False,
        )

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        positions = torch.arange(start, start + x.shape[1], device=x.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]
        encoding = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # interleaved sin, cos
        return x + encoding.to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """A trained embedding per position, up to ``max_length`` positions."""

    def __init__(self, dim: int, max_length: int) -> None:
        super().__init__()
        self.max_length = max_length
        self.embedding = nn.Embedding(max_length, dim)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        end = start + x.shape[1]
        if end > self.max_length:
            raise ValueError(f"position {end - 1} exceeds the learned positional embedding's max_length={self.max_length}")
        return x + self.embedding.weight[start:end].to(x.dtype)


ROTARY_PAIRS = ("interleaved", "halves")
"""How :class:`RotaryEmbedding` pairs the channels it rotates together."""


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021), applied to queries and keys of each head.

    Rotates pairs of channels by angle ``position * base^(-2i/rotary_dim)``; dims beyond ``rotary_dim`` pass
    through unchanged. ``pairs`` says which channels pair up: ``"interleaved"`` (the default, RoFormer's and
    llama.cpp's "normal" rotary): (x[2i], x[2i+1]); ``"halves"`` (GPT-NeoX's, and transformers' ``rotate_half``,
    the layout of most Hugging Face checkpoints): (x[i], x[i + rotary_dim/2]). The two differ only by a
    permutation of the channels, which leaves query-key products unchanged up to rounding; a pretrained model
    is reproduced to the bit only in the layout it was computed in.

    The frequencies are ``1 / base^(2i/rotary_dim)`` in float32, computed the way Llama's reference and
    transformers compute them, so that the angles are theirs to the bit.
    """

    def __init__(self, head_dim: int, rotary_dim: int | None = None, base: float = 10000.0, *,
                 pairs: str = "interleaved") -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or rotary_dim > head_dim or rotary_dim < 2:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        if pairs not in ROTARY_PAIRS:
            raise ValueError(f"pairs must be one of {', '.join(map(repr, ROTARY_PAIRS))}, got {pairs!r}")
        self.rotary_dim = rotary_dim
        self.pairs = pairs
        self.register_buffer(
            "inv_freq", 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim),
            persistent=False,
        )
        self._table: Optional[Tuple[tuple, Tensor, Tensor]] = None  # see _cos_sin

    def _cos_sin(self, start: int, seq: int) -> Tuple[Tensor, Tensor]:
        """cos and sin of the angles of positions ``[start, start + seq)`` in float32 (:meth:`_angles`): rows
        of a table kept for the longest length asked so far (a decoding step would otherwise form its one row
        in five operations), the same values as computed afresh. Under tracing or compilation, computed afresh."""
        end = start + seq
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return self._angles(start, end)
        key = (self.inv_freq.device, self.inv_freq.data_ptr(), self.inv_freq._version)
        table = self._table
        if table is None or table[0] != key or table[1].shape[0] < end:
            length = max(end, 2 * table[1].shape[0] if table is not None and table[0] == key else 0, 256)
            with torch.inference_mode(False), torch.no_grad():  # usable outside inference mode and autograd
                self._table = table = (key, *self._angles(0, length))
        return table[1][start:end], table[2][start:end]

    def _angles(self, start: int, end: int) -> Tuple[Tensor, Tensor]:
        """cos and sin, (end - start, rotary_dim/2), or for ``"halves"`` each repeated to (end - start,
        rotary_dim): the factors of both halves."""
        positions = torch.arange(start, end, device=self.inv_freq.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]  # (seq, rotary_dim/2)
        if self.pairs == "halves":
            angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        cos, sin = self._cos_sin(start, x.shape[-2])
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        whole = self.rotary_dim == x.shape[-1]
        rotated = x if whole else x[..., : self.rotary_dim]
        if self.pairs == "halves":
            # [a, b] -> [a cos - b sin, b cos + a sin] as x * [cos, cos] + [-b, a] * [sin, sin]: the same values
            # (a - b == a + (-b) exactly) in fewer operations.
            half = self.rotary_dim // 2
            turned = torch.cat([rotated[..., half:].neg(), rotated[..., :half]], dim=-1)
            out = rotated * cos + turned * sin
        else:
            even, odd = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return out if whole else torch.cat([out, x[..., self.rotary_dim :]], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, pairs={self.pairs!r}"

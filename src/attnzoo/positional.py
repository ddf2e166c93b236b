"""Positional information: sinusoidal and learned absolute encodings, and rotary embeddings (RoPE).

Absolute encodings are added to token embeddings, (batch, seq, dim) -> (batch, seq, dim). Rotary embeddings
rotate per-head queries and keys inside attention, (batch, heads, seq, head_dim) -> same shape. All take a
``start`` position so that incremental decoding sees the same positions as a full forward pass.
"""

from __future__ import annotations

import math

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

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        seq = x.shape[-2]
        positions = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]  # (seq, rotary_dim/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rotated, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.pairs == "halves":
            first, second = rotated[..., : self.rotary_dim // 2], rotated[..., self.rotary_dim // 2 :]
            out = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        else:
            even, odd = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return torch.cat([out, passthrough], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, pairs={self.pairs!r}"

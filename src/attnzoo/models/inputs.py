"""The checks of what the token models are given: token ids and padding masks, each error naming the argument.

Padding masks are (batch, seq) bool tensors, True marking padding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


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


__all__ = ["check_padding_mask", "check_tokens"]

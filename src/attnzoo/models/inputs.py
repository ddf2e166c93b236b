"""The checks of what the token models are given: token ids and padding masks, each error naming the argument.

Padding masks are (batch, seq) bool tensors, True marking padding.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..functional.packing import check_cu_seqlens
from ..mechanisms.base import Mechanism, UnsupportedOptionError


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


def packed_spans(
    model: nn.Module, tokens: Tensor, padding_mask: Optional[Tensor], cu_seqlens: Tensor
) -> List[Tuple[int, int]]:
    """Check a packed batch given to a token model before any computation: ``tokens`` (1, seq) holding
    documents back to back at offsets ``cu_seqlens`` (int64 ``[0, ..., seq]``), no ``padding_mask``, and every
    attention mechanism of ``model`` able to take packed batches (one that cannot is refused by name). Returns
    each document's (start, end)."""
    if padding_mask is not None:
        raise ValueError("cu_seqlens and padding_mask cannot be used together: a packed row has no padding")
    for module in model.modules():
        if isinstance(module, Mechanism) and not module.capabilities.packed:
            caps = module.capabilities
            who = module.name + (f" with {caps.limited_by}" if caps.limited_by else "")
            raise UnsupportedOptionError(
                f"{who} does not take cu_seqlens (packed batches): its output for a document would not be what it "
                f"gives that document alone; pad the documents into rows instead"
            )
    return check_cu_seqlens(cu_seqlens, tokens.shape[0], tokens.shape[1], tokens.device)


__all__ = ["check_padding_mask", "check_tokens", "packed_spans"]

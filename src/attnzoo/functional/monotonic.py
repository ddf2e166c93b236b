"""Monotonic attention at inference: the window of source positions a decoding step may attend to, and how
its focus moves (in the spirit of Tachibana et al. 2018's forcibly incremental attention).

The focus is one source position per sequence: where the cross-attention looked last. A step may attend to
the positions ``focus - behind .. focus + ahead``; its new focus is the most attended position, never less
than the old one. With ``behind=0`` attention itself can only stay or move forward, at most ``ahead``
positions per step.

Shapes: focus (batch,) int64 positions; masks and weights (batch, source_len).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def monotonic_window_mask(focus: Tensor, source_len: int, ahead: int, behind: int = 0) -> Tensor:
    """True at the source positions outside ``[focus - behind, focus + ahead]``: (batch,) -> (batch, source_len)
    bool, in the convention of a key padding mask (True = not attended)."""
    offset = torch.arange(source_len, device=focus.device)[None, :] - focus[:, None]
    return (offset < -behind) | (offset > ahead)


def monotonic_window_mask_reference(focus: Tensor, source_len: int, ahead: int, behind: int = 0) -> Tensor:
    """The same mask written out position by position, for tests."""
    mask = torch.ones(focus.shape[0], source_len, dtype=torch.bool)
    for row, f in enumerate(focus.tolist()):
        for position in range(max(f - behind, 0), min(f + ahead + 1, source_len)):
            mask[row, position] = False
    return mask.to(focus.device)


def initial_focus(padding_mask: Optional[Tensor], batch: int, source_len: int, device: torch.device) -> Tensor:
    """The focus before the first step: each source's first real (non-padding) position, (batch,) int64."""
    if padding_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    # argmax finds the first maximum: the first False of the padding mask.
    return (~padding_mask).to(torch.uint8).argmax(dim=1)


def advance_focus(focus: Tensor, weights: Tensor) -> Tensor:
    """The focus after a step: the position of the largest attention weight, or the old focus if that lies
    behind it (the focus never moves backwards). focus (batch,), weights (batch, source_len) -> (batch,)."""
    return torch.maximum(focus, weights.argmax(dim=-1))

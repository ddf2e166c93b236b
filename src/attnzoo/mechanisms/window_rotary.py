"""Rotating only a mechanism's exact window (capability ``own_rotary``): Liger's linear part, and LoLCATs' with
``rotate_features=False``, read the queries and keys as projected, while the window's softmax wants the layer's
rotary positions. A :class:`~attnzoo.MultiHeadAttention` with ``rotary=True`` then passes such a mechanism
unrotated queries and keys and hands it the embedding once (``use_rotary``)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from torch import Tensor

Rotation = Callable[..., Tensor]  # a rotary embedding: rotation(x (..., seq, head_dim), start=first position)


class RotatedWindow:
    """The mixin: keeps the layer's rotary embedding and rotates the window's queries and keys with it."""

    _rotary: Tuple[Optional[Rotation], ...] = (None,)  # in a tuple: not a submodule of the mechanism

    def use_rotary(self, rotary: Optional[Rotation]) -> None:
        """Rotate the window's queries and keys by ``rotary`` (the layer's :class:`~attnzoo.RotaryEmbedding`,
        called as ``rotary(x, start=position)``; positions from 0 in each sequence or document, a decoding
        step's from the positions seen), or not at all (None)."""
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary must be a rotary embedding (callable) or None, got {type(rotary).__name__}")
        self._rotary = (rotary,)

    @property
    def rotates_window(self) -> bool:
        """Whether the window's queries and keys are rotated apart from the rest (an embedding was handed over)."""
        return self._rotary[0] is not None

    def _window_inputs(self, q: Tensor, k: Tensor, start: int) -> Tuple[Tensor, Tensor]:
        """The window's queries and keys for positions from ``start``: q and k rotated, or as given."""
        rotary = self._rotary[0]
        if rotary is None:
            return q, k
        return rotary(q, start=start), rotary(k, start=start)

"""``nn.MultiheadAttention``'s masks in attnzoo's terms, translated per call by :class:`SwappedAttention
<attnzoo.dropin.swapped.SwappedAttention>`.

* ``key_padding_mask``: bool (True = padding), or float as ``nn.TransformerEncoder`` passes it (0 kept, -inf
  padding), becomes attnzoo's bool ``key_padding_mask``. A float mask with other values (a soft bias on keys)
  is an arbitrary mask (below).
* ``attn_mask``: the square causal mask (bool ``True`` above the diagonal, or float ``-inf`` above it and 0
  elsewhere, as ``nn.Transformer.generate_square_subsequent_mask`` makes it), or ``is_causal=True``, becomes
  ``causal=True``. A mask that masks nothing is dropped. Any other mask is arbitrary: an additive bias on the
  logits, which only an exact mechanism (``Capabilities.kind == "exact"``) can honour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_bool


@dataclass(frozen=True)
class TranslatedMasks:
    """torch's masks in attnzoo's terms.

    Attributes:
        causal: the square causal mask (or the ``is_causal`` hint): attnzoo's ``causal=True``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding, or None.
        additive: what is left, as a float bias added to the logits, broadcastable to
            (batch, heads, seq_q, seq_kv) (-inf where masked), or None. Only exact softmax can honour it.
        arbitrary: the names of the arguments that contributed to ``additive`` (for error messages).
    """

    causal: bool
    key_padding_mask: Optional[Tensor]
    additive: Optional[Tensor]
    arbitrary: Tuple[str, ...]


def _causal_reference(length: int, mask: Tensor) -> Tensor:
    """The square causal mask in ``mask``'s convention: bool True above the diagonal, float -inf there."""
    above = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        return above
    return torch.zeros(length, length, dtype=mask.dtype, device=mask.device).masked_fill_(above, -math.inf)


def _as_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A torch mask as an additive float bias: bool True -> -inf, float as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -math.inf)
    return mask.to(dtype)


def _padding(
    key_padding_mask: Tensor, batch: int, k_len: int, dtype: torch.dtype
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(bool padding mask, additive bias (batch, 1, 1, k_len)) of a ``key_padding_mask``: one of them is None."""
    if key_padding_mask.shape != (batch, k_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_kv) = ({batch}, {k_len}), got "
            f"{tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask, None
    if bool(((key_padding_mask == 0) | (key_padding_mask == -math.inf)).all()):
        return key_padding_mask == -math.inf, None  # the bool mask nn.TransformerEncoder turned into floats
    return None, key_padding_mask.to(dtype).view(batch, 1, 1, k_len)


def translate_masks(
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
) -> TranslatedMasks:
    """Translate ``nn.MultiheadAttention``'s masks (batched form) into attnzoo's.

    Args:
        attn_mask: None, (q_len, k_len) or (batch * heads, q_len, k_len); bool (True = masked) or float
            (added to the logits).
        key_padding_mask: None or (batch, k_len); bool (True = padding) or float (added to the logits).
        is_causal: torch's hint that ``attn_mask`` is the causal mask; trusted, as torch trusts it, when the
            lengths are equal.
        dtype: the dtype an arbitrary mask's bias takes (the inputs').

    Reading the masks' values (is this the causal mask, are these only 0 and -inf) synchronises with the
    device; it is what lets every mechanism take the masks ``nn.TransformerEncoder`` makes.
    """
    check_bool("is_causal", is_causal)
    for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if mask is not None and not isinstance(mask, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"{name} must be a bool or floating tensor, got {mask.dtype}")
    arbitrary: List[str] = []
    padding: Optional[Tensor] = None
    additive: Optional[Tensor] = None
    if key_padding_mask is not None:
        padding, additive = _padding(key_padding_mask, batch, k_len, dtype)
        if additive is not None:
            arbitrary.append("key_padding_mask")

    causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            expected = (q_len, k_len)
        elif attn_mask.dim() == 3:
            expected = (batch * heads, q_len, k_len)
        else:
            expected = None
        if expected is None or attn_mask.shape != expected:
            raise ValueError(
                f"attn_mask must have shape (seq_q, seq_kv) = ({q_len}, {k_len}) or (batch * heads, seq_q, seq_kv) "
                f"= ({batch * heads}, {q_len}, {k_len}), got {tuple(attn_mask.shape)}"
            )
        masks_nothing = not bool(attn_mask.any()) if attn_mask.dtype == torch.bool else not bool((attn_mask != 0).any())
        square = q_len == k_len
        if square and (is_causal or bool((attn_mask == _causal_reference(q_len, attn_mask)).all())):
            causal = True
        elif not masks_nothing:
            bias = _as_bias(attn_mask, dtype)
            bias = bias.view(1, 1, q_len, k_len) if bias.dim() == 2 else bias.view(batch, heads, q_len, k_len)
            additive = bias if additive is None else additive + bias
            arbitrary.append("attn_mask")
    elif is_causal:
        if q_len != k_len:
            # torch aligns a causal mask of unequal lengths top-left, attnzoo bottom-right: no silent guess.
            raise ValueError(
                f"is_causal=True without attn_mask needs queries and keys of one length, got {q_len} and {k_len}; "
                f"pass the mask itself"
            )
        causal = True
    return TranslatedMasks(causal, padding, additive, tuple(arbitrary))



__all__ = ["TranslatedMasks", "translate_masks"]

"""Boolean attention masks. Convention everywhere in attnzoo: ``True`` in an *allowed* mask means the
query may attend to that key; ``True`` in a ``key_padding_mask`` means the key is padding and ignored."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def causal_allowed(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(q_len, k_len) bool mask, aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + k_len - q_len``.

    With equal lengths this is the usual lower triangle. With ``k_len > q_len`` the queries are the *last*
    ``q_len`` positions of the key sequence, which is the decoding case (a new token attends to the cache and
    itself), so the last query always sees every key.
    """
    offset = k_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return cols <= rows + offset


def allowed_mask(
    batch: int,
    q_len: int,
    k_len: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    device: torch.device,
) -> Optional[Tensor]:
    """Combine causality and key padding into one allowed mask broadcastable to (batch, heads, q_len, k_len).

    Returns None when nothing is masked.
    """
    allowed: Optional[Tensor] = None
    if causal:
        allowed = causal_allowed(q_len, k_len, device).view(1, 1, q_len, k_len)
    if key_padding_mask is not None:
        keep = (~key_padding_mask).view(batch, 1, 1, k_len)
        allowed = keep if allowed is None else allowed & keep
    return allowed


def zero_padded(x: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``x`` (batch, heads, seq_kv, dim) with the padded positions set to zero (a copy; ``x`` itself when
    nothing is padded).

    Masking a padded key's weight is not enough to make it invisible: ``0 * NaN`` and ``-inf + NaN`` are NaN,
    so a non-finite value at a padded position would still reach every output row. Replacing it first does."""
    if key_padding_mask is None:
        return x
    return x.masked_fill(key_padding_mask[:, None, :, None], 0.0)

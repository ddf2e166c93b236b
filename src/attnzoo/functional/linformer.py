"""Linformer attention (Wang et al. 2020): softmax attention over keys and values projected along the sequence.

``out = softmax(Q (E^T K)^T / sqrt(d)) (F^T V)``: learned projections ``E`` (keys) and ``F`` (values) of shape
(positions, rank) map the ``n`` keys and values onto ``rank`` rows, so the softmax runs over ``rank`` columns
instead of ``n``: time O(n rank d), memory O(n rank) for the projections and O(n_q rank) for the weights.

Projections are given per head or shared, as ``(heads, max_positions, rank)`` or ``(1, max_positions, rank)``;
a sequence of ``n <= max_positions`` keys uses their first ``n`` rows (position ``i`` always meets row ``i``).
Padded keys and values are zeroed before they are projected, so they add nothing to any projected row (NaN and
inf included). Nothing in the method orders positions, so there is no causal form.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_floating, check_key_padding_mask, check_number, check_qkv
from .masks import zero_padded


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_projection: Tensor,
    value_projection: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Softmax attention of the queries over the keys and values projected to ``rank`` rows.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        key_projection: ``E``, (heads, max_positions, rank) per head or (1, max_positions, rank) shared by the
            heads, with ``max_positions >= seq_kv``; its first ``seq_kv`` rows are used.
        value_projection: ``F``, shaped like ``key_projection`` (the same tensor for shared key-value
            projections, which are then applied in one matmul).
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys, zeroed before the projection.
        scale: logit scale, a finite number > 0; ``1/sqrt(head_dim)`` by default.

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``q``. The projections are cast to it (gradients
        still reach them). An element whose keys are all padded projects to zero keys and values and yields
        zeros.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_projections(key_projection, value_projection, q.shape[1], k.shape[2], q.device)
    return linformer_attention_unchecked(q, k, v, key_projection, value_projection, key_padding_mask, scale)


def check_projections(
    key_projection: Tensor, value_projection: Tensor, heads: int, k_len: int, device: torch.device
) -> None:
    """Both projections (heads or 1, max_positions >= k_len, rank), of one rank, on ``device``."""
    for name, e in (("key_projection", key_projection), ("value_projection", value_projection)):
        check_floating(name, e)
        if e.dim() != 3 or e.shape[0] not in (1, heads) or e.shape[2] < 1:
            raise ValueError(
                f"{name} must have shape (heads, max_positions, rank) or (1, max_positions, rank) with "
                f"heads={heads}, got {tuple(e.shape)}"
            )
        if e.shape[1] < k_len:
            raise ValueError(
                f"{name} has {e.shape[1]} rows (positions) but the keys have length {k_len}: it needs one row "
                f"per key position"
            )
        if e.device != device:
            raise ValueError(f"{name} must be on {device}, got {e.device}")
    if key_projection.shape[2] != value_projection.shape[2]:
        raise ValueError(
            f"key_projection and value_projection must share the rank, got {key_projection.shape[2]} and "
            f"{value_projection.shape[2]}"
        )


def project_sequence(x: Tensor, projection: Tensor) -> Tensor:
    """``E^T x`` per head: (batch, heads, n, dim) and (heads or 1, >= n, rank) -> (batch, heads, rank, dim).

    One (batched) matmul whose columns are every batch element's (and, for a shared projection, every head's)
    features, so the projection is read once and never copied per batch element, as a broadcast batched
    matmul would (``E`` is max_positions x rank, often larger than the keys themselves).
    """
    batch, heads, n, dim = x.shape
    e = projection[:, :n].to(x.dtype)
    rank = e.shape[2]
    if e.shape[0] == 1:
        columns = x.permute(2, 1, 0, 3).reshape(1, n, heads * batch * dim)  # (1, n, H*B*d)
        projected = torch.matmul(e.transpose(1, 2), columns)  # (1, rank, H*B*d)
        return projected.view(rank, heads, batch, dim).permute(2, 1, 0, 3)
    columns = x.permute(1, 2, 0, 3).reshape(heads, n, batch * dim)  # (H, n, B*d)
    projected = torch.matmul(e.transpose(1, 2), columns)  # (H, rank, B*d)
    return projected.view(heads, rank, batch, dim).permute(2, 0, 1, 3)


def linformer_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_projection: Tensor,
    value_projection: Tensor,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float],
) -> Tensor:
    """:func:`linformer_attention` for callers that have validated every argument themselves (the mechanism,
    whose :meth:`~attnzoo.mechanisms.base.Mechanism.check_inputs` runs first): inputs are checked once."""
    # Zeroed before projecting: a padded position then adds nothing to any projected row, whatever it held
    # (a zero weight would not do: 0 * NaN is NaN).
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    if value_projection is key_projection and k.shape[3] == v.shape[3]:
        # One matrix for keys and values: project both in one matmul.
        both = project_sequence(torch.cat([k, v], dim=3), key_projection)
        k_proj, v_proj = both.split(k.shape[3], dim=3)
    else:
        k_proj, v_proj = project_sequence(k, key_projection), project_sequence(v, value_projection)
    # Every projected row is a real (possibly zero) key, so no row of weights is empty and no mask is needed.
    return F.scaled_dot_product_attention(q, k_proj, v_proj, scale=scale)


def linformer_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_projection: Tensor,
    value_projection: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Obviously-correct dense Linformer attention in float64, for tests: the projections expanded to every
    head, ``E^T K`` and ``F^T V`` by einsum, an explicit softmax. Same arguments as
    :func:`linformer_attention`; returns float64."""
    q = q.double()
    k = zero_padded(k.double(), key_padding_mask)
    v = zero_padded(v.double(), key_padding_mask)
    heads, n, head_dim = q.shape[1], k.shape[2], q.shape[3]
    e = key_projection.double()[:, :n].expand(heads, -1, -1)  # (heads, n, rank)
    f = value_projection.double()[:, :n].expand(heads, -1, -1)
    k_proj = torch.einsum("hnr,bhnd->bhrd", e, k)
    v_proj = torch.einsum("hnr,bhnd->bhrd", f, v)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    logits = torch.einsum("bhid,bhrd->bhir", q, k_proj) * scale
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("bhir,bhrd->bhid", weights, v_proj)

"""Exact softmax attention: a fast path on ``scaled_dot_product_attention`` and a float64 reference."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_bool, check_key_padding_mask, check_number, check_qkv
from .masks import allowed_mask, zero_padded
from .packing import attend_per_document, check_cu_seqlens


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    quiet: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Exact scaled dot-product attention.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        causal: mask future keys, aligned bottom-right when ``seq_q != seq_kv`` (see
            :func:`attnzoo.functional.masks.causal_allowed`): the last query sees every key.
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys that are ignored.
        quiet: "quiet" softmax, ``exp(s_j) / (1 + sum_i exp(s_i))``: a head can put its weight on nothing
            and output zero. Implemented as one extra key of zeros (logit 0) with a zero value.
        scale: logit scale, a finite number > 0; ``1/sqrt(head_dim)`` by default.

    Returns:
        (batch, heads, seq_q, head_dim_v). A query row whose keys are all masked yields zeros, not NaN.
        Padded keys and values are zeroed before use, so whatever they hold (NaN and inf included) changes
        no output. Which path runs depends on shapes and on which masks are given, never on the values in a
        mask, so traced and compiled graphs are correct for any mask.
    """
    check_bool("causal", causal)
    check_bool("quiet", quiet)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v)
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    check_key_padding_mask(key_padding_mask, batch, k_len, q.device)
    return softmax_attention_unchecked(q, k, v, causal, key_padding_mask, quiet, scale)


def softmax_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], quiet: bool,
    scale: Optional[float],
) -> Tensor:
    """:func:`softmax_attention` for callers that have validated every argument themselves (the mechanisms,
    whose :meth:`~attnzoo.mechanisms.base.Mechanism.check_inputs` runs first): inputs are checked once."""
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, q.device)
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)

    if quiet:
        k = torch.cat([k.new_zeros(batch, heads, 1, k.shape[3]), k], dim=2)
        v = torch.cat([v.new_zeros(batch, heads, 1, v.shape[3]), v], dim=2)
        if allowed is not None:
            null_column = torch.ones(*allowed.shape[:-1], 1, dtype=torch.bool, device=q.device)
            allowed = torch.cat([null_column, allowed], dim=-1)
        # The null key is always visible, so no row is ever empty.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)

    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if key_padding_mask is None and q_len == k_len:
        # Plain causal self-attention has a fused path; every row sees at least itself.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    return masked_sdpa(q, k, v, allowed, scale)


def packed_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    causal: bool = False,
    *,
    quiet: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Exact softmax attention over a packed row of documents, each attending only within itself:
    block-diagonal attention without an (N, N) mask, one fused call per distinct document length.

    Args:
        q, k: (1, heads, N, head_dim); v: (1, heads, N, head_dim_v): one packed row.
        cu_seqlens: int64 document offsets ``[0, ..., N]`` (see :mod:`attnzoo.functional.packing`).
        causal, quiet, scale: as :func:`softmax_attention`, within each document.

    Returns:
        (1, heads, N, head_dim_v): each document's rows equal :func:`softmax_attention` on it alone.
    """
    check_bool("causal", causal)
    check_bool("quiet", quiet)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"cu_seqlens packs self-attention: q has {q.shape[2]} positions, k {k.shape[2]}")
    spans = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)
    return packed_softmax_attention_unchecked(q, k, v, spans, causal, quiet, scale)


def packed_softmax_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, spans: List[Tuple[int, int]], causal: bool, quiet: bool,
    scale: Optional[float],
) -> Tensor:
    """:func:`packed_softmax_attention` on checked inputs, the documents given as (start, end) spans."""
    per_document = lambda *qkv: softmax_attention_unchecked(*qkv, causal, None, quiet, scale)  # noqa: E731
    return attend_per_document(per_document, q, k, v, spans)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: Optional[float] = None) -> Tensor:
    """SDPA under a bool ``allowed`` mask (broadcastable to (..., seq_q, seq_kv); None: every key) where a row
    that may see no key outputs zeros instead of NaN. The one place every mechanism's masked softmax goes
    through.

    Rows with no visible key would be 0/0. They are let see everything (keeps softmax and its gradient finite)
    and their output is then zeroed, so they contribute neither values nor gradients. Done for every row, with
    no branch on whether any row is empty: a data-dependent branch would be frozen into a traced graph.
    """
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    empty = ~allowed.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, scale=scale)
    return out.masked_fill(empty, 0.0)


def masked_softmax_reference(logits: Tensor, allowed: Optional[Tensor], dim: int = -1) -> Tensor:
    """Softmax of ``logits`` along ``dim`` over the ``allowed`` entries (bool, broadcastable; None: all), the
    obviously-correct form the float64 references share: exactly 0 at excluded entries, and all zeros on a
    row where nothing is allowed (never NaN)."""
    masked = logits if allowed is None else logits.masked_fill(~allowed, -math.inf)
    shift = masked.amax(dim, keepdim=True)
    weights = torch.exp(masked - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)))
    total = weights.sum(dim, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-300), torch.zeros_like(weights))


def softmax_weights(
    q: Tensor, k: Tensor, causal: bool, key_padding_mask: Optional[Tensor], *, quiet: bool = False,
    scale: Optional[float] = None, bias: Optional[Tensor] = None,
) -> Tensor:
    """The (batch, heads, seq_q, seq_kv) weights of softmax attention, in q's dtype: ``softmax(q . k * scale +
    bias)`` over the keys ``causal`` (bottom-right aligned) and ``key_padding_mask`` leave visible (the others
    weigh 0, whatever the padded keys hold); ``quiet`` adds one to the denominator. A row that sees no key
    weighs 0 everywhere (never NaN). k has q's heads; ``bias`` broadcasts to the weights' shape."""
    batch, _, q_len, head_dim = q.shape
    k_len = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    logits = torch.einsum("bhid,bhjd->bhij", q, zero_padded(k, key_padding_mask)) * scale
    if bias is not None:
        logits = logits + bias
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, q.device)
    if allowed is None:
        allowed = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=q.device)
    masked = logits.masked_fill(~allowed.expand_as(logits), -math.inf)
    shift = masked.amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    if quiet:
        shift = shift.clamp_min(0.0)  # the extra logit is 0, so the shift must cover it too
    weights = torch.exp(masked - shift)  # exp(-inf) = 0 for masked keys
    denominator = weights.sum(-1, keepdim=True)
    if quiet:
        denominator = denominator + torch.exp(-shift)
    tiny = torch.finfo(weights.dtype).tiny
    return torch.where(denominator > 0, weights / denominator.clamp_min(tiny), torch.zeros_like(weights))


def softmax_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    quiet: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Obviously-correct quadratic softmax attention in float64, for tests. Same arguments as
    :func:`softmax_attention`; returns float64."""
    weights = softmax_weights(q.double(), k.double(), causal, key_padding_mask, quiet=quiet, scale=scale)
    return weights @ zero_padded(v.double(), key_padding_mask)

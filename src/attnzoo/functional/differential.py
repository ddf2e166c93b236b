"""Differential attention (Ye et al. 2024, the Differential Transformer): the difference of two softmax maps,
which cancels the attention both give to irrelevant context, per-head RMS-normalised::

    out = (1 - lambda_init) * rms_norm(softmax(scale * Q1 K1^T) V - lambda * softmax(scale * Q2 K2^T) V)

On attnzoo's per-head contract the queries and keys of ``head_dim`` are split into halves ``(Q1, Q2)`` and
``(K1, K2)`` of ``head_dim / 2`` (so ``head_dim`` must be even; the fast path zeroes the other half of the
queries instead of slicing, see :func:`_query_halves`), and the values stay whole, as the paper's
model splits its projections (its heads have twice the value width of each query/key half). The scale is
``(head_dim / 2) ** -0.5``, the paper's ``1 / sqrt(d)`` of the dimension each map's dot product spans. The
norm is RMS over each head's value dimension (the paper's GroupNorm with one group per head, "subln") with no
learned weight: the output projection that follows absorbs a per-channel weight exactly.

Both maps run on the exact fused softmax kernel (:func:`attnzoo.functional.softmax.softmax_attention_unchecked`),
so nothing N x N is made beyond what that kernel makes, and causality, key padding, cross-attention, grouped
keys and values (native, never repeated) and packed batches all come from it.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_key_padding_mask, check_number, check_qkv
from .grouped import grouped_query_attention
from .packing import check_cu_seqlens
from .softmax import packed_softmax_attention_unchecked, softmax_attention_reference, softmax_attention_unchecked

RMS_EPS = 1e-5
"""The epsilon of the per-head RMS norm (the paper's)."""


def lambda_init_for(layer_index: int) -> float:
    """The paper's initial lambda for a layer (1-based): ``0.8 - 0.6 * exp(-0.3 * (layer_index - 1))``."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_index - 1))


def reparametrised_lambda(
    lambda_q1: Tensor, lambda_k1: Tensor, lambda_q2: Tensor, lambda_k2: Tensor, lambda_init: float
) -> Tensor:
    """The paper's learned lambda, ``exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init``
    (a 0-d tensor), each vector of ``head_dim / 2``: the re-parametrisation that keeps its learning dynamics
    those of the attention weights."""
    return torch.exp((lambda_q1 * lambda_k1).sum()) - torch.exp((lambda_q2 * lambda_k2).sum()) + lambda_init


def check_even_head_dim(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"differential attention splits queries and keys into two halves: head_dim must be even, "
                         f"got head_dim={head_dim}")


def differential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lambda_: Union[Tensor, float],
    lambda_init: float,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Differential attention (see the module docstring).

    Args:
        q: (batch, heads, seq_q, head_dim), head_dim even; k: (batch, kv_heads, seq_kv, head_dim), kv_heads
            dividing heads; v: (batch, kv_heads, seq_kv, head_dim_v).
        lambda_: the weight of the second map: a number or a 0-d tensor (learned, with a gradient).
        lambda_init: the output scale is ``1 - lambda_init``.
        causal: bottom-right aligned causal mask; key_padding_mask: (batch, seq_kv) bool, True marks padding.
        scale: logit scale (> 0) of both maps, ``(head_dim / 2) ** -0.5`` by default.

    Returns:
        (batch, heads, seq_q, head_dim_v); a row that may see no key is zeros.
    """
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    lambda_init = check_number("lambda_init", lambda_init)
    check_qkv(q, k, v, grouped=True)
    check_even_head_dim(q.shape[3])
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    lambda_ = _checked_lambda(lambda_, q)
    return differential_attention_unchecked(q, k, v, lambda_, lambda_init, causal, key_padding_mask, scale)


def _checked_lambda(lambda_: object, q: Tensor) -> Tensor:
    if isinstance(lambda_, Tensor):
        if lambda_.dim() != 0 or not lambda_.is_floating_point():
            raise ValueError(f"lambda_ must be a number or a 0-d floating tensor, got shape {tuple(lambda_.shape)} "
                             f"and dtype {lambda_.dtype}")
        if not bool(torch.isfinite(lambda_)):
            raise ValueError("lambda_ must be finite")
        return lambda_
    return torch.tensor(check_number("lambda_", lambda_), dtype=working_dtype(q.dtype), device=q.device)


def _halves(x: Tensor) -> Tuple[Tensor, Tensor]:
    half = x.shape[3] // 2
    return x[..., :half], x[..., half:]


def _query_halves(q: Tensor) -> Tuple[Tensor, Tensor]:
    """q with its second half zeroed, and with its first half zeroed: against the whole keys they give exactly
    the dot products of the halves, ``[q1, 0] . [k1, k2] = q1 . k1``. Keeping the head dim whole keeps q, k and v
    of one width, which the fused kernels need: halves of ``head_dim / 2`` against values of ``head_dim`` would
    send SDPA to its math path, which makes the (N, N) weights (1 GiB at N = 4096, 4 heads, measured)."""
    first = torch.arange(q.shape[3], device=q.device) < q.shape[3] // 2
    return torch.where(first, q, torch.zeros_like(q)), torch.where(first, torch.zeros_like(q), q)


def combine_maps(first: Tensor, second: Tensor, lambda_: Tensor, lambda_init: float) -> Tensor:
    """``(1 - lambda_init) * rms_norm(first - lambda_ * second)`` over the last dim, in the working dtype."""
    dtype = working_dtype(first.dtype)
    difference = first.to(dtype) - lambda_.to(dtype) * second.to(dtype)
    normalised = difference * torch.rsqrt(difference.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return (normalised * (1.0 - lambda_init)).to(first.dtype)


def differential_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, lambda_: Tensor, lambda_init: float, causal: bool,
    key_padding_mask: Optional[Tensor], scale: Optional[float],
) -> Tensor:
    """:func:`differential_attention` on checked inputs (the mechanism's path)."""
    scale = _scale(q.shape[3], scale)
    kv_heads = k.shape[1]

    def softmax_map(queries: Tensor, keys: Tensor) -> Tensor:
        if kv_heads == q.shape[1]:
            return softmax_attention_unchecked(queries, keys, v, causal, key_padding_mask, False, scale)
        return grouped_query_attention(
            lambda grouped, masked: softmax_attention_unchecked(grouped, keys, v, masked, key_padding_mask, False,
                                                                scale),
            queries, kv_heads, causal,
        )

    first, second = _query_halves(q)
    return combine_maps(softmax_map(first, k), softmax_map(second, k), lambda_, lambda_init)


def packed_differential_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, lambda_: Tensor, lambda_init: float, spans: List[Tuple[int, int]],
    causal: bool, scale: Optional[float],
) -> Tensor:
    """Differential attention over a checked packed row (1, heads, N, dim), each document (start, end) alone:
    both maps on softmax's block-diagonal path (one fused call per distinct document length); the norm is per
    position, so it needs no splitting."""
    scale = _scale(q.shape[3], scale)
    queries = _query_halves(q)
    first, second = (packed_softmax_attention_unchecked(x, k, v, spans, causal, False, scale) for x in queries)
    return combine_maps(first, second, lambda_, lambda_init)


def packed_differential_attention(
    q: Tensor, k: Tensor, v: Tensor, lambda_: Union[Tensor, float], lambda_init: float, cu_seqlens: Tensor,
    causal: bool = False, *, scale: Optional[float] = None,
) -> Tensor:
    """:func:`differential_attention` over a packed row of documents (q, k, v of batch 1, as many heads each),
    ``cu_seqlens`` the int64 offsets ``[0, ..., N]``; each document's rows equal the attention on it alone."""
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    lambda_init = check_number("lambda_init", lambda_init)
    check_qkv(q, k, v)
    check_even_head_dim(q.shape[3])
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"cu_seqlens packs self-attention: q has {q.shape[2]} positions, k {k.shape[2]}")
    spans = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)
    return packed_differential_attention_unchecked(q, k, v, _checked_lambda(lambda_, q), lambda_init, spans,
                                                   causal, scale)


def _scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim // 2) if scale is None else scale


def differential_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lambda_: Union[Tensor, float],
    lambda_init: float,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Differential attention in float64 from its definition: two quadratic softmax maps
    (:func:`~attnzoo.functional.softmax.softmax_attention_reference`), their difference, the RMS norm.
    k and v with as many heads as q. Returns float64."""
    scale = _scale(q.shape[3], scale)
    (q1, q2), (k1, k2) = _halves(q.double()), _halves(k.double())
    first = softmax_attention_reference(q1, k1, v, causal, key_padding_mask, scale=scale)
    second = softmax_attention_reference(q2, k2, v, causal, key_padding_mask, scale=scale)
    weight = lambda_.double() if isinstance(lambda_, Tensor) else float(lambda_)
    difference = first - weight * second
    rms = torch.sqrt((difference ** 2).mean(-1, keepdim=True) + RMS_EPS)
    return (1.0 - lambda_init) * difference / rms

"""Based (Arora et al. 2024): linear attention with the second-order Taylor feature map on a small projected
feature dimension, plus a small exact sliding-window softmax, the two outputs summed.

Linear part: queries and keys are projected per head to ``feature_dim`` (m) features by a learned linear map
(the paper projects the layer input; a mechanism sees q and k, so it projects those), then mapped by

    phi(x) = [1, x, vec(x x^T) / sqrt(2)]        (1 + m + m^2 features)

so that ``phi(q') . phi(k) = 1 + s + s^2 / 2`` with ``s = q' . k``, the Taylor expansion of ``exp(s)`` to
second order, which is positive for every s (its minimum is 1/2): the normaliser never vanishes. As in fla,
the scale ``m ** -0.5`` goes on the projected queries before the map (``q' = scale * q_proj``). The output is
``sum_j phi(q'_i).phi(k_j) v_j / sum_j phi(q'_i).phi(k_j)`` over the visible keys, computed by the shared
kernelized core (:mod:`attnzoo.functional.linear`): chunked causal with a carried state, or one sum
non-causally; O(m^2 d) state per head when decoding.

Window part: exact softmax over the ``window`` nearest keys (``|i - j| < window``; causally the window
positions up to the query), on the blockwise core of the fixed sparse patterns
(:class:`~attnzoo.functional.blocksparse.LocalPattern`); decoded with its ring buffer
(:mod:`attnzoo.functional.blocksparse.window_cache`).

The paper stacks the two as separate layers of a hybrid model; inside one attention they are summed, the
residual stream's own way of combining layers (each part is a normalised average of the values).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .blocksparse import (
    BlockPlan,
    blocksparse_attention_reference,
    blocksparse_attention_unchecked,
    window_cache_prefill,
    window_cache_step,
    window_pattern,
)
from .linear import (
    kernel_attention_prefill_unchecked,
    kernel_attention_reference,
    kernel_attention_step_unchecked,
    kernel_attention_unchecked,
)


def taylor_features(x: Tensor) -> Tensor:
    """The second-order Taylor feature map ``[1, x, vec(x x^T) / sqrt(2)]``: (..., m) -> (..., 1 + m + m^2),
    so that ``phi(a) . phi(b) = 1 + a.b + (a.b)^2 / 2``."""
    outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)


def taylor_feature_dim(feature_dim: int) -> int:
    """How many features :func:`taylor_features` makes of ``feature_dim`` inputs."""
    return 1 + feature_dim + feature_dim * feature_dim


def based_features(q: Tensor, k: Tensor, q_proj: Tensor, k_proj: Tensor) -> Tuple[Tensor, Tensor]:
    """Taylor features of the projected queries (scaled by ``feature_dim ** -0.5``) and keys.

    Args:
        q, k: (batch, heads, seq, head_dim); q_proj, k_proj: (heads, head_dim, feature_dim), per-head maps.

    Returns:
        phi_q, phi_k: (batch, heads, seq, 1 + m + m^2) in the working dtype of q.
    """
    dtype = working_dtype(q.dtype)
    # math.sqrt makes the scale a Python float (a traced size would be an integer tensor, whose power is float32)
    scale = 1.0 / math.sqrt(q_proj.shape[-1])
    projected_q = torch.einsum("bhnd,hdm->bhnm", q.to(dtype), q_proj.to(dtype)) * scale
    projected_k = torch.einsum("bhnd,hdm->bhnm", k.to(dtype), k_proj.to(dtype))
    return taylor_features(projected_q), taylor_features(projected_k)


def based_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    window: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    chunk_size: int,
    plan: Optional[BlockPlan] = None,
) -> Tensor:
    """Based attention on checked self-attention inputs (q, k, v: (batch, heads, seq, head_dim); masks as in
    :func:`~attnzoo.functional.softmax.softmax_attention`): the Taylor linear part plus the window part.
    ``plan``: a block plan of :func:`window_pattern` for this length and causality, to reuse. Returns (batch,
    heads, seq, head_dim_v) in v's dtype."""
    phi_q, phi_k = based_features(q, k, q_proj, k_proj)
    if key_padding_mask is not None:  # a NaN key must not reach its features (0 * NaN is NaN)
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    linear = kernel_attention_unchecked(phi_q, phi_k, v, causal, key_padding_mask, None, "sum", chunk_size, 0.0)
    local = blocksparse_attention_unchecked(q, k, v, window_pattern(window), causal, key_padding_mask, None, plan)
    return linear + local


def based_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    window: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """The same in float64 by quadratic maths: the (seq, seq) Taylor kernel matrix, masked and normalised,
    plus softmax under the window's dense mask."""
    q, k, v = q.double(), k.double(), v.double()
    if key_padding_mask is not None:
        k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    phi_q, phi_k = based_features(q, k, q_proj.double(), k_proj.double())
    linear = kernel_attention_reference(phi_q, phi_k, v, causal, key_padding_mask)
    local = blocksparse_attention_reference(q, k, v, window_pattern(window), causal, key_padding_mask)
    return linear + local


def based_state_layout(
    heads: int, head_dim: int, feature_dim: int, window: int, dtype: torch.dtype, value_width: Optional[int] = None
) -> dict:
    """The decoding state's tensors (name -> (shape after the batch dim, dtype)): the linear part's
    ``kv`` (heads, 1 + m + m^2, value_width + 1) and ``log_scale`` in the working dtype, and the window's ring
    ``k`` (heads, window, head_dim), ``v`` (heads, window, value_width) and ``positions`` (window,);
    ``value_width`` is ``head_dim`` when None."""
    state_dtype = working_dtype(dtype)
    value_width = head_dim if value_width is None else value_width
    return {
        "kv": ((heads, taylor_feature_dim(feature_dim), value_width + 1), state_dtype),
        "log_scale": ((heads, 1, 1), state_dtype),
        "k": ((heads, window, head_dim), dtype),
        "v": ((heads, window, value_width), dtype),
        "positions": ((window,), torch.long),
    }


_RING = ("k", "v", "positions")


def _window_state(tensors: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The window cache's state from ours: the ring, and empty sink slots (no sinks)."""
    ring = {name: tensors[name] for name in _RING}
    empty = tensors["k"][:, :, :0]
    return {**ring, "sink_k": empty, "sink_v": tensors["v"][:, :, :0]}


def based_prefill_unchecked(
    q: Tensor, k: Tensor, v: Tensor, q_proj: Tensor, k_proj: Tensor, window: int, chunk_size: int,
    plan: Optional[BlockPlan] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Causal Based attention over a checked prompt and the decoding state after it
    (:func:`based_state_layout`)."""
    phi_q, phi_k = based_features(q, k, q_proj, k_proj)
    linear, kernel_state = kernel_attention_prefill_unchecked(phi_q, phi_k, v, None, None, "sum", chunk_size, 0.0)
    local = blocksparse_attention_unchecked(q, k, v, window_pattern(window), True, None, None, plan)
    ring = window_cache_prefill(k, v, window, 0)
    return linear + local, {**kernel_state, **{name: ring[name] for name in _RING}}


def based_step_unchecked(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, q_proj: Tensor, k_proj: Tensor, window: int,
    tensors: Optional[Dict[str, Tensor]], length: int,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One decoding position (q_t, k_t, v_t: (batch, heads, 1, dim)) after ``length`` positions whose state
    is ``tensors`` (None at the start): O(m^2 d + window d). Returns the output and the new state."""
    phi_q, phi_k = based_features(q_t, k_t, q_proj, k_proj)
    kernel_state = None if tensors is None else {"kv": tensors["kv"], "log_scale": tensors["log_scale"]}
    linear, kernel_state = kernel_attention_step_unchecked(phi_q, phi_k, v_t, kernel_state, None, None, "sum", 0.0)
    ring = None if tensors is None else _window_state(tensors)
    local, ring = window_cache_step(q_t, k_t, v_t, ring, length, window, 0)
    return linear.to(v_t.dtype) + local, {**kernel_state, **{name: ring[name] for name in _RING}}

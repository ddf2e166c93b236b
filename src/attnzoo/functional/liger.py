"""Liger attention (Lan et al. 2025, "Liger: Linearizing Large Language Models to Gated Recurrent Structures"):
gated linear attention made from a pretrained model's own queries and keys, with no parameters of its own, and
an exact sliding window beside it, the two outputs averaged.

Gated linear part, per key/value head (the query heads of a group read their head's one state):

    phi(x) = softmax(x) over the head's channels (queries and keys alike),
    log a_t = logsigmoid(k_t) / gate_normalizer        (one decay per key channel, from the key itself),
    S_t = diag(a_t) S_{t-1} + phi(k_t) v_t^T,           o_t = phi(q_t)^T S_t      (scale 1, no normaliser).

Window part: softmax attention over the ``window`` nearest keys (causally the positions ``i - window + 1 .. i``),
with the first ``sinks`` positions visible to every query besides (StreamingLLM's sinks, optional), on the
blockwise core of the fixed sparse patterns. Liger rotates the window's queries and keys by the model's rotary
embedding and leaves the linear part's unrotated, so the functions here take both (the mechanism rotates).

    y_i = (window_i + o_i) / 2.

With ``normalize`` (not in Liger), the linear part is divided by its own weights' sum, ``o_t = phi(q_t)^T S_t /
phi(q_t)^T z_t`` with ``z_t = diag(a_t) z_{t-1} + phi(k_t)`` (values ``[v, 1]`` through the same recurrence), so
both parts are weighted averages of the values: without it the linear part's weights sum to as much as the number
of keys whose channels barely decay, which a pretrained model's outputs are not scaled for.

Non-causal (self-attention, not in Liger): the window looks both ways and every query reads the state after the
whole sequence, as the delta rule's non-causal form does.

Causal fast path, chunked (chunks of C positions; G_t the cumulative log decay inside a chunk, non-increasing):
inside a chunk the pairs ``sum_c phi_q_tc phi_k_jc exp(G_tc - G_jc)`` are the per-channel decayed products of
:mod:`attnzoo.functional.delta.channels` (safe for any decay); across chunks ``(phi_q_t * exp(G_t)) S`` reads the
state before the chunk, which moves on as ``S <- exp(G_C) * S + (phi_k * exp(G_C - G))^T V``. Every exponent is
<= 0, so nothing overflows. Padded keys are zeroed before their features and gates are formed, and their
features, gates (log decay 0: an identity step) and values are zeroed after, so NaN there reaches nothing.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .blocksparse import (
    BlockPlan,
    blocksparse_attention_reference,
    blocksparse_attention_unchecked,
    window_cache_layout,
    window_cache_prefill,
    window_cache_step,
    window_pattern,
)
from .delta.channels import DecayedProducts
from .linear import normalize_output
from .linear.inputs import _with_ones

_RING = ("k", "v", "positions", "sink_k", "sink_v")


def liger_features(q: Tensor, k: Tensor, gate_normalizer: float, key_padding_mask: Optional[Tensor]
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(phi(q), phi(k), log a)`` in the working dtype: softmax over the channels, and the log decays
    ``logsigmoid(k) / gate_normalizer``; padded keys (key_padding_mask (batch, seq), True = padding) have zero
    features and zero log decay whatever they hold."""
    dtype = working_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    padded = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    if padded is not None:  # before the features: softmax of NaN is NaN, and so would its gradient be
        k = k.masked_fill(padded, 0.0)
    phi_k, log_gate = k.softmax(-1), F.logsigmoid(k) / gate_normalizer
    if padded is not None:
        phi_k, log_gate = phi_k.masked_fill(padded, 0.0), log_gate.masked_fill(padded, 0.0)
    return q.softmax(-1), phi_k, log_gate


def _grouped(phi_q: Tensor, kv_heads: int) -> Tensor:
    """(batch, heads, n, d) -> (batch, kv_heads, group, n, d): the query heads of each key/value head."""
    batch, heads, n, d = phi_q.shape
    return phi_q.reshape(batch, kv_heads, heads // kv_heads, n, d)


def gated_channels_unchecked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Tensor, causal: bool, chunk_size: int,
    initial: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The gated linear part on features: phi_q (batch, heads, n, d); phi_k, log_gate (batch, kv_heads, n, d);
    v (batch, kv_heads, n, dv), in one dtype; initial (batch, kv_heads, d, dv) or None (zeros). Returns the
    output (batch, heads, n, dv) and the state after the last position (module docstring)."""
    batch, heads, n, d = phi_q.shape
    kv_heads, dv = phi_k.shape[1], v.shape[-1]
    q = _grouped(phi_q, kv_heads)
    state = phi_k.new_zeros(batch, kv_heads, d, dv) if initial is None else initial
    if not causal:
        later = log_gate.flip(2).cumsum(2).flip(2) - log_gate  # sum of the log decays after each key
        state = (log_gate.sum(2, keepdim=True).exp().transpose(-1, -2) * state
                 + (phi_k * later.exp()).transpose(-1, -2) @ v)
        return (q @ state[:, :, None]).reshape(batch, heads, n, dv), state
    pad = (-n) % chunk_size
    if pad:  # zero features, values and log decays: identity steps
        phi_k, v, log_gate = (F.pad(x, (0, 0, 0, pad)) for x in (phi_k, v, log_gate))
        q = F.pad(q, (0, 0, 0, pad))
    chunks = (n + pad) // chunk_size
    # (b, kv, chunks, group, C, d), contiguous: the decayed products' split form views its rows.
    qc = q.reshape(batch, kv_heads, -1, chunks, chunk_size, d).transpose(2, 3).contiguous()
    kc = phi_k.reshape(batch, kv_heads, chunks, chunk_size, d)
    vc = v.reshape(batch, kv_heads, chunks, chunk_size, dv)
    gc = log_gate.reshape(batch, kv_heads, chunks, chunk_size, d).cumsum(-2)
    intra = DecayedProducts.apply(qc, kc, gc) @ vc.unsqueeze(3)
    last = gc[..., -1:, :]
    own_states = (kc * (last - gc).exp()).transpose(-1, -2) @ vc  # (b, kv, chunks, d, dv), each from zero
    decays = last.exp().transpose(-1, -2)  # (b, kv, chunks, d, 1)
    before = []
    for index in range(chunks):
        before.append(state)
        state = decays[:, :, index] * state + own_states[:, :, index]
    inter = (qc * gc.exp().unsqueeze(3)) @ torch.stack(before, 2).unsqueeze(3)
    out = (intra + inter).transpose(2, 3).reshape(batch, heads, chunks * chunk_size, dv)
    return out[:, :, :n], state


def _linear_values(v: Tensor, dtype: torch.dtype, normalize: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    """The values the linear recurrence carries: v, or ``[v, 1]`` to sum the normaliser alongside; zero at padded
    keys."""
    values = v.to(dtype)
    if normalize:
        values = _with_ones(values)
    if key_padding_mask is not None:
        values = values.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return values


def liger_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, q_window: Tensor, k_window: Tensor, window: int, sinks: int,
    gate_normalizer: float, normalize: bool, causal: bool, key_padding_mask: Optional[Tensor], chunk_size: int,
    plan: Optional[BlockPlan] = None, initial: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Liger attention on checked self-attention inputs: q (batch, heads, seq, d), k (batch, kv_heads, seq, d),
    v (batch, kv_heads, seq, dv) for the gated linear part; q_window, k_window the same positions as the window
    part takes them (rotated, or q and k themselves). ``plan``: a block plan of :func:`window_pattern` for this
    length and causality, to reuse. Returns the output (batch, heads, seq, dv) in v's dtype, and the linear
    part's state after the last position (working dtype)."""
    phi_q, phi_k, log_gate = liger_features(q, k, gate_normalizer, key_padding_mask)
    values = _linear_values(v, phi_k.dtype, normalize, key_padding_mask)
    linear, state = gated_channels_unchecked(phi_q, phi_k, values, log_gate, causal, chunk_size, initial)
    linear = normalize_output(linear, "sum") if normalize else linear
    local = blocksparse_attention_unchecked(q_window, k_window, v, window_pattern(window, sinks), causal,
                                            key_padding_mask, None, plan)
    return (0.5 * (local.to(linear.dtype) + linear)).to(v.dtype), state


def liger_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, q_window: Tensor, k_window: Tensor, window: int, sinks: int,
    gate_normalizer: float, normalize: bool = False, causal: bool = False, key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """The same in float64 by quadratic maths: the linear part's weights ``sum_c phi_q_ic phi_k_jc
    exp(G_ic - G_jc)`` over the visible pairs (G the cumulative log decay; non-causal, G_i is that of the
    whole sequence), and softmax under the window's dense mask."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    phi_q, phi_k, log_gate = liger_features(q, k.repeat_interleave(groups, 1), gate_normalizer, key_padding_mask)
    values = v.repeat_interleave(groups, 1)
    if key_padding_mask is not None:
        values = values.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    total = log_gate.cumsum(2)
    n = q.shape[2]
    reads = total if causal else total[:, :, -1:].expand_as(total)
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    exponent = (reads[:, :, :, None] - total[:, :, None]).masked_fill(~visible[:, :, None], float("-inf"))
    weights = (phi_q[:, :, :, None] * phi_k[:, :, None] * exponent.exp()).sum(-1)
    if normalize:  # a row whose every key is padding has no weight: zeros, as the fast path gives
        total_weight = weights.sum(-1, keepdim=True)
        weights = weights / torch.where(total_weight == 0, torch.ones_like(total_weight), total_weight)
    local = blocksparse_attention_reference(q_window.double(), k_window.double().repeat_interleave(groups, 1),
                                            v.repeat_interleave(groups, 1), window_pattern(window, sinks), causal,
                                            key_padding_mask)
    return 0.5 * (local + weights @ values)


def liger_state_layout(heads: int, head_dim: int, window: int, sinks: int, normalize: bool, dtype: torch.dtype,
                       value_width: Optional[int] = None) -> dict:
    """The decoding state's tensors (name -> (shape after the batch dim, dtype)), ``heads`` the key/value heads:
    the linear part's ``kv`` (heads, head_dim, value_width, + 1 with ``normalize``) in the working dtype, and the
    window's ring and sinks (:func:`~attnzoo.functional.blocksparse.window_cache_layout`); ``value_width`` is
    ``head_dim`` when None."""
    value_width = head_dim if value_width is None else value_width
    return {"kv": ((heads, head_dim, value_width + int(normalize)), working_dtype(dtype)),
            **window_cache_layout(heads, window, sinks, head_dim, dtype, value_width)}


def liger_prefill_unchecked(
    q: Tensor, k: Tensor, v: Tensor, q_window: Tensor, k_window: Tensor, window: int, sinks: int,
    gate_normalizer: float, normalize: bool, chunk_size: int, plan: Optional[BlockPlan] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Causal Liger attention over a checked prompt and the decoding state after it
    (:func:`liger_state_layout`)."""
    out, state = liger_attention_unchecked(q, k, v, q_window, k_window, window, sinks, gate_normalizer, normalize,
                                           True, None, chunk_size, plan)
    return out, {"kv": state, **window_cache_prefill(k_window, v, window, sinks)}


def liger_step_unchecked(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, q_window: Tensor, k_window: Tensor, window: int, sinks: int,
    gate_normalizer: float, normalize: bool, tensors: Optional[Dict[str, Tensor]], length: int,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One decoding position (q_t (batch, heads, 1, d); k_t, v_t (batch, kv_heads, 1, d); q_window, k_window as
    the window takes them) after ``length`` positions whose state is ``tensors`` (None at the start): O(d dv +
    window d). Returns the output (batch, heads, 1, dv) and the new state."""
    phi_q, phi_k, log_gate = liger_features(q_t, k_t, gate_normalizer, None)
    batch, kv_heads, _, d = phi_k.shape
    values = _linear_values(v_t, phi_k.dtype, normalize, None)
    state = values.new_zeros(batch, kv_heads, d, values.shape[-1]) if tensors is None else tensors["kv"]
    state = log_gate.exp().transpose(-1, -2) * state + phi_k.transpose(-1, -2) @ values
    linear = (_grouped(phi_q, kv_heads) @ state[:, :, None]).reshape(batch, phi_q.shape[1], 1, -1)
    linear = normalize_output(linear, "sum") if normalize else linear
    ring = None if tensors is None else {name: tensors[name] for name in _RING}
    local, ring = window_cache_step(q_window, k_window, v_t, ring, length, window, sinks)
    return (0.5 * (local.to(linear.dtype) + linear)).to(v_t.dtype), {"kv": state, **ring}


__all__ = ["gated_channels_unchecked", "liger_attention_reference", "liger_attention_unchecked", "liger_features",
           "liger_prefill_unchecked", "liger_state_layout", "liger_step_unchecked"]

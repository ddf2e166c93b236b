"""Decoding of LoLCATs attention (:mod:`attnzoo.functional.lolcats`) with a constant-size state: a ring of the
last w keys and values, the sinks' keys and values, the linear state ``sum phi_k(k_j) [v_j, 1]^T`` of the other
keys that have left the window, and with a sparse cache (:mod:`attnzoo.functional.sparse_cache`) the keys it
keeps exact."""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from ._autocast import without_autocast
from .blocksparse import BlockPlan, window_cache_layout, window_cache_prefill, window_ring
from .features import hedgehog_decoding_weights, hedgehog_features_decoding, hedgehog_features_unchecked
from .linear.inputs import _with_ones
from .lolcats import LolcatsWeights, _attention, _log_decay, _logit_scale, _window_weight
from .sparse_cache import CACHE_TENSORS, admit_leaving_, empty_sparse_cache, sparse_cache_layout


class LolcatsStepWeights(NamedTuple):
    """The parameters as a decoding step takes them (:func:`lolcats_step_weights`), in the working dtype: both
    Hedgehog maps (:func:`~attnzoo.functional.features.hedgehog_decoding_weights`) stacked, the query maps'
    heads first, ``maps`` (2 * heads, head_dim, feature_dim) and ``biases`` (2 * heads, 1, feature_dim), so
    that one product gives the query's features and the leaving key's; and ``f_h = sigmoid(window_factor_h)``
    shaped (1, heads, 1, 1); with a decay, ``lambda_h`` shaped (1, heads, 1, 1), else None. Made once per change
    of the parameters by a caller that keeps them."""

    maps: Tensor
    biases: Tensor
    window_weight: Tensor
    decay: Optional[Tensor] = None


def lolcats_step_weights(weights: LolcatsWeights, dtype: torch.dtype) -> LolcatsStepWeights:
    """``weights`` as :func:`lolcats_step_unchecked` takes them, in ``dtype`` (the working dtype)."""
    query = hedgehog_decoding_weights(weights.query_weight, weights.query_bias, dtype)
    key = hedgehog_decoding_weights(weights.key_weight, weights.key_bias, dtype)
    log_decay = _log_decay(weights, dtype)
    decay = None if log_decay is None else log_decay.exp().view(1, -1, 1, 1)
    return LolcatsStepWeights(torch.cat([query[0], key[0]]), torch.cat([query[1], key[1]]),
                              _window_weight(weights, dtype), decay)


# -- decoding ------------------------------------------------------------------------------------------------
def lolcats_state_layout(
    heads: int, head_dim: int, feature_dim: int, window: int, dtype: torch.dtype, value_width: Optional[int] = None,
    sinks: int = 0, window_inputs: bool = False, cache_size: int = 0,
) -> dict:
    """The decoding state's tensors (name -> (shape after the batch dim, dtype)): the linear state ``kv``
    (heads, 2 * feature_dim, value_width + 1) in the working dtype, ``sum phi_k(k_j) [v_j, 1]^T`` over the keys
    that have left the window (sinks aside), and the window's ring ``k`` (heads, window, head_dim), ``v``
    (heads, window, value_width) and ``positions`` (window,), position t in slot ``t % window`` (-1 while
    empty). With sinks, also ``sink_k`` (heads, sinks, head_dim) and ``sink_v`` (heads, sinks, value_width):
    the first positions, kept for good. With ``window_inputs`` (the window's queries and keys given apart), the
    ring also holds the keys as the features take them, ``feature_k`` (heads, window, head_dim). With a sparse
    cache of ``cache_size`` keys, its tensors (:func:`~attnzoo.functional.sparse_cache.sparse_cache_layout`); ``kv``
    then sums the keys moved out of it."""
    value_width = head_dim if value_width is None else value_width
    layout = window_cache_layout(heads, window, sinks, head_dim, dtype, value_width)
    if not sinks:
        del layout["sink_k"], layout["sink_v"]
    if window_inputs:
        layout["feature_k"] = layout["k"]
    if cache_size:
        layout.update(sparse_cache_layout(heads, cache_size, head_dim, value_width, 2 * feature_dim, dtype,
                                          working_dtype(dtype)))
    return {"kv": ((heads, 2 * feature_dim, value_width + 1), working_dtype(dtype)), **layout}


@without_autocast
def lolcats_prefill_unchecked(
    q: Tensor, k: Tensor, v: Tensor, weights: LolcatsWeights, window: int, scale: Optional[float], chunk_size: int,
    plan: Optional[BlockPlan] = None, sinks: int = 0, q_window: Optional[Tensor] = None,
    k_window: Optional[Tensor] = None, cache_size: int = 0,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Causal LoLCATs attention over a checked prompt and the decoding state after it
    (:func:`lolcats_state_layout`, with ``window_inputs`` when ``q_window`` is given)."""
    out, schedule = _attention(q, k, v, weights, window, True, None, scale, chunk_size, plan, sinks, q_window,
                               k_window, cache_size)
    state = window_cache_prefill(k if k_window is None else k_window, v, window, sinks)
    if not sinks:
        del state["sink_k"], state["sink_v"]
    if k_window is not None:
        state["feature_k"] = window_ring(k, window)
    if schedule is not None:  # the linear state of the keys moved out of the cache, and the cache
        _, kv, cache, _ = schedule
        cache["cache_k"], cache["cache_v"] = cache["cache_k"].to(k.dtype), cache["cache_v"].to(v.dtype)
        return out, {"kv": kv, **state, **cache}
    return out, {"kv": _linear_state(k, v, weights, window, sinks), **state}


def _linear_state(k: Tensor, v: Tensor, weights: LolcatsWeights, window: int, sinks: int) -> Tensor:
    """``sum phi_k(k_j) [v_j, 1]^T`` over the keys that have left the window after a prompt (sinks aside),
    each aged by the decay."""
    dtype = working_dtype(v.dtype)
    first, gone = min(sinks, k.shape[2]), max(k.shape[2] - window, 0)  # linear: the keys [sinks, gone)
    phi_k = hedgehog_features_unchecked(k[:, :, first:gone].to(dtype), weights.key_weight, weights.key_bias)
    log_decay = _log_decay(weights, dtype)
    if log_decay is not None and gone > first:  # key j has decayed gone - 1 - j times
        age = torch.arange(gone - 1 - first, -1, -1, device=k.device, dtype=dtype)
        phi_k = phi_k * torch.exp(log_decay.view(-1, 1, 1) * age.view(-1, 1))
    return phi_k.transpose(-1, -2) @ _with_ones(v[:, :, first:gone].to(dtype))


def _empty_state(k_t: Tensor, v_t: Tensor, features: int, window: int, sinks: int, window_inputs: bool,
                 cache_size: int) -> Dict[str, Tensor]:
    """The state before the first position (``features``: the linear state's rows, 2 * feature_dim)."""
    batch, heads, _, head_dim = k_t.shape
    state = {
        "kv": k_t.new_zeros(batch, heads, features, v_t.shape[3] + 1, dtype=working_dtype(v_t.dtype)),
        "k": k_t.new_zeros(batch, heads, window, head_dim),
        "v": v_t.new_zeros(batch, heads, window, v_t.shape[3]),
        "positions": torch.full((batch, window), -1, dtype=torch.long, device=k_t.device),
    }
    if sinks:
        state["sink_k"], state["sink_v"] = k_t.new_zeros(batch, heads, sinks, head_dim), v_t.new_zeros(
            batch, heads, sinks, v_t.shape[3])
    if window_inputs:
        state["feature_k"] = torch.zeros_like(state["k"])
    if cache_size:
        state.update(empty_sparse_cache(batch, heads, cache_size, k_t, v_t, features, working_dtype(v_t.dtype)))
    return state


def _step_features(q_t: Tensor, old_k: Optional[Tensor], weights: LolcatsStepWeights,
                   ) -> Tuple[Tensor, Optional[Tensor]]:
    """phi_q of the query and phi_k of the key leaving the window (q_t, old_k: (batch, heads, 1, head_dim) in
    the working dtype; old_k None: no key leaves, and phi_k is None), from one product over the stacked maps:
    ((batch, heads, 1, 2 m), (batch, heads, 1, 2 m) or None)."""
    heads = q_t.shape[1]
    if old_k is None:
        return hedgehog_features_decoding(q_t, weights.maps[:heads], weights.biases[:heads]), None
    features = hedgehog_features_decoding(torch.cat([q_t, old_k], 1), weights.maps, weights.biases)
    return features[:, :heads], features[:, heads:]


def _next_ring(tensors: Dict[str, Tensor], k_t: Tensor, v_t: Tensor, slot: int, length: int, sinks: int,
               ) -> Tuple[Dict[str, Tensor], Tensor, Tensor]:
    """The state's ring and sinks with position ``length`` written in ``slot`` (new tensors: the previous state's
    are never written), and the keys and values a step reads, (batch, heads, sinks + window, dim): the sinks,
    then the ring. One copy per tensor makes both: the new ring is a view of the keys read."""
    sink_k, sink_v = tensors.get("sink_k"), tensors.get("sink_v")
    if length < sinks:  # the sinks are still being written
        sink_k, sink_v = sink_k.clone(), sink_v.clone()
        sink_k[:, :, length], sink_v[:, :, length] = k_t[:, :, 0], v_t[:, :, 0]
    window = tensors["k"].shape[2]

    def written(ring: Tensor, x_t: Tensor, front: Optional[Tensor]) -> Tensor:
        # Copied whole, then the slot written: a concatenation around the slot (non-contiguous pieces) costs
        # about twice as much.
        out = ring.clone() if front is None else torch.cat([front, ring], 2)
        out[:, :, sinks + slot] = x_t[:, :, 0]
        return out

    keys, values = written(tensors["k"], k_t, sink_k), written(tensors["v"], v_t, sink_v)
    positions = tensors["positions"].clone()
    positions[:, slot] = length
    new = {"k": keys.narrow(2, sinks, window), "v": values.narrow(2, sinks, window), "positions": positions}
    if sinks:
        new["sink_k"], new["sink_v"] = sink_k, sink_v
    return new, keys, values


def _step_unseen(positions: Tensor, length: int, window: int, sinks: int) -> Tensor:
    """Which of a step's keys (the sinks, then the ring) it does not read, (batch, 1, 1, sinks + window): the
    ring's empty slots, and the sinks still inside the window (they are in the ring)."""
    batch = positions.shape[0]
    sink_unseen = (torch.arange(sinks, device=positions.device) > length - window).expand(batch, sinks)
    return torch.cat([sink_unseen, positions < 0], 1).view(batch, 1, 1, -1)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for (batch, heads, n, k) and (batch, heads, k, p) as one batched product over batch * heads:
    the broadcasting matmul's dispatch costs as much as the product itself at a decoding step's sizes."""
    return torch.bmm(a.flatten(0, 1), b.flatten(0, 1)).unflatten(0, a.shape[:2])


@without_autocast
def lolcats_step_unchecked(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, weights: LolcatsStepWeights, window: int, scale: Optional[float],
    tensors: Optional[Dict[str, Tensor]], length: int, sinks: int = 0, q_window: Optional[Tensor] = None,
    k_window: Optional[Tensor] = None, cache_size: int = 0,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One decoding position (q_t, k_t: (batch, heads, 1, head_dim), v_t: (batch, heads, 1, head_dim_v)) after
    ``length`` positions whose state is ``tensors`` (None at the start), with the parameters of
    :func:`lolcats_step_weights`: O((w + sinks) d + m d). The key leaving the window (position ``length -
    window``) joins the linear state unless it is a sink, the new one takes its slot. ``q_window``,
    ``k_window``: the window's query and key, apart from the features' (the state then has ``feature_k``). The
    previous state's tensors are never written (a state may be stepped from twice). ``cache_size`` > 0: the
    leaving key is offered to the sparse cache instead (:func:`~attnzoo.functional.sparse_cache.admit_leaving_`),
    whose keys the query reads exactly. Returns the output and the new state.

    A step's rows are few, so its time is its op count: the leaving key's features are the only key features
    it forms, in the query's product (a ring of every window key's features in the state would be copied
    whole each step to save one (1, d) x (d, m) product), each ring tensor is made by one copy,
    nothing is masked once the ring is full and every sink is behind the window, the products are plain
    batched ones, and the linear state's outer product one broadcast ``addcmul`` (a matmul of a column by a
    row costs several times as much at these sizes)."""
    dtype = working_dtype(v_t.dtype)
    if tensors is None:
        tensors = _empty_state(k_t, v_t, 2 * weights.maps.shape[-1], window, sinks, q_window is not None,
                               cache_size)
    feature_ring = tensors.get("feature_k")  # the ring's keys as the features take them, when not the window's
    slot, leaving = length % window, length - window
    kv, q_t, old_k, k_features = tensors["kv"], q_t.to(dtype), None, k_t
    if leaving >= sinks:  # the slot holds position length - window, which leaves the window now
        old_k = (tensors["k"] if feature_ring is None else feature_ring).narrow(2, slot, 1).to(dtype)
        old_v = tensors["v"].narrow(2, slot, 1).to(dtype)
    phi_q, phi_old = _step_features(q_t, old_k, weights)
    cache = None
    if cache_size:  # copies, so that the previous state is never written
        kv = kv.clone() if weights.decay is None else kv * weights.decay
        cache = {name: tensors[name].clone() for name in CACHE_TENSORS}
        if phi_old is not None:
            admit_leaving_(kv, cache, tensors["k"].narrow(2, slot, 1), tensors["v"].narrow(2, slot, 1), phi_old,
                           leaving, length, window, weights.decay)
    elif phi_old is not None:  # kv + phi_k(k) [v, 1]^T
        if weights.decay is None:
            kv = torch.addcmul(kv, phi_old.transpose(-1, -2), F.pad(old_v, (0, 1), value=1.0))
        else:  # lambda kv + ...: the product is a new tensor, so the outer product is added in place
            kv = (kv * weights.decay).addcmul_(phi_old.transpose(-1, -2), F.pad(old_v, (0, 1), value=1.0))
    elif weights.decay is not None:  # every step ages the keys beyond the window (zeros before the first)
        kv = kv * weights.decay
    if q_window is not None:  # the window's own query and key from here on
        q_t, k_t = q_window.to(dtype), k_window
    new, keys, values = _next_ring(tensors, k_t, v_t, slot, length, sinks)
    if feature_ring is not None:
        new["feature_k"] = feature_ring.clone()
        new["feature_k"][:, :, slot] = k_features[:, :, 0]
    logits = _bmm(q_t, keys.to(dtype).transpose(-1, -2)).mul_(_logit_scale(scale, k_t.shape[3]))
    if length < window - 1 + sinks:  # an empty slot, or a sink still inside the window
        logits.masked_fill_(_step_unseen(new["positions"], length, window, sinks), -math.inf)
    top = logits.amax(-1, keepdim=True)  # finite: the new key is in the window
    weighted = torch.exp(logits - top) * weights.window_weight  # f_h exp(s - m); amax keeps logits for autograd
    linear = _bmm(phi_q, kv)  # (batch, heads, 1, d_v + 1): numerator and normaliser
    head_dim_v = v_t.shape[3]
    numerator = _bmm(weighted, values.to(dtype)).add_(linear.narrow(-1, 0, head_dim_v))
    normaliser = weighted.sum(-1, keepdim=True).add_(linear.narrow(-1, head_dim_v, 1))
    if cache is not None:  # the cached keys' exact terms, against the window's maximum
        cached = _bmm(q_t, cache["cache_k"].to(dtype).transpose(-1, -2)).mul_(_logit_scale(scale, k_t.shape[3]))
        cached = torch.exp(cached.masked_fill_(cache["cache_positions"].unsqueeze(2) < 0, -math.inf) - top)
        cached = cached * weights.window_weight
        numerator.add_(_bmm(cached, cache["cache_v"].to(dtype)))
        normaliser.add_(cached.sum(-1, keepdim=True))
        new.update(cache)
    out = numerator / normaliser.masked_fill_(normaliser == 0, 1.0)  # as normalize_output's guard
    return out.to(v_t.dtype), {"kv": kv, **new}

"""LoLCATs attention (Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models"): exact
softmax over a sliding window and Hedgehog linear attention beyond it, in one normalisation.

For query i, the keys of its window are ``W_i = {j : i - w < j <= i}`` (non-causal: ``|i - j| < w``) and the
others it may see are linear, ``L_i = {j : j <= i - w}`` (non-causal: ``|i - j| >= w``). With the logits
``s_ij = scale * q_i . k_j``, their maximum over the window ``m_i = max_{j in W_i} s_ij`` and the Hedgehog
features ``phi_q``, ``phi_k`` (:func:`~attnzoo.functional.features.hedgehog_features`, one map each),

    y_i = (f_h sum_{W_i} exp(s_ij - m_i) v_j + sum_{L_i} phi_q(q_i) . phi_k(k_j) v_j)
        / (f_h sum_{W_i} exp(s_ij - m_i)     + sum_{L_i} phi_q(q_i) . phi_k(k_j)),

``f_h = sigmoid(window_factor_h)`` a learned weight per head. The window's terms are taken relative to their
maximum, as LoLCATs writes them, so ``m_i`` is part of the maths (it sets the balance between the two parts,
and carries a gradient), not a stabiliser that cancels.

Fast path, O(N w d + N m d) time and memory linear in N (m = 2 * feature_dim features):

* window: the blockwise core's sliding-window plan (:class:`~attnzoo.functional.blocksparse.LocalPattern`,
  blocks of ``min(w, 64)``): each query block sees a band of key blocks (at w = 64, its own and the one
  before, a (64, 128) tile), under the window's element mask; per row the maximum, ``exp(s - m)`` and its
  sums against ``[v, 1]``.
* linear: the keys ``j <= i - w`` are the keys of a causal linear attention whose keys and values are
  shifted w positions later, so the shared kernelized core (:mod:`attnzoo.functional.linear`, chunked with a
  carried state and its hand-written backward) sums them, numerator and normaliser together (values
  ``[v, 1]``, no normalisation). Non-causal: also the keys ``j >= i + w``, the same on the reversed sequence.
* the two sums are added, the window's weighted by ``f_h``, and divided once.

Decay (optional; ``decay_logit`` in the weights, not in LoLCATs): the linear terms are weighted by
``lambda_h^(i - w - j)``, ``lambda_h = sigmoid(decay_logit_h)`` a learned decay per head, so a key's linear weight
is 1 as it leaves the window and shrinks with every position after (non-causal: ``lambda_h^(|i - j| - w)``).
Without it the linear part's normaliser grows with the number of keys beyond the window while the window's
stays bounded, so past the lengths a conversion trained on the linear part outweighs the window more and more;
with it the linear part sums about ``1 / (1 - lambda_h)`` keys at any length. In the fast path it is the
kernelized core's constant decay over the shifted keys; in decoding ``S <- lambda S + phi_k(k) [v, 1]^T``.

Window inputs apart (optional; ``q_window``, ``k_window``): the window's logits from other queries and keys
than the features' (the same positions; a rotary layer's rotated ones, the features taking them unrotated, as
Liger does). Rotated queries and keys make each feature map a function of the absolute position as well, and a
conversion trained on N positions meets rotation angles past N it never saw; unrotated, the linear part depends
on positions only through its window shift and decay. Decoding then also keeps the ring's keys as the features
take them (``feature_k``): the leaving key's features are formed from it.

Attention sinks (``sinks`` > 0; Xiao et al. 2023, StreamingLLM): the first ``sinks`` positions are exact keys
for every query, scored in the window's softmax terms against the same maximum ``m_i`` (taken over the window
and the sinks), and left out of the linear part. Pretrained models put much of each row's weight on their
first tokens, which a feature map approximates badly. In the fast path the sink keys are appended to every
query block's window keys (beyond the window only: inside it they are window keys already).

Decoding (:func:`lolcats_step_unchecked`), constant size: a ring of the last w keys and values, the sinks'
keys and values, and the linear state ``sum phi_k(k_j) [v_j, 1]^T`` of the other keys that have left the
window.

Padded keys are zeroed before their features are formed and their features zeroed after (a zero key's
features are not zero), so NaN or inf there reaches neither part. A row that sees no key outputs zeros.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from ._autocast import outside_autocast, without_autocast
from .blocksparse import (
    BlockPlan,
    blocksparse_plan,
    window_cache_layout,
    window_cache_prefill,
    window_pattern,
    window_ring,
)
from .blocksparse.core import _gather_keys, _gather_queries, _to_positions
from .features import hedgehog_decoding_weights, hedgehog_features_decoding, hedgehog_features_unchecked
from .gated import constant_log_decay
from .linear import kernel_attention_unchecked, normalize_output
from .linear.inputs import _with_ones
from .masks import zero_padded


class LolcatsWeights(NamedTuple):
    """The learned parameters of LoLCATs attention, per head: the query and key maps of Hedgehog's features
    (weights (heads, head_dim, feature_dim), biases (heads, feature_dim) or None) and the window factor
    (heads,), whose sigmoid weighs the window's terms against the linear ones."""

    query_weight: Tensor
    query_bias: Optional[Tensor]
    key_weight: Tensor
    key_bias: Optional[Tensor]
    window_factor: Tensor
    decay_logit: Optional[Tensor] = None


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


def window_plan(window: int, length: int, causal: bool, device: torch.device) -> BlockPlan:
    """The window's block plan for this length and causality (always blockwise: the rows' maxima are needed)."""
    return blocksparse_plan(window_pattern(window), length, causal, device, dense_when_cheaper=False)


def _logit_scale(scale: Optional[float], head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _features(q: Tensor, k0: Tensor, weights: LolcatsWeights, key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """phi_q, and phi_k of the zeroed keys with the padded keys' features zeroed too."""
    phi_q = hedgehog_features_unchecked(q, weights.query_weight, weights.query_bias)
    phi_k = hedgehog_features_unchecked(k0, weights.key_weight, weights.key_bias)
    return phi_q, zero_padded(phi_k, key_padding_mask)


def _window_weight(weights: LolcatsWeights, dtype: torch.dtype) -> Tensor:
    """f_h = sigmoid(window_factor_h), shaped (1, heads, 1, 1)."""
    return torch.sigmoid(weights.window_factor.to(dtype)).view(1, -1, 1, 1)


def _log_decay(weights: LolcatsWeights, dtype: torch.dtype) -> Optional[Tensor]:
    """log lambda_h = logsigmoid(decay_logit_h), (heads,), or None without a decay."""
    return None if weights.decay_logit is None else F.logsigmoid(weights.decay_logit.to(dtype))


def _sink_allowed(plan: BlockPlan, sinks: int, window: int, causal: bool) -> Tensor:
    """Which sinks each query slot reads as exact keys beyond its window, (n_query_blocks, 1, block_size,
    sinks): sink ``j`` for query ``i`` when ``j <= i - window`` (non-causal: ``|i - j| >= window``); a sink
    inside the window is already one of the window's keys."""
    queries = plan.query_positions.unsqueeze(-1)  # (nqb, bs, 1); -1 marks a padding slot
    keys = torch.arange(sinks, device=queries.device)
    beyond = keys <= queries - window if causal else (queries - keys).abs() >= window
    return (beyond & (queries >= 0) & (keys < plan.length)).unsqueeze(1)


def _window_allowed(plan: BlockPlan, batch: int, key_padding_mask: Optional[Tensor],
                    sink_allowed: Optional[Tensor] = None) -> Tensor:
    """The blocks' element mask, (batch * n_query_blocks or n_query_blocks, 1, block_size, S [+ sinks]), key
    padding included (as the blockwise core's gather makes it), the sink columns of :func:`_sink_allowed`
    appended."""
    allowed = plan.allowed if sink_allowed is None else torch.cat([plan.allowed, sink_allowed], dim=-1)
    if key_padding_mask is None:
        return allowed.repeat(batch, 1, 1, 1) if batch > 1 else allowed
    n_query_blocks, bs = plan.query_positions.shape
    keep = ~F.pad(key_padding_mask, (0, 1), value=True)[:, plan.index]  # (batch, nqb, S); index seq: none
    if sink_allowed is not None:
        sinks = sink_allowed.shape[-1]
        keep = torch.cat([keep, ~key_padding_mask[:, None, :sinks].expand(-1, n_query_blocks, -1)], dim=-1)
    allowed = allowed.unsqueeze(0) & keep.view(batch, n_query_blocks, 1, 1, -1)
    return allowed.reshape(batch * n_query_blocks, 1, bs, -1)


def _window_sums_traceable(q: Tensor, k0: Tensor, v1: Tensor, plan: BlockPlan, allowed: Tensor,
                            sink_k: Optional[Tensor], sink_v: Optional[Tensor]) -> Tensor:
    """:class:`_WindowSums` in plain differentiable operations, for ``torch.compile`` and ``torch.jit.trace``
    (which take no block plan as an argument of a hand-written Function)."""
    batch, heads, length, _ = q.shape
    q_blocks = _gather_queries(q, plan)
    k_blocks = _gather_keys(k0, plan.layout, plan.index, sink_k)
    v_blocks = _gather_keys(v1, plan.layout, plan.index, sink_v)
    logits = (q_blocks @ k_blocks.transpose(-1, -2)).masked_fill(~allowed, -math.inf)
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return _to_positions(torch.exp(logits - top) @ v_blocks, plan, batch, heads, length)


def _band_to_positions(blocks: Tensor, plan: BlockPlan, batch: int, length: int) -> Tensor:
    """The gradient of :func:`~attnzoo.functional.blocksparse.core._gather_keys` on a band layout: key blocks
    (batch * n_query_blocks, heads, S, c) summed back to their positions, (batch, heads, length, c)."""
    n_query_blocks, bs = plan.query_positions.shape
    heads, width, channels = blocks.shape[1:]
    per_row, before = width // bs, -plan.layout.band * bs
    blocks = blocks.view(batch, n_query_blocks, heads, per_row, bs, channels)
    rows = blocks.new_zeros(batch, (n_query_blocks + per_row - 1) * bs, heads, channels)
    for offset in range(per_row):  # the key blocks at one offset from their query block: one strided add
        span = rows[:, offset * bs : (offset + n_query_blocks) * bs].view(batch, n_query_blocks, bs, heads, channels)
        span.add_(blocks[:, :, :, offset].transpose(2, 3))
    return rows[:, before : before + length].transpose(1, 2)


class _WindowSums(torch.autograd.Function):
    """``sum_{W_i} exp(s_ij - m_i) [v_j, 1]`` by position over the blocks of a sliding-window plan (and the
    sinks beyond the window, appended to every query block's keys), with a hand-written backward.

    Per query block (its band of key blocks gathered, S slots): ``S = Q K^T`` under the element mask, the row
    maxima ``m`` (and where they are), ``P = exp(S - m)``, ``O = P V``. Backward, with ``dO``: ``dP = dO V^T``,
    ``dS = P * dP`` plus, at each row's maximum, ``-sum dS`` (the gradient through ``m``: the window's terms
    are relative to it), ``dQ = dS K``, ``dK = dS^T Q``, ``dV = P^T dO``, the key blocks' gradients summed back
    to their positions by one strided add per band offset. Autograd would keep the logits twice and sum the
    overlapping key blocks back through ``unfold``'s backward, the slowest step of the window on CPU.

    Shapes: q (B, H, N, d), already scaled; k0 (B, H, N, d) and v1 (B, H, N, c) zero-padded, v1 with its ones
    column; ``allowed`` from :func:`_window_allowed`; ``sink_k`` (B, H, s, d), ``sink_v`` (B, H, s, c) or
    None: the sinks' keys and values, their gradients summed over the query blocks. Returns (B, H, N, c).
    """

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k0: Tensor, v1: Tensor, plan: BlockPlan, allowed: Tensor,  # type: ignore[override]
                sink_k: Optional[Tensor], sink_v: Optional[Tensor]) -> Tensor:
        batch, heads, length, _ = q.shape
        q_blocks = _gather_queries(q, plan)
        k_blocks = _gather_keys(k0, plan.layout, plan.index, sink_k)
        v_blocks = _gather_keys(v1, plan.layout, plan.index, sink_v)
        logits = torch.matmul(q_blocks, k_blocks.transpose(-1, -2)).masked_fill_(~allowed, -math.inf)
        top, where = logits.max(-1, keepdim=True)
        # A row that sees no window key: its logits stay -inf, its weights 0.
        weights = logits.sub_(torch.where(torch.isfinite(top), top, torch.zeros_like(top))).exp_()
        ctx.save_for_backward(q_blocks, k_blocks, v_blocks, weights, where)
        ctx.plan, ctx.length, ctx.sinks = plan, length, 0 if sink_k is None else sink_k.shape[2]
        return _to_positions(weights @ v_blocks, plan, batch, heads, length)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q_blocks, k_blocks, v_blocks, weights, where = ctx.saved_tensors
        plan, length, sinks = ctx.plan, ctx.length, ctx.sinks
        batch = grad.shape[0]
        grad_blocks = _gather_queries(grad, plan)
        grad_logits = torch.matmul(grad_blocks, v_blocks.transpose(-1, -2)).mul_(weights)
        grad_logits.scatter_add_(-1, where, grad_logits.sum(-1, keepdim=True).neg_())
        grad_q = _to_positions(grad_logits @ k_blocks, plan, batch, grad.shape[1], length)
        grad_k_blocks = grad_logits.transpose(-1, -2) @ q_blocks
        grad_v_blocks = weights.transpose(-1, -2) @ grad_blocks
        band = grad_k_blocks.shape[2] - sinks
        grad_k = _band_to_positions(grad_k_blocks[:, :, :band], plan, batch, length)
        grad_v = _band_to_positions(grad_v_blocks[:, :, :band], plan, batch, length)
        grad_sink_k = grad_sink_v = None
        if sinks:  # every query block read the same sinks: their gradients are summed over the blocks
            grad_sink_k = grad_k_blocks[:, :, band:].unflatten(0, (batch, -1)).sum(1)
            grad_sink_v = grad_v_blocks[:, :, band:].unflatten(0, (batch, -1)).sum(1)
        return grad_q, grad_k, grad_v, None, None, grad_sink_k, grad_sink_v


def _window_sums(q: Tensor, k0: Tensor, v1: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor],
                 scale: float, window: int, causal: bool, sinks: int) -> Tensor:
    """``sum_{E_i} exp(s_ij - m_i) [v_j, 1]`` by position, (batch, heads, seq, d_v + 1), ``E_i`` the window's
    keys (the blocks of ``plan``) and the first ``sinks`` positions beyond it, ``m_i`` their largest logit
    (keys and values zero-padded; v1 with its ones column)."""
    sinks = min(sinks, q.shape[2])
    sink_allowed = _sink_allowed(plan, sinks, window, causal) if sinks else None
    sink_k, sink_v = (k0[:, :, :sinks], v1[:, :, :sinks]) if sinks else (None, None)
    allowed = _window_allowed(plan, q.shape[0], key_padding_mask, sink_allowed)
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # the plan is not a traceable argument
        return _window_sums_traceable(q * scale, k0, v1, plan, allowed, sink_k, sink_v)
    return _WindowSums.apply(q * scale, k0, v1, plan, allowed, sink_k, sink_v)


def _shifted(x: Tensor, window: int) -> Tensor:
    """x (batch, heads, seq, c) moved ``window`` positions later, zeros in front: position t holds x[t - w]."""
    return F.pad(x[:, :, : x.shape[2] - window], (0, 0, window, 0))


def _linear_sums(phi_q: Tensor, phi_k: Tensor, v1: Tensor, window: int, causal: bool, chunk_size: int,
                 log_decay: Optional[Tensor] = None) -> Tensor:
    """``sum_{L_i} phi_q(q_i) . phi_k(k_j) [v_j, 1]`` (times ``lambda_h^(|i - j| - w)`` with ``log_decay``,
    (heads,)), (batch, heads, seq, d_v + 1), on the kernelized core: causal linear attention over the keys
    shifted ``window`` positions later (and, non-causal, the same on the reversed sequence), unnormalised; the
    decay is the core's constant one, the same both ways."""
    batch, _, length, _ = phi_q.shape
    if window >= length:  # every key is in the window
        return phi_q.new_zeros(*v1.shape)
    decays = None if log_decay is None else constant_log_decay(log_decay, batch, length)

    def earlier(queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        return kernel_attention_unchecked(queries, _shifted(keys, window), _shifted(values, window), True, None,
                                          decays, "none", chunk_size, 0.0)

    sums = earlier(phi_q, phi_k, v1)
    if not causal:
        sums = sums + earlier(phi_q.flip(2), phi_k.flip(2), v1.flip(2)).flip(2)
    return sums


@without_autocast
def lolcats_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: LolcatsWeights,
    window: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scale: Optional[float],
    chunk_size: int,
    plan: Optional[BlockPlan] = None,
    sinks: int = 0,
    q_window: Optional[Tensor] = None,
    k_window: Optional[Tensor] = None,
) -> Tensor:
    """LoLCATs attention on checked self-attention inputs (q, k: (batch, heads, seq, head_dim), v: (batch,
    heads, seq, head_dim_v), as many heads as ``weights`` has; ``key_padding_mask`` (batch, seq), True marks
    padding). ``scale``: the logit scale, ``1/sqrt(head_dim)`` when None. ``plan``: :func:`window_plan` for
    this length and causality, to reuse. ``sinks``: the first ``sinks`` positions are exact keys for every
    query (see the module doc). ``q_window``, ``k_window``: the window's queries and keys, shaped as q and k
    (None: q and k; see the module doc). Returns (batch, heads, seq, head_dim_v) in v's dtype."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    q, k0, v0 = q.to(dtype), zero_padded(k, key_padding_mask).to(dtype), zero_padded(v, key_padding_mask).to(dtype)
    if plan is None:
        plan = window_plan(window, q.shape[2], causal, q.device)
    phi_q, phi_k = _features(q, k0, weights, key_padding_mask)
    if sinks:  # the sinks are exact keys: not in the linear part
        phi_k = F.pad(phi_k[:, :, sinks:], (0, 0, min(sinks, phi_k.shape[2]), 0))
    v1 = _with_ones(v0)
    if q_window is not None:
        q, k0 = q_window.to(dtype), zero_padded(k_window, key_padding_mask).to(dtype)
    sums = _window_sums(q, k0, v1, plan, key_padding_mask, _logit_scale(scale, q.shape[3]), window, causal, sinks)
    linear = _linear_sums(phi_q, phi_k, v1, window, causal, chunk_size, _log_decay(weights, dtype))
    sums = _window_weight(weights, dtype) * sums + linear
    return normalize_output(sums, "sum").to(out_dtype)


def lolcats_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: LolcatsWeights,
    window: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    sinks: int = 0,
    q_window: Optional[Tensor] = None,
    k_window: Optional[Tensor] = None,
) -> Tensor:
    """The same in float64 by quadratic maths: the (seq, seq) exact and linear masks, written from the
    definition (the sinks moved from the linear mask to the exact one), and the two weight matrices added and
    normalised. Returns float64."""
    q_window, k_window = (q, k) if q_window is None else (q_window, k_window)
    q_window, k_window = q_window.double(), zero_padded(k_window, key_padding_mask).double()
    q, k, v = q.double(), zero_padded(k, key_padding_mask).double(), zero_padded(v, key_padding_mask).double()
    weights = LolcatsWeights(*(None if w is None else w.double() for w in weights))
    length = q.shape[2]
    i = torch.arange(length, device=q.device)
    distance = i[:, None] - i[None, :]  # i - j
    if causal:
        in_window, linear = (distance >= 0) & (distance < window), distance >= window
    else:
        in_window, linear = distance.abs() < window, distance.abs() >= window
    is_sink = (i < sinks)[None, :]
    in_window, linear = in_window | (linear & is_sink), linear & ~is_sink
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        in_window, linear = in_window & keep, linear & keep
    logits = (q_window @ k_window.transpose(-1, -2)) * _logit_scale(scale, q.shape[3])
    logits = logits.masked_fill(~in_window, -math.inf)
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    phi_q = hedgehog_features_unchecked(q, weights.query_weight, weights.query_bias)
    phi_k = hedgehog_features_unchecked(k, weights.key_weight, weights.key_bias)
    kernel = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~linear, 0.0)
    if weights.decay_logit is not None:  # lambda_h^(|i - j| - w) beyond the window
        beyond = (distance.abs() - window).clamp(min=0).double()
        kernel = kernel * torch.exp(_log_decay(weights, torch.float64).view(-1, 1, 1) * beyond)
    mixed = _window_weight(weights, torch.float64) * torch.exp(logits - top) + kernel
    total = mixed.sum(-1, keepdim=True)
    return (mixed @ v) / torch.where(total > 0, total, torch.ones_like(total))


# -- decoding ------------------------------------------------------------------------------------------------
def lolcats_state_layout(
    heads: int, head_dim: int, feature_dim: int, window: int, dtype: torch.dtype, value_width: Optional[int] = None,
    sinks: int = 0, window_inputs: bool = False,
) -> dict:
    """The decoding state's tensors (name -> (shape after the batch dim, dtype)): the linear state ``kv``
    (heads, 2 * feature_dim, value_width + 1) in the working dtype, ``sum phi_k(k_j) [v_j, 1]^T`` over the keys
    that have left the window (sinks aside), and the window's ring ``k`` (heads, window, head_dim), ``v``
    (heads, window, value_width) and ``positions`` (window,), position t in slot ``t % window`` (-1 while
    empty). With sinks, also ``sink_k`` (heads, sinks, head_dim) and ``sink_v`` (heads, sinks, value_width):
    the first positions, kept for good. With ``window_inputs`` (the window's queries and keys given apart), the
    ring also holds the keys as the features take them, ``feature_k`` (heads, window, head_dim)."""
    value_width = head_dim if value_width is None else value_width
    layout = window_cache_layout(heads, window, sinks, head_dim, dtype, value_width)
    if not sinks:
        del layout["sink_k"], layout["sink_v"]
    if window_inputs:
        layout["feature_k"] = layout["k"]
    return {"kv": ((heads, 2 * feature_dim, value_width + 1), working_dtype(dtype)), **layout}


@without_autocast
def lolcats_prefill_unchecked(
    q: Tensor, k: Tensor, v: Tensor, weights: LolcatsWeights, window: int, scale: Optional[float], chunk_size: int,
    plan: Optional[BlockPlan] = None, sinks: int = 0, q_window: Optional[Tensor] = None,
    k_window: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Causal LoLCATs attention over a checked prompt and the decoding state after it
    (:func:`lolcats_state_layout`, with ``window_inputs`` when ``q_window`` is given)."""
    out = lolcats_attention_unchecked(q, k, v, weights, window, True, None, scale, chunk_size, plan, sinks,
                                      q_window, k_window)
    dtype = working_dtype(v.dtype)
    first, gone = min(sinks, k.shape[2]), max(k.shape[2] - window, 0)  # linear: the keys [sinks, gone)
    phi_k = hedgehog_features_unchecked(k[:, :, first:gone].to(dtype), weights.key_weight, weights.key_bias)
    log_decay = _log_decay(weights, dtype)
    if log_decay is not None and gone > first:  # key j has decayed gone - 1 - j times
        age = torch.arange(gone - 1 - first, -1, -1, device=k.device, dtype=dtype)
        phi_k = phi_k * torch.exp(log_decay.view(-1, 1, 1) * age.view(-1, 1))
    kv = phi_k.transpose(-1, -2) @ _with_ones(v[:, :, first:gone].to(dtype))
    state = window_cache_prefill(k if k_window is None else k_window, v, window, sinks)
    if not sinks:
        del state["sink_k"], state["sink_v"]
    if k_window is not None:
        state["feature_k"] = window_ring(k, window)
    return out, {"kv": kv, **state}


def _empty_state(k_t: Tensor, v_t: Tensor, features: int, window: int, sinks: int, window_inputs: bool,
                 ) -> Dict[str, Tensor]:
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
    k_window: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One decoding position (q_t, k_t: (batch, heads, 1, head_dim), v_t: (batch, heads, 1, head_dim_v)) after
    ``length`` positions whose state is ``tensors`` (None at the start), with the parameters of
    :func:`lolcats_step_weights`: O((w + sinks) d + m d). The key leaving the window (position ``length -
    window``) joins the linear state unless it is a sink, the new one takes its slot. ``q_window``,
    ``k_window``: the window's query and key, apart from the features' (the state then has ``feature_k``). The
    previous state's tensors are never written (a state may be stepped from twice). Returns the output and the
    new state.

    A step's rows are few, so its time is its op count: the leaving key's features are the only key features
    it forms, in the query's product (a ring of every window key's features in the state would be copied
    whole each step to save one (1, d) x (d, m) product), each ring tensor is made by one copy,
    nothing is masked once the ring is full and every sink is behind the window, the products are plain
    batched ones, and the linear state's outer product one broadcast ``addcmul`` (a matmul of a column by a
    row costs several times as much at these sizes)."""
    dtype = working_dtype(v_t.dtype)
    if tensors is None:
        tensors = _empty_state(k_t, v_t, 2 * weights.maps.shape[-1], window, sinks, q_window is not None)
    feature_ring = tensors.get("feature_k")  # the ring's keys as the features take them, when not the window's
    slot, leaving = length % window, length - window
    kv, q_t, old_k, k_features = tensors["kv"], q_t.to(dtype), None, k_t
    if leaving >= sinks:  # the slot holds position length - window, which leaves the window now
        old_k = (tensors["k"] if feature_ring is None else feature_ring).narrow(2, slot, 1).to(dtype)
        old_v = tensors["v"].narrow(2, slot, 1).to(dtype)
    phi_q, phi_old = _step_features(q_t, old_k, weights)
    if phi_old is not None:  # kv + phi_k(k) [v, 1]^T
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
    out = numerator / normaliser.masked_fill_(normaliser == 0, 1.0)  # as normalize_output's guard
    return out.to(v_t.dtype), {"kv": kv, **new}

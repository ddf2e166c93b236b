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

Decoding (:mod:`attnzoo.functional.lolcats_decoding`), constant size: a ring of the last w keys and values, the sinks'
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
from .blocksparse import BlockPlan, blocksparse_plan, window_pattern
from .blocksparse.core import _gather_keys, _gather_queries, _to_positions, masked_block_logits
from .features import hedgehog_features_unchecked
from .gated import constant_log_decay
from .linear import kernel_attention_unchecked, normalize_output
from .linear.inputs import _with_ones
from .masks import zero_padded
from .sparse_cache import block_starts, sparse_cache_members_reference, sparse_cache_schedule, sparse_cache_sums


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
    _, logits, top, v_blocks = masked_block_logits(q, k0, v1, plan, allowed, sink_k, sink_v)
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


def _window_keys(k0: Tensor, v1: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor], window: int,
                 causal: bool, sinks: int) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The window's element mask with the sinks' columns (:func:`_window_allowed`), and the sinks' keys and
    values (None without sinks)."""
    sinks = min(sinks, k0.shape[2])
    sink_allowed = _sink_allowed(plan, sinks, window, causal) if sinks else None
    sink_k, sink_v = (k0[:, :, :sinks], v1[:, :, :sinks]) if sinks else (None, None)
    return _window_allowed(plan, k0.shape[0], key_padding_mask, sink_allowed), sink_k, sink_v


def _window_sums(q: Tensor, k0: Tensor, v1: Tensor, plan: BlockPlan, key_padding_mask: Optional[Tensor],
                 scale: float, window: int, causal: bool, sinks: int) -> Tensor:
    """``sum_{E_i} exp(s_ij - m_i) [v_j, 1]`` by position, (batch, heads, seq, d_v + 1), ``E_i`` the window's
    keys (the blocks of ``plan``) and the first ``sinks`` positions beyond it, ``m_i`` their largest logit
    (keys and values zero-padded; v1 with its ones column)."""
    allowed, sink_k, sink_v = _window_keys(k0, v1, plan, key_padding_mask, window, causal, sinks)
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
    cache_size: int = 0,
) -> Tensor:
    """LoLCATs attention on checked self-attention inputs (q, k: (batch, heads, seq, head_dim), v: (batch,
    heads, seq, head_dim_v), as many heads as ``weights`` has; ``key_padding_mask`` (batch, seq), True marks
    padding). ``scale``: the logit scale, ``1/sqrt(head_dim)`` when None. ``plan``: :func:`window_plan` for
    this length and causality, to reuse. ``sinks``: the first ``sinks`` positions are exact keys for every
    query (see the module doc). ``q_window``, ``k_window``: the window's queries and keys, shaped as q and k
    (None: q and k; see the module doc). ``cache_size`` > 0 (causal only): LoLA's sparse cache of that many
    keys per head (:mod:`attnzoo.functional.sparse_cache`). Returns (batch, heads, seq, head_dim_v) in v's
    dtype."""
    return _attention(q, k, v, weights, window, causal, key_padding_mask, scale, chunk_size, plan, sinks, q_window,
                      k_window, cache_size)[0]


def _attention(q: Tensor, k: Tensor, v: Tensor, weights: LolcatsWeights, window: int, causal: bool,
               key_padding_mask: Optional[Tensor], scale: Optional[float], chunk_size: int, plan: Optional[BlockPlan],
               sinks: int, q_window: Optional[Tensor], k_window: Optional[Tensor], cache_size: int,
               ) -> Tuple[Tensor, Optional[Tuple[Tensor, Tensor, Dict[str, Tensor], Tensor]]]:
    """:func:`lolcats_attention_unchecked`, and with a cache, what :func:`sparse_cache_schedule` decided."""
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
    log_decay = _log_decay(weights, dtype)
    linear = _linear_sums(phi_q, phi_k, v1, window, causal, chunk_size, log_decay)
    logit_scale, schedule = _logit_scale(scale, q.shape[3]), None
    if cache_size:
        decay = None if log_decay is None else log_decay.exp().view(1, -1, 1, 1)
        schedule = sparse_cache_schedule(k0.detach(), v0.detach(), phi_k.detach(), window, sinks, cache_size, decay,
                                         key_padding_mask, block_starts(plan))
        allowed, sink_k, sink_v = _window_keys(k0, v1, plan, key_padding_mask, window, True, sinks)
        sums, cached = sparse_cache_sums(q * logit_scale, k0, v1, phi_q, phi_k, schedule[0], schedule[3], plan,
                                         allowed, sink_k, sink_v, window, sinks, log_decay, key_padding_mask)
        linear = linear - cached
    else:
        sums = _window_sums(q, k0, v1, plan, key_padding_mask, logit_scale, window, causal, sinks)
    sums = _window_weight(weights, dtype) * sums + linear
    return normalize_output(sums, "sum").to(out_dtype), schedule


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
    cache_size: int = 0,
) -> Tensor:
    """The same in float64 by quadratic maths: the (seq, seq) exact and linear masks, written from the
    definition (the sinks moved from the linear mask to the exact one; the cached keys of
    :func:`~attnzoo.functional.sparse_cache.sparse_cache_members_reference` too, after the window's maximum),
    and the two weight matrices added and normalised. Returns float64."""
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
    top = logits.masked_fill(~in_window, -math.inf).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    phi_q = hedgehog_features_unchecked(q, weights.query_weight, weights.query_bias)
    phi_k = hedgehog_features_unchecked(k, weights.key_weight, weights.key_bias)
    if cache_size:
        cached = sparse_cache_members_reference(k_window, v, zero_padded(phi_k, key_padding_mask), window, sinks,
                                                cache_size, _log_decay(weights, torch.float64), key_padding_mask)
        in_window, linear = in_window | cached, linear & ~cached
    logits = logits.masked_fill(~in_window, -math.inf)
    kernel = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~linear, 0.0)
    if weights.decay_logit is not None:  # lambda_h^(|i - j| - w) beyond the window
        beyond = (distance.abs() - window).clamp(min=0).double()
        kernel = kernel * torch.exp(_log_decay(weights, torch.float64).view(-1, 1, 1) * beyond)
    mixed = _window_weight(weights, torch.float64) * torch.exp(logits - top) + kernel
    total = mixed.sum(-1, keepdim=True)
    return (mixed @ v) / torch.where(total > 0, total, torch.ones_like(total))

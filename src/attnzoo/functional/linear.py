"""Kernelized (linear) attention: ``phi(q) (phi(k)^T v)`` with its normaliser, optionally with a decay.

Everything works on features ``phi_q`` (batch, heads, seq_q, m) and ``phi_k`` (batch, heads, seq_kv, m) and
values ``v`` (batch, heads, seq_kv, d_v). With a per-position log decay ``log_decay`` (batch, heads, seq) the
causal output is

    o_i = sum_{j <= i} exp(L_i - L_j) (phi_q_i . phi_k_j) v_j,   L_t = sum_{s <= t} log_decay_s,

i.e. the recurrence ``S_t = exp(log_decay_t) S_{t-1} + phi_k_t v_t^T``, ``o_t = phi_q_t S_t``; without decay
it is plain causal linear attention. The normaliser is the same sum with ``v_j`` replaced by 1; the values
get an extra column of ones so one matmul yields numerator and normaliser together.

Paths:

* non-causal: ``phi_q @ (phi_k^T @ [v, 1])``, O(N m d) time, O(N (m + d) + m d) memory.
* causal, chunked: within chunks of ``chunk_size`` positions the exact quadratic form (batched over all chunks
  at once), between chunks a carried (m, d) state. Chunk states are built by one cumulative sum (or, with a
  decay, a short loop over chunks), so memory is O(N (m + d) + (N / chunk_size) m d), never an (N, m, d) prefix
  tensor. The chunk states take no more memory than the features once ``chunk_size >= d``.
* recurrent: :func:`kernel_attention_step`, O(m d) per token whatever the context length.

Sums run in float32 for float16/bfloat16 inputs (half-precision sums over long sequences overflow), in float64
for float64 inputs; the output is cast back to the dtype of ``v``. Padded keys are removed from the features,
so they leave both the numerator and the normaliser; with a decay, a padded position is also an identity step
(log decay 0), as if it were absent from the sequence.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_floating, check_key_padding_mask, check_positive_int, check_qkv
from ..feature_maps import FeatureMap, resolve_feature_map
from .masks import allowed_mask

DEFAULT_CHUNK_SIZE = 64
"""Chunk length of the causal path; 64 balances the quadratic intra-chunk work (N * chunk * (m + d)) against
the per-chunk states (N / chunk * m * d) for head dims around 64 on CPU."""

SIGNED_DENOMINATOR_EPS = 1e-6
"""Smallest normaliser magnitude allowed for feature maps with negative features (trigonometric ones), whose
normaliser can cross zero; positive feature maps get no such guard."""

NORMALIZERS = ("sum", "max_abs", "none")

KernelState = Dict[str, Tensor]
"""Recurrent state: ``{"kv": (batch, heads, m, d_v + 1), "log_scale": (batch, heads, 1, 1)}``. The true state
``exp(log_scale) * kv`` holds ``sum_j decay * phi_k_j [v_j, 1]^T``; the separate scale lets feature maps whose
keys are stabilised by a shift (FAVOR+) merge new keys exactly."""


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_features(phi_q: Tensor, phi_k: Tensor, v: Tensor) -> None:
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, dim), got {tuple(x.shape)}")
    if phi_q.shape[:2] != phi_k.shape[:2] or phi_k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"phi_q, phi_k and v must share (batch, heads), got {tuple(phi_q.shape[:2])}, {tuple(phi_k.shape[:2])}, "
            f"{tuple(v.shape[:2])}"
        )
    if phi_q.shape[3] != phi_k.shape[3]:
        raise ValueError(
            f"phi_q and phi_k must have the same number of features, got {phi_q.shape[3]} and {phi_k.shape[3]}"
        )
    if phi_k.shape[2] != v.shape[2]:
        raise ValueError(f"phi_k and v must share the sequence length, got {phi_k.shape[2]} and {v.shape[2]}")
    if phi_q.shape[2] == 0 or phi_k.shape[2] == 0:
        raise ValueError("sequence lengths must be at least 1")


def _check_options(normalizer: str, chunk_size: int, denominator_eps: float) -> None:
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r}")
    check_positive_int("chunk_size", chunk_size)
    if not denominator_eps >= 0.0:
        raise ValueError(f"denominator_eps must be >= 0, got {denominator_eps!r}")


def _check_log_decay(log_decay: Optional[Tensor], batch: int, heads: int, seq: int, name: str = "log_decay") -> None:
    if log_decay is None:
        return
    check_floating(name, log_decay)
    if log_decay.shape != (batch, heads, seq):
        raise ValueError(
            f"{name} must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}), got {tuple(log_decay.shape)}"
        )


def normalize_output(num_den: Tensor, normalizer: str, denominator_eps: float = 0.0) -> Tensor:
    """Split (..., d_v + 1) into numerator and normaliser and combine them.

    ``"sum"``: ``num / den`` (softmax-like; a row with a zero normaliser, e.g. whose keys are all padding,
    outputs zeros); with ``denominator_eps > 0`` the normaliser's magnitude is kept >= eps, sign preserved.
    ``"max_abs"``: ``num / max(|den|, 1)`` (RetNet), for features of either sign. ``"none"``: ``num``.
    """
    if normalizer == "sum":
        return _SumNormalise.apply(num_den, denominator_eps)
    num, den = num_den[..., :-1], num_den[..., -1:]
    if normalizer == "none":
        return num
    return num / den.abs().clamp_min(1.0)


def denominator_floor(dtype: torch.dtype) -> float:
    """sqrt of the smallest normal number (1e-19 in float32): the smallest divisor a backward pass divides by.

    A normaliser can be far smaller and still exact (its numerator is as small; FAVOR+ at logit standard
    deviations of 30 and more gets there), so the forward divides by it as it is; but the backward's
    ``grad / den``, multiplied on by features near 1, would overflow into inf and then inf * 0 = NaN."""
    return math.sqrt(torch.finfo(dtype).tiny)


def _at_least(den: Tensor, floor: float) -> Tensor:
    """``den`` with magnitudes below ``floor`` raised to it, sign kept."""
    return torch.where(den.abs() < floor, torch.copysign(torch.full_like(den, floor), den), den)


def _guarded_denominator(den: Tensor, denominator_eps: float) -> Tensor:
    if denominator_eps > 0.0:
        return _at_least(den, denominator_eps)
    return torch.where(den == 0, torch.ones_like(den), den)


class _SumNormalise(torch.autograd.Function):
    """``num / den`` from the packed (..., d + 1) tensor, with the guard of :func:`normalize_output`.

    Hand-written so that the backward writes the packed gradient once, instead of two zero-filled slice
    gradients, their sum, and the five passes of a broadcast division's backward. The backward divides by
    the normaliser raised to :func:`denominator_floor`: rows whose normaliser is below it (an estimate that
    sees almost nothing of its keys) get their gradient scaled down by ``den / floor`` instead of overflowing.
    """

    @staticmethod
    def forward(ctx, num_den: Tensor, denominator_eps: float) -> Tensor:  # type: ignore[override]
        den = num_den[..., -1:]
        safe = _guarded_denominator(den, denominator_eps)
        # Divide rather than multiply by a reciprocal: a tiny (even subnormal) normaliser comes with an
        # equally tiny numerator, and only the reciprocal alone would overflow.
        out = num_den[..., :-1] / safe
        ctx.save_for_backward(out, safe, safe == den)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        out, safe, live = ctx.saved_tensors
        safe = _at_least(safe, denominator_floor(safe.dtype))
        grad_num_den = grad.new_empty(*grad.shape[:-1], grad.shape[-1] + 1)
        torch.div(grad, safe, out=grad_num_den[..., :-1])
        # d(num / den) / d den = -out / den; a guarded (constant) denominator gets no gradient.
        grad_den = (grad * out).sum(-1, keepdim=True).div_(safe).neg_()
        grad_num_den[..., -1:] = grad_den * live
        return grad_num_den, None


def _prepare_keys(
    phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """Cast, append the ones column to v, and zero padded keys (features and values, so that neither an
    infinite feature nor an infinite padded value can turn into NaN)."""
    phi_k = phi_k.to(dtype)
    v1 = torch.cat([v.to(dtype), v.new_ones(*v.shape[:-1], 1, dtype=dtype)], dim=-1)
    if key_padding_mask is not None:
        padded = key_padding_mask[:, None, :, None]
        phi_k = phi_k.masked_fill(padded, 0.0)
        v1 = v1.masked_fill(padded, 0.0)
    return phi_k, v1


def _pad_seq(x: Tensor, pad: int, dim_from_end: int) -> Tensor:
    return F.pad(x, (0, 0) * (dim_from_end - 1) + (0, pad)) if pad else x


def _flat(x: Tensor) -> Tensor:
    """(..., r, c) -> (prod(...), r, c) view for baddbmm (leading dims of our chunked tensors are contiguous)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


class _CausalChunks(torch.autograd.Function):
    """Causal linear attention without decay on chunked tensors, with a hand-written backward.

    Forward, per chunk c (all chunks in one batched matmul):
        S_c = tril(Q_c K_c^T),  L_c = K_c^T V_c,  P_c = S0 + sum_{c' < c} L_c',  O_c = S_c V_c + Q_c P_c,
    and the final state S0 + sum_c L_c. The backward mirrors it: the gradient of P_c flows to every earlier
    chunk (a reversed exclusive sum), and every matmul accumulates into its output (baddbmm) instead of
    allocating a sum. This halves the elementwise passes of the autograd version, which dominate the time on
    CPU. Both prefix sums are exclusive sums proper, never ``inclusive - own term``: with features spanning
    many orders of magnitude, a chunk's own large term would wipe out the small prefix in rounding.

    Shapes: q, k (B, H, C, chunk, m); values (B, H, C, chunk, d + 1); initial (B, H, m, d + 1).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, values: Tensor, initial: Tensor
    ) -> Tuple[Tensor, Tensor]:
        scores = torch.matmul(q, k.transpose(-1, -2)).tril_()
        local = torch.matmul(k.transpose(-1, -2), values)
        previous = torch.empty_like(local)
        previous[:, :, 0] = initial
        if local.shape[2] > 1:
            torch.cumsum(local[:, :, :-1], dim=2, out=previous[:, :, 1:])
            previous[:, :, 1:] += initial.unsqueeze(2)
        final = previous[:, :, -1] + local[:, :, -1]
        out = torch.matmul(q, previous)
        _flat(out).baddbmm_(_flat(scores), _flat(values))
        ctx.save_for_backward(q, k, values, scores, previous)
        return out, final

    @staticmethod
    def backward(ctx, grad_out: Optional[Tensor], grad_final: Optional[Tensor]):  # type: ignore[override]
        q, k, values, scores, previous = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros(*q.shape[:-1], values.shape[-1], dtype=q.dtype, device=q.device)
        grad_out = grad_out.contiguous()
        grad_scores = torch.matmul(grad_out, values.transpose(-1, -2)).tril_()
        grad_q = torch.matmul(grad_out, previous.transpose(-1, -2))
        _flat(grad_q).baddbmm_(_flat(grad_scores), _flat(k))
        grad_previous = torch.matmul(q.transpose(-1, -2), grad_out)  # (B, H, C, m, d + 1)
        # Chunk c's own contribution reaches the outputs of every later chunk, and the final state.
        grad_local = torch.zeros_like(grad_previous)
        if grad_previous.shape[2] > 1:
            grad_local[:, :, :-1] = torch.cumsum(grad_previous[:, :, 1:].flip(2), dim=2).flip(2)
        grad_initial = grad_local[:, :, 0] + grad_previous[:, :, 0]
        if grad_final is not None:
            grad_local.add_(grad_final.unsqueeze(2))
            grad_initial = grad_initial + grad_final
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
        _flat(grad_k).baddbmm_(_flat(values), _flat(grad_local.transpose(-1, -2)))
        grad_values = torch.matmul(scores.transpose(-1, -2), grad_out)
        _flat(grad_values).baddbmm_(_flat(k), _flat(grad_local))
        return grad_q, grad_k, grad_values, grad_initial


def _chunked_causal(
    phi_q: Tensor,
    phi_k: Tensor,
    v1: Tensor,
    log_decay: Optional[Tensor],
    chunk_size: int,
    initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """Causal numerator/normaliser for equal lengths.

    Args:
        phi_q, phi_k: (B, H, N, m); v1: (B, H, N, d + 1); log_decay: (B, H, N) or None;
        initial_state: (B, H, m, d + 1) state before position 0, or None.

    Returns:
        ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state after position N - 1).
    """
    batch, heads, n, m = phi_q.shape
    d1 = v1.shape[-1]
    chunk = min(chunk_size, n)
    n_chunks = math.ceil(n / chunk)
    pad = n_chunks * chunk - n
    # Padded tail positions have zero keys and (with decay) log decay 0: they change no state.
    q = _pad_seq(phi_q, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    k = _pad_seq(phi_k, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    values = _pad_seq(v1, pad, 2).reshape(batch, heads, n_chunks, chunk, d1)

    if log_decay is None:
        if initial_state is None:
            initial_state = q.new_zeros(batch, heads, m, d1)
        out, final = _CausalChunks.apply(q, k, values, initial_state)
    else:
        scores = q @ k.transpose(-1, -2)  # (B, H, C, chunk, chunk)
        within = F.pad(log_decay, (0, pad)).view(batch, heads, n_chunks, chunk).cumsum(-1)
        # exp(L_i - L_j) only for j <= i: the masked differences are <= 0, so exp never overflows.
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).triu(1)
        differences = (within.unsqueeze(-1) - within.unsqueeze(-2)).masked_fill(upper, -math.inf)
        scores = scores * torch.exp(differences)
        last = within[..., -1:]  # total log decay of each chunk, (B, H, C, 1)
        local = (k * torch.exp(last - within).unsqueeze(-1)).transpose(-1, -2) @ values
        chunk_decay = torch.exp(last).unsqueeze(-1)  # (B, H, C, 1, 1)
        state = initial_state if initial_state is not None else local.new_zeros(batch, heads, m, d1)
        # A scan over chunks: N / chunk_size small steps on (m, d + 1) states, stable for any decay. unbind
        # (not indexing in the loop) keeps the backward pass linear: one gradient buffer, not one per chunk.
        previous_states = []
        for decay_c, local_c in zip(chunk_decay.unbind(2), local.unbind(2)):
            previous_states.append(state)
            state = decay_c * state + local_c
        previous = torch.stack(previous_states, dim=2)
        out = scores @ values + (q * torch.exp(within).unsqueeze(-1)) @ previous
        final = state
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n], final


def _unnormalised(
    phi_q: Tensor,
    phi_k: Tensor,
    v1: Tensor,
    causal: bool,
    log_decay: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """(B, H, N_q, d + 1) numerator/normaliser for any lengths; causal is bottom-right aligned."""
    q_len, k_len = phi_q.shape[2], phi_k.shape[2]
    if not causal:
        return phi_q @ (phi_k.transpose(-1, -2) @ v1)
    if q_len == k_len:
        return _chunked_causal(phi_q, phi_k, v1, log_decay, chunk_size, None)[0]
    if k_len > q_len:
        # Bottom-right alignment: the first k_len - q_len keys are seen by every query, an initial state.
        offset = k_len - q_len
        initial = phi_k[:, :, :offset].transpose(-1, -2) @ v1[:, :, :offset]
        return _chunked_causal(phi_q, phi_k[:, :, offset:], v1[:, :, offset:], None, chunk_size, initial)[0]
    # More queries than keys: the first q_len - k_len queries see no key and output zeros.
    offset = q_len - k_len
    out = _chunked_causal(phi_q[:, :, offset:], phi_k, v1, None, chunk_size, None)[0]
    return F.pad(out, (0, 0, offset, 0))


def _masked_log_decay(
    log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Optional[Tensor]:
    if log_decay is None:
        return None
    log_decay = log_decay.to(dtype)
    if key_padding_mask is not None:
        log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
    return log_decay


def _backward_log_decay(log_decay: Tensor) -> Tensor:
    """Log decays for the reversed sequence: key j reaches query i < j through decays i+1..j, which after
    reversal must sit at the positions the reversed recurrence applies them."""
    shifted = F.pad(log_decay[..., 1:], (0, 1))
    return shifted.flip(-1)


def kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    denominator_eps: float = 0.0,
) -> Tensor:
    """Kernelized attention on precomputed features.

    Args:
        phi_q: (batch, heads, seq_q, m) query features.
        phi_k: (batch, heads, seq_kv, m) key features.
        v: (batch, heads, seq_kv, d_v)
        causal: autoregressive, bottom-right aligned when ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding.
        log_decay: (batch, heads, seq) per-position log decay (<= 0), needs ``seq_q == seq_kv``. Causal: the
            recurrence described in the module docstring. Non-causal: the bidirectional form, key j weighted
            by the decays between it and the query on either side (``gamma^|i - j|`` for a constant decay).
        normalizer: ``"sum"``, ``"max_abs"`` or ``"none"`` (see :func:`normalize_output`).
        chunk_size: chunk length of the causal path.
        denominator_eps: normaliser guard for feature maps with negative features (``"sum"`` only).

    Returns:
        (batch, heads, seq_q, d_v) in the dtype of ``v``.
    """
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    check_key_padding_mask(key_padding_mask, batch, k_len, phi_q.device)
    if log_decay is not None and q_len != k_len:
        raise ValueError(f"log_decay needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={k_len}")
    _check_log_decay(log_decay, batch, heads, k_len)

    dtype = _accumulation_dtype(v.dtype)
    phi_q = phi_q.to(dtype)
    phi_k, v1 = _prepare_keys(phi_k, v, key_padding_mask, dtype)
    log_decay = _masked_log_decay(log_decay, key_padding_mask, dtype)

    if log_decay is None or causal:
        num_den = _unnormalised(phi_q, phi_k, v1, causal, log_decay, chunk_size)
    else:
        forward = _chunked_causal(phi_q, phi_k, v1, log_decay, chunk_size, None)[0]
        backward = _chunked_causal(
            phi_q.flip(2), phi_k.flip(2), v1.flip(2), _backward_log_decay(log_decay), chunk_size, None
        )[0].flip(2)
        # Both directions include the key at the query's own position (weight 1): count it once.
        diagonal = (phi_q * phi_k).sum(-1, keepdim=True) * v1
        num_den = forward + backward - diagonal
    return normalize_output(num_den, normalizer, denominator_eps).to(v.dtype)


def kernel_attention_prefill(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """Causal :func:`kernel_attention` over a prompt (seq_q == seq_kv) that also returns the recurrent state.

    ``key_log_scale`` (batch, heads, 1, 1): the true key features are ``phi_k * exp(key_log_scale)`` (see
    :meth:`attnzoo.feature_maps.FeatureMap.key_features`); None means 0.
    """
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    if phi_k.shape[2] != q_len:
        raise ValueError(
            f"prefill needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={phi_k.shape[2]}"
        )
    _check_log_decay(log_decay, batch, heads, q_len)
    dtype = _accumulation_dtype(v.dtype)
    phi_k, v1 = _prepare_keys(phi_k, v, None, dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    num_den, kv = _chunked_causal(phi_q.to(dtype), phi_k, v1, log_decay, chunk_size, None)
    log_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q.device)
    return normalize_output(num_den, normalizer, denominator_eps).to(v.dtype), {"kv": kv, "log_scale": log_scale}


def _log_scale_or_zero(
    key_log_scale: Optional[Tensor], batch: int, heads: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    if key_log_scale is None:
        return torch.zeros(batch, heads, 1, 1, dtype=dtype, device=device)
    if key_log_scale.shape != (batch, heads, 1, 1):
        raise ValueError(f"key_log_scale must have shape (batch, heads, 1, 1), got {tuple(key_log_scale.shape)}")
    return key_log_scale.to(dtype)


def kernel_attention_step(
    phi_q_t: Tensor,
    phi_k_t: Tensor,
    v_t: Tensor,
    state: Optional[KernelState],
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay_t: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """One recurrent step, O(m d) whatever the context length.

    Args:
        phi_q_t, phi_k_t: (batch, heads, 1, m); v_t: (batch, heads, 1, d_v).
        state: from :func:`kernel_attention_prefill` or a previous step, or None at the start.
        key_log_scale: (batch, heads, 1, 1) scale of this key's features, or None for 0.
        log_decay_t: (batch, heads, 1) log decay applied to the state before adding this key.

    Returns:
        ((batch, heads, 1, d_v), new state); equals the last row of the causal parallel form.
    """
    _check_features(phi_q_t, phi_k_t, v_t)
    _check_options(normalizer, 1, denominator_eps)
    batch, heads = phi_q_t.shape[:2]
    if phi_q_t.shape[2] != 1 or phi_k_t.shape[2] != 1:
        raise ValueError("kernel_attention_step takes one position: phi_q_t and phi_k_t of shape (batch, heads, 1, m)")
    _check_log_decay(log_decay_t, batch, heads, 1, "log_decay_t")
    dtype = _accumulation_dtype(v_t.dtype)
    phi_k_t, v1 = _prepare_keys(phi_k_t, v_t, None, dtype)
    token_kv = phi_k_t.transpose(-1, -2) @ v1
    token_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q_t.device)
    if state is None:
        kv, log_scale = token_kv, token_scale
    else:
        old_scale = state["log_scale"]
        log_scale = torch.maximum(old_scale, token_scale)
        carry = old_scale - log_scale
        if log_decay_t is not None:
            carry = carry + log_decay_t.to(dtype).unsqueeze(-1)
        kv = torch.exp(carry) * state["kv"] + torch.exp(token_scale - log_scale) * token_kv
    out = normalize_output(phi_q_t.to(dtype) @ kv, normalizer, denominator_eps)
    return out.to(v_t.dtype), {"kv": kv, "log_scale": log_scale}


def kernel_attention_reference(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tensor:
    """Obviously-correct quadratic form of :func:`kernel_attention` in float64: the (seq_q, seq_kv) weight
    matrix ``(phi_q phi_k^T) * decay`` with masked entries zeroed. Returns float64."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    batch, _, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    weights = phi_q @ phi_k.transpose(-1, -2)
    if log_decay is not None:
        log_decay = log_decay.double()
        if key_padding_mask is not None:
            log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
        cumulative = log_decay.cumsum(-1)
        later = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)  # L_i - L_j: decays j+1..i, for j <= i
        rows = torch.arange(q_len, device=phi_q.device).unsqueeze(1)
        cols = torch.arange(k_len, device=phi_q.device).unsqueeze(0)
        # A key after the query (non-causal) is reached through the decays i+1..j, i.e. L_j - L_i.
        weights = weights * torch.exp(torch.where(cols <= rows, later, -later))
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, phi_q.device)
    if allowed is not None:
        weights = weights.masked_fill(~allowed, 0.0)
    num_den = torch.cat([weights @ v, weights.sum(-1, keepdim=True)], dim=-1)
    return normalize_output(num_den, normalizer, denominator_eps)


FeatureMapArg = Union[str, FeatureMap]


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMapArg = "elu",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Linear attention ``phi(q) (phi(k)^T v) / phi(q) . sum_j phi(k_j)``.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        feature_map: ``"elu"`` (elu + 1), ``"relu"``, or a :class:`attnzoo.feature_maps.FeatureMap`.
        causal: autoregressive (chunked algorithm), bottom-right aligned when ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys, removed from numerator and normaliser.
        chunk_size: chunk length of the causal path.

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``v``.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    phi_map = resolve_feature_map(feature_map)
    phi_q = phi_map.query_features(q)
    phi_k, _ = phi_map.key_features(k, key_padding_mask)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention(phi_q, phi_k, v, causal, key_padding_mask, chunk_size=chunk_size, denominator_eps=eps)


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMapArg = "elu",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Quadratic float64 reference of :func:`linear_attention`, on the map's unstabilised features
    (``feature_map(x)``), so it also checks that the stabilisers cancel. Returns float64."""
    phi_map = resolve_feature_map(feature_map)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention_reference(
        phi_map(q.double()), phi_map(k.double()), v, causal, key_padding_mask, denominator_eps=eps
    )

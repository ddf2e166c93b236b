"""The chunked parallel form of kernelized (linear) attention, ``phi(q) (phi(k)^T v)`` with its normaliser,
optionally with a decay.

Everything works on features ``phi_q`` (batch, heads, seq_q, m) and ``phi_k`` (batch, heads, seq_kv, m) and
values ``v`` (batch, heads, seq_kv, d_v). With a per-position log decay ``log_decay`` (batch, heads, seq) the
causal output is

    o_i = sum_{j <= i} exp(L_i - L_j) (phi_q_i . phi_k_j) v_j,   L_t = sum_{s <= t} log_decay_s,

i.e. the recurrence ``S_t = exp(log_decay_t) S_{t-1} + phi_k_t v_t^T``, ``o_t = phi_q_t S_t``; without decay
it is plain causal linear attention. The normaliser is the same sum with ``v_j`` replaced by 1; the values
get an extra column of ones so one matmul yields numerator and normaliser together.

Paths:

* non-causal: ``phi_q @ (phi_k^T @ [v, 1])``, O(N m d) time, O(N (m + d) + m d) memory.
* causal, chunked: within chunks of ``chunk_size`` positions the exact quadratic form, between chunks a
  carried (m, d + 1) state; never an (N, m, d) prefix tensor. Without decay
  (:class:`.causal_chunks._CausalChunks`) the chunks go a group of :data:`.causal_chunks.GROUP_ROWS` rows at a
  time (batched matmuls over the group's chunks), forward in order and backward in reverse, and the backward
  recomputes a group's chunk scores and states from q, k, v and the one state kept per group: training memory
  is the features, values, outputs and gradients plus one group's working set,
  O(N (m + d) + GROUP_ROWS (chunk_size + m d / chunk_size)); under ``torch.compile``, which does not trace
  its writes into slices, :func:`.causal_chunks.causal_chunks_traceable` (the same maths in plain
  operations, all chunks at once). With a decay, chunk
  scores (batched over all chunks at once) and states (a short loop over chunks) cover the whole sequence,
  O(N (m + d) + (N / chunk_size) m d); the states take no more memory than the features once
  ``chunk_size >= d``.
* recurrent (:mod:`.recurrent`): :func:`.recurrent.kernel_attention_step`, O(m d) per token whatever the
  context length.

Non-finite inputs, causal: a NaN or inf in ``phi_q``, ``phi_k`` or ``log_decay`` at position p reaches no
output before p (future keys' weights are set to zero, never multiplied by zero). A non-finite entry of
``v`` at position p does reach the outputs at the earlier positions of its own chunk, ``p - p % chunk_size``
to ``p - 1``, in the columns where it is non-finite: the intra-chunk product ``tril(Q K^T) V`` multiplies
its zero weight by it, and ``0 * NaN = 0 * inf = NaN``. Earlier chunks, the other columns and the
normaliser keep their values, and incremental decoding (:func:`.recurrent.kernel_attention_step`) never sees the future
value, so there the parallel form and decoding disagree. ``chunk_size=1`` has no future position inside a
chunk, at a large cost in speed. Keeping the value out in general would take a second intra-chunk product or
a data-dependent branch per group of chunks (a host synchronisation on GPU), for an input that makes every
later output non-finite anyway. For comparison, PyTorch's ``scaled_dot_product_attention`` (exact softmax,
torch 2.13 on CPU) spreads a non-finite future value into the outputs at every earlier position.

Sums run in float32 for float16/bfloat16 inputs (half-precision sums over long sequences overflow), in float64
for float64 inputs; the output is cast back to the dtype of ``v``. Padded keys are removed from the features,
so they leave both the numerator and the normaliser; with a decay, a padded position is also an identity step
(log decay 0), as if it were absent from the sequence.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import without_autocast
from ..._dtypes import working_dtype
from ..._validation import check_bool, check_key_padding_mask, check_qkv
from .causal_chunks import _CausalChunks, causal_chunks_traceable
from .checks import _check_features, _check_log_decay, _check_options
from .inputs import _masked_keys, _masked_log_decay, _pad_seq, _with_ones
from .normalize import SIGNED_DENOMINATOR_EPS, normalize_output
from .protocol import FeatureMapArg, resolve_features

DEFAULT_CHUNK_SIZE = 64
"""Chunk length of the causal path; 64 balances the quadratic intra-chunk work (N * chunk * (m + d)) against
the per-chunk states (N / chunk * m * d) for head dims around 64 on CPU. A non-finite value reaches the
earlier outputs of its chunk (see the module docstring)."""


def _chunked_causal(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_decay: Optional[Tensor],
    chunk_size: int,
    initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """Causal numerator/normaliser for equal lengths.

    Args:
        phi_q, phi_k: (B, H, N, m); v: (B, H, N, d), without the ones column; log_decay: (B, H, N) or None;
        initial_state: (B, H, m, d + 1) state before position 0, or None.

    Returns:
        ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state after position N - 1).
    """
    batch, heads, n, m = phi_q.shape
    d1 = v.shape[-1] + 1
    if initial_state is None:
        initial_state = phi_q.new_zeros(batch, heads, m, d1)
    if log_decay is None:
        # chunk_size, not a length derived from a shape: under torch.jit.trace shapes are tensors, which
        # autograd.Function would take for inputs.
        if torch.compiler.is_compiling():
            return causal_chunks_traceable(phi_q, phi_k, v, initial_state, chunk_size)
        return _CausalChunks.apply(phi_q, phi_k, v, initial_state, chunk_size)
    chunk = min(chunk_size, n)

    n_chunks = math.ceil(n / chunk)
    pad = n_chunks * chunk - n
    # Padded tail positions have zero keys and log decay 0: they change no state.
    q = _pad_seq(phi_q, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    k = _pad_seq(phi_k, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    values = _pad_seq(_with_ones(v), pad, 2).reshape(batch, heads, n_chunks, chunk, d1)
    within = F.pad(log_decay, (0, pad)).view(batch, heads, n_chunks, chunk).cumsum(-1)
    # exp(L_i - L_j) only for j <= i: the masked differences are <= 0, so exp never overflows. In place on
    # fresh tensors whose producers' backwards do not read them (exp's reads its own result): two fewer
    # (B, H, N, chunk) allocations, which pay for the masking of the product below.
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).triu(1)
    decay = (within.unsqueeze(-1) - within.unsqueeze(-2)).masked_fill_(upper, -math.inf).exp_()
    # The future-key weights are set to zero, not multiplied by exp(-inf) = 0: a NaN or inf key (or log
    # decay) after the query would otherwise reach it as 0 * NaN. In place on the product, which mul's
    # backward does not read.
    scores = (q @ k.transpose(-1, -2) * decay).masked_fill_(upper, 0.0)
    last = within[..., -1:]  # total log decay of each chunk, (B, H, C, 1)
    local = (k * torch.exp(last - within).unsqueeze(-1)).transpose(-1, -2) @ values
    chunk_decay = torch.exp(last).unsqueeze(-1)  # (B, H, C, 1, 1)
    state = initial_state
    # A scan over chunks: N / chunk_size small steps on (m, d + 1) states, stable for any decay. unbind
    # (not indexing in the loop) keeps the backward pass linear: one gradient buffer, not one per chunk.
    previous_states = []
    for decay_c, local_c in zip(chunk_decay.unbind(2), local.unbind(2)):
        previous_states.append(state)
        state = decay_c * state + local_c
    previous = torch.stack(previous_states, dim=2)
    out = scores @ values + (q * torch.exp(within).unsqueeze(-1)) @ previous
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n], state


def _unnormalised(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool,
    log_decay: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """(B, H, N_q, d + 1) numerator/normaliser for any lengths, from v (B, H, N_k, d) without the ones
    column; causal is bottom-right aligned."""
    q_len, k_len = phi_q.shape[2], phi_k.shape[2]
    if not causal:
        return phi_q @ (phi_k.transpose(-1, -2) @ _with_ones(v))
    if q_len == k_len:
        return _chunked_causal(phi_q, phi_k, v, log_decay, chunk_size, None)[0]
    if k_len > q_len:
        # Bottom-right alignment: the first k_len - q_len keys are seen by every query, an initial state.
        offset = k_len - q_len
        initial = phi_k[:, :, :offset].transpose(-1, -2) @ _with_ones(v[:, :, :offset])
        return _chunked_causal(phi_q, phi_k[:, :, offset:], v[:, :, offset:], None, chunk_size, initial)[0]
    # More queries than keys: the first q_len - k_len queries see no key and output zeros.
    offset = q_len - k_len
    out = _chunked_causal(phi_q[:, :, offset:], phi_k, v, None, chunk_size, None)[0]
    return F.pad(out, (0, 0, offset, 0))


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
        chunk_size: chunk length of the causal path. Causal: a NaN or inf in the features or log decay
            reaches no earlier output; one in ``v`` reaches the earlier outputs of its chunk (module
            docstring, "Non-finite inputs").
        denominator_eps: normaliser guard for feature maps with negative features (``"sum"`` only).

    Returns:
        (batch, heads, seq_q, d_v) in the dtype of ``v``.
    """
    check_bool("causal", causal)
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    check_key_padding_mask(key_padding_mask, batch, k_len, phi_q.device)
    if log_decay is not None and q_len != k_len:
        raise ValueError(f"log_decay needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={k_len}")
    _check_log_decay(log_decay, batch, heads, k_len)
    return kernel_attention_unchecked(
        phi_q, phi_k, v, causal, key_padding_mask, log_decay, normalizer, chunk_size, denominator_eps
    )


@without_autocast
def kernel_attention_unchecked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    log_decay: Optional[Tensor],
    normalizer: str,
    chunk_size: int,
    denominator_eps: float,
) -> Tensor:
    """:func:`kernel_attention` for callers that validated its arguments themselves (the mechanisms check
    their inputs and options once, and compute the features and decays from them)."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    phi_q = phi_q.to(dtype)
    phi_k, v = _masked_keys(phi_k, v, key_padding_mask, dtype)
    log_decay = _masked_log_decay(log_decay, key_padding_mask, dtype)

    if log_decay is None or causal:
        num_den = _unnormalised(phi_q, phi_k, v, causal, log_decay, chunk_size)
    else:
        forward = _chunked_causal(phi_q, phi_k, v, log_decay, chunk_size, None)[0]
        backward = _chunked_causal(
            phi_q.flip(2), phi_k.flip(2), v.flip(2), _backward_log_decay(log_decay), chunk_size, None
        )[0].flip(2)
        # Both directions include the key at the query's own position (weight 1): count it once.
        diagonal = (phi_q * phi_k).sum(-1, keepdim=True) * _with_ones(v)
        num_den = forward + backward - diagonal
    return normalize_output(num_den, normalizer, denominator_eps).to(out_dtype)


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
        chunk_size: chunk length of the causal path. Causal: a NaN or inf in q or k reaches no earlier
            output (the named maps act on each position alone); one in ``v`` reaches the earlier outputs of
            its chunk (module docstring, "Non-finite inputs").

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``v``.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    phi_map = resolve_features(feature_map)
    phi_q = phi_map.query_features(q)
    phi_k, _ = phi_map.key_features(k, key_padding_mask)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention(phi_q, phi_k, v, causal, key_padding_mask, chunk_size=chunk_size, denominator_eps=eps)

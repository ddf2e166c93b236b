"""Attention Free Transformer (Zhai et al. 2021, "An Attention Free Transformer"), per head.

For queries, keys and values of one head (seq, d) and learned pairwise position biases ``w`` (seq_q, seq_kv):

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt'),

elementwise over the d features: each feature j is a softmax over positions of ``K_t'j + w_tt'`` averaging
``V_t'j``, gated by the query. Variants (the paper's):

* AFT-simple, ``w = 0``: the weights no longer depend on t, so the non-causal form is one weighted average per
  feature, O(N d). Causal, the average runs over the prefix: the running prefix softmax of
  :mod:`attnzoo.functional.efficient` feature by feature (chunks shifted by a running maximum, states carried
  between them; O(N d)), with a recurrent step of O(d) per token.
* AFT-full: ``w`` a learned (seq, seq) matrix per head; O(N^2 d) time, O(N^2) memory by definition
  (:func:`aft_full`, which takes the bias matrix).
* AFT-local: ``w`` learned only where ``|t - t'| < window`` and 0 outside, so distant keys still count, with
  weight ``exp(K_t')``. :func:`aft_local` takes the band of learned values and runs in O(N b d), b =
  ``max(chunk_size, window)``: prefix (and suffix) sums for the keys beyond the window, a banded matrix applied
  block by block within it. :func:`local_position_bias` spreads the band over the full matrix instead.

Stabiliser: exponentials are shifted by a maximum that cancels between numerator and normaliser. Keys by the
maximum of each feature over the positions (causal: the running maximum at the end of each chunk, so that
nothing overflows; see :mod:`attnzoo.functional.efficient` for the one extreme, a running maximum rising by
~80 within a chunk in float32), position biases by the maximum of each row over the keys the row may see. A row
whose visible terms all sit ~80 (float32) below those shifts underflows and outputs zeros.

Key padding: padded keys and values are zeroed first, then their weights, so they leave numerators and
normalisers and whatever they hold (NaN, inf) reaches nothing; a query that sees no unpadded key outputs
zeros. Causal, non-finite input: a NaN or inf in an unpadded key or value at position p reaches the outputs at
the earlier positions of its own chunk (through the chunk's maximum or the block's product), as in
:mod:`attnzoo.functional.efficient`. Sums run in float32 for float16/bfloat16 inputs, in float64 for float64;
the output has the dtype of v.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int, check_qkv
from .efficient import (
    DEFAULT_CHUNK_SIZE,
    Summary,
    bottom_right_causal,
    prefix_chunks,
    prefix_step_weights,
    safe_denominator,
    scan_chunk_states,
    unchunked,
    whole_sequence_weights,
)
from .masks import allowed_mask, causal_allowed, zero_padded

AftState = Dict[str, Tensor]
"""Recurrent state of causal AFT-simple: ``{"num": (batch, heads, d), "den": (batch, heads, d), "max":
(batch, heads, d)}``, per feature the running ``sum_t exp(K_t - max) V_t``, ``sum_t exp(K_t - max)`` and the
running maximum ``max`` of the keys they are shifted by."""


def _check_same_values_width(q: Tensor, v: Tensor) -> None:
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"AFT gates each value feature with its query feature: v must have the head_dim of q, got "
            f"{v.shape[-1]} and {q.shape[-1]}"
        )


def _check_position_bias(position_bias: Tensor, heads: int, length: int) -> None:
    check_floating("position_bias", position_bias)
    if position_bias.shape != (heads, length, length):
        raise ValueError(
            f"position_bias must have shape (heads, seq, seq) = ({heads}, {length}, {length}), "
            f"got {tuple(position_bias.shape)}"
        )


# -- AFT-simple ---------------------------------------------------------------------------------------------------
def _simple_summary(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Summary:
    """Keys seen by every query of a bottom-right aligned causal call: (max, [sum E v, sum E] (B, H, d, 2))."""
    weights, v, maximum = whole_sequence_weights(k, v, key_padding_mask)
    return maximum, torch.stack([(weights * v).sum(2), weights.sum(2)], dim=-1)


def _simple_causal(
    gate: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    initial: Optional[Summary],
    chunk_size: int,
) -> Tuple[Tensor, Summary]:
    """Causal AFT-simple for a gate ``sigmoid(q)``, k, v of one length N after the keys of ``initial``:
    prefix sums within each chunk plus the state carried into it. Returns ((B, H, N, d), the summary after
    position N - 1)."""
    chunks = prefix_chunks(k, v, key_padding_mask, chunk_size, None if initial is None else initial[0])
    weights = chunks.weights()  # (B, H, C, chunk, d), each <= 1
    weighted = weights * chunks.values
    local = torch.stack([weighted.sum(3), weights.sum(3)], dim=-1)  # (B, H, C, d, 2)
    previous, final = scan_chunk_states(chunks.decay, local, None if initial is None else initial[1])
    num = previous[..., 0].unsqueeze(3) + weighted.cumsum(dim=3)
    den = previous[..., 1].unsqueeze(3) + weights.cumsum(dim=3)
    out = chunks.chunked(gate) * (num / safe_denominator(den))
    return unchunked(out, gate.shape[2]), (chunks.last_max, final)


def aft_simple(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """AFT-simple: ``sigmoid(Q_t) * sum_t' softmax_t'(K_t') V_t'``, feature by feature.

    Args:
        q: (batch, heads, seq_q, d)
        k: (batch, heads, seq_kv, d)
        v: (batch, heads, seq_kv, d)
        causal: the softmax over the prefix, bottom-right aligned when ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys.
        chunk_size: chunk length of the causal path.

    Returns:
        (batch, heads, seq_q, d) in the dtype of v; zeros for a query that sees no unpadded key.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    _check_same_values_width(q, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_positive_int("chunk_size", chunk_size)
    return aft_simple_unchecked(q, k, v, causal, key_padding_mask, chunk_size)


def aft_simple_unchecked(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], chunk_size: int
) -> Tensor:
    """:func:`aft_simple` for callers that validated its arguments themselves (the mechanism)."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    gate, k, v = torch.sigmoid(q.to(dtype)), k.to(dtype), v.to(dtype)
    if causal:

        def run(gate: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], initial: Optional[Summary]) -> Tensor:
            return _simple_causal(gate, k, v, mask, initial, chunk_size)[0]

        return bottom_right_causal(run, _simple_summary, gate, k, v, key_padding_mask).to(out_dtype)
    weights, v, _ = whole_sequence_weights(k, v, key_padding_mask)
    context = (weights * v).sum(2, keepdim=True) / safe_denominator(weights.sum(2, keepdim=True))  # (B, H, 1, d)
    return (gate * context).to(out_dtype)


def aft_simple_prefill(
    q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tuple[Tensor, AftState]:
    """Causal :func:`aft_simple` over a prompt (seq_q == seq_kv) that also returns the recurrent state."""
    check_qkv(q, k, v)
    _check_same_values_width(q, v)
    check_positive_int("chunk_size", chunk_size)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"prefill needs queries and keys of one sequence, got seq_q={q.shape[2]} and "
                         f"seq_kv={k.shape[2]}")
    return aft_simple_prefill_unchecked(q, k, v, chunk_size)


def aft_simple_prefill_unchecked(q: Tensor, k: Tensor, v: Tensor, chunk_size: int) -> Tuple[Tensor, AftState]:
    """:func:`aft_simple_prefill` for callers that validated its arguments themselves."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    out, (maximum, final) = _simple_causal(torch.sigmoid(q.to(dtype)), k.to(dtype), v.to(dtype), None, None,
                                           chunk_size)
    return out.to(out_dtype), {"num": final[..., 0], "den": final[..., 1], "max": maximum}


def aft_simple_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[AftState]
) -> Tuple[Tensor, AftState]:
    """One causal position of AFT-simple, O(d) whatever the context length.

    Args:
        q_t, k_t, v_t: (batch, heads, 1, d).
        state: from :func:`aft_simple_prefill` or a previous step, or None at the start.

    Returns:
        ((batch, heads, 1, d), new state); equals the last row of the causal parallel form.
    """
    check_qkv(q_t, k_t, v_t)
    _check_same_values_width(q_t, v_t)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError("aft_simple_step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, d)")
    return aft_simple_step_unchecked(q_t, k_t, v_t, state)


def aft_simple_step_unchecked(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[AftState]
) -> Tuple[Tensor, AftState]:
    """:func:`aft_simple_step` for callers that validated its arguments themselves (the mechanism, whose
    decoding states are checked against its declared layout)."""
    dtype = working_dtype(v_t.dtype)
    q, k, v = q_t[:, :, 0].to(dtype), k_t[:, :, 0].to(dtype), v_t[:, :, 0].to(dtype)
    decay, weight, maximum = prefix_step_weights(k, None if state is None else state["max"])
    if state is None or decay is None:
        num, den = weight * v, weight
    else:
        num = decay * state["num"] + weight * v
        den = decay * state["den"] + weight
    # den >= 1: the feature's running maximum contributes exp(0).
    out = torch.sigmoid(q) * num / den
    return out.unsqueeze(2).to(v_t.dtype), {"num": num, "den": den, "max": maximum}


# -- AFT-full and AFT-local -----------------------------------------------------------------------------------------
def local_position_bias(band: Tensor, length: int, window: int) -> Tensor:
    """The (heads, length, length) bias matrix of AFT-local: ``w[h, t, t'] = band[h, t, t' - t + window - 1]``
    where ``|t - t'| < window``, 0 outside.

    Args:
        band: (heads, >= length, 2 * window - 1) learned biases by query position and offset.
    """
    rows = torch.arange(length, device=band.device).unsqueeze(1)
    offsets = torch.arange(length, device=band.device).unsqueeze(0) - rows  # t' - t
    inside = offsets.abs() < window
    index = (offsets + window - 1).clamp(0, 2 * window - 2).expand(band.shape[0], length, length)
    gathered = band[:, :length].gather(2, index)
    return torch.where(inside, gathered, torch.zeros_like(gathered))


def aft_full(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_bias: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """AFT-full (and AFT-local, given :func:`local_position_bias`): queries and keys of one sequence.

    Args:
        q, k, v: (batch, heads, seq, d)
        position_bias: (heads, seq, seq) the biases ``w[h, t, t']``.
        causal: keys t' > t masked.
        key_padding_mask: (batch, seq) bool, True marks padding keys.
        chunk_size: causal: query rows per block, each block's keys shifted by their running maximum.

    Returns:
        (batch, heads, seq, d) in the dtype of v; zeros for a query that sees no unpadded key.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    _check_same_values_width(q, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"aft_full weighs pairs of positions of one sequence: seq_q and seq_kv must be equal, "
                         f"got {q.shape[2]} and {k.shape[2]}")
    _check_position_bias(position_bias, q.shape[1], q.shape[2])
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_positive_int("chunk_size", chunk_size)
    return aft_full_unchecked(q, k, v, position_bias, causal, key_padding_mask, chunk_size)


def aft_full_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_bias: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """:func:`aft_full` for callers that validated its arguments themselves (the mechanism)."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    gate, k, v, bias = torch.sigmoid(q.to(dtype)), k.to(dtype), v.to(dtype), position_bias.to(dtype)
    n, d = k.shape[2], k.shape[3]
    if causal:
        bias = bias.masked_fill(~causal_allowed(n, n, k.device), -math.inf)
    # exp(w - row max): every factor <= 1, the row's largest 1 (each causal row sees its diagonal, so its
    # maximum is finite; exp(-inf) = 0 masks the future).
    pair_weights = torch.exp(bias - bias.detach().amax(dim=-1, keepdim=True))  # (H, N, N)
    if not causal:
        weights, v, _ = whole_sequence_weights(k, v, key_padding_mask)
        num_den = pair_weights @ torch.cat([weights * v, weights], dim=-1)  # (B, H, N, 2 d)
    else:
        # Each block of query rows shifts the keys it may see by their running maximum at its end, so that no
        # query's visible keys sit below a shift set by keys after them in another block.
        # Blocks are taken apart with unbind/split and put together with cat, never sliced out of a whole
        # tensor: a slice's backward zero-fills a gradient of the whole size, once per block.
        chunks = prefix_chunks(k, v, key_padding_mask, chunk_size, None)
        size = chunks.keys.shape[3]
        key_blocks, value_blocks = chunks.keys.unbind(2), chunks.values.unbind(2)
        hidden_blocks = None if chunks.hidden is None else chunks.hidden.unbind(2)
        blocks = []
        for index, rows in enumerate(pair_weights.split(size, dim=1)):
            end = min((index + 1) * size, n)  # the keys rows of this block may see
            weights = torch.exp(_leading(key_blocks, index + 1, end) - chunks.shift[:, :, index].unsqueeze(2))
            if hidden_blocks is not None:
                weights = weights.masked_fill(_leading(hidden_blocks, index + 1, end), 0.0)
            values = _leading(value_blocks, index + 1, end)
            blocks.append(_first(rows, end) @ torch.cat([weights * values, weights], dim=-1))
        num_den = torch.cat(blocks, dim=2)
    out = gate * (num_den[..., :d] / safe_denominator(num_den[..., d:]))
    return out.to(out_dtype)


def _first(x: Tensor, end: int) -> Tensor:
    """x (..., columns) cut to its first ``end`` columns, x itself when it has no more."""
    return x if x.shape[-1] == end else x[..., :end]


def _leading(blocks: Tuple[Tensor, ...], count: int, end: int) -> Tensor:
    """The first ``count`` of (B, H, block, c) blocks joined along the positions, cut to ``end`` positions
    (the last block may overhang the sequence)."""
    joined = torch.cat(blocks[:count], dim=2)
    return joined if joined.shape[2] == end else joined[:, :, :end]


def _check_band(band: Tensor, heads: int, length: int, window: int) -> None:
    check_floating("band", band)
    if band.dim() != 3 or band.shape[0] != heads or band.shape[1] < length or band.shape[2] != 2 * window - 1:
        raise ValueError(
            f"band must have shape (heads, >= seq, 2 * window - 1) = ({heads}, >= {length}, {2 * window - 1}), "
            f"got {tuple(band.shape)}"
        )


def aft_local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    band: Tensor,
    window: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """AFT-local in O(N b d) time and O(N (b + d)) memory, b = ``max(chunk_size, window)``: the biases of
    ``|t - t'| < window`` from ``band`` (see :func:`local_position_bias`), 0 beyond.

    The keys beyond the window of each query weigh ``exp(K_t')`` alone, so they enter as prefix and suffix
    sums (causal: prefix sums only, carried between chunks with running-maximum shifts as in AFT-simple);
    the window is a banded matrix, applied block by block: each block of b query rows against the key blocks
    before, at and (non-causal) after it. A window covering the whole sequence takes :func:`aft_full`'s path.

    Args:
        q, k, v: (batch, heads, seq, d), one sequence.
        band: (heads, >= seq, 2 * window - 1), row t holding ``w[t, t - window + 1 .. t + window - 1]``.
        window: the band's half-width, >= 1.
        causal: keys t' > t masked.
        key_padding_mask: (batch, seq) bool, True marks padding keys.
        chunk_size: the least block length.

    Returns:
        (batch, heads, seq, d) in the dtype of v; zeros for a query that sees no unpadded key.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    _check_same_values_width(q, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"aft_local weighs pairs of positions of one sequence: seq_q and seq_kv must be equal, "
                         f"got {q.shape[2]} and {k.shape[2]}")
    check_positive_int("window", window)
    _check_band(band, q.shape[1], q.shape[2], window)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_positive_int("chunk_size", chunk_size)
    return aft_local_unchecked(q, k, v, band, window, causal, key_padding_mask, chunk_size)


def _band_visible(n: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """(n, 2 * window - 1): whether row t sees the key at offset ``index - window + 1`` of its band."""
    rows = torch.arange(n, device=device).unsqueeze(1)
    keys = rows + torch.arange(-window + 1, window, device=device).unsqueeze(0)  # t + offset
    visible = (keys >= 0) & (keys < n)
    return visible & (keys <= rows) if causal else visible


def _band_row_shift(band: Tensor, n: int, window: int, causal: bool) -> Tensor:
    """(heads, n, 1) each row's shift for the position biases: the largest bias the row may see, and 0 (the
    bias beyond the window) where the row has keys beyond it. Detached: it cancels."""
    rows = torch.arange(n, device=band.device).unsqueeze(1)
    beyond = rows >= window if causal else (rows >= window) | (rows + window < n)
    visible = _band_visible(n, window, causal, band.device)
    with torch.no_grad():
        top = band[:, :n].detach().masked_fill(~visible, -math.inf).amax(-1, keepdim=True)
        return torch.where(beyond, top.clamp_min(0.0), top)


def _band_blocks(band: Tensor, n: int, window: int, block: int, causal: bool, row_shift: Tensor) -> Tensor:
    """(heads, blocks, block, width) the banded weights ``exp(w - row shift)`` of each block of query rows
    against its key blocks, the previous, its own and (non-causal) the next one: width 3 blocks, causal 2."""
    heads = band.shape[0]
    blocks = math.ceil(n / block)
    visible = _band_visible(n, window, causal, band.device)
    weights = torch.exp(band[:, :n] - row_shift).masked_fill(~visible, 0.0)  # (H, n, 2w - 1)
    weights = _pad_rows(weights, blocks * block - n).view(heads, blocks, block, 2 * window - 1)
    # Row i of a block against column c of its key blocks (which start one block earlier): offset
    # c - block - i, stored at index offset + window - 1, the same in every block.
    width = (2 if causal else 3) * block
    columns = torch.arange(width, device=band.device).unsqueeze(0)
    offset = columns - block - torch.arange(block, device=band.device).unsqueeze(1)
    inside = (offset.abs() < window) & (offset <= 0) if causal else offset.abs() < window
    index = (offset + window - 1).clamp(0, 2 * window - 2).expand(heads, blocks, block, width)
    return weights.gather(-1, index).masked_fill(~inside, 0.0)


def _pad_rows(x: Tensor, pad: int) -> Tensor:
    """x (..., rows, c) with ``pad`` rows of zeros added at the end."""
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def aft_local_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    band: Tensor,
    window: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """:func:`aft_local` for callers that validated its arguments themselves (the mechanism)."""
    n, d = k.shape[2], k.shape[3]
    if window >= n:  # every pair is inside the window
        return aft_full_unchecked(q, k, v, local_position_bias(band, n, window), causal, key_padding_mask,
                                  chunk_size)
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    gate, k, v, band = torch.sigmoid(q.to(dtype)), k.to(dtype), v.to(dtype), band.to(dtype)
    batch, heads = k.shape[:2]
    block = min(max(chunk_size, window), n)  # prefix_chunks' chunks are at most the sequence long
    blocks = math.ceil(n / block)
    row_shift = _band_row_shift(band, n, window, causal)  # (H, n, 1)
    banded = _band_blocks(band, n, window, block, causal, row_shift)  # (H, blocks, block, 2 or 3 blocks)
    if causal:
        # Keys in chunks of one block, each shifted by its running maximum; the previous block's keys are
        # rescaled to the current block's shift per feature, which commutes with the sum over keys.
        chunks = prefix_chunks(k, v, key_padding_mask, block, None)
        weights = chunks.weights()
        terms = torch.cat([weights * chunks.values, weights], dim=-1)  # (B, H, C, block, 2 d)
        decay = chunks.decay.repeat(1, 1, 1, 2).unsqueeze(3)  # (B, H, C, 1, 2 d)
        earlier = F.pad(terms, (0, 0, 0, 0, 1, 0))[:, :, :-1] * decay
        near = banded[..., :block] @ earlier + banded[..., block:] @ terms
        # Beyond the window: the prefix up to t - window, carried between chunks and rescaled to t's chunk.
        sums = terms.sum(3).view(batch, heads, blocks, 2, d).transpose(-1, -2)
        previous, _ = scan_chunk_states(chunks.decay, sums, None)
        prefix = terms.cumsum(3) + previous.transpose(-1, -2).reshape(batch, heads, blocks, 1, 2 * d)
        prefix = unchunked(prefix, blocks * block)
        shift = chunks.shift.unsqueeze(3).expand(-1, -1, -1, block, -1).reshape(batch, heads, blocks * block, d)
        earlier_shift = F.pad(shift, (0, 0, window, 0), value=-math.inf)[:, :, : blocks * block]
        rescale = torch.exp(earlier_shift - shift).repeat(1, 1, 1, 2)  # 0 before position window
        far = F.pad(prefix, (0, 0, window, 0))[:, :, : blocks * block] * rescale
    else:
        weights, v, _ = whole_sequence_weights(k, v, key_padding_mask)
        terms = torch.cat([weights * v, weights], dim=-1)  # (B, H, n, 2 d), one shift for the whole sequence
        padded = F.pad(terms, (0, 0, block, (blocks + 1) * block - n))
        padded = padded.view(batch, heads, blocks + 2, block, 2 * d)
        around = torch.cat([padded[:, :, :-2], padded[:, :, 1:-1], padded[:, :, 2:]], dim=3)
        near = banded @ around
        prefix = terms.cumsum(2)
        suffix = terms.flip(2).cumsum(2).flip(2)
        # Beyond the window: the keys up to t - window and from t + window on.
        far = F.pad(prefix, (0, 0, window, 0))[:, :, :n] + F.pad(suffix[:, :, window:], (0, 0, 0, window))
        far = _pad_rows(far, blocks * block - n)
    # The weights beyond the window are exp(0 - row shift).
    beyond = torch.exp(-_pad_rows(row_shift, blocks * block - n))
    num_den = unchunked(near, n) + (far * beyond)[:, :, :n]
    out = gate * (num_den[..., :d] / safe_denominator(num_den[..., d:]))
    return out.to(out_dtype)


def aft_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_bias: Optional[Tensor] = None,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Obviously-correct dense form of AFT in float64: for every query t, key t' and feature j the logit
    ``K_t'j + w_tt'``, a softmax over the keys t' the query may see (a (seq_q, seq_kv, d) tensor of weights),
    the weighted sum of ``V_t'j``, gated by ``sigmoid(Q_tj)``.

    Args:
        position_bias: (heads, seq_q, seq_kv) ``w``, or None for AFT-simple (``w = 0``).

    Returns float64 (batch, heads, seq_q, d); zeros for a query that sees no unpadded key."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    if position_bias is None:
        w = torch.zeros(heads, q_len, k_len, dtype=torch.float64, device=q.device)
    else:
        w = position_bias.double()
    logits = k.unsqueeze(2) + w.unsqueeze(0).unsqueeze(-1)  # (B, H, seq_q, seq_kv, d)
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, q.device)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(-1), -math.inf)
    top = logits.detach().amax(dim=3, keepdim=True)
    exp = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    total = exp.sum(dim=3, keepdim=True)
    weights = exp / torch.where(total > 0, total, torch.ones_like(total))
    return torch.sigmoid(q) * torch.einsum("bhitj,bhtj->bhij", weights, v)

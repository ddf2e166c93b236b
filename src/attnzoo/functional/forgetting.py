"""Forgetting attention (Lin et al. 2025, the Forgetting Transformer, FoX): softmax attention with the
cumulative log of a data-dependent forget gate added to the logits::

    o_i = sum_j softmax_j(scale * q_i . k_j + D_ij) v_j,    D_ij = sum_{l=j+1..i} log f_l = c_i - c_j,

where ``c_t = sum_{l<=t} log f_l`` and ``f_t`` in (0, 1] is a forget gate per head and position, given here as
``log_forget`` (batch, heads, seq), every value <= 0. A key's weight decays by every gate between it and the
query; with every gate 1 it is exact softmax attention.

``causal=False`` applies the gates in both directions, ``D_ij = -|c_i - c_j|`` (the sum of the log gates strictly
after the earlier of i, j up to the later), as retention's non-causal form decays ``gamma^|i - j|``. Padded
positions are skipped: their keys get no weight and their gates are taken as 1 (``log f = 0``), so they decay
nothing, and whatever they hold (NaN, inf) reaches no output.

The fast path (:func:`forgetting_attention_unchecked`) is blockwise with an online softmax, as
flash-attention is: key blocks of ``block_size`` positions, each met by every query that may see it, the
running row maxima and sums rescaled as blocks arrive. A block's bias is the difference of the cumulative log
gates of its rows and columns, made for that block only: no (N, N) tensor exists, in the forward or in the
hand-written backward, which recomputes each block from q, k, v, the gates and the rows' log-sum-exp (the
flash-attention-2 backward). The cumulative gates are summed in float64 and each block's bias ``c_i - c_j`` is
formed in float64 before it meets the logits' dtype, so it is as exact as the logits however large ``|c|``
grows (a float32 sum reaching c = -5000 would put errors of 1e-4 on nearby keys' weights). :func:`forgetting_attention_reference` builds the whole (N, N) matrix in float64.

Grouped-query keys and values (fewer heads than the queries, each query head with its own gates) are used
without repeating them: the query heads of a group meet their shared key block in one broadcast matmul.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_number, check_positive_int, check_qkv
from ._autocast import without_autocast
from .grouped import query_groups, repeat_kv
from .masks import allowed_mask, zero_padded
from .softmax import masked_softmax_reference

DEFAULT_BLOCK_SIZE = 64
"""Key positions per block of the blockwise kernel: the transient logits of one block are (seq x block)."""


def forgetting_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_forget: Tensor,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Tensor:
    """Forgetting attention (see the module docstring), blockwise, never an (N, N) tensor.

    Args:
        q: (batch, heads, seq, head_dim)
        k: (batch, kv_heads, seq, head_dim), ``kv_heads`` dividing ``heads`` (grouped-query attention, native)
        v: (batch, kv_heads, seq, head_dim_v)
        log_forget: (batch, heads, seq), the log forget gates ``log f_t <= 0``, one per query head; finite at
            every position the padding mask keeps (a padded one may hold anything).
        causal: queries see keys up to themselves; False applies the gates in both directions.
        key_padding_mask: (batch, seq) bool, True marks padding.
        scale: logit scale (> 0), ``1/sqrt(head_dim)`` by default.
        block_size: key positions per block.

    Returns:
        (batch, heads, seq, head_dim_v) in q's dtype; a row that may see no key is zeros.
    """
    check_bool("causal", causal)
    scale = check_number("scale", scale, minimum=0.0, exclusive_minimum=True, optional=True)
    block_size = check_positive_int("block_size", block_size)
    check_qkv(q, k, v, grouped=True)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"forgetting attention pairs positions of one sequence: q seq={q.shape[2]} and "
                         f"k seq={k.shape[2]} must be equal")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_log_forget(log_forget, q, key_padding_mask)
    return forgetting_attention_unchecked(q, k, v, log_forget, causal, key_padding_mask, scale, block_size)


def check_log_forget(log_forget: object, q: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    """``log_forget`` a floating tensor (batch, heads, seq) on q's device, finite and <= 0 wherever the padding
    mask keeps the position. Errors name ``log_forget``."""
    check_floating("log_forget", log_forget)  # type: ignore[arg-type]
    assert isinstance(log_forget, Tensor)
    batch, heads, seq = q.shape[:3]
    if log_forget.shape != (batch, heads, seq):
        raise ValueError(f"log_forget must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}), got "
                         f"{tuple(log_forget.shape)}")
    if log_forget.device != q.device:
        raise ValueError(f"log_forget must be on {q.device} with the queries, got {log_forget.device}")
    kept = log_forget if key_padding_mask is None else log_forget.masked_fill(key_padding_mask[:, None, :], 0.0)
    if not bool(torch.isfinite(kept).all()):
        raise ValueError("log_forget must be finite at every unpadded position (it holds NaN or inf)")
    if bool((kept > 0).any()):
        raise ValueError("log_forget must be <= 0 (the log of a forget gate f_t in (0, 1]), got a positive value")


def forget_gate_logs(k: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Log forget gates ``log sigmoid(k_t . weight_h + bias_h)`` (batch, heads, seq), one per query head h,
    from keys of ``kv_heads`` heads (query head h reads key head ``h // (heads // kv_heads)``), without
    repeating the keys. ``weight`` (heads, head_dim), ``bias`` (heads,); computed in at least float32."""
    batch, kv_heads, seq, dim = k.shape
    heads = weight.shape[0]
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    grouped_weight = weight.to(dtype).view(kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("bhnd,hgd->bhgn", k.to(dtype), grouped_weight).reshape(batch, heads, seq)
    return F.logsigmoid(logits + bias.to(dtype).unsqueeze(-1))


def cumulative_log_forget(log_forget: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``c_t = sum_{l<=t} log f_l`` (batch, heads, seq) in float64, padded positions counted as gates of 1."""
    if key_padding_mask is not None:
        log_forget = log_forget.masked_fill(key_padding_mask[:, None, :], 0.0)
    return log_forget.to(torch.float64).cumsum(-1)


def forgetting_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, log_forget: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
    scale: Optional[float], block_size: int,
) -> Tensor:
    """:func:`forgetting_attention` for callers that validated every argument (the mechanism)."""
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    dtype = working_dtype(q.dtype)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    cumulative = cumulative_log_forget(log_forget, key_padding_mask)
    k, v = zero_padded(k, key_padding_mask).to(dtype), zero_padded(v, key_padding_mask).to(dtype)
    q5 = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, seq, dim)
    c5 = cumulative.view(batch, kv_heads, heads // kv_heads, seq)
    key_allowed = None if key_padding_mask is None else ~key_padding_mask
    out = _blockwise(q5, k, v, c5, key_allowed, causal, scale, min(block_size, seq))
    return out.reshape(batch, heads, seq, v.shape[3]).to(q.dtype)


@without_autocast
def _blockwise(q5: Tensor, k: Tensor, v: Tensor, c5: Tensor, key_allowed: Optional[Tensor], causal: bool,
               scale: float, block: int) -> Tensor:
    """The hand-written kernel, or under ``torch.compile`` the same blockwise forward left to autograd (dynamo
    traces plain operations; a compiled graph plans its own memory)."""
    if torch.compiler.is_compiling():
        return _forward_blocks(q5, k, v, c5, key_allowed, causal, scale, block)[0]
    return _ForgettingBlocks.apply(q5, k, v, c5, key_allowed, causal, scale, block)


def _block_logits(
    q_rows: Tensor, k_block: Tensor, c_rows: Tensor, c_cols: Tensor, first_row: int, first_col: int,
    key_allowed: Optional[Tensor], causal: bool, scale: float,
) -> Tuple[Tensor, Tensor]:
    """The biased, masked logits of one key block and the rows that meet it, (B, KV, G, R, W), and the (R, W)
    bool of which keys lie at or before their query (the bias's sign where ``causal=False``).

    q_rows (B, KV, G, R, d) for positions ``first_row...``; k_block (B, KV, W, d) for ``first_col...``; c_rows
    (B, KV, G, R) and c_cols (B, KV, G, W) float64 cumulative log gates; key_allowed (B, N) or None."""
    rows, width = q_rows.shape[3], k_block.shape[2]
    logits = q_rows @ k_block.unsqueeze(2).transpose(-1, -2) * scale
    bias = (c_rows.unsqueeze(-1) - c_cols.unsqueeze(-2)).to(logits.dtype)
    row_positions = torch.arange(first_row, first_row + rows, device=q_rows.device)
    col_positions = torch.arange(first_col, first_col + width, device=q_rows.device)
    before = row_positions[:, None] >= col_positions[None, :]
    allowed: Optional[Tensor] = before if causal else None
    if not causal:
        bias = torch.where(before, bias, -bias)
    if key_allowed is not None:
        keys = key_allowed[:, first_col:first_col + width].view(-1, 1, 1, 1, width)
        allowed = keys if allowed is None else allowed & keys
    logits = logits + bias
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    return logits, before


def _forward_blocks(
    q5: Tensor, k: Tensor, v: Tensor, c5: Tensor, key_allowed: Optional[Tensor], causal: bool, scale: float,
    block: int,
) -> Tuple[Tensor, Tensor]:
    """Online softmax over the key blocks: (out (B, KV, G, N, dv), log-sum-exp (B, KV, G, N), +inf on a row
    that sees no key). Causally a block is met only by the rows from its first position on, and rows finish
    as the blocks pass them; out-of-place throughout, so autograd can also differentiate it directly."""
    seq = q5.shape[3]
    first = 0  # the first row the running state holds
    top = q5.new_full(q5.shape[:4], -math.inf)
    total = q5.new_zeros(q5.shape[:4])
    acc = q5.new_zeros(*q5.shape[:4], v.shape[3])
    outs, lses = [], []
    for start in range(0, seq, block):
        end = min(start + block, seq)
        logits, _ = _block_logits(q5[..., first:, :], k[:, :, start:end], c5[..., first:], c5[..., start:end],
                                  first, start, key_allowed, causal, scale)
        new_top = torch.maximum(top, logits.amax(-1))
        shift = torch.where(torch.isfinite(new_top), new_top, torch.zeros_like(new_top))
        weights = torch.exp(logits - shift.unsqueeze(-1))
        rescale = torch.exp(top - shift)  # 0 while a row has seen no key
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + weights @ v[:, :, start:end].unsqueeze(2)
        top = new_top
        if causal:  # rows start..end have met every block they may see
            done = end - first
            outs.append(_finish(acc[..., :done, :], total[..., :done]))
            lses.append(_log_sum_exp(top[..., :done], total[..., :done]))
            top, total, acc, first = top[..., done:], total[..., done:], acc[..., done:, :], end
    if not causal:
        outs, lses = [_finish(acc, total)], [_log_sum_exp(top, total)]
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _finish(acc: Tensor, total: Tensor) -> Tensor:
    return acc / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)


def _log_sum_exp(top: Tensor, total: Tensor) -> Tensor:
    seen = total > 0
    return torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))),
                       torch.full_like(total, math.inf))


def _backward_blocks(
    saved: Tuple[Tensor, ...], key_allowed: Optional[Tensor], causal: bool, scale: float, block: int,
    grad_out: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flash-attention-2's backward, key block by key block, each block's weights recomputed from the saved
    log-sum-exp: gradients of q5, k, v and the float64 cumulative gates c5."""
    q5, k, v, c5, out, lse = saved
    seq = q5.shape[3]
    delta = (grad_out * out).sum(-1)  # (B, KV, G, N): sum_j P_ij dP_ij
    grad_q, grad_k, grad_v = torch.zeros_like(q5), torch.zeros_like(k), torch.zeros_like(v)
    grad_c = torch.zeros_like(c5)
    for start in range(0, seq, block):
        end = min(start + block, seq)
        first = start if causal else 0
        q_rows, k_block, v_block = q5[..., first:, :], k[:, :, start:end], v[:, :, start:end].unsqueeze(2)
        logits, before = _block_logits(q_rows, k_block, c5[..., first:], c5[..., start:end], first, start,
                                       key_allowed, causal, scale)
        weights = torch.exp(logits - lse[..., first:].unsqueeze(-1))
        rows_grad = grad_out[..., first:, :]
        grad_v[:, :, start:end] = (weights.transpose(-1, -2) @ rows_grad).sum(2)
        grad_logits = weights * (rows_grad @ v_block.transpose(-1, -2) - delta[..., first:].unsqueeze(-1))
        grad_q[..., first:, :] += grad_logits @ k_block.unsqueeze(2) * scale
        grad_k[:, :, start:end] = (grad_logits.transpose(-1, -2) @ q_rows).sum(2) * scale
        grad_bias = grad_logits if causal else torch.where(before, grad_logits, -grad_logits)
        grad_c[..., first:] += grad_bias.sum(-1).to(grad_c.dtype)
        grad_c[..., start:end] -= grad_bias.sum(-2).to(grad_c.dtype)
    return grad_q, grad_k, grad_v, grad_c


class _ForgettingBlocks(torch.autograd.Function):
    """The blockwise forward (:func:`_forward_blocks`, run without autograd) and the hand-written backward
    (:func:`_backward_blocks`): what is kept for the backward is q, k, v, the gates, the output and one
    log-sum-exp per row; no block's weights."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q5: Tensor, k: Tensor, v: Tensor, c5: Tensor, key_allowed: Optional[Tensor], causal: bool,
        scale: float, block: int,
    ) -> Tensor:
        out, lse = _forward_blocks(q5, k, v, c5, key_allowed, causal, scale, block)
        ctx.save_for_backward(q5, k, v, c5, out, lse, key_allowed)
        ctx.causal, ctx.scale, ctx.block = causal, scale, block
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        *saved, key_allowed = ctx.saved_tensors
        grads = _backward_blocks(tuple(saved), key_allowed, ctx.causal, ctx.scale, ctx.block, grad_out)
        return (*grads, None, None, None, None)


def forgetting_attention_step_unchecked(
    q_t: Tensor, keys: Tensor, values: Tensor, cumulative: Tensor, scale: Optional[float]
) -> Tensor:
    """One decoding position against a cache: q_t (batch, heads, 1, head_dim); keys, values (batch, kv_heads,
    T, dim) of every position so far, the new one last; cumulative (batch, heads, T) float64 cumulative log
    gates at those positions. Returns (batch, heads, 1, head_dim_v) in q_t's dtype."""
    batch, heads, _, dim = q_t.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    dtype = working_dtype(q_t.dtype)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    bias = (cumulative[..., -1:] - cumulative).to(dtype).view(batch, kv_heads, heads // kv_heads, 1, length)
    q5 = q_t.to(dtype).view(batch, kv_heads, heads // kv_heads, 1, dim)
    logits = q5 @ keys.to(dtype).unsqueeze(2).transpose(-1, -2) * scale + bias
    out = torch.softmax(logits, dim=-1) @ values.to(dtype).unsqueeze(2)
    return out.reshape(batch, heads, 1, values.shape[3]).to(q_t.dtype)


def forgetting_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_forget: Tensor,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Obviously-correct forgetting attention in float64: the whole (N, N) bias ``D_ij`` written out from its
    definition (the sum of the log gates between j and i), grouped keys and values repeated. Arguments as
    :func:`forgetting_attention`; returns float64."""
    groups = query_groups(q.shape[1], k.shape[1])
    q = q.double()
    k = repeat_kv(zero_padded(k.double(), key_padding_mask), groups)
    v = repeat_kv(zero_padded(v.double(), key_padding_mask), groups)
    batch, _, seq, dim = q.shape
    gates = log_forget.double()
    if key_padding_mask is not None:
        gates = gates.masked_fill(key_padding_mask[:, None, :], 0.0)
    i = torch.arange(seq, device=q.device)[:, None, None]
    j = torch.arange(seq, device=q.device)[None, :, None]
    l = torch.arange(seq, device=q.device)[None, None, :]
    # Position l lies strictly after the earlier of (i, j) and at or before the later one.
    between = (l > torch.minimum(i, j)) & (l <= torch.maximum(i, j))
    bias = torch.einsum("bhl,ijl->bhij", gates, between.to(gates.dtype))
    logits = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(dim) if scale is None else scale) + bias
    allowed = allowed_mask(batch, seq, seq, causal, key_padding_mask, q.device)
    return masked_softmax_reference(logits, allowed) @ v

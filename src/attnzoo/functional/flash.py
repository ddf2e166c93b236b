"""The attention of the gated attention unit (GAU) and FLASH's mixed chunk attention (Hua et al. 2022,
"Transformer Quality in Linear Time"), on per-head tensors, with float64 references.

Both take their queries and keys in the forms the paper derives from one shared projection: a cheap
per-dimension scale and offset (:func:`scale_offset`), optionally followed by rotary positions
(:func:`rotate`). The functions below take those forms ready-made.

Scores. ``scores="relu2"`` weights key j for query i by the squared ReLU of the scaled dot product,
``relu(q_i . k_j / sqrt(d))^2``, divided by a length (not normalised per row, as in the paper);
``scores="softmax"`` uses the softmax of ``q_i . k_j / sqrt(d)`` over the same keys instead.

* GAU (:func:`gau_attention`): quadratic, one score per pair. The squared-ReLU weights of row i are divided
  by ``n_i``, the number of keys the row sees: the N (unpadded) keys of the sequence when non-causal, which is
  the paper's 1/N; the ``i + 1`` keys up to and including position i when causal (fewer where padded), so
  that a row's scale never depends on later positions and decoding one token at a time gives the same output.
* FLASH (:func:`mixed_chunk_attention`): the sequence is cut into chunks of ``c`` positions (the last one may
  be shorter). Inside each chunk, exact quadratic attention on the quadratic forms ``(q_quad, k_quad)``:
  squared-ReLU weights divided by the chunk size ``c`` (a constant, as in the paper, also for the last chunk
  and under causal masking), or a softmax over the chunk's visible keys. Across chunks, linear attention on
  the linear forms ``(q_lin, k_lin)`` with no feature map and no row normalisation:
  ``q_lin_i . (sum_j k_lin_j v_j^T) / (sqrt(d) n_i)``, where the sum runs over every unpadded key of the
  sequence (own chunk included) when non-causal, and over the keys of the *previous* chunks when causal
  (prefix sums of the chunk states); ``n_i`` is the number of keys in that sum (at least 1), so the paper's
  1/N when non-causal. The two parts are added.

Padded keys and values are zeroed before use and masked out of every sum, so whatever they hold changes no
output. Code paths depend on shapes only, never on mask values.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_choice, check_key_padding_mask, check_number, check_qkv
from .masks import allowed_mask, zero_padded
from .prefix import lagged_prefix_sums
from .softmax import masked_sdpa, masked_softmax_reference

SCORES = ("relu2", "softmax")
ROTARY_BASE = 10000.0


# -- the shared-projection forms ------------------------------------------------------------------------------
def scale_offset(x: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    """The paper's cheap per-dimension transform of a shared projection: ``x * gamma + beta``.

    Args:
        x: (batch, heads, seq, dim); gamma, beta: (heads, dim).

    Returns:
        (batch, heads, seq, dim) in x's dtype.
    """
    return x * gamma.to(x.dtype)[None, :, None, :] + beta.to(x.dtype)[None, :, None, :]


def rotate(x: Tensor, start: int = 0, base: float = ROTARY_BASE) -> Tensor:
    """Rotary positions (Su et al. 2021) on x (..., seq, dim) for positions ``start .. start + seq - 1``.

    Pairs ``(x[2i], x[2i + 1])`` rotate by ``position * base^(-2i / dim)``, the same convention as
    :class:`attnzoo.positional.RotaryEmbedding`; ``dim`` must be even. Rotating queries and keys makes their
    dot product depend on the offset between their positions only.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=compute) / dim)
    positions = torch.arange(start, start + seq, device=x.device, dtype=compute)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rotate_reference(x: Tensor, start: int = 0, base: float = ROTARY_BASE) -> Tensor:
    """:func:`rotate` in float64 by complex multiplication: pair (a, b) is the number a + ib, turned by
    ``exp(i * angle)``."""
    x = x.double()
    seq, dim = x.shape[-2], x.shape[-1]
    pairs = torch.complex(x[..., 0::2], x[..., 1::2])
    angles = torch.arange(start, start + seq, dtype=torch.float64)[:, None] * base ** (
        -torch.arange(0, dim, 2, dtype=torch.float64) / dim
    )
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)


class _SquaredReluAttention(torch.autograd.Function):
    """``(relu(q k^T)^2, zero where blocked) @ v`` over the last two dims, with a hand-written backward.

    The (q_len x k_len) weights are the largest tensors of GAU and FLASH. Autograd keeps the scores, their
    ReLU, its square and the masked copy, and its backward makes a pass over the matrix for each of those
    steps. Here the forward makes the ReLU and the mask in place on the scores and keeps only that ``r``;
    the backward squares it again for ``dV = (r^2)^T dO`` and forms ``dS = 2 r (dO V^T)`` in place, using
    that the derivative of ``relu(s)^2`` is ``2 relu(s)`` (zero where blocked, since r is zero there)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, blocked: Optional[Tensor]) -> Tensor:  # type: ignore[override]
        r = torch.matmul(q, k.transpose(-1, -2)).relu_()
        if blocked is not None:
            r.masked_fill_(blocked, 0.0)
        ctx.save_for_backward(q, k, v, r)
        return torch.matmul(r.square(), v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        q, k, v, r = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_v = torch.matmul(r.square().transpose(-1, -2), grad_out) if needs[2] else None
        grad_q = grad_k = None
        if needs[0] or needs[1]:
            half = torch.matmul(grad_out, v.transpose(-1, -2)).mul_(r)  # dS / 2
            grad_q = torch.matmul(half, k).mul_(2.0) if needs[0] else None
            grad_k = torch.matmul(half.transpose(-1, -2), q).mul_(2.0) if needs[1] else None
        return grad_q, grad_k, grad_v, None


def squared_relu_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor] = None) -> Tensor:
    """``(relu(q k^T)^2 masked to allowed) @ v``, unnormalised and unscaled (fold the scale into q).

    q (..., q_len, d), k (..., k_len, d), v (..., k_len, d_v) -> (..., q_len, d_v); ``allowed``: bool,
    broadcastable to (..., q_len, k_len), True where a query sees a key (None: every key)."""
    return _SquaredReluAttention.apply(q, k, v, None if allowed is None else ~allowed)


def _check_common(causal: bool, scores: str) -> None:
    check_bool("causal", causal)
    check_choice("scores", scores, SCORES)


# -- GAU: quadratic -------------------------------------------------------------------------------------------
def gau_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """The gated attention unit's single-head quadratic attention (see the module docstring for the scaling).

    Args:
        q, k: (batch, heads, seq, d), the query and key forms; v: (batch, heads, seq, e).
        causal: each query sees the keys up to its own position.
        key_padding_mask: (batch, seq) bool, True = padding.
        scores: "relu2" (squared ReLU divided by the number of visible keys) or "softmax".

    Returns:
        (batch, heads, seq, e); rows that see no key are zero.
    """
    _check_common(causal, scores)
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"gau_attention is self-attention: q and k lengths must match, got {q.shape[2]}, {k.shape[2]}")
    return gau_attention_unchecked(q, k, v, causal, key_padding_mask, scores)


def gau_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], scores: str
) -> Tensor:
    """:func:`gau_attention` on checked arguments. Also the decoding step: one query (q_len = 1) over the
    k_len keys of a cache, non-causal (it sees them all), bottom-right aligned like every causal mask."""
    dtype = q.dtype
    compute = working_dtype(dtype)
    q, k, v = q.to(compute), zero_padded(k, key_padding_mask).to(compute), zero_padded(v, key_padding_mask).to(compute)
    batch, _, q_len, dim = q.shape
    k_len = k.shape[2]
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, q.device)
    if scores == "softmax":
        return masked_sdpa(q, k, v, allowed).to(dtype)
    # The scale goes on q, not over the (q_len x k_len) scores: one pass fewer.
    out = squared_relu_attention(q * (1.0 / math.sqrt(dim)), k, v, allowed)
    if allowed is None:
        return (out / k_len).to(dtype)
    visible = allowed.expand(batch, 1, q_len, k_len).sum(-1, keepdim=True).clamp_min(1).to(compute)
    return (out / visible).to(dtype)


def gau_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """:func:`gau_attention` by the definition, in float64, pair by pair through a full weight matrix."""
    q, k, v = q.double(), zero_padded(k.double(), key_padding_mask), zero_padded(v.double(), key_padding_mask)
    batch, heads, length, dim = q.shape
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(dim)
    allowed = torch.ones(batch, heads, length, length, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    if scores == "softmax":
        weights = masked_softmax_reference(logits, allowed)
    else:
        count = allowed.sum(-1, keepdim=True).clamp_min(1).double()
        weights = torch.where(allowed, torch.clamp(logits, min=0.0) ** 2, torch.zeros_like(logits)) / count
    return weights @ v


# -- FLASH: mixed chunk attention -----------------------------------------------------------------------------
def mixed_chunk_attention(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """FLASH's mixed chunk attention (see the module docstring for the exact scaling).

    Args:
        q_quad, k_quad: (batch, heads, seq, d), the forms of the quadratic attention inside each chunk.
        q_lin, k_lin: (batch, heads, seq, d), the forms of the linear attention across chunks.
        v: (batch, heads, seq, e).
        chunk_size: c, positions per chunk (the last chunk may be shorter).
        causal: causal mask inside the chunk, prefix sums of the previous chunks' states across chunks.
        key_padding_mask: (batch, seq) bool, True = padding.
        scores: "relu2" or "softmax" inside the chunks.

    Returns:
        (batch, heads, seq, e). Time O(N c (d + e) + N d e), memory O(N c + (N / c) d e).
    """
    _check_common(causal, scores)
    check_number("chunk_size", chunk_size, integer=True, minimum=1)
    check_qkv(q_quad, k_quad, v)
    check_qkv(q_lin, k_lin, v)
    if not (q_quad.shape == k_quad.shape == q_lin.shape == k_lin.shape):
        raise ValueError(
            "q_quad, k_quad, q_lin and k_lin must share one shape (self-attention), got "
            f"{tuple(q_quad.shape)}, {tuple(k_quad.shape)}, {tuple(q_lin.shape)}, {tuple(k_lin.shape)}"
        )
    check_key_padding_mask(key_padding_mask, q_quad.shape[0], q_quad.shape[2], q_quad.device)
    return mixed_chunk_attention_unchecked(q_quad, k_quad, q_lin, k_lin, v, chunk_size, causal, key_padding_mask,
                                           scores)


def _chunked(x: Tensor, chunks: int, size: int) -> Tensor:
    """(batch, heads, seq, dim) -> (batch, heads, chunks, size, dim), zero-padded at the end."""
    batch, heads, length, dim = x.shape
    if chunks * size != length:
        x = F.pad(x, (0, 0, 0, chunks * size - length))
    return x.reshape(batch, heads, chunks, size, dim)


def mixed_chunk_attention_unchecked(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    scores: str,
) -> Tensor:
    """:func:`mixed_chunk_attention` on checked arguments."""
    dtype = q_quad.dtype
    compute = working_dtype(dtype)
    batch, heads, length, dim = q_quad.shape
    width = v.shape[3]
    device = q_quad.device
    # Tensors are cut into chunks of `size` positions; the scale stays 1/chunk_size (a sequence shorter than one
    # chunk is one short chunk, not padded to a full one).
    size = min(chunk_size, length)
    chunks = -(-length // size)
    total = chunks * size

    valid = torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None \
        else ~key_padding_mask
    valid = F.pad(valid, (0, total - length))  # the positions added to fill the last chunk are not keys
    valid_chunks = valid.view(batch, 1, chunks, size)

    k_quad, k_lin = zero_padded(k_quad, key_padding_mask), zero_padded(k_lin, key_padding_mask)
    q_quad, k_quad = (_chunked(x.to(compute), chunks, size) for x in (q_quad, k_quad))
    q_lin, k_lin = (_chunked(x.to(compute), chunks, size) for x in (q_lin, k_lin))
    v = _chunked(zero_padded(v, key_padding_mask).to(compute), chunks, size)
    zero = torch.zeros((), dtype=compute, device=device)
    k_lin = torch.where(valid_chunks[..., None], k_lin, zero)

    # Quadratic attention inside each chunk: (batch, heads, chunks, size, size).
    allowed = valid_chunks[:, :, :, None, :]
    if causal:
        allowed = allowed & torch.ones(size, size, dtype=torch.bool, device=device).tril()
    allowed = allowed.expand(batch, 1, chunks, size, size)
    if scores == "softmax":
        flat = lambda x: x.reshape(batch, heads * chunks, size, x.shape[-1])  # noqa: E731
        mask = allowed.expand(batch, heads, chunks, size, size).reshape(batch, heads * chunks, size, size)
        quadratic = masked_sdpa(flat(q_quad), flat(k_quad), flat(v), mask).view(batch, heads, chunks, size, width)
    else:
        # relu(s / sqrt(d))^2 / c = relu(s / sqrt(d c))^2: both scales go on q, none over the (size x size) scores.
        quadratic = squared_relu_attention(q_quad * (1.0 / math.sqrt(dim * chunk_size)), k_quad, v, allowed)

    # Linear attention across chunks, on one (dim x width) state per chunk.
    states = torch.matmul(k_lin.transpose(-1, -2), v)  # (batch, heads, chunks, dim, width)
    counts = valid_chunks.sum(-1).to(compute)  # (batch, 1, chunks)
    if causal:
        # Exclusive prefix sums: chunk g reads chunks 0 .. g - 1 (written in place, forward and backward).
        states = lagged_prefix_sums(states, 1)
        counts = torch.cumsum(counts, dim=2) - counts
    else:
        states = states.sum(dim=2, keepdim=True)
        counts = counts.sum(dim=2, keepdim=True)
    scale = (counts.clamp_min(1.0) * math.sqrt(dim))[..., None, None]
    linear = torch.matmul(q_lin, states / scale)

    out = (quadratic + linear).reshape(batch, heads, total, width)[:, :, :length]
    return out.to(dtype)


def mixed_chunk_attention_reference(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    scores: str = "relu2",
) -> Tensor:
    """:func:`mixed_chunk_attention` by the definition in float64: one full (seq x seq) weight matrix, the
    quadratic weight of every pair in one chunk plus the linear weight of every pair the linear part covers."""
    q_quad, q_lin = q_quad.double(), q_lin.double()
    k_quad = zero_padded(k_quad.double(), key_padding_mask)
    k_lin = zero_padded(k_lin.double(), key_padding_mask)
    v = zero_padded(v.double(), key_padding_mask)
    batch, heads, length, dim = q_quad.shape
    chunk = torch.arange(length) // chunk_size
    same_chunk = chunk[:, None] == chunk[None, :]
    earlier_chunk = chunk[None, :] < chunk[:, None]
    is_key = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    if key_padding_mask is not None:
        is_key = ~key_padding_mask[:, None, None, :]

    in_chunk = same_chunk & (torch.ones(length, length, dtype=torch.bool).tril() if causal else True)
    in_chunk = in_chunk & is_key
    logits = torch.einsum("bhid,bhjd->bhij", q_quad, k_quad) / math.sqrt(dim)
    if scores == "softmax":
        quadratic = masked_softmax_reference(logits, in_chunk.expand(batch, heads, length, length))
    else:
        quadratic = torch.where(in_chunk, torch.clamp(logits, min=0.0) ** 2, torch.zeros_like(logits)) / chunk_size

    covered = (earlier_chunk if causal else torch.ones(length, length, dtype=torch.bool)) & is_key
    count = covered.sum(-1, keepdim=True).clamp_min(1).double()
    lin_logits = torch.einsum("bhid,bhjd->bhij", q_lin, k_lin) / math.sqrt(dim)
    linear = torch.where(covered, lin_logits, torch.zeros_like(lin_logits)) / count
    return (quadratic + linear) @ v


__all__ = [
    "SCORES",
    "gau_attention",
    "gau_attention_reference",
    "gau_attention_unchecked",
    "mixed_chunk_attention",
    "mixed_chunk_attention_reference",
    "mixed_chunk_attention_unchecked",
    "rotate",
    "rotate_reference",
    "scale_offset",
]

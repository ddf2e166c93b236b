"""The attention of the gated attention unit (GAU, Hua et al. 2022, "Transformer Quality in Linear Time"),
on per-head tensors, with float64 references; and what it shares with FLASH's mixed chunk attention
(:mod:`attnzoo.functional.mixed_chunk`): the query and key forms and the squared-ReLU core.

Both take their queries and keys in the forms the paper derives from one shared projection: a cheap
per-dimension scale and offset (:func:`scale_offset`), optionally followed by rotary positions
(:func:`rotate`). The functions below take those forms ready-made.

Scores. ``scores="relu2"`` weights key j for query i by the squared ReLU of the scaled dot product,
``relu(q_i . k_j / sqrt(d))^2``, divided by a length (not normalised per row, as in the paper);
``scores="softmax"`` uses the softmax of ``q_i . k_j / sqrt(d)`` over the same keys instead.

GAU (:func:`gau_attention`) is quadratic, one score per pair. The squared-ReLU weights of row i are divided by
``n_i``, the number of keys the row sees: the N (unpadded) keys of the sequence when non-causal, which is the
paper's 1/N; the ``i + 1`` keys up to and including position i when causal (fewer where padded), so that a
row's scale never depends on later positions and decoding one token at a time gives the same output.

Padded keys and values are zeroed before use and masked out of every sum, so whatever they hold changes no
output. Code paths depend on shapes only, never on mask values.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._autocast import outside_autocast
from .._dtypes import working_dtype
from .._validation import check_bool, check_choice, check_key_padding_mask, check_qkv
from .masks import allowed_mask, zero_padded
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
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, blocked: Optional[Tensor]) -> Tensor:  # type: ignore[override]
        r = torch.matmul(q, k.transpose(-1, -2)).relu_()
        if blocked is not None:
            r.masked_fill_(blocked, 0.0)
        ctx.save_for_backward(q, k, v, r)
        return torch.matmul(r.square(), v)

    @staticmethod
    @outside_autocast
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


__all__ = [
    "SCORES",
    "gau_attention",
    "gau_attention_reference",
    "gau_attention_unchecked",
    "rotate",
    "rotate_reference",
    "scale_offset",
    "squared_relu_attention",
]

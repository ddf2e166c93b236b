"""Per-channel decay inside a chunk: the products ``M_tj = sum_c x_tc y_jc exp(g_tc - g_jc)`` (j <= t, 0 above
the diagonal) that the chunked delta rule needs when the log decay has one value per key channel (Kimi Delta
Attention), with their backward.

With a scalar decay per position these are ``(X Y^T) * Gamma``, one matmul and a mask. Per channel the decay
sits inside the sum, so it cannot be applied afterwards; the product must be factored,
``(x_t * exp(g_t - r)) . (y_j * exp(r - g_j))``, around a reference ``r``. The factors overflow unless both
exponents are <= 0, i.e. unless ``r`` lies between ``j`` and ``t`` (the cumulative log decay falls
monotonically, and a single step may be as low as -100 or less: ``exp`` of a difference across a whole chunk
is then far out of range in float32, and even float64). A reference at the chunk's start, end or middle is
therefore unsafe; fla's ``chunk_intra`` uses sub-chunks (a reference at each sub-chunk boundary for the pairs
across sub-chunks, the pairs inside one computed element by element).

Here the split is recursive: a block of 2h positions splits into halves, the pairs (second half, first half)
take the reference at the boundary (the last position of the first half), so both factors are <= 1 and
nothing overflows (an underflow stands for a product that is that small), and each half recurses down to
single positions (the diagonal, ``x_t . y_t``). Each level is one matmul of the C/2 second-half rows by the
C/2 first-half columns (the blocks of the level lie on its block diagonal), so the cost is O(C d log C)
elementwise work and log2(C) matmuls of (C/2 x d)(d x C/2) per chunk. A chunk whose length is not a power of
two is padded with positions that hold zeros and do not decay.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import outside_autocast


def _padded_length(chunk: int) -> int:
    # int(): under torch.jit.trace a size is a tensor; the chunk length is a constant of the traced graph.
    return 1 << max(int(chunk) - 1, 0).bit_length()


def _pad(x: Tensor, y: Tensor, g: Tensor, extra: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Zero rows for x and y, and g held at its last value (no decay), up to a power-of-two length."""
    if not extra:
        return x, y, g
    x, y = F.pad(x, (0, 0, 0, extra)), F.pad(y, (0, 0, 0, extra))
    return x, y, torch.cat([g, g[..., -1:, :].expand(*g.shape[:-2], extra, g.shape[-1])], dim=-2)


def _level_factors(g: Tensor, level: int) -> Tuple[Tensor, Tensor]:
    """At ``level`` (blocks of 2h positions, h = C >> (level + 1)): ``exp(g_t - r)`` for the second halves'
    rows and ``exp(r - g_j)`` for the first halves' columns, r the last log decay of each first half; both
    (..., P, h, d) with P = C / 2h, both <= 1."""
    chunk, width = int(g.shape[-2]), g.shape[-1]
    half = chunk >> (level + 1)
    blocks = g.view(*g.shape[:-2], chunk // (2 * half), 2, half, width)
    reference = blocks[..., 0, -1:, :]
    return torch.sub(blocks[..., 1, :, :], reference).exp_(), torch.sub(reference, blocks[..., 0, :, :]).exp_()


def _halves(x: Tensor, level: int, which: int) -> Tensor:
    """The second (which=1) or first (which=0) halves of the level's blocks: (..., P, h, d), a view."""
    chunk, width = int(x.shape[-2]), x.shape[-1]
    half = chunk >> (level + 1)
    return x.view(*x.shape[:-2], chunk // (2 * half), 2, half, width)[..., which, :, :]


def _level_operands(x: Tensor, y: Tensor, g: Tensor, level: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(exp factors of rows, of columns, scaled rows (..., S * C/2, d), scaled columns (..., C/2, d))."""
    rows, columns = _level_factors(g, level)
    half_chunk = int(y.shape[-2]) // 2
    x_scaled = (_halves(x, level, 1) * rows.unsqueeze(-4)).view(*x.shape[:-3], -1, x.shape[-1])
    y_scaled = (_halves(y, level, 0) * columns).view(*y.shape[:-2], half_chunk, y.shape[-1])
    return rows, columns, x_scaled, y_scaled


def _tables(chunk: int, stacked: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Index tables between M (stacked, C, C) flattened and the sources: every level's (stacked, C/2, C/2)
    products flattened one level after another, then the (stacked, C) diagonal, then one zero. Returns
    (for each entry of M its source, for each level product entry its entry of M or the zero past M's end).
    Built from aranges each call (a few thousand integers), so traced and compiled graphs hold them."""
    levels, half = chunk.bit_length() - 1, chunk // 2
    per_level = stacked * half * half
    s = torch.arange(stacked, device=device).view(-1, 1, 1)
    t = torch.arange(chunk, device=device).view(1, -1, 1)
    j = torch.arange(chunk, device=device).view(1, 1, -1)
    place = torch.full((stacked, chunk, chunk), levels * per_level + stacked * chunk, device=device)
    a = torch.arange(half, device=device).view(1, -1, 1)
    b = torch.arange(half, device=device).view(1, 1, -1)
    inverse = []
    for level in range(levels):
        h = chunk >> (level + 1)
        block_t, block_j = t // (2 * h), j // (2 * h)
        selected = (block_t == block_j) & (t % (2 * h) >= h) & (j % (2 * h) < h)
        source = level * per_level + s * half * half + (block_t * h + t % h) * half + block_j * h + j % h
        place = torch.where(selected, source, place)
        row, column = a // h * 2 * h + h + a % h, b // h * 2 * h + b % h
        entry = s * chunk * chunk + row * chunk + column
        inverse.append(torch.where(a // h == b // h, entry, stacked * chunk * chunk).flatten())
    place = torch.where(t == j, levels * per_level + s * chunk + t, place)
    return place.flatten(), torch.cat(inverse) if inverse else place.new_zeros(0)


def _gathered(source: Tensor, batch_dims: int, index: Tensor) -> Tensor:
    """``source[..., index]`` over the last dimension, as an index_select of a 2-d view (several times faster
    on CPUs than index_select along the last dimension of a many-dimensional tensor)."""
    flat = source.reshape(-1, source.shape[-1]).index_select(1, index)
    return flat.view(*source.shape[:batch_dims], index.shape[0])


def decayed_products_unchecked(x: Tensor, y: Tensor, g: Tensor) -> Tensor:
    """x (..., S, C, d) (S stacked row operands, e.g. queries and keys), y (..., C, d), g (..., C, d) the
    cumulative log decay within the chunk (non-increasing along C). Returns M (..., S, C, C):
    ``M_tj = sum_c x_tc y_jc exp(g_tc - g_jc)`` for j <= t, 0 above the diagonal (module docstring)."""
    chunk = int(y.shape[-2])
    padded = _padded_length(chunk)
    x, y, g = _pad(x, y, g, padded - chunk)
    products: List[Tensor] = []
    for level in range(padded.bit_length() - 1):
        _, _, x_scaled, y_scaled = _level_operands(x, y, g, level)
        products.append((x_scaled @ y_scaled.transpose(-1, -2)).flatten(-2))
    diagonal = (x * y.unsqueeze(-3)).sum(-1).flatten(-2)
    source = torch.cat(products + [diagonal, diagonal.new_zeros(*diagonal.shape[:-1], 1)], dim=-1)
    place, _ = _tables(padded, int(x.shape[-3]), x.device)
    out = _gathered(source, source.dim() - 1, place).view(*x.shape[:-1], padded)
    return out[..., :chunk, :chunk]


def decayed_products_backward(grad: Tensor, x: Tensor, y: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """Gradients (of x (..., S, C, d), of y (..., C, d)) from that of M (..., S, C, C), whose entries above the
    diagonal must be zero. That of g is ``(x * grad_x).sum(S) - y * grad_y``: M depends on g only through
    ``exp(g_t - g_j)``, which multiplies x_t and y_j."""
    chunk, stacked = int(y.shape[-2]), int(x.shape[-3])
    padded = _padded_length(chunk)
    x, y, g = _pad(x, y, g, padded - chunk)
    if padded != chunk:
        grad = F.pad(grad, (0, padded - chunk, 0, padded - chunk))
    _, inverse = _tables(padded, stacked, x.device)
    flat = grad.flatten(-3)
    levels, half = padded.bit_length() - 1, padded // 2
    by_level = _gathered(torch.cat([flat, flat.new_zeros(*flat.shape[:-1], 1)], dim=-1), flat.dim() - 1, inverse)
    by_level = by_level.view(*flat.shape[:-1], levels, stacked * half, half)
    diagonal = grad.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    grad_x = diagonal * y.unsqueeze(-3)
    grad_y = (diagonal * x).sum(-3)
    for level in range(levels):
        rows, columns, x_scaled, y_scaled = _level_operands(x, y, g, level)
        grad_level = by_level[..., level, :, :]
        # (Y^T dM^T)^T: a (d x C/2)(C/2 x S C/2) product runs about twice as fast on CPUs as dM Y, whose
        # (S C/2 x C/2)(C/2 x d) shape has the short side inside.
        grad_rows = (y_scaled.transpose(-1, -2) @ grad_level.transpose(-1, -2)).transpose(-1, -2)
        grad_rows = grad_rows.unflatten(-2, (stacked, *rows.shape[-3:-1]))
        _halves(grad_x, level, 1).addcmul_(grad_rows, rows.unsqueeze(-4))
        grad_columns = (grad_level.transpose(-1, -2) @ x_scaled).view_as(columns)
        _halves(grad_y, level, 0).addcmul_(grad_columns, columns)
    return grad_x[..., :chunk, :], grad_y[..., :chunk, :]


class DecayedProducts(torch.autograd.Function):
    """:func:`decayed_products_unchecked` with its backward, for the forms differentiated by autograd (the
    non-causal and compiled chunked forms): (x, y, g) -> M, as documented there."""

    @staticmethod
    @outside_autocast
    def forward(ctx, x: Tensor, y: Tensor, g: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, y, g)
        return decayed_products_unchecked(x, y, g)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, y, g = ctx.saved_tensors
        chunk = y.shape[-2]
        lower = torch.ones(chunk, chunk, dtype=torch.bool, device=grad.device).tril()
        grad_x, grad_y = decayed_products_backward(grad.masked_fill(~lower, 0.0), x, y, g)
        grad_g = (x * grad_x).sum(-3) - y * grad_y
        return grad_x, grad_y, grad_g


__all__ = ["DecayedProducts", "decayed_products_backward", "decayed_products_unchecked"]

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

Most chunks need none of that: where every channel's log decay falls by at most ``log(max) / 2`` of the
dtype across the chunk (44 in float32, 354 in float64), one reference per channel at the middle of its range,
``r = (g_first + g_last) / 2``, keeps both factors within ``exp(+-log(max) / 4)`` (e^22 in float32), far from
overflow and underflow, and the whole chunk is one matmul, ``tril((X * exp(g - r)) (Y * exp(r - g))^T)``, as
exact as the recursion (each term is still a product of two rounded factors). The functions here take that
form for every such chunk and the recursion for the others (gathered, computed, and written back), so a head
with strong decays costs only its own chunks. A traced or compiled graph always takes the recursion: the
choice reads the data, and a graph must hold one path that is right for any input.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

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


def _recursive_products(x: Tensor, y: Tensor, g: Tensor) -> Tensor:
    """:func:`decayed_products_unchecked` by the recursion over halves, safe for any decay."""
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


def _recursive_backward(grad: Tensor, x: Tensor, y: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`decayed_products_backward` by the recursion over halves, safe for any decay."""
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


def _single_reference_factors(g: Tensor, clamp: bool) -> Tuple[Tensor, Tensor]:
    """``exp(g - r)`` and ``exp(r - g)`` (..., C, d), r the middle of each chunk's range per channel. ``clamp``
    bounds the exponents at ``log(max) / 4`` (a no-op in a chunk that may take this form; elsewhere it keeps the
    values, which the recursion then replaces, finite and clear of slow subnormals)."""
    difference = g - 0.5 * (g[..., :1, :] + g[..., -1:, :])
    if clamp:
        bound = _log_max(g.dtype) / 4
        difference.clamp_(-bound, bound)
    rows = difference.exp_()
    return rows, rows.reciprocal()


def _log_max(dtype: torch.dtype) -> float:
    return math.log(torch.finfo(dtype).max)


def _single_reference_chunks(g: Tensor) -> Optional[Tensor]:
    """For g (L, C, d): which of the L chunks may take the single-reference form (bool (L,)), or None where the
    recursion must serve them all: none may, or a graph is being traced or compiled (module docstring)."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or g.shape[-2] == 0:
        return None
    safe = (g[..., 0, :] - g[..., -1, :]).amax(-1) <= _log_max(g.dtype) / 2
    return safe if bool(safe.any()) else None


class ChunkFactors(NamedTuple):
    """What one g (..., C, d) gives every product and decay factor of a chunked rule, computed once.

    ``rows`` = exp(g - r) and ``columns`` = exp(r - g), flattened to (L, C, d), r the middle of each chunk's
    range per channel, or both None where every chunk takes the recursion (:func:`_single_reference_chunks`);
    ``unsafe``: the indices of the chunks that take it (possibly empty)."""

    g: Tensor
    rows: Optional[Tensor]
    columns: Optional[Tensor]
    unsafe: Optional[Tensor]


def chunk_factors(g: Tensor) -> ChunkFactors:
    """The :class:`ChunkFactors` of g (..., C, d), the cumulative log decay within each chunk."""
    gf = g.reshape(-1, int(g.shape[-2]), g.shape[-1])
    safe = _single_reference_chunks(gf)
    if safe is None:
        return ChunkFactors(g, None, None, None)
    unsafe = (~safe).nonzero().squeeze(1)
    rows, columns = _single_reference_factors(gf, clamp=bool(unsafe.numel()))
    return ChunkFactors(g, rows, columns, unsafe)


def decay_factors(factors: ChunkFactors) -> Tuple[Tensor, Tensor]:
    """``exp(g)`` and ``exp(g_C - g)`` (..., C, d), the decays from each chunk's start and to its end, which the
    chunked rules scale their rows by. In a chunk that has single-reference factors they are those times a
    vector per chunk (``exp(r)``, ``exp(g_C - r)``), one product each instead of an ``exp``; the other chunks take
    the ``exp`` itself. Every exponent is <= 0 either way; where ``exp(r)`` underflows the true value is below
    ``exp(r + log(max) / 4)``, far under the dtype's resolution of the sums it enters."""
    g = factors.g
    if factors.rows is None or factors.columns is None or factors.unsafe is None:
        return g.exp(), (g[..., -1:, :] - g).exp()
    gf = g.reshape(factors.rows.shape)
    middle = 0.5 * (gf[..., :1, :] + gf[..., -1:, :])
    from_start = factors.rows * middle.exp()
    to_end = factors.columns * (gf[..., -1:, :] - middle).exp()
    if factors.unsafe.numel():
        strong = gf.index_select(0, factors.unsafe)
        from_start.index_copy_(0, factors.unsafe, strong.exp())
        to_end.index_copy_(0, factors.unsafe, (strong[..., -1:, :] - strong).exp())
    return from_start.view_as(g), to_end.view_as(g)


def decayed_products_unchecked(x: Tensor, y: Tensor, g: Tensor) -> Tensor:
    """x (..., S, C, d) (S stacked row operands, e.g. queries and keys), y (..., C, d), g (..., C, d) the
    cumulative log decay within the chunk (non-increasing along C). Returns M (..., S, C, C):
    ``M_tj = sum_c x_tc y_jc exp(g_tc - g_jc)`` for j <= t, 0 above the diagonal (module docstring)."""
    return decayed_products_many(x.unbind(-3), (y,), g)[0]


def _scaled_rows(xs: Sequence[Tensor], rows: Tensor) -> Tensor:
    """Each row operand of ``xs`` (each (..., C, d)) times the factors ``rows`` (L, C, d), written side by side
    into one (L, S * C, d) tensor: the rows of every operand meet the columns in one matmul, and no stacked copy
    of the operands is made first."""
    length, chunk, width = rows.shape
    scaled = rows.new_empty(length, len(xs), chunk, width)
    for index, x in enumerate(xs):
        torch.mul(x.reshape(length, chunk, width), rows, out=scaled[:, index])
    return scaled.view(length, len(xs) * chunk, width)


def _stacked_chunks(xs: Sequence[Tensor], chunks: Tensor, chunk: int, width: int) -> Tensor:
    """The chunks ``chunks`` (indices into the flattened leading dimensions) of each operand, stacked:
    (len(chunks), S, C, d)."""
    return torch.stack([x.reshape(-1, chunk, width).index_select(0, chunks) for x in xs], dim=1)


def decayed_products_many(xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor,
                          factors: Optional[ChunkFactors] = None) -> List[Tensor]:
    """:func:`decayed_products_unchecked` of the row operands ``xs`` (S of them, each (..., C, d)) against each
    column operand of ``ys`` (each (..., C, d)): for each y, M (..., S, C, C), the factors and the scaled rows
    computed once (``factors``: g's :func:`chunk_factors`, where the caller has them)."""
    chunk, width = int(g.shape[-2]), g.shape[-1]
    rows, columns, unsafe = (factors or chunk_factors(g))[1:]
    if rows is None or columns is None or unsafe is None:
        x = torch.stack(list(xs), dim=-3)
        return [_recursive_products(x, y, g) for y in ys]
    x_scaled = _scaled_rows(xs, rows)
    if unsafe.numel():  # gathered once for every column operand
        gf = g.reshape(-1, chunk, width)
        x_unsafe, g_unsafe = _stacked_chunks(xs, unsafe, chunk, width), gf.index_select(0, unsafe)
    outs = []
    for y in ys:
        yf = y.reshape(-1, chunk, width)
        out = (x_scaled @ (yf * columns).transpose(-1, -2)).view(-1, len(xs), chunk, chunk).tril_()
        if unsafe.numel():
            out.index_copy_(0, unsafe, _recursive_products(x_unsafe, yf.index_select(0, unsafe), g_unsafe))
        outs.append(out.view(*g.shape[:-2], len(xs), chunk, chunk))
    return outs


def decayed_products_backward(grad: Tensor, x: Tensor, y: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """Gradients (of x (..., S, C, d), of y (..., C, d)) from that of M (..., S, C, C), whose entries above the
    diagonal must be zero. That of g is ``(x * grad_x).sum(S) - y * grad_y``: M depends on g only through
    ``exp(g_t - g_j)``, which multiplies x_t and y_j."""
    grad_x, (grad_y,) = decayed_products_backward_many((grad,), x.unbind(-3), (y,), g)
    return grad_x, grad_y


def decayed_products_backward_many(grads: Sequence[Tensor], xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor,
                                   factors: Optional[ChunkFactors] = None) -> Tuple[Tensor, List[Tensor]]:
    """The backward of :func:`decayed_products_many`: from the gradient of each product (as
    :func:`decayed_products_backward` takes it), (the gradient of the row operands, stacked (..., S, C, d) and
    summed over the products, [the gradient of each y])."""
    chunk, width = int(g.shape[-2]), g.shape[-1]
    rows, columns, unsafe = (factors or chunk_factors(g))[1:]
    if rows is None or columns is None or unsafe is None:
        x = torch.stack(list(xs), dim=-3)
        pairs = [_recursive_backward(grad, x, y, g) for grad, y in zip(grads, ys)]
        return torch.stack([pair[0] for pair in pairs]).sum(0), [pair[1] for pair in pairs]
    length, stacked = rows.shape[0], len(xs)
    x_scaled = _scaled_rows(xs, rows)
    grad_x_scaled: Optional[Tensor] = None
    grad_ys = []
    for grad, y in zip(grads, ys):
        yf, grad_flat = y.reshape(-1, chunk, width), grad.reshape(length, stacked * chunk, chunk)
        y_scaled = yf * columns
        # The first product is written, the others added to it: no zero-filled tensor to start from.
        grad_x_scaled = grad_flat @ y_scaled if grad_x_scaled is None else grad_x_scaled.baddbmm_(grad_flat, y_scaled)
        grad_ys.append((grad_flat.transpose(-1, -2) @ x_scaled).mul_(columns))
    assert grad_x_scaled is not None
    grad_x = grad_x_scaled.view(length, stacked, chunk, width).mul_(rows.unsqueeze(1))
    if unsafe.numel():
        gf = g.reshape(-1, chunk, width)
        x_unsafe, g_unsafe = _stacked_chunks(xs, unsafe, chunk, width), gf.index_select(0, unsafe)
        grad_x_unsafe = None
        for grad, y, grad_y in zip(grads, ys, grad_ys):
            grad_unsafe = grad.reshape(length, stacked, chunk, chunk).index_select(0, unsafe)
            part_x, part_y = _recursive_backward(grad_unsafe, x_unsafe, y.reshape(-1, chunk, width).index_select(
                0, unsafe), g_unsafe)
            grad_x_unsafe = part_x if grad_x_unsafe is None else grad_x_unsafe.add_(part_x)
            grad_y.index_copy_(0, unsafe, part_y)
        grad_x.index_copy_(0, unsafe, grad_x_unsafe)
    return grad_x.view(*g.shape[:-2], stacked, chunk, width), [grad_y.view_as(y) for grad_y, y in zip(grad_ys, ys)]


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


__all__ = ["ChunkFactors", "DecayedProducts", "chunk_factors", "decay_factors", "decayed_products_backward",
           "decayed_products_backward_many", "decayed_products_many", "decayed_products_unchecked"]

"""Per-channel decay inside a chunk: the products ``M_tj = sum_c x_tc y_jc exp(g_tc - g_jc)`` (j <= t, 0 above
the diagonal) that the chunked delta rule needs when the log decay has one value per key channel (Kimi Delta
Attention), with their backward.

With a scalar decay per position these are ``(X Y^T) * Gamma``, one matmul and a mask. Per channel the decay
sits inside the sum, so it cannot be applied afterwards; the product must be factored,
``(x_t * exp(g_t - r)) . (y_j * exp(r - g_j))``, around a reference ``r`` per channel. The cumulative log decay
falls monotonically, and a single step may be as low as -100 or less, so over a whole chunk ``exp`` of the
difference to a fixed reference may be far out of range in float32, and even float64.

One reference per block, at the middle of each channel's range, ``r = (g_first + g_last) / 2``: where every
channel's log decay falls by at most ``log(max)`` of the dtype across the block (88 in float32, 709 in float64),
both factors stay within ``exp(+-log(max) / 2)`` (e^44 in float32, 19 orders of magnitude from overflow and
from the subnormals), and the block is one matmul, ``tril((X * exp(g - r)) (Y * exp(r - g))^T)``. Each term of
the lower triangle is a product of two rounded factors whose exponents sum to ``g_t - g_j <= 0``; the upper
triangle, which may overflow, is overwritten by the mask.

A block whose decay spans more is split in halves: the pairs (second half, first half) take the reference at
the boundary (the last position of the first half), so both factors are <= 1 and nothing overflows (an
underflow stands for a product that is that small), and each half is a block again, one reference if it spans
little enough, split again if not, down to single positions (the diagonal, ``x_t . y_t``). So a chunk costs
one matmul where the decay is gentle and O(C d log C) elementwise work with log2(C) half-size matmuls where it
is strong everywhere; fla's ``chunk_intra`` uses fixed sub-chunks instead (a reference at each sub-chunk
boundary for the pairs across sub-chunks, the pairs inside one computed element by element). The blocks that
split are gathered, computed, and written back, so a head with strong decays costs only its own chunks. A
chunk whose length is not a power of two is padded for the split with positions that hold zeros and do not
decay.

A traced or compiled graph always splits down to single positions: the choice reads the data, and a graph
must hold one path that is right for any input.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autocast import outside_autocast
from ..exp_floor import exp_nonpositive, exp_nonpositive_


def log_max(dtype: torch.dtype) -> float:
    """log of the dtype's largest finite number: 88.7 in float32, 709.8 in float64."""
    return math.log(torch.finfo(dtype).max)


def graph_fixed() -> bool:
    """Whether a graph is being traced or compiled: then every block splits, whatever its decay."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _fits_one_reference(g: Tensor) -> Tensor:
    """For g (L, C, d): which of the L blocks take one reference (bool (L,)): those whose every channel falls by
    at most ``log(max)`` of the dtype across the block (module docstring)."""
    return (g[..., 0, :] - g[..., -1, :]).amax(-1) <= log_max(g.dtype)


def _one_reference_factors(g: Tensor, clamp: bool) -> Tuple[Tensor, Tensor]:
    """``exp(g - r)`` and ``exp(r - g)`` (..., C, d), r the middle of each block's range per channel. ``clamp``
    bounds the exponents at ``log(max) / 2`` (a no-op in a block that may take this form; elsewhere it keeps the
    values, which the split form then replaces, finite)."""
    difference = g - 0.5 * (g[..., :1, :] + g[..., -1:, :])
    if clamp:
        bound = log_max(g.dtype) / 2
        difference.clamp_(-bound, bound)
    rows = difference.exp_()
    return rows, rows.reciprocal()


def _scaled_rows(xs: Sequence[Tensor], rows: Tensor) -> Tensor:
    """Each row operand of ``xs`` (each (..., C, d)) times the factors ``rows`` (L, C, d), written side by side
    into one (L, S * C, d) tensor: the rows of every operand meet the columns in one matmul, and no stacked copy
    of the operands is made first."""
    length, chunk, width = rows.shape
    scaled = rows.new_empty(length, len(xs), chunk, width)
    for index, x in enumerate(xs):
        torch.mul(x.reshape(length, chunk, width), rows, out=scaled[:, index])
    return scaled.view(length, len(xs) * chunk, width)


def _one_reference_products(xs: Sequence[Tensor], ys: Sequence[Tensor], rows: Tensor, columns: Tensor
                            ) -> List[Tensor]:
    """The products of blocks that take one reference, given its factors (L, C, d): for each y, (L, S, C, C)."""
    length, chunk, width = rows.shape
    x_scaled = _scaled_rows(xs, rows)
    return [(x_scaled @ (y.reshape(length, chunk, width) * columns).transpose(-1, -2))
            .view(length, len(xs), chunk, chunk).tril_() for y in ys]


def _one_reference_backward(grads: Sequence[Tensor], xs: Sequence[Tensor], ys: Sequence[Tensor], rows: Tensor,
                            columns: Tensor) -> Tuple[Tensor, List[Tensor]]:
    """The backward of :func:`_one_reference_products`: (grad of the rows (L, S, C, d), [grad of each y])."""
    length, chunk, width = rows.shape
    stacked = len(xs)
    x_scaled = _scaled_rows(xs, rows)
    grad_x_scaled: Optional[Tensor] = None
    grad_ys = []
    for grad, y in zip(grads, ys):
        grad_flat = grad.reshape(length, stacked * chunk, chunk)
        y_scaled = y.reshape(length, chunk, width) * columns
        # The first product is written, the others added to it: no zero-filled tensor to start from.
        grad_x_scaled = grad_flat @ y_scaled if grad_x_scaled is None else grad_x_scaled.baddbmm_(grad_flat, y_scaled)
        grad_ys.append((grad_flat.transpose(-1, -2) @ x_scaled).mul_(columns))
    assert grad_x_scaled is not None
    return grad_x_scaled.view(length, stacked, chunk, width).mul_(rows.unsqueeze(1)), grad_ys


def _padded_length(chunk: int) -> int:
    # int(): under torch.jit.trace a size is a tensor; the chunk length is a constant of the traced graph.
    return 1 << max(int(chunk) - 1, 0).bit_length()


def _pad_rows(x: Tensor, extra: int) -> Tensor:
    """Zero rows after the C rows of x (..., C, d)."""
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def _pad_decay(g: Tensor, extra: int) -> Tensor:
    """g (L, C, d) held at its last value for ``extra`` more positions (they do not decay)."""
    if not extra:
        return g
    return torch.cat([g, g[..., -1:, :].expand(g.shape[0], extra, g.shape[-1])], dim=-2)


def _blocks_as_halves(x: Tensor) -> Tensor:
    """(2L, S, h, d), each half of each of L blocks a block of its own, -> (L, S, 2h, d)."""
    blocks, stacked, half, width = x.shape
    return x.view(blocks // 2, 2, stacked, half, width).transpose(1, 2).reshape(blocks // 2, stacked, 2 * half, width)


def _boundary_factors(g: Tensor) -> Tuple[Tensor, Tensor]:
    """For blocks g (L, C, d), C even: ``exp(g_t - r)`` for the second half's rows and ``exp(r - g_j)`` for the
    first half's columns, r the log decay at the first half's last position; both (L, C/2, d), both <= 1."""
    half = g.shape[1] // 2
    reference = g[:, half - 1:half, :]
    return exp_nonpositive_(g[:, half:, :] - reference), exp_nonpositive_(reference - g[:, :half, :])


def _halves(xs: Sequence[Tensor]) -> List[Tensor]:
    """Blocks (L, C, d) -> (2L, C/2, d), each half a block of its own (a view of each)."""
    return [x.reshape(2 * x.shape[0], x.shape[1] // 2, x.shape[2]) for x in xs]


def _second_half_rows(xs: Sequence[Tensor], rows: Tensor) -> Tensor:
    """The second half of each block of every row operand (each (L, C, d)) times ``rows`` (L, C/2, d), stacked:
    (L, S * C/2, d). No ``out=`` (a compiled graph, which always takes the split form, cannot write into one)."""
    length, half, width = rows.shape
    return torch.stack([x[:, half:, :] * rows for x in xs], dim=1).view(length, len(xs) * half, width)


def _split_products(xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor) -> List[Tensor]:
    """Blocks of the row operands xs and the column operands ys (each (L, C, d)) and g (L, C, d), C a power of
    two, split in halves (module docstring): for each y, (L, S, C, C)."""
    length, chunk, width = g.shape
    stacked = len(xs)
    if chunk == 1:
        return [torch.stack([(x * y).sum(-1, keepdim=True) for x in xs], dim=1) for y in ys]
    half = chunk // 2
    rows, columns = _boundary_factors(g)
    x_rows = _second_half_rows(xs, rows)
    (g_halves,) = _halves([g])
    within = _mixed_products(_halves(xs), _halves(ys), g_halves, _choice(g_halves))
    outs = []
    for y, inside in zip(ys, within):
        out = g.new_empty(length, stacked, chunk, chunk)
        out[:, :, :half, half:] = 0.0
        out[:, :, half:, :half] = (x_rows @ (y[:, :half, :] * columns).transpose(-1, -2)).view(
            length, stacked, half, half)
        inside = inside.view(length, 2, stacked, half, half)
        out[:, :, :half, :half] = inside[:, 0]
        out[:, :, half:, half:] = inside[:, 1]
        outs.append(out)
    return outs


def _split_backward(grads: Sequence[Tensor], xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor
                    ) -> Tuple[Tensor, List[Tensor]]:
    """The backward of :func:`_split_products` from the gradient of each product (L, S, C, C) (only its lower
    triangle is read): (grad of the rows (L, S, C, d), [grad of each y (L, C, d)])."""
    length, chunk, width = g.shape
    stacked = len(xs)
    if chunk == 1:
        grad_x = torch.stack([grad * y.unsqueeze(1) for grad, y in zip(grads, ys)]).sum(0)
        return grad_x, [(grad * torch.stack(list(xs), dim=1)).sum(1) for grad in grads]
    half = chunk // 2
    rows, columns = _boundary_factors(g)
    x_rows = _second_half_rows(xs, rows)
    within = [torch.stack([grad[:, :, :half, :half], grad[:, :, half:, half:]], dim=1).reshape(
        2 * length, stacked, half, half) for grad in grads]
    (g_halves,) = _halves([g])
    grad_halves, grad_ys_halves = _mixed_backward(within, _halves(xs), _halves(ys), g_halves, _choice(g_halves))
    grad_x = _blocks_as_halves(grad_halves)
    grad_ys = [grad_y.view(length, chunk, width) for grad_y in grad_ys_halves]
    grad_x_rows: Optional[Tensor] = None
    for grad, y, grad_y in zip(grads, ys, grad_ys):
        across = grad[:, :, half:, :half].reshape(length, stacked * half, half)
        y_columns = y[:, :half, :] * columns
        grad_x_rows = across @ y_columns if grad_x_rows is None else grad_x_rows.baddbmm_(across, y_columns)
        grad_y[:, :half, :].addcmul_(across.transpose(-1, -2) @ x_rows, columns)
    assert grad_x_rows is not None
    grad_x[:, :, half:, :].addcmul_(grad_x_rows.view(length, stacked, half, width), rows.unsqueeze(1))
    return grad_x, grad_ys


Choice = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]
"""(rows, columns, split): the single-reference factors of every block (L, C, d) and the indices of the blocks
that split instead (possibly none); all None where every block splits."""


def _choice(g: Tensor) -> Choice:
    """Which blocks of g (L, C, d) take one reference, with their factors (:data:`Choice`): every block splits
    where a graph is traced or compiled (module docstring) or none fits."""
    if graph_fixed() or g.shape[1] == 0:
        return None, None, None
    fits = _fits_one_reference(g)
    if not bool(fits.any()):
        return None, None, None
    split = (~fits).nonzero().squeeze(1)
    return (*_one_reference_factors(g, clamp=bool(split.numel())), split)


def _mixed_products(xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor, choice: Choice) -> List[Tensor]:
    """Blocks xs, ys, g (each (L, C, d)): one reference for every block, then the blocks that split written over
    (gathered once for every column operand); for each y, (L, S, C, C)."""
    rows, columns, split = choice
    if rows is None or columns is None or split is None:
        return _split_entry(xs, ys, g)
    outs = _one_reference_products(xs, ys, rows, columns)
    if split.numel():
        strong = _split_entry(*_picked(split, xs, ys), g.index_select(0, split))
        for out, part in zip(outs, strong):
            out.index_copy_(0, split, part)
    return outs


def _mixed_backward(grads: Sequence[Tensor], xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor,
                    choice: Choice) -> Tuple[Tensor, List[Tensor]]:
    """The backward of :func:`_mixed_products`: (grad of the rows (L, S, C, d), [grad of each y (L, C, d)])."""
    rows, columns, split = choice
    if rows is None or columns is None or split is None:
        return _split_entry_backward(grads, xs, ys, g)
    grad_x, grad_ys = _one_reference_backward(grads, xs, ys, rows, columns)
    if split.numel():
        strong_x, strong_ys = _split_entry_backward([grad.index_select(0, split) for grad in grads],
                                                    *_picked(split, xs, ys), g.index_select(0, split))
        grad_x.index_copy_(0, split, strong_x)
        for grad_y, part in zip(grad_ys, strong_ys):
            grad_y.index_copy_(0, split, part)
    return grad_x, grad_ys


def _picked(blocks: Tensor, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
    return [x.index_select(0, blocks) for x in xs], [y.index_select(0, blocks) for y in ys]


def _split_entry(xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor) -> List[Tensor]:
    """:func:`_split_products` for blocks xs, ys, g (each (L, C, d)) of any length C: padded to a power of two for
    the halves, the result cut back."""
    chunk = int(g.shape[1])
    extra = _padded_length(chunk) - chunk
    outs = _split_products([_pad_rows(x, extra) for x in xs], [_pad_rows(y, extra) for y in ys],
                           _pad_decay(g, extra))
    return [out[..., :chunk, :chunk] for out in outs] if extra else outs


def _split_entry_backward(grads: Sequence[Tensor], xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor
                          ) -> Tuple[Tensor, List[Tensor]]:
    """The backward of :func:`_split_entry`."""
    chunk = int(g.shape[1])
    extra = _padded_length(chunk) - chunk
    grad_x, grad_ys = _split_backward([F.pad(grad, (0, extra, 0, extra)) if extra else grad for grad in grads],
                                      [_pad_rows(x, extra) for x in xs], [_pad_rows(y, extra) for y in ys],
                                      _pad_decay(g, extra))
    if extra:
        return grad_x[..., :chunk, :], [grad_y[..., :chunk, :] for grad_y in grad_ys]
    return grad_x, grad_ys


class ChunkFactors(NamedTuple):
    """What one g (..., C, d) gives every product and decay factor of a chunked rule, computed once.

    ``rows`` = exp(g - r) and ``columns`` = exp(r - g), flattened to (L, C, d), r the middle of each chunk's
    range per channel, or both None where no chunk takes one reference as a whole (or a graph is traced or
    compiled); ``split``: the indices of the chunks that do not (possibly empty), None with the factors."""

    g: Tensor
    rows: Optional[Tensor]
    columns: Optional[Tensor]
    split: Optional[Tensor]


def chunk_factors(g: Tensor) -> ChunkFactors:
    """The :class:`ChunkFactors` of g (..., C, d), the cumulative log decay within each chunk."""
    return ChunkFactors(g, *_choice(g.reshape(-1, int(g.shape[-2]), g.shape[-1])))


def decay_factors(factors: ChunkFactors) -> Tuple[Tensor, Tensor]:
    """``exp(g)`` and ``exp(g_C - g)`` (..., C, d), the decays from each chunk's start and to its end, which the
    chunked rules scale their rows by. In a chunk that has single-reference factors they are those times a
    vector per chunk (``exp(r)``, ``exp(g_C - r)``), one product each instead of an ``exp``; the other chunks take
    the ``exp`` itself. Every exponent is <= 0 either way. Where ``exp(r)`` falls below the dtype's normal range
    (r < -87 in float32) the product keeps fewer bits or none, but the true value is then below
    ``exp(r + log(max) / 2)`` (e^-43 in float32), far under the resolution of the sums it enters."""
    g = factors.g
    if factors.rows is None or factors.columns is None or factors.split is None:
        return exp_nonpositive(g), exp_nonpositive_(g[..., -1:, :] - g)
    gf = g.reshape(factors.rows.shape)
    middle = 0.5 * (gf[..., :1, :] + gf[..., -1:, :])
    from_start = factors.rows * middle.exp()
    to_end = factors.columns * (gf[..., -1:, :] - middle).exp()
    if factors.split.numel():
        strong = gf.index_select(0, factors.split)
        from_start.index_copy_(0, factors.split, exp_nonpositive(strong))
        to_end.index_copy_(0, factors.split, exp_nonpositive_(strong[..., -1:, :] - strong))
    return from_start.view_as(g), to_end.view_as(g)


def decayed_products_unchecked(x: Tensor, y: Tensor, g: Tensor) -> Tensor:
    """x (..., S, C, d) (S stacked row operands, e.g. queries and keys), y (..., C, d), g (..., C, d) the
    cumulative log decay within the chunk (non-increasing along C). Returns M (..., S, C, C):
    ``M_tj = sum_c x_tc y_jc exp(g_tc - g_jc)`` for j <= t, 0 above the diagonal (module docstring)."""
    return decayed_products_many(x.unbind(-3), (y,), g)[0]


def _flat_chunks(xs: Sequence[Tensor], chunk: int, width: int) -> List[Tensor]:
    return [x.reshape(-1, chunk, width) for x in xs]


def decayed_products_many(xs: Sequence[Tensor], ys: Sequence[Tensor], g: Tensor,
                          factors: Optional[ChunkFactors] = None) -> List[Tensor]:
    """:func:`decayed_products_unchecked` of the row operands ``xs`` (S of them, each (..., C, d)) against each
    column operand of ``ys`` (each (..., C, d)): for each y, M (..., S, C, C), the factors and the scaled rows
    computed once (``factors``: g's :func:`chunk_factors`, where the caller has them)."""
    chunk, width = int(g.shape[-2]), g.shape[-1]
    choice = (factors or chunk_factors(g))[1:]
    outs = _mixed_products(_flat_chunks(xs, chunk, width), _flat_chunks(ys, chunk, width),
                           g.reshape(-1, chunk, width), choice)
    return [out.view(*g.shape[:-2], len(xs), chunk, chunk) for out in outs]


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
    choice = (factors or chunk_factors(g))[1:]
    grad_x, grad_ys = _mixed_backward([grad.reshape(-1, len(xs), chunk, chunk) for grad in grads],
                                      _flat_chunks(xs, chunk, width), _flat_chunks(ys, chunk, width),
                                      g.reshape(-1, chunk, width), choice)
    return grad_x.view(*g.shape[:-2], len(xs), chunk, width), [grad_y.view_as(y) for grad_y, y in zip(grad_ys, ys)]


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
           "decayed_products_backward_many", "decayed_products_many", "decayed_products_unchecked", "graph_fixed",
           "log_max"]

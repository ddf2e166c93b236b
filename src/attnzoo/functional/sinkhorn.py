"""Sparse Sinkhorn attention (Tay et al. 2020): blocks of keys softly sorted by a learned, Sinkhorn-balanced
block permutation, then attended to beside the query's own block.

The sequence is cut into ``n_b = ceil(N / block_size)`` blocks. A sorting network scores block pairs:

* block summaries: the mean of the (unpadded) queries of block ``i`` and of the keys of block ``j``;
* logits ``R[i, j] = (W_h s^q_i + b_h) . s^k_j / (sqrt(head_dim) * temperature)``, with a learned ``(head_dim,
  head_dim)`` matrix ``W_h`` and bias ``b_h`` per head;
* Sinkhorn balancing in log space (rows, then columns, ``iterations`` times) makes ``P = exp(R)``
  approximately doubly stochastic: a soft permutation of the blocks.

Query block ``i`` then attends to its *sorted block* (slot ``t`` holds the ``P[i]``-weighted average of the
``t``-th key and value of every block) and to its own local block: softmax over ``2 * block_size`` keys.
SortCut instead lets every query attend to the first ``sortcut`` sorted blocks only.

Padding. A sequence that is not a multiple of ``block_size`` is padded internally; those positions, like the
keys a ``key_padding_mask`` marks, are zeroed, left out of the block summaries, masked in the local block, and
left out of the sorted-slot averages (each slot averages only the blocks that have a key there, the weights
renormalised; a slot no block fills is masked). So padding is invisible whatever it holds.

Causal. Query block ``i`` sorts only among the strictly earlier blocks ``j < i`` (all of whose keys precede
every query of block ``i``), and its local block is causally masked. The row summary of block ``i`` is the
cumulative mean of the queries *before* the block (the paper's cumulative sums, shifted so that no query of
the block itself contributes). Causal Sinkhorn balancing: row ``i`` of ``P`` is the last row of the Sinkhorn
balancing of the square ``i x i`` matrix of rows ``1..i`` and columns ``0..i-1``, i.e. exactly the balancing
the past alone determines; balancing the whole lower triangle at once would let later rows leak into earlier
ones through the column sums (and a doubly stochastic matrix with triangular support is the identity). Block 0
has no past: it attends to its local block only. Batched over the blocks, this takes ``O(n_b^3)`` time per
Sinkhorn round and ``O(n_b^3)`` memory (the backward rebuilds each iterate from ``O(n_b^2)`` potentials).

Every public op validates its arguments; its ``*_unchecked`` form skips that (for the mechanism, whose inputs
are checked once at its entry point). ``*_reference`` forms are obviously-correct float64 versions written
independently (Sinkhorn in probability space, explicit loops, a dense N x N weight matrix).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_number, check_positive_int, check_qkv
from .masks import zero_padded
from .softmax import masked_sdpa, masked_softmax_reference

DEFAULT_BLOCK_SIZE = 64
DEFAULT_ITERATIONS = 8
DEFAULT_TEMPERATURE = 0.75


# -- argument checks -----------------------------------------------------------------------------------------
def _check_options(
    block_size: object, iterations: object, temperature: object, causal: object, sortcut: object
) -> Tuple[int, int, float, bool, Optional[int]]:
    block_size = check_positive_int("block_size", block_size)
    iterations = check_positive_int("iterations", iterations)
    temperature = check_number("temperature", temperature, minimum=0.0, exclusive_minimum=True)
    causal = check_bool("causal", causal)
    sortcut = check_number("sortcut", sortcut, integer=True, minimum=1, optional=True)
    if causal and sortcut is not None:
        raise ValueError(f"sortcut={sortcut} is non-causal only (every query attends to the first sorted blocks, "
                         f"future included); pass sortcut=None for causal=True")
    return block_size, iterations, temperature, causal, sortcut


def _check_sorter(sort_weight: Tensor, sort_bias: Tensor, q: Tensor) -> None:
    check_floating("sort_weight", sort_weight)
    check_floating("sort_bias", sort_bias)
    heads, dim = q.shape[1], q.shape[3]
    if sort_weight.shape != (heads, dim, dim):
        raise ValueError(f"sort_weight must have shape (heads, head_dim, head_dim) = ({heads}, {dim}, {dim}), "
                         f"got {tuple(sort_weight.shape)}")
    if sort_bias.shape != (heads, dim):
        raise ValueError(f"sort_bias must have shape (heads, head_dim) = ({heads}, {dim}), got {tuple(sort_bias.shape)}")
    for name, t in (("sort_weight", sort_weight), ("sort_bias", sort_bias)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")


def _check_self_attention(q: Tensor, k: Tensor) -> None:
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"sinkhorn attention is self-attention (blocks pair query and key positions of one "
                         f"sequence): q and k must have one length, got q seq={q.shape[2]}, k seq={k.shape[2]}")


# -- Sinkhorn balancing --------------------------------------------------------------------------------------
CAUSAL_CHUNKS = 8
"""Causal balancing solves one problem per query block; they are batched in this many chunks of consecutive
blocks, each chunk as large as its largest problem (about 0.4 of one cube of all problems at full size)."""


class _PrefixSinkhorn(torch.autograd.Function):
    """A chunk of causal balancing problems, kept in memory as potentials rather than as iterates.

    ``cube`` (..., problems, m, m) holds problem ``i`` as the top-left ``sizes[i] x sizes[i]`` square of the
    logits, completed by the identity (logit 0 on the rest of the diagonal, -inf elsewhere): a block-diagonal
    matrix whose extra block Sinkhorn leaves as it is, so that no row or column is ever empty and no masking is
    needed between half-steps (and exp() never meets the huge negative stand-ins that are slow on CPUs). Returns
    (..., problems, m) the log-space row ``last[i]`` of each balanced problem.

    Each iterate is ``cube + a + b``, with row potentials ``a`` and column potentials ``b`` of size
    (problems x m): saving those instead of the iterates autograd would keep makes the backward's memory one
    iterate at a time, not one per Sinkhorn half-step. The backward rebuilds each iterate from its potentials
    and applies ``dx = g - exp(y) * sum(g)`` (the gradient of ``y = x - logsumexp(x)``) in reverse."""

    @staticmethod
    def forward(ctx, cube: Tensor, last: Tensor, iterations: int) -> Tensor:  # type: ignore[override]
        a = cube.new_zeros(*cube.shape[:-1], 1)
        b = cube.new_zeros(*cube.shape[:-2], 1, cube.shape[-1])
        potentials = []
        y = cube.clone()
        for _ in range(iterations):
            shift = torch.logsumexp(y, dim=-1, keepdim=True)
            a = a - shift
            y.sub_(shift)
            potentials += [a, b]
            shift = torch.logsumexp(y, dim=-2, keepdim=True)
            b = b - shift
            y.sub_(shift)
            potentials += [a, b]
        ctx.save_for_backward(cube, last, *potentials)
        return y.gather(-2, last.expand(*y.shape[:-2], 1, y.shape[-1])).squeeze(-2)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        cube, last, *flat = ctx.saved_tensors
        gradient = torch.zeros_like(cube)
        gradient.scatter_(-2, last.expand(*cube.shape[:-2], 1, cube.shape[-1]), grad.unsqueeze(-2))
        for step in reversed(range(len(flat) // 2)):
            y = cube + flat[2 * step] + flat[2 * step + 1]  # the iterate after this half-step
            dim = -1 if step % 2 == 0 else -2  # even half-steps normalise rows, odd ones columns
            gradient = gradient - torch.exp(y) * gradient.sum(dim=dim, keepdim=True)
        return gradient, None, None


def _causal_balance(x: Tensor, iterations: int) -> Tensor:
    """Causal Sinkhorn balancing of (..., n, n) tempered logits: row p is the last row of the balanced p x p
    matrix of rows 1..p and columns 0..p-1 (row 0 is zeros)."""
    n = x.shape[-1]
    # inner[r', j] = x[r' + 1, j]: problem p is the top-left p x p square of inner, and its last row r' = p - 1.
    inner = x[..., 1:, :-1]
    rows = [x.new_zeros(*x.shape[:-2], 1, n)]
    width = -(-(n - 1) // CAUSAL_CHUNKS) if n > 1 else 1
    for lo in range(1, n, width):  # a few chunks of problems (at most CAUSAL_CHUNKS passes, whatever the block count)
        hi = min(lo + width, n)  # problems p = lo .. hi - 1, of sizes up to hi - 1
        size = hi - 1
        index = torch.arange(size, device=x.device)
        sizes = torch.arange(lo, hi, device=x.device).view(-1, 1, 1)
        row, column = index.view(1, -1, 1), index.view(1, 1, -1)
        inside = (row < sizes) & (column < sizes)
        identity = (row == column) & ~inside
        completion = x.new_zeros(identity.shape).masked_fill(~identity, -math.inf)
        # Where the logits are not used, where() sends them no gradient.
        cube = torch.where(inside, inner[..., :size, :size].unsqueeze(-3), completion)
        last_rows = _PrefixSinkhorn.apply(cube, sizes - 1, iterations)
        earlier = index.view(1, -1) < sizes.view(-1, 1)
        rows.append(F.pad(torch.exp(last_rows).masked_fill(~earlier, 0.0), (0, n - size)))
    return torch.cat(rows, dim=-2)


def sinkhorn_balance_unchecked(logits: Tensor, iterations: int, temperature: float, causal: bool) -> Tensor:
    """:func:`sinkhorn_balance` on checked arguments."""
    x = logits / temperature
    if causal:
        return _causal_balance(x, iterations)
    for _ in range(iterations):
        x = x - torch.logsumexp(x, dim=-1, keepdim=True)
        x = x - torch.logsumexp(x, dim=-2, keepdim=True)
    return torch.exp(x)


def sinkhorn_balance(logits: Tensor, iterations: int, *, temperature: float = 1.0, causal: bool = False) -> Tensor:
    """Sinkhorn normalisation in log space: a soft permutation from square logits.

    Args:
        logits: (..., n, n) floating.
        iterations: rounds of row then column normalisation (>= 1).
        temperature: the logits are divided by it (> 0); lower is closer to a hard permutation.
        causal: row ``i`` may use only columns ``j < i``, and depends on rows ``<= i`` alone: it is the last
            row of the balanced ``i x i`` matrix of rows ``1..i``, columns ``0..i-1``. Row 0 is all zeros.

    Returns:
        (..., n, n) probabilities: non-causal, columns sum to 1 and rows to ~1 (exactly in the limit of
        iterations); causal, each row ``i >= 1`` is a row of a ~doubly stochastic matrix, zeros elsewhere.
    """
    check_floating("logits", logits)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] == 0:
        raise ValueError(f"logits must be square in their last two dims (..., n, n), got {tuple(logits.shape)}")
    iterations = check_positive_int("iterations", iterations)
    temperature = check_number("temperature", temperature, minimum=0.0, exclusive_minimum=True)
    causal = check_bool("causal", causal)
    return sinkhorn_balance_unchecked(logits, iterations, temperature, causal)


def _sinkhorn_probabilities_reference(logits: Tensor, iterations: int) -> Tensor:
    """Sinkhorn-Knopp on exp(logits) in probability space, float64: divide rows by their sums, then columns."""
    a = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))  # a common factor changes nothing
    for _ in range(iterations):
        a = a / a.sum(dim=-1, keepdim=True)
        a = a / a.sum(dim=-2, keepdim=True)
    return a


def sinkhorn_balance_reference(
    logits: Tensor, iterations: int, *, temperature: float = 1.0, causal: bool = False
) -> Tensor:
    """:func:`sinkhorn_balance` in float64, in probability space, one prefix problem at a time."""
    x = logits.double() / temperature
    if not causal:
        return _sinkhorn_probabilities_reference(x, iterations)
    n = x.shape[-1]
    rows = []
    for p in range(n):
        row = x.new_zeros(*x.shape[:-2], n)
        if p > 0:
            balanced = _sinkhorn_probabilities_reference(x[..., 1 : p + 1, :p], iterations)
            row = torch.cat([balanced[..., -1, :], x.new_zeros(*x.shape[:-2], n - p)], dim=-1)
        rows.append(row)
    return torch.stack(rows, dim=-2)


# -- the sorting network -------------------------------------------------------------------------------------
def _blocks(n: int, block_size: int) -> Tuple[int, int]:
    """(block size actually used, number of blocks): a block longer than the sequence is the sequence."""
    size = min(block_size, n)
    return size, -(-n // size)


def sinkhorn_sorting_unchecked(
    q: Tensor,
    k: Tensor,
    sort_weight: Tensor,
    sort_bias: Tensor,
    block_size: int,
    iterations: int,
    temperature: float,
    causal: bool,
    key_padding_mask: Optional[Tensor],
) -> Tensor:
    """:func:`sinkhorn_sorting` on checked arguments (q, k in any floating dtype; computed in the working
    dtype)."""
    q_blocks, k_blocks, present = _prepare(q, k, None, block_size, key_padding_mask)[:3]
    return _sorting(q_blocks, k_blocks, present, sort_weight, sort_bias, iterations, temperature, causal)


def sinkhorn_sorting(
    q: Tensor,
    k: Tensor,
    sort_weight: Tensor,
    sort_bias: Tensor,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    iterations: int = DEFAULT_ITERATIONS,
    temperature: float = DEFAULT_TEMPERATURE,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """The soft block permutation ``P`` of :func:`sinkhorn_attention`: (batch, heads, n_b, n_b), row ``i`` the
    weights query block ``i`` gives key block ``j``, in the working dtype (float32 for half inputs)."""
    check_qkv(q, k, k)
    _check_self_attention(q, k)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    _check_sorter(sort_weight, sort_bias, q)
    block_size, iterations, temperature, causal, _ = _check_options(block_size, iterations, temperature, causal, None)
    return sinkhorn_sorting_unchecked(
        q, k, sort_weight, sort_bias, block_size, iterations, temperature, causal, key_padding_mask
    )


def _padded(x: Tensor, extra: int) -> Tensor:
    """``x`` (B, H, N, d) with ``extra`` zero positions appended (no copy when there are none)."""
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def _prepare(
    q: Tensor, k: Tensor, v: Optional[Tensor], block_size: int, key_padding_mask: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Cut into blocks, in the working dtype: (q_blocks (B, H, n_b, b, d) with padded queries zeroed, for the
    summaries only; k_blocks; present (B, 1, n_b, b) bool or None when every position is a real, unpadded key;
    v_blocks or None). Padded keys and values are zeroed (so NaN and inf in them change nothing), and
    internal padding is zeros."""
    batch, heads, n, dim = q.shape
    size, count = _blocks(n, block_size)
    extra = size * count - n
    dtype = working_dtype(q.dtype)
    present: Optional[Tensor] = None
    if key_padding_mask is not None or extra:
        keep = torch.ones(batch, n, dtype=torch.bool, device=q.device)
        if key_padding_mask is not None:
            keep = ~key_padding_mask
        present = F.pad(keep, (0, extra), value=False).reshape(batch, 1, count, size)

    def blocks(x: Tensor) -> Tensor:
        x = zero_padded(x.to(dtype), key_padding_mask)
        return _padded(x, extra).reshape(batch, heads, count, size, x.shape[-1])

    return blocks(q), blocks(k), present, None if v is None else blocks(v)


def _sorting(
    q_blocks: Tensor,
    k_blocks: Tensor,
    present: Optional[Tensor],
    sort_weight: Tensor,
    sort_bias: Tensor,
    iterations: int,
    temperature: float,
    causal: bool,
) -> Tensor:
    """The soft permutation (B, H, n_b, n_b) from blocked, zero-padded queries and keys."""
    dim = q_blocks.shape[-1]
    if present is None:
        counts = q_blocks.new_full((1, 1, q_blocks.shape[2], 1), float(q_blocks.shape[3]))
    else:
        counts = present.to(q_blocks.dtype).sum(-1, keepdim=True)  # (B, 1, n_b, 1)
    q_sums, k_sums = q_blocks.sum(3), k_blocks.sum(3)  # padded positions hold zeros
    k_summary = k_sums / counts.clamp_min(1.0)
    if causal:
        # Cumulative sums over the blocks strictly before each block: nothing of the block itself, or later.
        q_sums = F.pad(torch.cumsum(q_sums, dim=2)[:, :, :-1], (0, 0, 1, 0))
        counts = F.pad(torch.cumsum(counts, dim=2)[:, :, :-1], (0, 0, 1, 0))
    q_summary = q_sums / counts.clamp_min(1.0)
    weight, bias = sort_weight.to(q_blocks.dtype), sort_bias.to(q_blocks.dtype)
    projected = torch.einsum("bhid,hde->bhie", q_summary, weight) + bias[None, :, None, :]
    logits = torch.einsum("bhie,bhje->bhij", projected, k_summary) / math.sqrt(dim)
    return sinkhorn_balance_unchecked(logits, iterations, temperature, causal)


# -- attention -----------------------------------------------------------------------------------------------
def sinkhorn_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_weight: Tensor,
    sort_bias: Tensor,
    block_size: int,
    iterations: int,
    temperature: float,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    sortcut: Optional[int],
) -> Tensor:
    """:func:`sinkhorn_attention` for callers that have validated every argument themselves (the mechanism,
    whose ``check_inputs`` runs first): inputs are checked once."""
    batch, heads, n, dim = q.shape
    dim_v = v.shape[-1]
    q_clean, k_blocks, present, v_blocks = _prepare(q, k, v, block_size, key_padding_mask)
    assert v_blocks is not None
    _, count, size, _ = k_blocks.shape[1:]
    permutation = _sorting(q_clean, k_blocks, present, sort_weight, sort_bias, iterations, temperature, causal)

    # Sorted blocks: slot t of sorted block i averages the t-th keys (values) of the blocks, weighted by P[i]
    # and renormalised over the blocks that have a key there. SortCut needs only the first `sortcut` rows.
    rows = count if sortcut is None else min(sortcut, count)
    weights = permutation[:, :, :rows]
    slot_ok: Optional[Tensor] = None  # (B, H, rows, b): whether a sorted slot holds any key
    if present is None:
        # Every slot of every block is a real key: the totals are the row sums of P, folded into P (a small
        # matrix) before mixing. Non-causal rows are positive; a causal row is empty for block 0 only.
        totals = weights.sum(-1, keepdim=True)
        if causal:
            slot_ok = (totals > 0).expand(batch, heads, rows, size)
            totals = torch.where(totals > 0, totals, torch.ones_like(totals))
        weights = weights / totals
    sorted_k = (weights @ k_blocks.flatten(3)).view(batch, heads, rows, size, dim)
    sorted_v = (weights @ v_blocks.flatten(3)).view(batch, heads, rows, size, dim_v)
    if present is not None:
        slot_totals = weights @ present.to(weights.dtype)  # (B, H, rows, b)
        slot_ok = slot_totals > 0
        slot_totals = torch.where(slot_ok, slot_totals, torch.ones_like(slot_totals))[..., None]
        sorted_k, sorted_v = sorted_k / slot_totals, sorted_v / slot_totals

    q_work = _padded(q.to(k_blocks.dtype), size * count - n)
    if sortcut is not None:
        # SortCut: every query attends to the keys of the first `rows` sorted blocks, and nothing else.
        keys, values = sorted_k.flatten(2, 3), sorted_v.flatten(2, 3)
        allowed = None if slot_ok is None else slot_ok.flatten(2, 3)[:, :, None, :]
        out = masked_sdpa(q_work, keys, values, allowed)
        return out[:, :, :n].to(q.dtype)

    # Each query block attends to [its sorted block, its local block]: 2b keys, batched over the blocks.
    keys = torch.cat([sorted_k, k_blocks], dim=3).flatten(1, 2)
    values = torch.cat([sorted_v, v_blocks], dim=3).flatten(1, 2)
    allowed = None
    if slot_ok is not None:  # None only without padding and without causality: nothing to mask
        sorted_ok = slot_ok[:, :, :, None, :].expand(batch, heads, count, size, size)
        local_ok = torch.ones(1, 1, 1, size, size, dtype=torch.bool, device=q.device)
        if present is not None:
            local_ok = local_ok & present[:, :, :, None, :]
        if causal:
            local_ok = local_ok & torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        local_ok = local_ok.expand(batch, heads, count, size, size)
        allowed = torch.cat([sorted_ok, local_ok], dim=-1).flatten(1, 2)
    out = masked_sdpa(q_work.reshape(batch, heads * count, size, dim), keys, values, allowed)
    return out.reshape(batch, heads, count * size, dim_v)[:, :, :n].to(q.dtype)


def sinkhorn_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_weight: Tensor,
    sort_bias: Tensor,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    iterations: int = DEFAULT_ITERATIONS,
    temperature: float = DEFAULT_TEMPERATURE,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    sortcut: Optional[int] = None,
) -> Tensor:
    """Sparse Sinkhorn self-attention.

    Args:
        q, k: (batch, heads, seq, head_dim), one sequence (self-attention).
        v: (batch, heads, seq, head_dim_v)
        sort_weight: (heads, head_dim, head_dim), sort_bias: (heads, head_dim): the sorting network's layer.
        block_size: positions per block (>= 1); a sequence that is not a multiple is padded internally, and a
            block longer than the sequence is the whole sequence (then this is exact softmax attention).
        iterations: Sinkhorn rounds (>= 1). temperature: divides the sorting logits (> 0).
        causal: sort among earlier blocks only, causal mask in the local block; no look-ahead at all.
        key_padding_mask: (batch, seq) bool, True marks padding: invisible whatever it holds.
        sortcut: non-causal only; every query attends to the first ``sortcut`` sorted blocks (and not to its
            local block), ``sortcut * block_size`` keys.

    Returns:
        (batch, heads, seq, head_dim_v) in the input dtype (computed in float32 for half inputs). A query that
        may see no key outputs zeros.
    """
    check_qkv(q, k, v)
    _check_self_attention(q, k)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    _check_sorter(sort_weight, sort_bias, q)
    block_size, iterations, temperature, causal, sortcut = _check_options(
        block_size, iterations, temperature, causal, sortcut
    )
    return sinkhorn_attention_unchecked(
        q, k, v, sort_weight, sort_bias, block_size, iterations, temperature, causal, key_padding_mask, sortcut
    )


def sinkhorn_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_weight: Tensor,
    sort_bias: Tensor,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    iterations: int = DEFAULT_ITERATIONS,
    temperature: float = DEFAULT_TEMPERATURE,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    sortcut: Optional[int] = None,
) -> Tensor:
    """:func:`sinkhorn_attention` by explicit loops in float64: block summaries position by position, Sinkhorn
    in probability space, and the dense (seq x seq) matrix of the weights each query gives each value, built
    slot by slot. Same arguments; returns float64."""
    batch, _, n, _ = q.shape
    q, k, v = q.double(), k.double(), v.double()
    keep = torch.ones(batch, n, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask.cpu()
    keep = keep.to(q.device)
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    q_clean = zero_padded(q, key_padding_mask)  # for summaries only: a padded query is no part of a block
    size = min(block_size, n)
    blocks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    logits = _sort_logits_reference(q_clean, k, keep, sort_weight.double(), sort_bias.double(), blocks, causal)
    permutation = sinkhorn_balance_reference(logits, iterations, temperature=temperature, causal=causal)
    if sortcut is not None:
        slots = [_sorted_slot_reference(permutation, k, keep, blocks, i, t)
                 for i in range(min(sortcut, len(blocks))) for t in range(size)]
        return _sortcut_weights_reference(q, slots) @ v
    return _local_and_sorted_weights_reference(q, k, keep, permutation, blocks, size, causal) @ v


def _masked_mean_reference(x: Tensor, where: range, keep: Tensor) -> Tensor:
    """Mean of x (batch, heads, n, d) over the unpadded positions ``where`` (``keep`` (batch, n)), position by
    position: (batch, heads, d), zero where none is kept."""
    batch, heads, _, dim = x.shape
    total, number = x.new_zeros(batch, heads, dim), x.new_zeros(batch, 1, 1)
    for position in where:
        flag = keep[:, position].double().view(batch, 1, 1)
        total = total + flag * x[:, :, position]
        number = number + flag
    return total / number.clamp_min(1.0)


def _sort_logits_reference(
    q_clean: Tensor, k: Tensor, keep: Tensor, weight: Tensor, bias: Tensor, blocks: List[range], causal: bool
) -> Tensor:
    """(batch, heads, count, count) sorting logits: each block's query summary (causal: of the positions before
    it), projected, dotted with every block's key summary, over sqrt(d)."""
    batch, heads, _, dim = k.shape
    count = len(blocks)
    key_summaries = [_masked_mean_reference(k, block, keep) for block in blocks]
    if causal:
        query_summaries = [_masked_mean_reference(q_clean, range(0, block.start), keep) for block in blocks]
    else:
        query_summaries = [_masked_mean_reference(q_clean, block, keep) for block in blocks]
    logits = k.new_zeros(batch, heads, count, count)
    for i in range(count):
        projected = torch.einsum("bhd,hde->bhe", query_summaries[i], weight) + bias
        for j in range(count):
            logits[:, :, i, j] = (projected * key_summaries[j]).sum(-1) / math.sqrt(dim)
    return logits


def _sorted_slot_reference(
    permutation: Tensor, k: Tensor, keep: Tensor, blocks: List[range], i: int, t: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sorted block i, slot t: (key (B, H, d), the weight (B, H, n) it gives each position, whether any block
    fills it (B, H))."""
    batch, heads, n, _ = k.shape
    mix = k.new_zeros(batch, heads, n)
    for j, block in enumerate(blocks):
        position = block.start + t
        if position < n:
            mix[:, :, position] = permutation[:, :, i, j] * keep[:, position].double().view(batch, 1)
    total = mix.sum(-1)
    filled = total > 0
    mix = mix / torch.where(filled, total, torch.ones_like(total))[..., None]
    return torch.einsum("bhn,bhnd->bhd", mix, k), mix, filled


def _sortcut_weights_reference(q: Tensor, slots: List[Tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """(batch, heads, n, n) weights of every query over the ``slots`` of the first sorted blocks alone."""
    batch, heads, n, dim = q.shape
    dense = q.new_zeros(batch, heads, n, n)
    scale = 1.0 / math.sqrt(dim)
    for row in range(n):
        logit_list = [(q[:, :, row] * key).sum(-1) * scale for key, _, _ in slots]
        ok_list = [filled for _, _, filled in slots]
        probabilities = masked_softmax_reference(torch.stack(logit_list, -1), torch.stack(ok_list, -1))
        for s, (_, mix, _) in enumerate(slots):
            dense[:, :, row] = dense[:, :, row] + probabilities[..., s : s + 1] * mix
    return dense


def _local_and_sorted_weights_reference(
    q: Tensor, k: Tensor, keep: Tensor, permutation: Tensor, blocks: List[range], size: int, causal: bool
) -> Tensor:
    """(batch, heads, n, n) weights of every query over the slots of its own sorted block and the keys of its
    local block (causal: those up to the query), one softmax over both."""
    batch, heads, n, dim = q.shape
    dense = q.new_zeros(batch, heads, n, n)
    scale = 1.0 / math.sqrt(dim)
    for i, local in enumerate(blocks):
        slots = [_sorted_slot_reference(permutation, k, keep, blocks, i, t) for t in range(size)]
        for row in local:
            logit_list, ok_list = [], []
            for key, _, filled in slots:
                logit_list.append((q[:, :, row] * key).sum(-1) * scale)
                ok_list.append(filled)
            for column in local:
                logit_list.append((q[:, :, row] * k[:, :, column]).sum(-1) * scale)
                visible = keep[:, column].view(batch, 1).expand(batch, heads)
                if causal and column > row:
                    visible = torch.zeros_like(visible)
                ok_list.append(visible)
            probabilities = masked_softmax_reference(torch.stack(logit_list, -1), torch.stack(ok_list, -1))
            for s, (_, mix, _) in enumerate(slots):
                dense[:, :, row] = dense[:, :, row] + probabilities[..., s : s + 1] * mix
            for s, column in enumerate(local):
                dense[:, :, row, column] = dense[:, :, row, column] + probabilities[..., size + s]
    return dense

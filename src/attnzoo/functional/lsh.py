"""LSH attention (Reformer, Kitaev et al. 2020): shared-QK attention restricted to the keys that angular
locality-sensitive hashing puts near each query.

Shared QK. One projection serves as queries and keys: query ``i`` is ``x_i`` and key ``j`` is the unit vector
``x_j / |x_j|``, so the logit of a pair is ``x_i . x_j / (|x_j| sqrt(d))`` (the paper normalises the keys; a
query's dot product with itself would otherwise dominate its row).

Hashing. For each of ``n_hashes`` rounds a random matrix ``R`` of shape ``(d, n_buckets / 2)`` sends ``x`` to
the bucket ``argmax([x R, -x R])`` (angular LSH by random rotations: nearby directions tend to share a
bucket). ``n_buckets`` follows the length as in the paper, about ``N / bucket_size``: ``2 ceil(N / (2
bucket_size))``, an even number, or one bucket (no hashing) when ``N <= bucket_size``.
The columns of ``R`` are standard normal numbers computed from a 32-bit key by a counter-based generator
(:func:`lsh_rotations`): entry ``(round, row, column)`` depends on the key and its own indices only, so any
length finds as many columns as it needs, the same ones every time, on any device, and nothing random runs at
call time (a traced or compiled graph computes the same rotations).

Attention, per round (the paper's chunked form). Positions are sorted by (bucket, position) and the sorted
sequence is cut into chunks of ``bucket_size`` (the last one padded internally and masked, so any length
works). Without ``causal``, a query attends to every key of its chunk and of the chunk before it (no wrap
around: the first chunk has none before it), across bucket boundaries as in the paper.

With ``causal``, that rule cannot be kept: where chunk boundaries fall in the sorted order depends on the
buckets of LATER positions (every later position hashed to a lower bucket shifts the whole order), so a query
would see different past keys when the future changes. Causal attention therefore uses the keys of the
query's own bucket alone (a different bucket's position in the sorted order depends on the future): query
``i`` attends to the ``bucket_size`` latest positions ``j <= i`` of its bucket (itself included), i.e. a
sliding window of ``bucket_size`` over the sorted order restricted to its bucket. Which positions those are
depends on the buckets of positions ``<= i`` only. The window lies within the query's chunk and the chunk
before it, so the work and memory are those of the non-causal form. With one bucket (``N <= bucket_size``) both
forms are exact shared-QK attention (causal or not).

A query never attends to itself unless it sees no other key (the paper: with shared QK a query's own key
would win its row): its own logit is replaced by ``SELF_LOGIT = -1e5``, whose weight ``exp(-1e5 - max)`` is
exactly zero in floating point next to any real key, and 1 when it is the only one.

Rounds are combined by their normalisers: ``out_i = sum_r softmax_r(lse_r(i)) o_r(i)``, with ``o_r(i)`` and
``lse_r(i)`` the output and the log-sum-exp of query ``i``'s softmax in round ``r``: the softmax over the
union of the rounds' keys. A round in which the query only saw itself has ``lse = -1e5`` and weight zero
next to any other round. A key met by the same query in several rounds counts once per round (the paper's
correction for such duplicates is not applied, as in common implementations).

Key padding: padded positions are zeroed first (whatever they hold), sorted into a bucket of their own after
all others (so the order and the chunks of the unpadded positions do not depend on them), never attended to,
and their own output rows are zeros. A row whose every key is padded therefore yields zeros.

Cost: ``n_hashes`` sorts of N and ``O(n_hashes N bucket_size d)`` time, ``O(n_hashes N bucket_size)``
memory: the scores of each query against ``2 bucket_size`` keys per round. All chunks of all rounds go through
one batched matrix product, the windows (a chunk and the one before it) read in place as an overlapping
strided view of the sorted keys; the backward is written out (from the saved probabilities), and the sorting
gathers are undone by gathers with the inverse permutations rather than by scatter-adds.

Every public op validates its arguments; its ``*_unchecked`` form skips that (for the mechanism, whose inputs
are checked once at its entry point). :func:`lsh_attention_reference` is an independent float64 version that
builds each round's dense N x N mask of who attends to whom from explicitly sorted positions.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._autocast import outside_autocast
from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_number, check_positive_int
from .masks import zero_padded

DEFAULT_BUCKET_SIZE = 64
DEFAULT_N_HASHES = 4
SELF_LOGIT = -1e5
"""A query's logit for its own key: the paper's stand-in, far below any real logit (keys are unit vectors, so
a real logit is at most ``|x_i| / sqrt(d)``), so that the query attends to itself only when alone."""

_M32 = 0xFFFFFFFF


# -- hashing -------------------------------------------------------------------------------------------------
def lsh_bucket_count(length: int, bucket_size: int) -> int:
    """The number of hash buckets for a sequence of ``length``: about ``length / bucket_size``, even (angular
    LSH makes buckets in +- pairs), or 1 when one chunk holds the whole sequence."""
    if length <= bucket_size:
        return 1
    return 2 * -(-length // (2 * bucket_size))


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` holding 32-bit values, with no int64 overflow (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash with good avalanche (the "lowbias32" finaliser) on int64 tensors of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def lsh_hash_key(seed: int) -> int:
    """The 32-bit key of :func:`lsh_rotations` for a non-negative integer ``seed`` (both of its 32-bit halves
    mixed in)."""
    seed = check_number("seed", seed, integer=True, minimum=0, maximum=2**63 - 1)
    low, high = torch.tensor(seed & _M32), torch.tensor(seed >> 32)
    return int(_mix32(_mix32(high + 0x9E3779B9) ^ low))


def lsh_rotations_unchecked(hash_key: Tensor, n_hashes: int, head_dim: int, columns: int) -> Tensor:
    """:func:`lsh_rotations` on checked arguments."""
    device = hash_key.device
    rounds = torch.arange(n_hashes, device=device).view(-1, 1, 1)
    rows = torch.arange(head_dim, device=device).view(1, -1, 1)
    cols = torch.arange(columns, device=device).view(1, 1, -1)
    # Absorb (key, round, row, column) one at a time: entry (r, i, c) depends on nothing else.
    state = _mix32(hash_key.to(torch.int64) & _M32)
    state = _mix32(state ^ rounds)
    state = _mix32(state ^ rows)
    state = _mix32(state ^ cols)
    # Two uniforms in (0, 1) from two further hashes, then Box-Muller.
    u1 = (_mix32(state ^ 0x68E31DA4).double() + 0.5) / 2.0**32
    u2 = (_mix32(state ^ 0xB5297A4D).double() + 0.5) / 2.0**32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def _check_hash_key(hash_key: object) -> None:
    if not isinstance(hash_key, Tensor) or hash_key.dtype not in (torch.int32, torch.int64) or hash_key.dim() != 0:
        raise TypeError(f"hash_key must be a 0-dim integer tensor (the key of lsh_rotations), got {hash_key!r}")


def lsh_rotations(hash_key: Tensor, n_hashes: int, head_dim: int, columns: int) -> Tensor:
    """The random matrices of angular LSH: (n_hashes, head_dim, columns) standard normal numbers, float64,
    computed from ``hash_key`` (an integer tensor holding a 32-bit key) by a counter-based generator.

    Entry ``(r, i, c)`` depends only on the key and ``(r, i, c)``: asking for more columns extends the matrices
    without changing the first ones, and the result is the same on every call and device."""
    _check_hash_key(hash_key)
    n_hashes = check_positive_int("n_hashes", n_hashes)
    head_dim = check_positive_int("head_dim", head_dim)
    columns = check_positive_int("columns", columns)
    return lsh_rotations_unchecked(hash_key, n_hashes, head_dim, columns)


def lsh_buckets_unchecked(x: Tensor, hash_key: Tensor, n_hashes: int, n_buckets: int) -> Tensor:
    """:func:`lsh_buckets` on checked arguments."""
    shape = (*x.shape[:-2], n_hashes, x.shape[-2])
    if n_buckets == 1:
        return torch.zeros(shape, dtype=torch.int64, device=x.device)
    half = n_buckets // 2
    rotations = lsh_rotations_unchecked(hash_key, n_hashes, x.shape[-1], half).to(x.dtype)
    # (..., N, d) @ (d, n_hashes * half) -> (..., N, n_hashes, half): one matmul for every round.
    rotated = (x @ rotations.transpose(0, 1).reshape(x.shape[-1], n_hashes * half)).view(*x.shape[:-1], n_hashes, half)
    # argmax([r, -r]) without building it: the largest entry, or the most negative one (then in the second
    # half), the first half winning a tie as argmax would pick it.
    top, top_index = rotated.max(dim=-1)
    bottom, bottom_index = rotated.min(dim=-1)
    buckets = torch.where(top >= -bottom, top_index, bottom_index + half)
    return buckets.movedim(-1, -2)


def lsh_buckets(x: Tensor, hash_key: Tensor, n_hashes: int, n_buckets: int) -> Tensor:
    """Angular LSH: the bucket ``argmax([x R_r, -x R_r])`` of every vector for every round ``r``.

    Args:
        x: (..., N, d) floating.
        hash_key: 0-dim integer tensor, the key of :func:`lsh_rotations`.
        n_hashes: rounds, each with its own rotation.
        n_buckets: 1 (all in bucket 0) or an even number.

    Returns:
        (..., n_hashes, N) int64 buckets in ``[0, n_buckets)``.
    """
    check_floating("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., N, d), got {tuple(x.shape)}")
    n_hashes = check_positive_int("n_hashes", n_hashes)
    n_buckets = check_positive_int("n_buckets", n_buckets)
    if n_buckets != 1 and n_buckets % 2:
        raise ValueError(f"n_buckets must be 1 or even (angular LSH buckets come in +- pairs), got {n_buckets}")
    _check_hash_key(hash_key)
    return lsh_buckets_unchecked(x, hash_key, n_hashes, n_buckets)


# -- attention -----------------------------------------------------------------------------------------------
def _check(qk: Tensor, v: Tensor, bucket_size: object, n_hashes: object, causal: object) -> Tuple[int, int, bool]:
    for name, x in (("qk", qk), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {x.dim()} dims: {tuple(x.shape)}")
    if qk.dtype != v.dtype or qk.device != v.device:
        raise TypeError(f"qk and v must share a dtype and device, got {qk.dtype} on {qk.device}, {v.dtype} on {v.device}")
    if qk.shape[:3] != v.shape[:3]:
        raise ValueError(f"qk and v must share batch, heads and seq, got {tuple(qk.shape)} and {tuple(v.shape)}")
    if qk.shape[2] == 0:
        raise ValueError("the sequence length must be at least 1, got seq=0")
    return (check_positive_int("bucket_size", bucket_size), check_positive_int("n_hashes", n_hashes),
            check_bool("causal", causal))


def lsh_attention(
    qk: Tensor,
    v: Tensor,
    hash_key: Tensor,
    *,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    n_hashes: int = DEFAULT_N_HASHES,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Reformer's LSH self-attention with shared queries and keys (see the module docstring).

    Args:
        qk: (batch, heads, seq, head_dim), the queries; the keys are these, normalised to unit length.
        v: (batch, heads, seq, head_dim_v)
        hash_key: 0-dim int64 tensor, the key the rotations are computed from (:func:`lsh_rotations`).
        bucket_size: chunk length (about the positions per bucket); ``>= seq`` gives exact shared-QK attention.
        n_hashes: hashing rounds, combined by their log-sum-exp weights.
        causal: query ``i`` attends to earlier positions of its bucket only (see the module docstring).
        key_padding_mask: (batch, seq) bool, True marks padding.

    Returns:
        (batch, heads, seq, head_dim_v), the dtype of ``qk``.
    """
    bucket_size, n_hashes, causal = _check(qk, v, bucket_size, n_hashes, causal)
    check_key_padding_mask(key_padding_mask, qk.shape[0], qk.shape[2], qk.device)
    _check_hash_key(hash_key)
    if hash_key.device != qk.device:
        raise ValueError(f"hash_key must be on {qk.device}, got {hash_key.device}")
    return lsh_attention_unchecked(qk, v, hash_key, bucket_size, n_hashes, causal, key_padding_mask)


# The fast path works on one flat layout. Each (batch, head, round) block holds ``M = (C + 1) * size`` slots:
# a leading chunk of dummy slots (the "chunk before the first"), then the N positions in sorted order, then
# dummy slots up to a whole chunk. Stacking the blocks gives ``T = B * H * R * (C + 1)`` chunks, and the keys of
# query chunk ``g`` (g >= 1) are chunks ``g - 1`` and ``g``: an overlapping strided view of the key rows, read by
# the matrix products in place (no copy of the keys or values per chunk). The windows of a block's dummy chunk
# span the previous block: computed, never used.


class _SortRounds(torch.autograd.Function):
    """``x`` (B, H, N, c) -> (B, H, R, M, c): round ``r`` lists the rows ``order[..., r, :]`` (M slots: a
    permutation of the N positions between dummy slots, which pick row 0).

    One ``index_select`` of the flattened rows. The backward gathers each position's slot in every round
    (``slot[..., r, j]``) and sums the rounds: a parallel gather instead of the serial ``index_add`` that
    autograd's backward of a gather is."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, slot: Tensor) -> Tensor:  # type: ignore[override]
        b, h, n, c = x.shape
        ctx.save_for_backward(slot)
        offsets = (torch.arange(b * h, device=x.device) * n).view(b, h, 1, 1)
        return x.reshape(b * h * n, c).index_select(0, (order + offsets).reshape(-1)).view(*order.shape, c)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (slot,) = ctx.saved_tensors
        b, h, rounds, n = slot.shape
        slots, c = grad.shape[-2:]
        flat = slot + (torch.arange(b * h * rounds, device=grad.device) * slots).view(b, h, rounds, 1)
        picked = grad.reshape(-1, c).index_select(0, flat.reshape(-1)).view(b, h, rounds, n, c)
        return picked.sum(dim=2), None, None


class _UnsortRounds(torch.autograd.Function):
    """Rows of the flat layout minus its first chunk, ``y`` ((T - 1) size, c), back to the original positions:
    (B, H, R, N, c), row ``j`` of round ``r`` from its slot ``slot[..., r, j]``. The backward sends each
    position's gradient to its slot (a gather with ``order``) and zeros to the dummy slots."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, slot: Tensor, size: int) -> Tensor:  # type: ignore[override]
        b, h, rounds, n = slot.shape
        slots = order.shape[-1]
        ctx.save_for_backward(order)
        ctx.size = size
        flat = slot - size + (torch.arange(b * h * rounds, device=y.device) * slots).view(b, h, rounds, 1)
        return y.index_select(0, flat.reshape(-1)).view(b, h, rounds, n, y.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        size = ctx.size
        b, h, rounds, n, c = grad.shape
        slots = order.shape[-1]
        flat = order + (torch.arange(b * h * rounds, device=grad.device) * n).view(b, h, rounds, 1)
        picked = grad.reshape(-1, c).index_select(0, flat.reshape(-1)).view(b * h * rounds, slots, c)
        picked[:, :size].zero_()
        picked[:, size + n :].zero_()
        return picked.view(-1, c)[size:], None, None, None


def _windows(rows: Tensor, size: int) -> Tensor:
    """(T size, c) contiguous rows -> (T - 1, 2 size, c): chunks g - 1 and g for g = 1 .. T - 1, a view."""
    c = rows.shape[-1]
    return rows.as_strided((rows.shape[0] // size - 1, 2 * size, c), (size * c, c, 1))


class _ChunkAttention(torch.autograd.Function):
    """Softmax attention of every query chunk over its window (the chunk before it and itself), returning the
    output and each row's log-sum-exp (the round weights), with a hand-written backward.

    ``xs``, ``ks``, ``vs``: the queries, keys and values in the flat layout, (T size, d) / (T size, dv); the
    queries are the rows from the second chunk on. ``blocked``: bool masks broadcastable to (T - 1, size,
    2 size), True where a query may not attend. A query meets itself on the diagonal ``t = a + size`` of its
    window: that logit is set to :data:`SELF_LOGIT`. Saves the probabilities; the backward is ``dS = P * (dP -
    rowsum(dO * O) + dlse)`` on the visible logits (the others are constants, through which no gradient flows)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, xs: Tensor, ks: Tensor, vs: Tensor, size: int, *blocked: Tensor):  # type: ignore[override]
        queries = xs[size:].view(-1, size, xs.shape[-1])
        scores = torch.bmm(queries, _windows(ks, size).transpose(1, 2))
        for mask in blocked:
            scores.masked_fill_(mask, -math.inf)
        scores.diagonal(offset=size, dim1=1, dim2=2).fill_(SELF_LOGIT)
        largest = scores.amax(dim=-1, keepdim=True)  # finite: the self logit is always there
        probabilities = torch.softmax(scores, dim=-1)  # one fused pass, where logsumexp, sub and exp take four
        del scores
        # The log-sum-exp from the largest probability, exp(largest - lse) >= 1 / (2 size): no precision lost.
        lse = largest - probabilities.amax(dim=-1, keepdim=True).log()
        out = torch.bmm(probabilities, _windows(vs, size))
        ctx.size = size
        ctx.save_for_backward(xs, ks, vs, probabilities, out, *blocked)
        return out, lse.squeeze(-1)

    @staticmethod
    @outside_autocast
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]):  # type: ignore[override]
        xs, ks, vs, probabilities, out, *blocked = ctx.saved_tensors
        size = ctx.size
        queries = xs[size:].view(-1, size, xs.shape[-1])
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dscores = torch.bmm(grad_out, _windows(vs, size).transpose(1, 2))
        shift = (grad_out * out).sum(dim=-1, keepdim=True)  # one pass over the scores for both row terms
        if grad_lse is not None:
            shift = shift - grad_lse.unsqueeze(-1)
        dscores.sub_(shift).mul_(probabilities)
        for mask in blocked:
            dscores.masked_fill_(mask, 0.0)
        dscores.diagonal(offset=size, dim1=1, dim2=2).zero_()
        # Queries: the rows after the first chunk (the first chunk holds dummy slots only).
        dxs = torch.empty_like(xs)
        dxs[:size].zero_()
        torch.bmm(dscores, _windows(ks, size), out=dxs[size:].view(queries.shape))
        # Keys and values: chunk g is the second half of window g and the first half of window g + 1.
        return dxs, _fold(dscores, queries, size, ks), _fold(probabilities, grad_out, size, vs), None, *(
            None for _ in blocked)


def _fold(weights: Tensor, rows: Tensor, size: int, like: Tensor) -> Tensor:
    """The gradient of the rows under the windows, (T size, c): ``weights^T @ rows`` per window, its two halves
    added to the chunks they came from."""
    c = rows.shape[-1]
    total = torch.empty_like(like).view(-1, size, c)
    total[0].zero_()
    torch.bmm(weights[:, :, size:].transpose(1, 2), rows, out=total[1:])
    total[:-1].baddbmm_(weights[:, :, :size].transpose(1, 2), rows)
    return total.view(-1, c)


def lsh_attention_unchecked(
    qk: Tensor,
    v: Tensor,
    hash_key: Tensor,
    bucket_size: int,
    n_hashes: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
) -> Tensor:
    """:func:`lsh_attention` on validated arguments (the mechanism calls it after its own checks)."""
    dtype = qk.dtype
    wd = working_dtype(dtype)
    b, h, n, d = qk.shape
    dv = v.shape[3]
    size = bucket_size
    n_buckets = lsh_bucket_count(n, size)
    if n_buckets == 1:
        # One bucket: every round sorts the positions alike and computes the same output with the same
        # normaliser, so their log-sum-exp weighted mean is that output. One round computes it.
        n_hashes = 1
    chunks = -(-n // size)
    slots = (chunks + 1) * size  # per round: a dummy chunk, the sorted positions, dummies to a whole chunk
    tail = slots - size - n
    x = zero_padded(qk, key_padding_mask).to(wd)
    values = zero_padded(v, key_padding_mask).to(wd)

    with torch.no_grad():
        buckets = lsh_buckets_unchecked(x, hash_key, n_hashes, n_buckets)  # (b, h, R, n)
    if key_padding_mask is not None:
        # Padded positions sort after every real one: the order of the real positions ignores them.
        buckets = buckets.masked_fill(key_padding_mask[:, None, None, :], n_buckets)
    # A stable sort of the buckets is the sort by (bucket, position).
    sorted_buckets, order = torch.sort(buckets, dim=-1, stable=True)
    # slot[..., r, j]: where position j sits in round r's block.
    slot = torch.empty_like(order).scatter_(-1, order, torch.arange(size, size + n, device=order.device).expand_as(order))
    order = torch.nn.functional.pad(order, (size, tail))  # dummy slots read row 0
    sorted_buckets = torch.nn.functional.pad(sorted_buckets, (size, tail), value=n_buckets + 1)

    xs = _SortRounds.apply(x, order, slot).view(-1, d)  # (T size, d)
    vs = _SortRounds.apply(values, order, slot).view(-1, dv)
    # Unit keys with the 1/sqrt(d) scale folded in (a zero vector, i.e. padding or a dummy, stays zero).
    ks = xs * (torch.rsqrt((xs * xs).sum(-1, keepdim=True).clamp_min(1e-24)) * (1.0 / math.sqrt(d)))

    flat_buckets = sorted_buckets.reshape(-1)
    query_buckets = flat_buckets[size:].view(-1, size, 1)
    key_buckets = _windows(flat_buckets.view(-1, 1), size).view(-1, 1, 2 * size)
    if causal:
        # The bucket_size - 1 latest earlier keys of the query's own bucket: sorted index s - t' in (0, size).
        a = torch.arange(size, device=qk.device).view(-1, 1)
        t = torch.arange(2 * size, device=qk.device).view(1, -1)
        blocked = ((query_buckets != key_buckets) | (t <= a) | (t >= a + size),)
    else:
        # Every real key of the window. Dummy and padded query rows compute something finite, never used.
        blocked = (key_buckets >= n_buckets,)

    out, lse = _ChunkAttention.apply(xs, ks, vs, size, *blocked)  # (T - 1, size, dv), (T - 1, size)
    # Back to the original positions, (b, h, R, n, .).
    out = _UnsortRounds.apply(out.view(-1, dv), order, slot, size)
    if n_hashes == 1:
        result = out[:, :, 0]
    else:
        lse = _UnsortRounds.apply(lse.view(-1, 1), order, slot, size)
        weights = torch.softmax(lse, dim=2)  # (b, h, R, n, 1): the rounds by their normalisers
        result = (out * weights).sum(dim=2)
    if key_padding_mask is not None:
        result = result.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # padded positions are no queries
    return result.to(dtype)


def lsh_attention_reference(
    qk: Tensor,
    v: Tensor,
    hash_key: Tensor,
    *,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    n_hashes: int = DEFAULT_N_HASHES,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """:func:`lsh_attention` by dense float64 maths: per round and per (batch, head), the positions sorted by
    (bucket, position) in Python, the N x N mask of who attends to whom built from their sorted ranks, a dense
    masked softmax; the rounds weighted by the softmax of their log-sum-exps. Returns float64."""
    bucket_size, n_hashes, causal = _check(qk, v, bucket_size, n_hashes, causal)
    check_key_padding_mask(key_padding_mask, qk.shape[0], qk.shape[2], qk.device)
    b, h, n, d = qk.shape
    padded = torch.zeros(b, n, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.cpu()
    keep = ~padded
    x = qk.double().masked_fill(padded[:, None, :, None].to(qk.device), 0.0)
    values = v.double().masked_fill(padded[:, None, :, None].to(qk.device), 0.0)
    n_buckets = 1 if n <= bucket_size else 2 * math.ceil(n / (2 * bucket_size))
    rotations = lsh_rotations(hash_key, n_hashes, d, max(1, n_buckets // 2)).to(x.device)
    norms = x.norm(dim=-1, keepdim=True)
    keys = torch.where(norms > 0, x / torch.where(norms > 0, norms, 1.0), 0.0)
    logits = x @ keys.transpose(-1, -2) / math.sqrt(d)  # (b, h, n, n)
    eye = torch.eye(n, dtype=torch.bool, device=x.device)

    round_outputs: List[Tensor] = []
    round_lses: List[Tensor] = []
    for r in range(n_hashes):
        if n_buckets == 1:
            bucket = torch.zeros(b, h, n, dtype=torch.int64)
        else:
            projected = x.detach() @ rotations[r]  # (b, h, n, n_buckets / 2)
            bucket = torch.cat([projected, -projected], dim=-1).argmax(dim=-1).cpu()
        rows = [[[[False] * n for _ in range(n)] for _ in range(h)] for _ in range(b)]
        for bi in range(b):
            real = [i for i in range(n) if keep[bi, i]]
            for hi in range(h):
                of = bucket[bi, hi].tolist()
                ranked = sorted(real, key=lambda i: (of[i], i))
                rank = {position: s for s, position in enumerate(ranked)}
                for i in real:
                    for j in real:
                        if i == j:
                            continue
                        if causal:
                            # Same bucket, earlier, among the bucket_size - 1 latest before i.
                            ok = of[i] == of[j] and j < i and rank[i] - rank[j] < bucket_size
                        else:
                            ok = rank[i] // bucket_size - 1 <= rank[j] // bucket_size <= rank[i] // bucket_size
                        rows[bi][hi][i][j] = ok
        allowed = torch.tensor(rows, dtype=torch.bool, device=x.device).view(b, h, n, n)
        scores = torch.where(allowed, logits, torch.full_like(logits, -math.inf))
        scores = torch.where(eye, torch.full_like(logits, SELF_LOGIT), scores)
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.softmax(scores, dim=-1)
        round_outputs.append(weights @ values)
        round_lses.append(lse)
    lses = torch.stack(round_lses)  # (R, b, h, n)
    mix = torch.softmax(lses, dim=0)
    out = sum(mix[r].unsqueeze(-1) * round_outputs[r] for r in range(n_hashes))
    # Padded positions are no queries: zeros.
    return out.masked_fill(padded[:, None, :, None].to(x.device), 0.0)

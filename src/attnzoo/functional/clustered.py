"""Clustered attention (Vyas et al. 2020, "Fast Transformers with Clustered Attention").

The queries are grouped into C clusters and each cluster's centroid (the mean of its member queries) attends
once over all keys with exact softmax; its output is broadcast to the cluster's queries. Cost O(N C d)
instead of O(N^2 d).

Clustering (:func:`cluster_queries`), as in the paper: every query is hashed to a B-bit code by the signs of
its projections on B random hyperplanes (LSH for the angle between queries), and the codes are clustered by
k-means under the Hamming distance: centroids start at the codes of C evenly spaced queries (positions
``floor(c N / C)``, deterministic), then each Lloyd iteration assigns every code to its nearest centroid code
(the lowest index on ties) and moves each centroid code to the bitwise majority of its members (a tie gives
0; a cluster left without members keeps its code). A last assignment gives the clusters. The whole thing is
discrete and batched over (batch, heads): Hamming distances are one matrix product of 0/1 codes (exact
integers in floating point), the majority one product with a 0/1 membership matrix; the only Python loop is
over the Lloyd iterations, which stops early once no centroid moves (a fixed point: the rest would repeat
it). With at least as many clusters as queries every query is its own cluster (k-means would be pointless):
the output is then exact softmax attention.

Gradients: the assignments are not differentiated (argmin), but the centroids are means of their member
queries, so gradients reach q through them, as in the paper.

Improved clustered attention ("i-clustered", ``topk``): the centroid attention ``A^c`` (C, N_kv) picks each
cluster's k keys of largest weight, ``T_j``. Query i of cluster j recomputes exact softmax attention over
those k keys and gives them the mass the centroid put on them, ``m_j = sum_{l in T_j} A^c_jl``; the other keys
keep the centroid's weights (the paper's eq. for ``A^t``):

    A^t_il = m_j exp(q_i k_l / sqrt d) / sum_{r in T_j} exp(q_i k_r / sqrt d)    if l in T_j
    A^t_il = A^c_jl                                                               otherwise
    out_i  = m_j softmax_{T_j}(q_i K_T^T / sqrt d) V_T + sum_{l not in T_j} A^c_jl v_l

With k = N_kv (every key in T_j, ``m_j = 1``) this is exact softmax attention for any clustering.

Padding: padded keys and values are zeroed before use and get no weight (a query whose keys are all padded
outputs zeros). ``query_padding_mask`` (in self-attention, the key padding mask) marks queries that are
zeroed and left out of the clustering: they join no centroid, so whatever they hold (NaN, inf) changes no
other query's output; they are still assigned to a cluster and get its (finite) output.

Precision: hashing, centroids and the centroid attention weights run in float32 for float16/bfloat16 inputs
(in float64 for float64); the plain form's centroid attention runs through ``scaled_dot_product_attention``
in the input dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_floating, check_key_padding_mask, check_number, check_positive_int, check_qkv
from .masks import zero_padded
from .softmax import masked_sdpa

DEFAULT_CLUSTERS = 100
DEFAULT_HASH_BITS = 32
DEFAULT_ITERATIONS = 10
DEFAULT_TOPK = 32


# -- clustering -----------------------------------------------------------------------------------------------
def cluster_count(q_len: int, clusters: int) -> int:
    """How many clusters ``q_len`` queries form: ``clusters``, or one per query when there are fewer."""
    return min(clusters, q_len)


def _check_planes(planes: Tensor, head_dim: int, device: torch.device) -> None:
    check_floating("planes", planes)
    if planes.dim() != 2 or planes.shape[0] != head_dim:
        raise ValueError(f"planes must have shape (head_dim, hash_bits) = ({head_dim}, bits), got {tuple(planes.shape)}")
    if planes.device != device:
        raise ValueError(f"planes must be on {device}, got {planes.device}")


def _check_query_padding_mask(mask: Optional[Tensor], batch: int, length: int, device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"query_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"query_padding_mask must be a bool tensor (True = padding), got {mask.dtype}")
    if mask.shape != (batch, length):
        raise ValueError(
            f"query_padding_mask must have shape (batch, seq_q) = ({batch}, {length}), got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"query_padding_mask must be on {device}, got {mask.device}")


def cluster_queries(
    q: Tensor, planes: Tensor, clusters: int, iterations: int, query_padding_mask: Optional[Tensor] = None
) -> Tensor:
    """The cluster of every query: LSH codes by ``planes`` (head_dim, hash_bits), then Hamming k-means with
    ``iterations`` Lloyd iterations (see the module docstring).

    Args:
        q: (batch, heads, seq_q, head_dim)
        planes: (head_dim, hash_bits) hyperplane normals; bit b of a query is ``q . planes[:, b] > 0``.
        clusters: C, the number of clusters (one per query when there are fewer queries).
        iterations: Lloyd iterations.
        query_padding_mask: (batch, seq_q) bool, True marks queries left out of the centroids.

    Returns:
        (batch, heads, seq_q) int64 cluster indices in ``[0, cluster_count(seq_q, clusters))``; not
        differentiable.
    """
    check_floating("q", q)
    if q.dim() != 4 or q.shape[2] == 0:
        raise ValueError(f"q must have shape (batch, heads, seq, head_dim) with seq >= 1, got {tuple(q.shape)}")
    _check_planes(planes, q.shape[3], q.device)
    check_positive_int("clusters", clusters)
    check_positive_int("iterations", iterations)
    _check_query_padding_mask(query_padding_mask, q.shape[0], q.shape[2], q.device)
    return cluster_queries_unchecked(q, planes, clusters, iterations, query_padding_mask)


def _nearest(codes: Tensor, centers: Tensor) -> Tensor:
    """Index of the nearest centre code (Hamming distance; the first on ties) for every code.

    With +-1 codes of b bits, ``x . c = b - 2 hamming(x, c)``: the nearest centre is the one of largest dot
    product, one batched matrix product and an argmax (the first maximum on ties). Every term is a small
    integer, exact in floating point."""
    return (codes @ centers.transpose(-1, -2)).argmax(-1)


def cluster_queries_unchecked(
    q: Tensor, planes: Tensor, clusters: int, iterations: int, query_padding_mask: Optional[Tensor]
) -> Tensor:
    """:func:`cluster_queries` for callers that have checked its arguments."""
    batch, heads, q_len, _ = q.shape
    count = cluster_count(q_len, clusters)
    if count == q_len:
        # One cluster per query (a decision on shapes only, so traced graphs stay valid for any mask).
        return torch.arange(q_len, device=q.device).expand(batch, heads, q_len)
    work = working_dtype(q.dtype)
    with torch.no_grad():
        # Padded queries are zeroed first, so whatever they hold gives them the same code (every bit 0).
        q = zero_padded(q.detach(), query_padding_mask)
        positive = q.to(work) @ planes.to(work) > 0
        one = torch.ones((), dtype=work, device=q.device)
        codes = torch.where(positive, one, -one)  # (B, H, N, bits): bit 1 as +1, bit 0 as -1
        # What each query adds to its cluster's votes: its code and a 1 counting it; nothing if padded.
        votes_of = torch.cat([codes, one.expand(batch, heads, q_len, 1)], dim=-1)
        if query_padding_mask is not None:
            votes_of = votes_of.masked_fill(query_padding_mask[:, None, :, None], 0.0)
        votes_of = votes_of.reshape(batch * heads * q_len, -1)
        # Flat index of cluster c of (batch, head) number i: i * count + c.
        offsets = (torch.arange(batch * heads, device=q.device) * count).view(batch, heads, 1)
        start = torch.arange(count, device=q.device) * q_len // count  # evenly spaced, distinct (count < q_len)
        centers = codes[:, :, start]  # (B, H, C, bits)
        for _ in range(iterations):
            assignment = _nearest(codes, centers)
            # Per cluster: the sum of its members' +-1 codes (> 0 where most have the bit set) and their count.
            # Sums of small integers: exact, whatever the order of the additions.
            votes = codes.new_zeros(batch * heads * count, votes_of.shape[-1])
            votes.index_add_(0, (assignment + offsets).flatten(), votes_of)
            votes = votes.view(batch, heads, count, -1)
            majority = torch.where(votes[..., :-1] > 0, one, -one)  # a tie gives bit 0
            moved = torch.where(votes[..., -1:] > 0, majority, centers)  # a cluster with no member stays
            if not torch.compiler.is_compiling() and torch.equal(moved, centers):
                # A fixed point: the same centres give the same assignment, so every later iteration would
                # repeat this one. Stopping here returns exactly what all the iterations would. (A compiled
                # graph has no data-dependent exit, so it runs them all.)
                break
            centers = moved
        return _nearest(codes, centers)


# -- attention ------------------------------------------------------------------------------------------------
def clustered_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    planes: Tensor,
    clusters: int = DEFAULT_CLUSTERS,
    iterations: int = DEFAULT_ITERATIONS,
    topk: Optional[int] = None,
    query_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Clustered attention (non-causal); see the module docstring for the maths.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys, which get no weight.
        planes: (head_dim, hash_bits) LSH hyperplanes of the clustering.
        clusters: C, the number of query clusters (one per query when there are fewer queries).
        iterations: Lloyd iterations of the Hamming k-means.
        topk: None for clustered attention; k for improved clustered attention, where every query recomputes
            exact attention over its cluster's k keys of largest centroid weight (all keys when fewer).
        query_padding_mask: (batch, seq_q) bool, True marks queries left out of the clustering (their own
            rows are still computed). For self-attention pass the key padding mask.

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``v``.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    _check_query_padding_mask(query_padding_mask, q.shape[0], q.shape[2], q.device)
    _check_planes(planes, q.shape[3], q.device)
    check_positive_int("clusters", clusters)
    check_positive_int("iterations", iterations)
    check_number("topk", topk, integer=True, minimum=1, optional=True)
    return clustered_attention_unchecked(
        q, k, v, key_padding_mask, query_padding_mask, planes, clusters, iterations, topk
    )


def clustered_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    query_padding_mask: Optional[Tensor],
    planes: Tensor,
    clusters: int,
    iterations: int,
    topk: Optional[int],
) -> Tensor:
    """:func:`clustered_attention` for callers that have validated every argument themselves (the mechanism,
    after :meth:`~attnzoo.mechanisms.base.Mechanism.check_inputs`): inputs are checked once."""
    dtype = v.dtype
    work = working_dtype(dtype)
    batch, heads, q_len, head_dim = q.shape
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    if query_padding_mask is not None:
        q = q.masked_fill(query_padding_mask[:, None, :, None], 0.0)
    assignment = cluster_queries_unchecked(q, planes, clusters, iterations, query_padding_mask)
    count = cluster_count(q_len, clusters)
    allowed = None if key_padding_mask is None else (~key_padding_mask)[:, None, None, :]

    if count == q_len:
        centroids = q.to(work)  # every query its own cluster (assignment is the identity)
        if topk is None:
            return masked_sdpa(q, k, v, allowed)
    else:
        # Centroids: means of the unpadded member queries, through a 0/1 membership matrix so that the
        # gradient reaches every member (a product, deterministic, O(N C d) like the attention itself).
        weight = torch.ones(batch, 1, 1, q_len, dtype=work, device=q.device)
        if query_padding_mask is not None:
            weight = (~query_padding_mask).to(work).view(batch, 1, 1, q_len)
        membership = torch.zeros(batch, heads, count, q_len, dtype=work, device=q.device)
        membership.scatter_(2, assignment.unsqueeze(2), weight.expand(batch, heads, 1, q_len))
        membership = membership / membership.sum(-1, keepdim=True).clamp_min(1.0)  # an empty cluster: zeros
        centroids = membership @ q.to(work)  # (B, H, C, d)

    def broadcast(per_cluster: Tensor) -> Tensor:
        """(B, H, C, c) per cluster -> (B, H, N, c) per query, by gather."""
        return per_cluster.gather(2, assignment.unsqueeze(-1).expand(batch, heads, q_len, per_cluster.shape[-1]))

    if topk is None:
        return broadcast(masked_sdpa(centroids.to(dtype), k, v, allowed))

    # Improved: the centroid attention weights A^c (B, H, C, N_kv), explicitly, to pick each cluster's top keys.
    k_len = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    k_work, v_work = k.to(work), v.to(work)
    logits = (centroids @ k_work.transpose(-1, -2)) * scale
    empty = None
    if allowed is not None:
        # A batch element with every key padded lets its rows see all (zeroed) keys, which keeps softmax finite;
        # its weights are then zeroed, so it outputs zeros (and passes no gradient).
        empty = ~allowed.any(-1, keepdim=True)
        logits = logits.masked_fill(~(allowed | empty), -math.inf)
    weights = torch.softmax(logits, dim=-1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    chosen = min(topk, k_len)
    top_weights, top_index = weights.topk(chosen, dim=-1)  # (B, H, C, k)
    mass = top_weights.sum(-1, keepdim=True)  # m_j: the centroid's mass on its top keys
    rest = weights.scatter(-1, top_index, 0.0) @ v_work  # the other keys, at the centroid's weights

    top_out = _attend_to_cluster_keys(q.to(work) * scale, assignment, count, top_index, k_work, v_work,
                                      key_padding_mask)
    out = broadcast(mass) * top_out + broadcast(rest)
    return out.to(dtype)


def _attend_to_cluster_keys(
    q: Tensor,
    assignment: Tensor,
    count: int,
    top_index: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
) -> Tensor:
    """Softmax attention of every query (B, H, N, d), already scaled, over its cluster's top keys only:
    ``top_index`` (B, H, C, k) indexes the keys ``k`` and values ``v`` (B, H, N_kv, .). Returns (B, H, N, d_v).

    The queries are grouped by cluster into chunks of S slots (S the mean cluster size, rounded up), each
    chunk holding queries of one cluster, so that every chunk is one small matrix product with its cluster's
    k keys: the keys are gathered once per chunk, not once per query. A cluster of n queries takes
    ceil(n / S) chunks, so ``(N + C (S - 1)) // S`` chunks (about N / S + C) always suffice; the layout is
    computed from the assignments with sorts and cumulative sums, of static shapes whatever they hold."""
    batch, heads, q_len, head_dim = q.shape
    chosen = top_index.shape[-1]
    size = -(-q_len // count)  # S
    chunks = (q_len + count * (size - 1)) // size  # M
    # Queries sorted by cluster; each one's rank within its cluster gives its chunk and slot.
    order = assignment.argsort(dim=-1, stable=True)
    sorted_cluster = assignment.gather(-1, order)
    members = torch.zeros(batch, heads, count, dtype=torch.long, device=q.device)
    members.scatter_add_(-1, assignment, torch.ones_like(assignment))
    cluster_chunks = (members + size - 1) // size
    first_chunk = cluster_chunks.cumsum(-1) - cluster_chunks
    first_member = members.cumsum(-1) - members
    rank = torch.arange(q_len, device=q.device) - first_member.gather(-1, sorted_cluster)
    chunk = first_chunk.gather(-1, sorted_cluster) + rank // size  # (B, H, N), in sorted order
    slot = torch.empty_like(order).scatter_(-1, order, chunk * size + rank % size)  # each query's slot
    chunk_cluster = torch.zeros(batch, heads, chunks, dtype=torch.long, device=q.device)
    chunk_cluster.scatter_(-1, chunk, sorted_cluster)  # an unused chunk keeps cluster 0; its slots are empty

    # Queries into their slots (empty slots are zeros), each chunk's keys and values.
    queries = q.new_zeros(batch, heads, chunks * size, head_dim)
    queries = queries.scatter(2, slot.unsqueeze(-1).expand(batch, heads, q_len, head_dim), q)
    index = top_index.gather(2, chunk_cluster.unsqueeze(-1).expand(batch, heads, chunks, chosen))
    flat = index.reshape(batch, heads, chunks * chosen, 1)
    keys = k.gather(2, flat.expand(-1, -1, -1, head_dim)).view(batch, heads, chunks, chosen, head_dim)
    values = v.gather(2, flat.expand(-1, -1, -1, v.shape[-1])).view(batch, heads, chunks, chosen, v.shape[-1])
    logits = queries.view(batch, heads, chunks, size, head_dim) @ keys.transpose(-1, -2)  # (B, H, M, S, k)
    if key_padding_mask is not None:
        # Top keys that are padding (only when fewer than k keys are real) get no weight; a chunk of nothing
        # but padding keeps all (zeroed) keys, finite, and its mass is zero.
        padded = key_padding_mask.gather(1, index.reshape(batch, -1)).view(batch, heads, chunks, 1, chosen)
        padded = padded & ~padded.all(-1, keepdim=True)
        logits = logits.masked_fill(padded, -math.inf)
    out = (torch.softmax(logits, dim=-1) @ values).view(batch, heads, chunks * size, v.shape[-1])
    return out.gather(2, slot.unsqueeze(-1).expand(batch, heads, q_len, v.shape[-1]))


# -- reference ------------------------------------------------------------------------------------------------
def clustered_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    planes: Tensor,
    clusters: int = DEFAULT_CLUSTERS,
    iterations: int = DEFAULT_ITERATIONS,
    topk: Optional[int] = None,
    query_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Obviously-correct float64 clustered attention, one (batch, head) and one cluster at a time.

    Same arguments as :func:`clustered_attention`. The clusters come from :func:`cluster_queries` on the
    queries as given (the clustering is discrete, so sharing it hides no arithmetic); everything after it is
    written out densely here: centroids as explicit member means, the centroid's softmax over the unpadded
    keys, its top keys by a stable sort, each member query's softmax over them. Returns float64 (batch,
    heads, seq_q, head_dim_v).
    """
    batch, heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    device = q.device
    key_padded = torch.zeros(batch, k_len, dtype=torch.bool, device=device) if key_padding_mask is None \
        else key_padding_mask
    query_padded = torch.zeros(batch, q_len, dtype=torch.bool, device=device) if query_padding_mask is None \
        else query_padding_mask
    # The queries as given (in their dtype), so that the codes are the fast path's bit for bit.
    assignment = cluster_queries(q, planes, clusters, iterations, query_padding_mask)
    q = q.double().masked_fill(query_padded[:, None, :, None], 0.0)
    k = k.double().masked_fill(key_padded[:, None, :, None], 0.0)
    v = v.double().masked_fill(key_padded[:, None, :, None], 0.0)
    scale = 1.0 / math.sqrt(head_dim)
    rows = []
    for b in range(batch):
        keep = [l for l in range(k_len) if not bool(key_padded[b, l])]
        head_rows = []
        for h in range(heads):
            out = [torch.zeros(v.shape[-1], dtype=torch.float64, device=device) for _ in range(q_len)]
            for c in range(cluster_count(q_len, clusters)):
                queries = [i for i in range(q_len) if int(assignment[b, h, i]) == c]
                members = [i for i in queries if not bool(query_padded[b, i])]
                if not queries or not keep:
                    continue  # no query to serve, or nothing to attend to: zeros
                centroid = torch.zeros(head_dim, dtype=torch.float64, device=device)
                for i in members:
                    centroid = centroid + q[b, h, i] / len(members)
                logits = torch.stack([centroid @ k[b, h, l] * scale for l in keep])
                centroid_weights = torch.exp(logits - logits.max())
                centroid_weights = centroid_weights / centroid_weights.sum()
                if topk is None:
                    value = sum(w * v[b, h, l] for w, l in zip(centroid_weights, keep))
                    for i in queries:
                        out[i] = value
                    continue
                order = torch.sort(centroid_weights.detach(), descending=True, stable=True).indices.tolist()
                top = sorted(order[: min(topk, len(keep))])  # positions in ``keep``: top keys among the unpadded
                mass = sum(centroid_weights[j] for j in top)
                others = sum((centroid_weights[j] * v[b, h, keep[j]] for j in range(len(keep)) if j not in top),
                             torch.zeros(v.shape[-1], dtype=torch.float64, device=device))
                for i in queries:
                    own = torch.stack([q[b, h, i] @ k[b, h, keep[j]] * scale for j in top])
                    own = torch.exp(own - own.max())
                    own = own / own.sum()
                    out[i] = mass * sum(w * v[b, h, keep[j]] for w, j in zip(own, top)) + others
            head_rows.append(torch.stack(out))
        rows.append(torch.stack(head_rows))
    return torch.stack(rows)

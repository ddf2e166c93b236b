"""Clustered attention (Vyas et al. 2020): queries grouped by Hamming k-means on LSH codes, one exact softmax
per cluster centroid, broadcast to its queries; optionally improved by each query's exact attention over its
cluster's top keys. The maths lives in :mod:`attnzoo.functional.clustered`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._validation import check_bool, check_number, check_positive_int
from ..functional.clustered import (
    DEFAULT_CLUSTERS,
    DEFAULT_HASH_BITS,
    DEFAULT_ITERATIONS,
    DEFAULT_TOPK,
    clustered_attention_reference,
    clustered_attention_unchecked,
)
from .base import APPROXIMATE, PACKED_SPLIT, Capabilities, Mechanism, seeded_generator
from .capabilities import PADDED_NEITHER
from .registry import register


@register
class ClusteredAttention(Mechanism):
    """Clustered attention: the queries of each (batch, head) are clustered, each centroid (the mean of its
    member queries) attends over all keys with exact softmax, and every query takes its centroid's output.

    Takes q, k (batch, heads, seq, head_dim) and v (batch, heads, seq_kv, head_dim_v); returns (batch, heads,
    seq_q, head_dim_v). Non-causal only (a centroid mixes queries from every position). Cross-attention
    clusters the queries and attends over any keys. In self-attention the key padding mask is also the query
    padding: padded queries join no centroid (whatever they hold changes no other output).

    Clustering: every query's code is the signs of its projections on ``hash_bits`` random hyperplanes
    (a buffer, drawn at construction), and the codes are clustered by k-means under the Hamming distance,
    starting from evenly spaced queries, for ``iterations`` Lloyd iterations. It is not differentiated;
    gradients reach the queries through the centroids. With at least as many clusters as queries every query
    is its own cluster and the output is exact softmax attention.

    Options:
        clusters: C, the number of query clusters; cost O(N C d).
        hash_bits: bits of the LSH code (random hyperplanes).
        iterations: Lloyd iterations of the Hamming k-means.
        improved: improved clustered attention ("i-clustered"): each query recomputes exact softmax attention
            over its cluster's ``topk`` keys of largest centroid weight, giving them the centroid's mass on
            them, while the other keys keep the centroid's weights. With ``topk`` >= the key length it is exact
            softmax attention whatever the clusters.
        topk: k, the keys each cluster recomputes exactly (with ``improved=True``); cost O(N k d) more.
        seed: seed of the hyperplanes (the global RNG when None).
    """

    name = "clustered"
    capabilities = Capabilities(
        # The cluster count and the first centroids (evenly spaced queries) follow the padded row's length.
        padding_invariance=PADDED_NEITHER,
        causal=False,
        cross=True,
        key_padding=True,
        recurrent_step=False,
        kind=APPROXIMATE,
        complexity="time O(N C (d + b i)), memory O(N C); C clusters, b hash bits, i iterations; improved: "
                   "+ O(N k d)",
        summary="queries clustered by Hamming k-means on LSH codes, one softmax per centroid; improved: exact "
                "attention on each cluster's top-k keys (Vyas et al. 2020)",
        packing=PACKED_SPLIT,
    )
    sweep_option = "clusters"
    # 3 clusters over the suite's 11 queries (5 in its short cross-attention case) run the k-means; 16 gives
    # one cluster per query (exact); topk 4 < 11 keys and 32 > every key count test both sides of the top-k.
    test_options = {"clusters": 3, "hash_bits": 8, "iterations": 2, "seed": 0}
    test_variants = (
        {"clusters": 16, "hash_bits": 8, "iterations": 2, "seed": 0},
        {"clusters": 3, "hash_bits": 8, "iterations": 2, "seed": 0, "improved": True, "topk": 4},
        {"clusters": 3, "hash_bits": 8, "iterations": 2, "seed": 0, "improved": True, "topk": 32},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        clusters: int = DEFAULT_CLUSTERS,
        hash_bits: int = DEFAULT_HASH_BITS,
        iterations: int = DEFAULT_ITERATIONS,
        improved: bool = False,
        topk: int = DEFAULT_TOPK,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.clusters = check_positive_int("clusters", clusters)
        self.hash_bits = check_positive_int("hash_bits", hash_bits)
        self.iterations = check_positive_int("iterations", iterations)
        self.improved = check_bool("improved", improved)
        self.topk = check_positive_int("topk", topk)
        self.seed = check_number("seed", seed, integer=True, minimum=0, optional=True)
        generator = seeded_generator(self.seed)
        # Hyperplane normals (head_dim, hash_bits), shared by the heads; a buffer, so saved with the model and
        # never redrawn during a forward pass.
        self.register_buffer("planes", torch.randn(head_dim, self.hash_bits, generator=generator))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs and __init__ the options: validate once. In self-attention a padded
        # key is a padded query too, left out of the clustering.
        return clustered_attention_unchecked(
            q, k, v, key_padding_mask, None if cross else key_padding_mask, self.planes, self.clusters,
            self.iterations, self.topk if self.improved else None,
        )

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Dense float64 maths, one (batch, head) and cluster at a time, on the same (discrete) clusters."""
        return clustered_attention_reference(
            q,
            k,
            v,
            key_padding_mask,
            planes=self.planes,
            clusters=self.clusters,
            iterations=self.iterations,
            topk=self.topk if self.improved else None,
            query_padding_mask=None if cross else key_padding_mask,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, clusters={self.clusters}, hash_bits={self.hash_bits}, "
            f"iterations={self.iterations}, improved={self.improved}, topk={self.topk}, seed={self.seed}"
        )

"""Reformer's LSH attention (Kitaev et al. 2020) as a mechanism: the hashing key and the wiring; the maths is in
:mod:`attnzoo.functional.lsh`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._validation import check_number, check_positive_int
from ..functional.lsh import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_N_HASHES,
    lsh_attention_reference,
    lsh_attention_unchecked,
    lsh_bucket_count,
    lsh_hash_key,
    lsh_rotations_unchecked,
)
from ..functional.ties import tied_to_unused
from .base import OWN, PACKED_SPLIT, Capabilities, Mechanism
from .capabilities import PADDED_NEITHER
from .registry import register


@register
class ReformerAttention(Mechanism):
    """LSH attention: shared-QK attention within the chunks of positions sorted by angular-LSH bucket.

    Shared QK: ``q`` serves as queries AND keys (the keys are the queries normalised to unit length), as in
    the Reformer, where one projection makes both. The ``k`` argument of :meth:`forward` is therefore not
    read: it receives an exactly zero gradient, and whatever it holds changes nothing. (Using ``k`` as keys
    would hash queries and keys separately, which the paper avoids: with shared QK a query and the keys most
    similar to it fall in one bucket by construction.)

    Kind ``"own"``: with one bucket (``bucket_size >= seq``) the output is exact shared-QK attention with
    unit keys and the self-position masked; that is an attention of its own, not ``softmax(Q K^T)`` with
    separate keys, so no distance from softmax attention is an approximation error here.

    Per round (``n_hashes`` rounds, combined by their log-sum-exp weights), positions are sorted by (bucket,
    position), cut into chunks of ``bucket_size``, and each query attends to its chunk and the one before it;
    a query attends to itself only when it sees no other key. Causal: the chunk rule would let later positions
    move the chunk boundaries, so each query attends to the ``bucket_size`` latest positions up to it of its
    own bucket instead (no look-ahead; see :mod:`attnzoo.functional.lsh`). Padded positions are neither keys
    nor queries (zero output rows). Any length works: the sorted sequence is padded to whole chunks internally.

    Options:
        bucket_size: chunk length; there are about ``seq / bucket_size`` buckets (an even number), one when
            ``seq <= bucket_size``.
        n_hashes: hashing rounds: more rounds, fewer similar keys missed, proportionally more work.
        seed: the seed of the random rotations. None draws one from the global generator at construction,
            so ``torch.manual_seed`` makes models reproducible. The 32-bit key derived from it is kept in the
            buffer ``hash_key`` (saved in ``state_dict``); the rotations of every round are computed from it
            (:func:`~attnzoo.functional.lsh.lsh_rotations`, as many columns as a length needs), the same on
            every call: nothing is random at call time, and a reloaded model hashes as the saved one did.

    Self-attention only (no cross-attention: keys are the queries); no recurrent step (a position's chunk
    depends on the whole sequence's sorting).

    Shapes: q, k (batch, heads, seq, head_dim), v (batch, heads, seq, head_dim_v) -> (batch, heads, seq,
    head_dim_v).
    """

    name = "reformer"
    capabilities = Capabilities(
        # Padded positions take their place in the sorted buckets, moving the chunk boundaries.
        padding_invariance=PADDED_NEITHER,
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(h N (b d + log N)), memory O(h N b) (b = bucket_size, h = n_hashes)",
        summary="Reformer LSH attention: shared-QK attention within chunks sorted by angular-LSH bucket, several "
        "hash rounds (Kitaev et al. 2020)",
        packing=PACKED_SPLIT,
    )
    test_options = {"bucket_size": 4, "n_hashes": 2}
    test_variants = (
        {"bucket_size": 2, "n_hashes": 3, "seed": 7},
        {"bucket_size": 3, "n_hashes": 1},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        n_hashes: int = DEFAULT_N_HASHES,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.bucket_size = check_positive_int("bucket_size", bucket_size)
        self.n_hashes = check_positive_int("n_hashes", n_hashes)
        self.seed = check_number("seed", seed, integer=True, minimum=0, maximum=2**63 - 1, optional=True)
        if self.seed is None:
            # From the global generator, like any parameter's initialisation.
            drawn = int(torch.randint(0, 2**62, ()))
            key = lsh_hash_key(drawn)
        else:
            key = lsh_hash_key(self.seed)
        self.register_buffer("hash_key", torch.tensor(key, dtype=torch.int64))

    def n_buckets(self, length: int) -> int:
        """The number of buckets used for a sequence of ``length``."""
        return lsh_bucket_count(check_positive_int("length", length), self.bucket_size)

    def rotations(self, length: int) -> Tensor:
        """The random matrices (n_hashes, head_dim, n_buckets / 2) of a sequence of ``length`` (float64), for
        inspection; a single bucket needs none (zero columns)."""
        columns = self.n_buckets(length) // 2
        if columns == 0:
            return torch.zeros(self.n_hashes, self.head_dim, 0, dtype=torch.float64, device=self.hash_key.device)
        return lsh_rotations_unchecked(self.hash_key, self.n_hashes, self.head_dim, columns)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs (self-attention, equal lengths). Shared QK: k is not read.
        out = lsh_attention_unchecked(q, v, self.hash_key, self.bucket_size, self.n_hashes, causal, key_padding_mask)
        return tied_to_unused(out, k)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        out = lsh_attention_reference(
            q, v, self.hash_key, bucket_size=self.bucket_size, n_hashes=self.n_hashes, causal=causal,
            key_padding_mask=key_padding_mask,
        )
        return tied_to_unused(out, k)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bucket_size={self.bucket_size}, n_hashes={self.n_hashes}, seed={self.seed}"

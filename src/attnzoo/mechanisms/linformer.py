"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity") as a mechanism.

Keys and values are projected along the sequence axis onto ``rank`` rows by learned matrices ``E`` and ``F``
(one row per position up to ``max_seq_len``), and the queries attend to those rows with exact softmax:
``out = softmax(Q (E^T K)^T / sqrt(d)) (F^T V)``. The maths is in :mod:`attnzoo.functional.linformer`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_positive_int
from ..functional.linformer import linformer_attention_reference, linformer_attention_unchecked
from .base import APPROXIMATE, NO_GROUPED_KV, Capabilities, Mechanism, UnsupportedOptionError
from .capabilities import PADDED_RIGHT
from .registry import register

SHARING = ("none", "headwise", "kv")
"""The paper's projection sharing within a layer (section 4): ``"none"``, one ``E`` and one ``F`` per head;
``"headwise"``, one ``E`` and one ``F`` for all heads; ``"kv"``, one matrix for keys and values of all heads.
Its fourth mode, layerwise sharing, ties layers together: :meth:`LinformerAttention.share_projection_from`."""


def pooling_projection(max_seq_len: int, rank: int) -> Tensor:
    """(max_seq_len, rank) mean pooling: column ``j`` averages the span ``[j, j + 1) * max_seq_len / rank`` of
    positions, a position cut by a span's edge counting for the part of it inside (each column's weights sum to
    1; a position meets at most two columns). Needs ``rank <= max_seq_len``.

    The initial value of ``E`` and ``F``. The paper names mean pooling with kernel and stride ``n / k`` among
    its choices of projection (section 4). At initialisation it makes every projected key and value the mean
    of an equally long span of neighbouring positions, so the softmax over the spans approaches exact softmax
    attention as ``rank`` grows and equals it at ``rank == max_seq_len`` (``E = F = I``). Spans of equal length
    matter: softmax weighs a span of ``m`` alike keys ``m`` times, a projected row once, so spans of 1 and 2
    positions (whole-position blocks at rank 96 of 128) bias the result towards the short ones. Random entries
    such as the ``N(0, 1/rank)`` of the paper's analysis do worse still: a projected key then sums ``n`` keys
    with weights of size ``1/sqrt(rank)``, so logits and values grow like ``sqrt(n / rank)``. On the
    standard normal inputs of ``tests/mechanisms/test_linformer.py`` (N=128, head_dim 16) the relative error against exact
    softmax at rank 16, 32, 64, 128 is 0.740, 0.707, 0.608, 0 with pooling and about 12, 7, 2.8, 1.4 with
    ``N(0, 1/rank)`` entries (uniform attention: 0.769). It draws nothing from the random generator.
    """
    position = torch.arange(max_seq_len)
    # In units of 1 / rank of a position: position i covers [i * rank, (i + 1) * rank), column j covers
    # [j * max_seq_len, (j + 1) * max_seq_len); integer arithmetic, so the spans meet exactly.
    start, stop = position * rank, (position + 1) * rank
    first, last = start // max_seq_len, (stop - 1) // max_seq_len
    pooling = torch.zeros(max_seq_len, rank, dtype=torch.float64)
    pooling[position, first] = (torch.minimum(stop, (first + 1) * max_seq_len) - start).double()
    cut = last != first
    pooling[position[cut], last[cut]] = (stop - last * max_seq_len)[cut].double()
    return (pooling / max_seq_len).to(torch.get_default_dtype())


@register
class LinformerAttention(Mechanism):
    """Linformer: softmax attention over keys and values projected along the sequence to ``rank`` rows.

    Shapes: q (batch, heads, seq_q, head_dim), k (batch, heads, seq_kv, head_dim), v (batch, heads, seq_kv,
    head_dim_v) -> (batch, heads, seq_q, head_dim_v). Time O(seq_q rank d + seq_kv rank d).

    Options:
        rank: ``k`` of the paper, the number of projected rows the softmax runs over (what trades cost for
            accuracy); at most ``max_seq_len``.
        max_seq_len: the longest key sequence (``E`` and ``F`` have one row per position). A shorter sequence
            of ``n`` keys uses the first ``n`` rows: with the pooling initialisation (see
            :func:`pooling_projection`) only the blocks of its first ``n`` positions are filled and the other
            projected rows are zero keys with zero values, which take softmax weight until trained, so build
            it for the length it will see (``attnzoo compare`` sets ``max_seq_len`` to each length).
        sharing: ``"none"`` (``E``, ``F`` per head: ``2 * heads * max_seq_len * rank`` parameters),
            ``"headwise"`` (one ``E`` and one ``F``: ``2 * max_seq_len * rank``) or ``"kv"`` (one matrix for
            keys and values: ``max_seq_len * rank``); see :data:`SHARING`.

    Parameters: ``proj_e`` (keys) and ``proj_f`` (values; None with ``sharing="kv"``, where ``proj_e`` serves
    both), each of shape (heads, max_seq_len, rank) with ``sharing="none"``, (1, max_seq_len, rank) otherwise.

    Layerwise sharing (the paper's fourth mode: one matrix for every layer, head, key and value) is built by
    tying layers after construction: ``layer.share_projection_from(first)`` makes ``layer`` use ``first``'s
    parameters. In a model::

        encoder = attnzoo.Encoder(dim=256, heads=4, depth=6, self_attention="linformer",
                                  self_attention_options={"max_seq_len": 512, "rank": 64, "sharing": "kv"})
        first = encoder.layers[0].self_attention.mechanism
        for layer in encoder.layers[1:]:
            layer.self_attention.mechanism.share_projection_from(first)

    ``model.parameters()`` then yields the matrix once and every layer's gradient accumulates in it. The tie
    is structure, not data: ``state_dict`` lists the matrix under every layer's name, and a model restored from
    it must be tied the same way before (or after) ``load_state_dict``.

    Capabilities: non-causal only (the projection mixes every position into every projected row, and the paper
    defines no causal form); key padding (padded keys and values are zeroed before the projection);
    cross-attention where the keys fit: the key length is limited to ``max_seq_len``, the queries (which are
    not projected) may be of any length; self-attention sequences up to ``max_seq_len``. No recurrent step.
    """

    name = "linformer"
    capabilities = Capabilities(
        # Its projections are learned over positions counted from the row's start.
        padding_invariance=PADDED_RIGHT,
        causal=False,
        cross=True,
        key_padding=True,
        recurrent_step=False,
        kind=APPROXIMATE,
        complexity="time O(N k d), memory O(N k); k = rank, N <= max_seq_len",
        summary="softmax over keys and values projected along the sequence to rank rows (Wang et al. 2020)",
        # Learned projections along the sequence, per head or layer, compress each head's keys: no sharing.
        grouped_kv=NO_GROUPED_KV,
    )
    sweep_option = "rank"
    length_option = "max_seq_len"
    # The suite's sequences (11 positions) fit; rank 4 < 11 keeps the projection lossy.
    test_options = {"rank": 4, "max_seq_len": 12}
    test_variants = (
        {"rank": 4, "max_seq_len": 12, "sharing": "none"},
        {"rank": 4, "max_seq_len": 12, "sharing": "kv"},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        rank: int = 256,
        max_seq_len: int = 4096,
        sharing: str = "headwise",
    ) -> None:
        super().__init__(heads, head_dim)
        self.rank = check_positive_int("rank", rank)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self.sharing = check_choice("sharing", sharing, SHARING)
        if self.rank > self.max_seq_len:
            # Unsupported rather than malformed: `attnzoo compare` reports such a sweep point as unsupported.
            raise UnsupportedOptionError(
                f"{self.name}: rank={self.rank} exceeds max_seq_len={self.max_seq_len}: E and F project at most "
                f"max_seq_len positions onto rank rows, so rank must be <= max_seq_len"
            )
        copies = heads if self.sharing == "none" else 1
        initial = pooling_projection(self.max_seq_len, self.rank)
        self.proj_e = nn.Parameter(initial.repeat(copies, 1, 1))
        # Registered even when absent, so that `proj_f` is a parameter slot of every instance.
        values = None if self.sharing == "kv" else nn.Parameter(initial.repeat(copies, 1, 1))
        self.register_parameter("proj_f", values)

    @property
    def max_length(self) -> Optional[int]:
        return self.max_seq_len

    def projections(self) -> Tuple[Tensor, Tensor]:
        """(E, F): the key and value projections (the same tensor with ``sharing="kv"``)."""
        return self.proj_e, self.proj_e if self.proj_f is None else self.proj_f

    def share_projection_from(self, other: "LinformerAttention") -> "LinformerAttention":
        """Use ``other``'s projection parameters from now on (layerwise sharing); returns ``self``.

        Both must be linformer mechanisms with the same ``sharing``, ``rank`` and ``max_seq_len`` (and
        ``heads`` with ``sharing="none"``). This layer's own parameters are dropped; afterwards the two hold
        the very same tensors, so gradients from both layers reach one tensor and changing it changes both.
        """
        if not isinstance(other, LinformerAttention):
            raise TypeError(f"other must be a LinformerAttention to share projections with, got {type(other).__name__}")
        mine = (self.sharing, self.rank, self.max_seq_len, tuple(self.proj_e.shape))
        theirs = (other.sharing, other.rank, other.max_seq_len, tuple(other.proj_e.shape))
        if mine != theirs:
            raise ValueError(
                f"other has sharing={other.sharing!r}, rank={other.rank}, max_seq_len={other.max_seq_len}, "
                f"heads={other.heads}; this layer has sharing={self.sharing!r}, rank={self.rank}, "
                f"max_seq_len={self.max_seq_len}, heads={self.heads}: projections are shared only between "
                f"layers built alike (heads may differ unless sharing='none')"
            )
        # Assigning a registered Parameter makes this module hold the same object: one tensor, one gradient.
        self.proj_e = other.proj_e
        self.proj_f = other.proj_f
        return self

    def length_limit_reasons(self, q_len: int, k_len: int, cross: bool) -> List[str]:
        # Only the keys are projected: in cross-attention the limit binds the keys alone.
        too_long = k_len if cross else max(q_len, k_len)
        if too_long <= self.max_seq_len:
            return []
        label = "key length" if cross else "sequence length"
        return [
            f"{self.name}: {label} {too_long} exceeds max_seq_len={self.max_seq_len} (its max_length): E and F "
            f"have one row per key position; build it with a larger max_seq_len"
        ]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        # forward() checked the inputs (and the lengths against max_seq_len, so E and F have the rows needed).
        e, f = self.projections()
        return linformer_attention_unchecked(q, k, v, e, f, key_padding_mask, None)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        e, f = self.projections()
        return linformer_attention_reference(q, k, v, e, f, key_padding_mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, max_seq_len={self.max_seq_len}, sharing={self.sharing!r}"

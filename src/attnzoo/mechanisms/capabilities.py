"""What a mechanism declares it can do: :class:`Capabilities`, the kinds of output, how it takes grouped-query
inputs and packed batches, and the error for what it cannot do.

Re-exported by :mod:`attnzoo.mechanisms.base`, where the contract that reads these declarations lives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Optional

from .._validation import check_bool


class UnsupportedOptionError(ValueError):
    """A mechanism was asked for something its capabilities do not include (the message names the option)."""


NARROWABLE = ("causal", "non_causal", "cross", "key_padding", "recurrent_step", "any_value_width", "attention_weights",
              "causal_rows")
"""The capabilities an instance's options may switch off (:meth:`Capabilities.narrowed`)."""

EXACT = "exact"
APPROXIMATE = "approximate"
OWN = "own"
KINDS = {
    EXACT: "computes exact softmax attention",
    APPROXIMATE: "approximates softmax attention: its distance from softmax is an approximation error",
    OWN: "an attention of its own (e.g. decayed linear attention): its distance from softmax is no error",
}
"""What a mechanism's output is, relative to exact softmax attention (:attr:`Capabilities.kind`)."""

NATIVE_KV = "native"
REPEAT_KV = "repeat"
NO_GROUPED_KV = "none"
GROUPED_KV = {
    NATIVE_KV: "shares each key/value head among its query heads without copying the keys and values",
    REPEAT_KV: "repeats each key/value head for its query heads (a copy per query head) before attending",
    NO_GROUPED_KV: "refuses keys and values with fewer heads than the queries",
}
"""How a mechanism takes grouped-query inputs, k and v with ``kv_heads`` < ``heads`` heads
(:attr:`Capabilities.grouped_kv`), from best to worst: an instance's options may only move it down."""
PACKED_NATIVE = "native"
PACKED_SPLIT = "split"
NOT_PACKED = "none"
PACKINGS = {
    PACKED_NATIVE: "takes packed batches (cu_seqlens) in a path of its own",
    PACKED_SPLIT: "takes packed batches (cu_seqlens) by running each document alone (equal lengths batched)",
    NOT_PACKED: "refuses packed batches (cu_seqlens): its output for a document would depend on the others",
}
"""How a mechanism honours ``cu_seqlens`` (:attr:`Capabilities.packing`): each document attends only within
itself, giving exactly what it gives that document alone."""
PADDED_EITHER_SIDE = "either"
PADDED_RIGHT = "right"
PADDED_NEITHER = "neither"
PADDING_INVARIANCE = {
    PADDED_EITHER_SIDE: "a sequence padded on the right or on the left gives at its positions what it gives alone",
    PADDED_RIGHT: "a sequence padded on the right gives at its positions what it gives alone; padded on the left "
                  "it may not: its maths reads positions counted from the row's start (a learned table or "
                  "projection over positions, a block or chunk grid, or tokens chosen by position)",
    PADDED_NEITHER: "a sequence's output may change with how long the padded row is, on either side (segments, "
                    "buckets, clusters, blocks or random draws made over the whole row, or a transform of it)",
}
"""Where a sequence may be padded, in a batch with a ``key_padding_mask``, without changing its output at its
own positions (:attr:`Capabilities.padding_invariance`)."""
PADDED_SIDES = {PADDED_EITHER_SIDE: ("right", "left"), PADDED_RIGHT: ("right",), PADDED_NEITHER: ()}
"""The sides (``"right"``: after the sequence, ``"left"``: before it) each :data:`PADDING_INVARIANCE` value
promises."""


@dataclass(frozen=True)
class CallInput:
    """A per-call input a mechanism takes beyond the contract's arguments (:attr:`Mechanism.call_inputs`): a
    (batch, seq) bool mask over the positions of the sequence, True marking a position (of a packed row, with
    ``cu_seqlens``, a (1, seq) mask over the row).

    The base class checks it once (shape, dtype, device, naming it) and passes it by name, None when not given,
    to :meth:`Mechanism.attend`, :meth:`Mechanism.attend_packed` and :meth:`Mechanism.attend_reference`;
    ``MultiHeadAttention`` passes it on, naming no mechanism, and a mechanism that does not declare it refuses
    it, naming it.

    Attributes:
        name: the keyword argument's name.
        summary: what the mask marks, for error messages and ``attnzoo list``.
        untraceable: why a call under ``torch.jit.trace`` cannot take it (e.g. a count read from its values,
            which a trace would freeze), or None when it can.
    """

    name: str
    summary: str
    untraceable: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a call input's name must be an identifier, got {self.name!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a mechanism supports, declared once per mechanism class: what the contract, the drop-in and the
    models need to know of it, so that no code outside ``mechanisms/`` reads a mechanism's class or looks for an
    option by name.

    Attributes:
        causal: supports ``causal=True`` (autoregressive masking).
        non_causal: supports ``causal=False`` (every key seen by every query); False only for an instance whose
            option exists in reading order alone (a memory filled as a stream), which names it.
        cross: supports cross-attention (``cross=True``): keys and values from another sequence, of any length.
        key_padding: supports ``key_padding_mask``.
        recurrent_step: offers :meth:`Mechanism.step` for incremental decoding.
        kind: one of :data:`KINDS`: ``"exact"`` softmax attention, an ``"approximate"`` one (whose error
            against softmax ``attnzoo compare`` reports), or an attention of its ``"own"``.
        complexity: time/memory in the sequence length N, for people reading ``attnzoo list``.
        summary: one line describing the mechanism.
        max_length: the longest query or key sequence it accepts, or None for no limit.
        length_multiple: query and key lengths must be multiples of it (blocks, buckets), or None.
        limited_by: for an instance whose options switched capabilities off (see :meth:`narrowed`), those
            options, so that error messages can name them; None in a class's declaration.
        grouped_kv: one of :data:`GROUPED_KV`, for k and v with fewer heads (``kv_heads``, dividing ``heads``)
            than q, query head h using key/value head ``h // (heads // kv_heads)``: ``"native"`` (never
            materialises the repeated keys/values; decoding states hold ``kv_heads``), ``"repeat"`` (the base
            class repeats them explicitly before :meth:`Mechanism.attend` and :meth:`Mechanism.attend_step`:
            same outputs, full memory; the default) or ``"none"`` (refused, naming kv_heads).
        packing: one of :data:`PACKINGS`: whether :meth:`Mechanism.forward` takes ``cu_seqlens`` (a packed
            batch of documents), natively, by splitting the row into documents, or not at all.
        any_value_width: v may have another head dim than q and k (the output then has v's); False for a
            mechanism that ties each value channel to a query or key channel or learns weights over v's
            channels (it needs v with ``head_dim`` channels and refuses others, naming this capability).
        dot_product_logits: its logits are ``q . k / sqrt(head_dim)`` (exact softmax, an approximation of it, or
            softmax on a fixed pattern of positions), so scaling the queries by ``s * sqrt(head_dim)`` gives it
            the logit scale ``s``. None (the default) means: true for an exact or approximate ``kind``.
        scale_option: the option that sets its logit scale directly (``q . k`` times it), or None.
        window_option: the option that restricts every query to a sliding window of the nearest keys and to
            nothing beyond it (what a model's ``sliding_window`` means), or None.
        quiet_option: the option that adds one to its softmax denominator (attention to one extra zero key and
            value, what ``add_zero_attn`` comes closest to), or None.
        attention_weights: offers :meth:`Mechanism.attention_weights`: the (batch, heads, seq_q, seq_kv) weights
            its output mixes the values with, under any additive bias on the logits.
        causal_rows: with ``causal=True``, output row i reads query i and no other query (the keys and values up
            to i decide the rest), so the last rows of a causal call are those of a call whose earlier queries
            are anything, zeros included: how a decoder computes the rows of new tokens over a cache.
        linear_recurrence: its causal form is a linear-attention recurrence with a constant-size state, whose
            terms (features, decays) :meth:`Mechanism.linear_terms` gives: what sequence parallelism splits
            across ranks.
        padding_invariance: one of :data:`PADDING_INVARIANCE`, for a mechanism taking ``key_padding_mask``:
            on which sides a sequence may be padded (the padded positions of q, k and v holding anything)
            and still give at its positions, to rounding, the output it gives alone, i.e. whether its output
            depends on the batch it is padded into: ``"either"`` (the default), ``"right"`` (its maths counts
            positions from the row's start) or ``"neither"``. A promise the conformance suite holds it to: a
            class declares the most its options allow, an instance whose options make it depend on positions
            in the row (or on the row's length) declares the weaker value. Whatever it declares, what padded
            positions hold never reaches an unpadded one.
        own_rotary: it applies a layer's rotary embedding itself, to the parts of its maths that want positions
            (Liger's window rotates, its gated linear part reads the keys as projected): a
            :class:`~attnzoo.MultiHeadAttention` with ``rotary=True`` passes it unrotated queries and keys and
            hands it the embedding once (``use_rotary``); where the caller rotates (a Hugging Face model's own
            attention) it is refused.
    """

    causal: bool
    cross: bool
    key_padding: bool
    recurrent_step: bool
    kind: str
    complexity: str
    summary: str
    max_length: Optional[int] = None
    length_multiple: Optional[int] = None
    limited_by: Optional[str] = None
    grouped_kv: str = REPEAT_KV
    packing: str = NOT_PACKED
    any_value_width: bool = True
    dot_product_logits: Optional[bool] = None
    scale_option: Optional[str] = None
    window_option: Optional[str] = None
    quiet_option: Optional[str] = None
    attention_weights: bool = False
    causal_rows: bool = False
    linear_recurrence: bool = False
    padding_invariance: str = PADDED_EITHER_SIDE
    own_rotary: bool = False
    non_causal: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.grouped_kv not in GROUPED_KV:
            raise ValueError(f"grouped_kv must be one of {', '.join(GROUPED_KV)}, got {self.grouped_kv!r}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.dot_product_logits is None:  # frozen: set once, as the declaration reads
            object.__setattr__(self, "dot_product_logits", self.kind in (EXACT, APPROXIMATE))
        for role in ("scale_option", "window_option", "quiet_option"):
            value = getattr(self, role)
            if value is not None and (not isinstance(value, str) or not value.isidentifier()):
                raise ValueError(f"{role} must name an option (an identifier) or be None, got {value!r}")
        if self.padding_invariance not in PADDING_INVARIANCE:
            raise ValueError(f"padding_invariance must be one of {', '.join(PADDING_INVARIANCE)}, "
                             f"got {self.padding_invariance!r}")

    @property
    def packed(self) -> bool:
        """Whether packed batches (``cu_seqlens``) are accepted."""
        return self.packing != NOT_PACKED

    @property
    def exact(self) -> bool:
        """Whether the output is exact softmax attention."""
        return self.kind == EXACT

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def narrowed(
        self, limited_by: str, *, kind: Optional[str] = None, grouped_kv: Optional[str] = None, **switched_off: bool
    ) -> "Capabilities":
        """These capabilities with some switched off by an instance option named in ``limited_by``: any of
        :data:`NARROWABLE` set to False, an exact mechanism's ``kind`` changed (an option that makes
        its output differ from exact softmax attention), and/or ``grouped_kv`` moved down :data:`GROUPED_KV`."""
        unknown = sorted(set(switched_off) - set(NARROWABLE))
        order = list(GROUPED_KV)
        worse_grouping = grouped_kv is None or (grouped_kv in order and order.index(grouped_kv) >= order.index(
            self.grouped_kv))
        if unknown or any(switched_off.values()) or (kind is not None and (kind not in KINDS or not self.exact)) \
                or not worse_grouping:
            raise ValueError(
                f"narrowed() only switches capabilities off, got kind={kind!r}, grouped_kv={grouped_kv!r}, "
                f"{switched_off}"
            )
        return replace(
            self, limited_by=limited_by, kind=kind or self.kind, grouped_kv=grouped_kv or self.grouped_kv,
            **switched_off,
        )

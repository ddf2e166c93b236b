"""The mechanism contract: the base class every mechanism derives from (the declarations it reads are in
:mod:`.capabilities`, the registry in :mod:`.registry`).

Every attention mechanism is a small ``nn.Module`` working on per-head tensors (batch, heads, seq, head_dim).
It declares what it can do once, in a :class:`Capabilities`; the registry, the conformance tests,
``attnzoo list`` and the error messages all read that one declaration.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_key_padding_mask, check_number, check_positive_int, check_qkv
from ..functional.grouped import query_groups, repeat_kv
from ..functional.packing import attend_per_document, check_cu_seqlens
from ..functional.state_scan import LinearTerms
from ..state import DecodingState
from .call_inputs import check_call_input_values, declared_call_inputs
from .made_inputs import seeded_generator, shapes_only  # noqa: F401 - importable from here as before
from .packed_checks import check_document_lengths
from .state_checks import StateLayout, check_state_made_here, check_state_tensors
from .capabilities import (  # noqa: F401 - the contract's declarations, importable from here as before
    APPROXIMATE,
    CallInput,
    Capabilities,
    EXACT,
    GROUPED_KV,
    KINDS,
    NARROWABLE,
    NATIVE_KV,
    NO_GROUPED_KV,
    NOT_PACKED,
    OWN,
    PACKED_NATIVE,
    PACKED_SPLIT,
    PACKINGS,
    REPEAT_KV,
    UnsupportedOptionError,
)

State = Optional[DecodingState]
"""A mechanism's decoding state: a :class:`~attnzoo.state.DecodingState`, or None before the first step.
Passed in and returned explicitly; never stored on the module."""


class Mechanism(nn.Module):
    """Base class of every attention mechanism.

    Subclasses set ``name`` and ``capabilities``, take ``heads`` and ``head_dim`` plus their own keyword-only
    options in ``__init__``, and implement :meth:`attend`. Those offering incremental decoding implement
    :meth:`step` (and may override :meth:`prefill` with a parallel version).
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]
    test_options: ClassVar[Dict[str, Any]] = {}
    """Keyword options the conformance suite builds this mechanism with (small, fast settings); never mutated."""
    test_variants: ClassVar[Tuple[Dict[str, Any], ...]] = ()
    """Further option sets the conformance suite also checks: options that change the maths or narrow the
    capabilities (an instance's ``capabilities`` then differ from the class's declaration)."""
    sweep_option: ClassVar[Optional[str]] = None
    """For an approximate mechanism, the integer option that trades cost for accuracy (features, rank,
    landmarks, buckets): what the error sweep of ``attnzoo compare`` varies."""
    length_option: ClassVar[Optional[str]] = None
    """The integer option that must equal the sequence length (a learned projection over positions), if any:
    ``attnzoo compare`` sets it to each length it measures."""
    call_inputs: ClassVar[Tuple[CallInput, ...]] = ()
    """The per-call inputs this mechanism takes beyond the contract's arguments (e.g. longformer's
    ``global_mask``), each a :class:`CallInput`: :meth:`forward` and :meth:`reference` check them and pass
    them by name to :meth:`attend`, :meth:`attend_packed` and :meth:`attend_reference`, which take each as a
    keyword-only argument defaulting to None. ``MultiHeadAttention.forward`` passes them on."""

    _CONTRACT_METHODS: ClassVar[Tuple[str, ...]] = ("forward", "reference")
    """What the base class does for every mechanism and no subclass overrides: the checks live there, once."""

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__(**options)
        for method, instead in zip(cls._CONTRACT_METHODS, ("attend", "attend_reference")):
            if method in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__} overrides {method}(), which checks the inputs for every mechanism: implement "
                    f"{instead}() instead (declare per-call inputs in call_inputs)"
                )

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = check_positive_int("heads", heads)
        self.head_dim = check_positive_int("head_dim", head_dim)

    # -- parallel form -------------------------------------------------------------------------------------
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
        cu_seqlens: Optional[Tensor] = None,
        **call_inputs: Optional[Tensor],
    ) -> Tensor:
        """Attend.

        Args:
            q: (batch, heads, seq_q, head_dim)
            k: (batch, kv_heads, seq_kv, head_dim); ``kv_heads`` divides ``heads`` (grouped-query attention:
                query head h uses key/value head ``h // (heads // kv_heads)``), as
                :attr:`Capabilities.grouped_kv` allows; ``kv_heads == heads`` is plain multi-head attention.
            v: (batch, kv_heads, seq_kv, head_dim_v)
            causal: autoregressive mask, aligned so the last query sees every key.
            key_padding_mask: (batch, seq_kv) bool, True marks padding.
            cross: the keys and values come from another sequence than the queries (cross-attention). Said
                explicitly, never guessed from the lengths: self-attention (the default) needs
                ``seq_q == seq_kv``, and cross-attention may have any lengths, equal ones included.
            cu_seqlens: a packed batch (self-attention, batch 1): int64 document offsets ``[0, ..., seq]``,
                each document attending only within itself (see :mod:`attnzoo.functional.packing`); for a
                mechanism whose ``capabilities.packing`` accepts it; ``max_length`` binds each document, not the
                row (:meth:`check_packed_inputs`). None: one sequence per batch row.
            **call_inputs: the per-call inputs this mechanism declares in :attr:`call_inputs` (each a (batch,
                seq) bool mask); any other name is refused, naming it.

        Returns:
            (batch, heads, seq_q, head_dim_v)
        """
        inputs = self.check_call_inputs(call_inputs)
        if cu_seqlens is not None:
            spans = self.check_packed_inputs(q, k, v, causal, key_padding_mask, cross, cu_seqlens)
            self.check_call_input_values(inputs, q)
            k, v = self.repeated_kv(q, k, v)  # kv_heads heads stay for a native mechanism, as unpacked
            return self.attend_packed(q, k, v, causal, spans, **inputs)
        self.check_inputs(q, k, v, causal, key_padding_mask, cross)
        self.check_call_input_values(inputs, q)
        k, v = self.repeated_kv(q, k, v)
        return self.attend(q, k, v, causal, key_padding_mask, cross, **inputs)

    def check_call_inputs(self, given: Dict[str, Any]) -> Dict[str, Any]:
        """The declared per-call inputs (:attr:`call_inputs`), each the value given or None, after refusing any
        other name, naming it (:func:`.call_inputs.declared_call_inputs`): callers ask before any work."""
        return declared_call_inputs(self.name, self.call_inputs, given)

    def check_call_input_values(self, inputs: Dict[str, Any], q: Tensor) -> None:
        """Each given per-call input a (batch, seq) bool mask over q's positions on q's device (naming it), and
        none under ``torch.jit.trace`` that a trace cannot take."""
        check_call_input_values(self.name, self.call_inputs, inputs, q)

    def repeated_kv(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """k and v as :meth:`attend` and :meth:`attend_step` receive them: repeated to q's heads for a mechanism
        declaring ``grouped_kv="repeat"``, unchanged otherwise (a native one gets the ``kv_heads`` heads)."""
        if k.shape[1] == q.shape[1] or self.capabilities.grouped_kv != REPEAT_KV:
            return k, v
        groups = query_groups(q.shape[1], k.shape[1])
        return repeat_kv(k, groups), repeat_kv(v, groups)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """The mechanism's maths, on checked inputs; k, v with fewer heads than q only if ``grouped_kv="native"``.
        A mechanism declaring :attr:`call_inputs` takes each as a keyword-only argument (None when not given)."""
        raise NotImplementedError

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
        **call_inputs: Optional[Tensor],
    ) -> Tensor:
        """The same attention computed by slow, obviously-correct quadratic maths in float64.

        Every mechanism provides one (:meth:`attend_reference`); the conformance suite compares :meth:`forward`
        with it. Takes the arguments of :meth:`forward` (packed rows: :meth:`reference_packed`), checked as
        :meth:`forward` checks them, and uses this instance's parameters and buffers (features, projections);
        returns float64 (batch, heads, seq_q, head_dim_v). Grouped keys and values are repeated to q's heads
        (grouped-query attention is defined as attention on the repeated keys and values).
        """
        inputs = self.check_call_inputs(call_inputs)
        self.check_inputs(q, k, v, causal, key_padding_mask, cross)
        self.check_call_input_values(inputs, q)
        if k.shape[1] != q.shape[1]:
            groups = query_groups(q.shape[1], k.shape[1])
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return self.attend_reference(q, k, v, causal, key_padding_mask, cross, **inputs)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """The mechanism's float64 maths (what :meth:`reference` returns) on checked inputs, k and v with q's
        heads."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement attend_reference()")

    # -- the weights, for what needs more than the output -----------------------------------------------------
    def attention_weights(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, *, causal: bool = False,
        bias: Optional[Tensor] = None,
    ) -> Tensor:
        """For a mechanism declaring ``capabilities.attention_weights``: the (batch, heads, seq_q, seq_kv) weights
        its output mixes the values with, for q (batch, heads, seq_q, head_dim) and k (batch, heads or kv_heads,
        seq_kv, head_dim), under ``key_padding_mask`` (True = padding: weight 0), ``causal`` (bottom-right
        aligned) and an additive ``bias`` on the logits broadcasting to (batch, heads, seq_q, seq_kv) (-inf
        hides a key). In q's dtype, with gradient."""
        caps = self.capabilities
        if not caps.attention_weights:
            raise UnsupportedOptionError(
                f"{self.refused_by('attention_weights')} forms no attention weight matrix (capability "
                f"attention_weights=False)"
            )
        check_qkv(q, k, k, grouped=True)
        check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        if k.shape[1] != q.shape[1]:
            k = repeat_kv(k, query_groups(q.shape[1], k.shape[1]))
        return self.attend_weights(q, k, key_padding_mask, causal, bias)

    def attend_weights(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], causal: bool, bias: Optional[Tensor]
    ) -> Tensor:
        """The weights of :meth:`attention_weights` on checked inputs, k with q's heads."""
        raise NotImplementedError(f"{type(self).__qualname__} declares attention_weights=True but has no "
                                  f"attend_weights()")

    def linear_terms(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None) -> LinearTerms:
        """For a mechanism declaring ``capabilities.linear_recurrence``: the terms of its causal recurrence over
        q (batch, heads, seq, head_dim) and k (k with q's heads), checked as a causal forward is."""
        if not self.capabilities.linear_recurrence:
            raise UnsupportedOptionError(f"{self.refused_by('linear_recurrence')} has no linear-attention "
                                         f"recurrence to expose (capability linear_recurrence=False)")
        self.check_inputs(q, k, k, True, key_padding_mask)
        return self.attend_linear_terms(q, k, key_padding_mask)

    def attend_linear_terms(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]) -> LinearTerms:
        """The terms of :meth:`linear_terms` on checked inputs."""
        raise NotImplementedError(f"{type(self).__qualname__} declares linear_recurrence=True but has no "
                                  f"attend_linear_terms()")

    def logit_scale(self) -> Optional[float]:
        """The scale this instance's dot-product logits use, as set by the option its ``capabilities.scale_option``
        names (kept as the attribute of that name); None for ``1/sqrt(head_dim)`` (unset, or no such option)."""
        option = self.capabilities.scale_option
        return None if option is None else getattr(self, option)

    # -- packed batches (cu_seqlens) -----------------------------------------------------------------------------
    def check_packing(
        self, q: Tensor, key_padding_mask: Optional[Tensor], cross: bool, cu_seqlens: object
    ) -> List[Tuple[int, int]]:
        """Refuse ``cu_seqlens`` where this instance cannot honour it, check it, and return each document's
        (start, end). Errors name ``cu_seqlens``; raised before any computation."""
        caps = self.capabilities
        who = self.refused_by("packing")
        if not caps.packed:
            raise UnsupportedOptionError(
                f"{who} does not take cu_seqlens (packed batches): its output for a document would not be what it "
                f"gives that document alone; pad the documents into rows instead"
            )
        if cross:
            raise UnsupportedOptionError("cu_seqlens describes packed self-attention: not with cross=True")
        if key_padding_mask is not None:
            raise ValueError("cu_seqlens and key_padding_mask cannot be used together: a packed row has no padding")
        if torch.jit.is_tracing():
            raise UnsupportedOptionError(f"{who}: cu_seqlens cannot be traced: the documents are read from its values")
        return check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)

    def check_packed_inputs(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool,
        cu_seqlens: object,
    ) -> List[Tuple[int, int]]:
        """Check a packed call as :meth:`check_inputs` checks an unpacked one (errors name the argument, before
        any computation) and return its documents' (start, end). Length constraints bind each document, not
        the row: a document is what runs alone, so ``max_length``, ``length_multiple`` and a mechanism's own
        rules apply to every document's length (:func:`.packed_checks.check_document_lengths`, errors naming
        the document), and a row of documents that each fit may be longer than ``max_length``."""
        check_bool("causal", causal)
        check_bool("cross", cross)
        self.check_grouping(q, k, v, refuse=False)
        spans = self.check_packing(q, key_padding_mask, cross, cu_seqlens)  # refuses cross=True and tracing
        if k.shape[2] != q.shape[2]:  # refused there, naming the lengths
            self.check_inputs(q, k, v, causal, key_padding_mask, cross)
        refused = self.value_width_reason(v.shape[3])  # whatever the lengths: the row's refusal, no document's
        if refused:
            raise UnsupportedOptionError(refused)
        check_document_lengths(self.check_inputs, q, k, v, causal, spans)  # cross is False: refused above
        return spans

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        """Attention over a checked packed row q (1, heads, N, dim), k, v (1, kv_heads, N, dim), each document
        (start, end) of ``spans`` alone; k, v with fewer heads than q only if ``grouped_kv="native"`` (never
        repeated), as :meth:`attend` takes them. By default :meth:`attend` on every document, equal lengths
        batched (``packing="split"``); a ``"native"`` mechanism overrides it (and so does one declaring
        :attr:`call_inputs`, which it takes as :meth:`attend` does, each a (1, seq) mask over the row)."""
        return attend_per_document(lambda *qkv: self.attend(*qkv, causal, None, False), q, k, v, spans,
                                   takes_grouped=True)

    def reference_packed(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, *, cu_seqlens: Tensor,
        **call_inputs: Optional[Tensor],
    ) -> Tensor:
        """:meth:`reference` of a packed row: float64, each document's reference computed alone in turn (a
        per-call input, a (1, seq) mask over the row, cut to each document)."""
        inputs = self.check_call_inputs(call_inputs)
        spans = self.check_packing(q, None, False, cu_seqlens)
        self.check_call_input_values(inputs, q)

        def document(start: int, end: int) -> Dict[str, Any]:
            return {name: None if mask is None else mask[:, start:end] for name, mask in inputs.items()}

        return torch.cat([self.reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal,
                                         **document(start, end)) for start, end in spans], dim=2)

    def check_inputs(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        key_padding_mask: Optional[Tensor],
        cross: bool = False,
    ) -> None:
        """Raise for malformed input (naming the argument), then for input this instance cannot run
        (:class:`UnsupportedOptionError` giving every reason :meth:`unsupported_reasons` finds)."""
        check_bool("causal", causal)
        check_bool("cross", cross)
        self.check_grouping(q, k, v, refuse=False)
        check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        if q.shape[3] != self.head_dim:
            raise ValueError(
                f"{self.name}: q has head_dim={q.shape[3]}, the mechanism was built with head_dim={self.head_dim}"
            )
        reasons = self.unsupported_reasons(q, k, v, causal, key_padding_mask, cross=cross)
        if reasons:
            raise UnsupportedOptionError("; ".join(reasons))

    def check_grouping(self, q: Tensor, k: Tensor, v: Tensor, *, refuse: bool = True) -> None:
        """q, k, v well formed (:func:`~attnzoo._validation.check_qkv`), q with this instance's ``heads``, k and v
        with as many heads as each other, dividing ``heads``; errors name the argument. With ``refuse``, also
        raise :class:`UnsupportedOptionError` for grouped k, v if this instance declares ``grouped_kv="none"``."""
        check_qkv(q, k, v, grouped=True)
        if q.shape[1] != self.heads:
            raise ValueError(f"{self.name}: q has {q.shape[1]} heads, the mechanism was built with heads={self.heads}")
        if refuse:
            reason = self.grouping_reason(k.shape[1])
            if reason:
                raise UnsupportedOptionError(reason)

    def grouping_reason(self, kv_heads: int) -> Optional[str]:
        """Why this instance refuses k, v of ``kv_heads`` heads, or None."""
        caps = self.capabilities
        if kv_heads == self.heads or caps.grouped_kv != NO_GROUPED_KV:
            return None
        return (f"{self.refused_by('grouped_kv')} does not support grouped-query attention (k and v with "
                f"kv_heads={kv_heads} heads for heads={self.heads} query heads; capability grouped_kv='none'): pass "
                f"kv_heads == heads")

    def unsupported_reasons(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        *,
        cross: bool = False,
    ) -> List[str]:
        """Every reason this instance cannot run these (well-formed) inputs; empty when it can.

        Read from the declared capabilities (as narrowed by the instance's options) and input constraints
        (``max_length``, ``length_multiple``); a mechanism with a constraint of its own extends the list. Only
        shapes are read, so ``q, k, v`` may be :func:`shapes_only` tensors. :meth:`forward`,
        ``MultiHeadAttention``, ``attnzoo compare`` and the conformance suite all ask here.
        """
        caps = self.capabilities
        who = self.refused_by("cross")
        q_len, k_len = q.shape[2], k.shape[2]
        reasons = []
        if causal and not caps.causal:
            reasons.append(f"{self.refused_by('causal')} does not support causal=True (non-causal only)")
        if not causal and not caps.non_causal:
            reasons.append(f"{self.refused_by('non_causal')} does not support causal=False (causal only)")
        if key_padding_mask is not None and not caps.key_padding:
            reasons.append(f"{self.refused_by('key_padding')} does not support key_padding_mask")
        grouping = self.grouping_reason(k.shape[1])
        if grouping:
            reasons.append(grouping)
        if cross and not caps.cross:
            reasons.append(f"{who} does not support cross-attention (cross=True): its keys must come from the "
                           f"query sequence")
        if not cross and q_len != k_len:
            reasons.append(
                f"{who}: queries of length {q_len} and keys of length {k_len} cannot be self-attention "
                + ("(cross=False); pass cross=True for keys and values from another sequence" if caps.cross
                   else "and it does not support cross-attention: its keys must come from the query sequence")
            )
        value_width = self.value_width_reason(v.shape[3])
        if value_width:
            reasons.append(value_width)
        reasons += self.length_limit_reasons(q_len, k_len, cross)
        multiple = caps.length_multiple
        if multiple is not None:
            for label, length in (("query", q_len), ("key", k_len)):
                if length % multiple:
                    reasons.append(f"{who}: {label} length {length} is not a multiple of length_multiple={multiple}")
        return reasons

    def refused_by(self, capability: str) -> str:
        """The name to give in a refusal for lack of ``capability`` (a :class:`Capabilities` field): the
        mechanism's, with the option that switched it off (``limited_by``) when the class declares it and this
        instance does not, so an option is never blamed for what the mechanism never had."""
        caps, declared = self.capabilities, type(self).capabilities
        switched = caps.limited_by is not None and getattr(caps, capability) != getattr(declared, capability)
        return self.name + (f" with {caps.limited_by}" if switched else "")

    def value_width_reason(self, width: int) -> Optional[str]:
        """Why this instance refuses values with ``width`` channels (capability ``any_value_width``), or None."""
        if self.capabilities.any_value_width or width == self.head_dim:
            return None
        return (f"{self.refused_by('any_value_width')} needs v with head_dim={self.head_dim} channels, like q and k, "
                f"got {width} (capability any_value_width=False)")

    def length_limit_reasons(self, q_len: int, k_len: int, cross: bool) -> List[str]:
        """Why these lengths exceed :attr:`max_length` (empty if they don't). Queries and keys alike by default; a
        mechanism whose limit binds only the keys (a learned projection over key positions) narrows it here."""
        limit = self.max_length
        if limit is not None and max(q_len, k_len) > limit:
            who = self.name + (f" with {self.capabilities.limited_by}" if self.capabilities.limited_by else "")
            # A limit set by an option (a learned table over positions) is named with the option to change.
            fix = f" (set by {self.length_option}: build it with a larger {self.length_option})" \
                if self.length_option else ""
            return [f"{who}: sequence length {max(q_len, k_len)} exceeds max_length={limit}{fix}"]
        return []

    @property
    def max_length(self) -> Optional[int]:
        """The longest sequence this instance accepts (instances may narrow the class's declaration)."""
        return self.capabilities.max_length

    # -- incremental decoding ------------------------------------------------------------------------------
    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor, state: State) -> Tuple[Tensor, DecodingState]:
        """One causal decoding step.

        Args:
            q_t: (batch, heads, 1, head_dim) for the new position; k_t: (batch, kv_heads, 1, head_dim), v_t:
                (batch, kv_heads, 1, head_dim_v), as in :meth:`forward` (every step with the same head_dim_v).
            state: what the previous step (or :meth:`prefill`) of this mechanism returned, or None at the
                start. A state of another mechanism, batch size or shape (heads instead of kv_heads included)
                raises an error naming ``state``.

        Returns:
            (out_t of shape (batch, heads, 1, head_dim_v), new state). Equals the last row of the causal
            parallel forward over all positions so far.
        """
        self.check_step_inputs(q_t, k_t, v_t)
        k_t, v_t = self.repeated_kv(q_t, k_t, v_t)
        grouped = {} if k_t.shape[1] == self.heads else {"kv_heads": k_t.shape[1]}  # overrides may not take it
        self.check_state(state, q_t, **grouped, value_width=v_t.shape[3])
        tensors = None if state is None else state.tensors
        length = 0 if state is None else state.length
        out, tensors = self.attend_step(q_t, k_t, v_t, tensors, length)
        return out, DecodingState(self.name, length + 1, tensors)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, DecodingState]:
        """Causal attention over a prompt (batch, heads, seq, head_dim; k and v with kv_heads heads, as in
        :meth:`forward`) that also returns the decoding state after it."""
        self.require_recurrent_step()
        self.check_inputs(q, k, v, True, None)
        k, v = self.repeated_kv(q, k, v)
        out, tensors = self.attend_prefill(q, k, v)
        return out, DecodingState(self.name, q.shape[2], tensors)

    def prefill_packed(
        self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor
    ) -> Tuple[Tensor, List[DecodingState]]:
        """:meth:`prefill` of a packed row (1, heads, N, head_dim) of prompts: the causal output, each document
        alone, and one state per document (batch 1), in order, each continuing its own prompt. Checked as a
        packed :meth:`forward` is (:meth:`check_packed_inputs`)."""
        self.require_recurrent_step()
        spans = self.check_packed_inputs(q, k, v, True, None, False, cu_seqlens)
        k, v = self.repeated_kv(q, k, v)
        outputs, states = [], []
        for start, end in spans:
            out, tensors = self.attend_prefill(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end])
            outputs.append(out)
            states.append(DecodingState(self.name, end - start, tensors))
        return torch.cat(outputs, dim=2), states

    # What a mechanism with recurrent_step=True implements; the public methods above check and wrap.
    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        """One step on checked inputs: ``tensors`` is the previous state's (None at the start), ``length`` the
        positions it has seen. Returns the output and the new state's tensors (laid out as
        :meth:`state_layout` declares)."""
        raise NotImplementedError(f"{type(self).__qualname__} declares recurrent_step=True but has no attend_step()")

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        """Causal attention over a checked prompt and the state's tensors after it. The default walks
        :meth:`attend_step` over the positions; mechanisms override it with a parallel version."""
        tensors: Optional[Dict[str, Tensor]] = None
        outputs = []
        for t in range(q.shape[2]):
            out_t, tensors = self.attend_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], tensors, t)
            outputs.append(out_t)
        assert tensors is not None  # a prompt has at least one position (check_inputs)
        return torch.cat(outputs, dim=2), tensors

    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        """Every state tensor's shape after the batch dim (None where it varies) and dtype, for inputs of
        ``dtype`` and values of ``value_width`` channels (``head_dim`` when None; asked only of a mechanism
        declaring ``any_value_width``): what :meth:`check_state` holds a state to. A mechanism declaring
        ``grouped_kv="native"`` takes ``state_layout(dtype, kv_heads=None, value_width=None)`` instead, asked
        with ``kv_heads`` for keys/values of fewer heads than ``heads``."""
        raise NotImplementedError(f"{type(self).__qualname__} declares recurrent_step=True but has no state_layout()")

    def value_width(self, value_width: Optional[int]) -> int:
        """``value_width`` as :meth:`state_layout` is asked it: the values' channels, ``head_dim`` when None."""
        return self.head_dim if value_width is None else value_width

    def require_recurrent_step(self) -> None:
        """Raise UnsupportedOptionError unless this instance offers :meth:`step` and :meth:`prefill`."""
        caps = self.capabilities
        if not caps.recurrent_step:
            who = self.refused_by("recurrent_step")
            hint = f"; build it without {caps.limited_by} to decode" if who != self.name else ""
            raise UnsupportedOptionError(f"{who} has no recurrent step (capability recurrent_step=False){hint}")

    def check_step_inputs(self, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> None:
        self.require_recurrent_step()
        check_qkv(q_t, k_t, v_t, grouped=True)
        if q_t.shape[1] != self.heads or q_t.shape[3] != self.head_dim:
            raise ValueError(
                f"{self.name}.step: q_t has {q_t.shape[1]} heads of dim {q_t.shape[3]}, the mechanism was built "
                f"with heads={self.heads}, head_dim={self.head_dim}"
            )
        if q_t.shape[2] != 1 or k_t.shape[2] != 1:
            raise ValueError(f"{self.name}.step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, dim), "
                             f"got seq lengths {q_t.shape[2]} and {k_t.shape[2]}")
        refused = self.grouping_reason(k_t.shape[1]) or self.value_width_reason(v_t.shape[3])
        if refused:
            raise UnsupportedOptionError(refused)

    def check_state(
        self, state: object, q_t: Tensor, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> None:
        """A state this mechanism can continue from for the step input ``q_t`` (and keys/values of ``kv_heads``
        heads, ``heads`` when None, values of ``value_width`` channels, ``head_dim`` when None): made by a
        mechanism of this name, for this batch size, with every tensor
        laid out as :meth:`state_layout` declares (so heads, widths and feature counts match), on the input's
        device. Anything else raises naming ``state``."""
        if state is None:
            return
        check_state_made_here(state, self.name)
        kv_heads = self.heads if kv_heads is None else kv_heads
        grouped = kv_heads != self.heads and self.capabilities.grouped_kv == NATIVE_KV
        # Overrides take kv_heads only when grouped natively, value_width only when declaring any_value_width.
        other_width = value_width is not None and value_width != self.head_dim
        asked = {**({"kv_heads": kv_heads} if grouped else {}), **({"value_width": value_width} if other_width else {})}
        layout = self.state_layout(q_t.dtype, **asked)
        check_state_tensors(state, self.name, layout, q_t, self.heads, kv_heads, self.head_dim,
                            self.value_width(value_width))

    # -- training hooks --------------------------------------------------------------------------------------
    # What a training loop asks of every mechanism in its model (attnzoo.mechanisms.hooks walks them): none names
    # a mechanism, so one with training-time state trains without a line changed in the loop.
    def auxiliary_loss(self) -> Optional[Tensor]:
        """The loss term this mechanism's latest training-mode forward asks the training loop to add to the
        task loss (e.g. a commitment loss), taken: a second call returns None until the next such forward, so
        no term is added twice and no autograd graph outlives its step. A real scalar tensor of the forward's
        working dtype with a gradient path to what produced it. None (the default): no auxiliary loss."""
        return None

    def after_optimizer_step(self, step: int, seed: int) -> None:
        """Called by the training loop after optimiser step ``step`` (0-based, an int >= 0) of a run, with a
        ``seed`` (an int >= 0) derived from the run's: checks both and calls :meth:`update_after_step`."""
        step = check_number("step", step, integer=True, minimum=0)
        seed = check_number("seed", seed, integer=True, minimum=0)
        self.update_after_step(step, seed)

    def update_after_step(self, step: int, seed: int) -> None:
        """What a mechanism with training-time state overrides (a redraw of random features, a codebook's
        EMA): an update after the optimiser step. Any randomness is drawn from a generator seeded by
        ``(step, seed)`` alone, never the global one, so that a resumed run and every rank of a data-parallel
        run update alike. Nothing by default."""

    def data_parallel_reasons(self) -> List[str]:
        """Why this instance cannot train data-parallel (replicas on shares of each batch, gradients
        averaged), each reason naming the mechanism; empty (the default) when it can: e.g. state updated
        from per-rank statistics that data parallelism does not combine."""
        return []

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}"

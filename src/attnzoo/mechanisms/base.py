"""The mechanism contract and the registry.

Every attention mechanism is a small ``nn.Module`` working on per-head tensors (batch, heads, seq, head_dim).
It declares what it can do once, in a :class:`Capabilities`; the registry, the conformance tests,
``attnzoo list`` and the error messages all read that one declaration.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

import torch
from torch import Tensor, nn

from .._validation import check_key_padding_mask, check_qkv

State = Any
"""A mechanism's decoding state: a tree (dict, tuple, list) of tensors whose first dim is the batch, or None
before the first step. Passed in and returned explicitly; never stored on the module."""


class UnsupportedOptionError(ValueError):
    """A mechanism was asked for something its capabilities do not include (the message names the option)."""


@dataclass(frozen=True)
class Capabilities:
    """What a mechanism supports, declared once per mechanism class.

    Attributes:
        causal: supports ``causal=True`` (autoregressive masking).
        cross: supports keys/values from another sequence, with a length different from the queries.
        key_padding: supports ``key_padding_mask``.
        recurrent_step: offers :meth:`Mechanism.step` for incremental decoding.
        max_length: the longest key sequence it accepts, or None for no limit.
        approximate: its output approximates exact softmax attention rather than computing it.
        complexity: time/memory in the sequence length N, for people reading ``attnzoo list``.
        summary: one line describing the mechanism.
        limited_by: for an instance whose options switched capabilities off (see :meth:`narrowed`), those
            options, so that error messages can name them; None in a class's declaration.
    """

    causal: bool
    cross: bool
    key_padding: bool
    recurrent_step: bool
    approximate: bool
    complexity: str
    summary: str
    max_length: Optional[int] = None
    limited_by: Optional[str] = None

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def narrowed(self, limited_by: str, **switched_off: bool) -> "Capabilities":
        """These capabilities with some switched off by an instance option named in ``limited_by``."""
        unknown = sorted(set(switched_off) - {"causal", "cross", "key_padding", "recurrent_step"})
        if unknown or any(switched_off.values()):
            raise ValueError(f"narrowed() only switches capabilities off, got {switched_off}")
        return replace(self, limited_by=limited_by, **switched_off)


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

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim

    # -- parallel form -------------------------------------------------------------------------------------
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None
    ) -> Tensor:
        """Attend.

        Args:
            q: (batch, heads, seq_q, head_dim)
            k: (batch, heads, seq_kv, head_dim)
            v: (batch, heads, seq_kv, head_dim_v)
            causal: autoregressive mask, aligned so the last query sees every key.
            key_padding_mask: (batch, seq_kv) bool, True marks padding.

        Returns:
            (batch, heads, seq_q, head_dim_v)
        """
        self.check_inputs(q, k, v, causal, key_padding_mask)
        return self.attend(q, k, v, causal, key_padding_mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None
    ) -> Tensor:
        """The same attention computed by slow, obviously-correct quadratic maths in float64.

        Every mechanism provides one; the conformance suite compares :meth:`forward` with it. Takes the
        arguments of :meth:`forward` and uses this instance's parameters and buffers (features, projections);
        returns float64 (batch, heads, seq_q, head_dim_v).
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement reference()")

    def check_inputs(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]
    ) -> None:
        check_qkv(q, k, v)
        check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        caps = self.capabilities
        limited = f" with {caps.limited_by}" if caps.limited_by else ""
        if q.shape[1] != self.heads:
            raise ValueError(f"{self.name}: q has {q.shape[1]} heads, the mechanism was built with heads={self.heads}")
        if q.shape[3] != self.head_dim:
            raise ValueError(
                f"{self.name}: q has head_dim={q.shape[3]}, the mechanism was built with head_dim={self.head_dim}"
            )
        if causal and not caps.causal:
            raise UnsupportedOptionError(f"{self.name}{limited} does not support causal=True (non-causal only)")
        if key_padding_mask is not None and not caps.key_padding:
            raise UnsupportedOptionError(f"{self.name}{limited} does not support key_padding_mask")
        if k.shape[2] != q.shape[2] and not caps.cross:
            raise UnsupportedOptionError(
                f"{self.name}{limited} does not support cross-attention (queries of length {q.shape[2]}, keys of length "
                f"{k.shape[2]}): its keys must come from the query sequence"
            )
        if self.max_length is not None and max(q.shape[2], k.shape[2]) > self.max_length:
            raise ValueError(
                f"{self.name}: sequence length {max(q.shape[2], k.shape[2])} exceeds max_length={self.max_length}"
            )

    @property
    def max_length(self) -> Optional[int]:
        """The longest sequence this instance accepts (instances may narrow the class's declaration)."""
        return self.capabilities.max_length

    # -- incremental decoding ------------------------------------------------------------------------------
    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor, state: State) -> Tuple[Tensor, State]:
        """One causal decoding step.

        Args:
            q_t, k_t, v_t: (batch, heads, 1, head_dim) for the new position.
            state: what the previous step (or :meth:`prefill`) returned, or None at the start.

        Returns:
            (out_t of shape (batch, heads, 1, head_dim_v), new state). Equals the last row of the causal
            parallel forward over all positions so far.
        """
        self.require_recurrent_step()
        raise NotImplementedError(f"{type(self).__qualname__} declares recurrent_step=True but has no step()")

    def require_recurrent_step(self) -> None:
        """Raise UnsupportedOptionError unless this instance offers :meth:`step` and :meth:`prefill`."""
        caps = self.capabilities
        if not caps.recurrent_step:
            limited = f" with {caps.limited_by}" if caps.limited_by else ""
            hint = f"; build it without {caps.limited_by} to decode" if caps.limited_by else ""
            raise UnsupportedOptionError(
                f"{self.name}{limited} has no recurrent step (capability recurrent_step=False){hint}"
            )

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, State]:
        """Causal attention over a prompt that also returns the decoding state after it.

        The default walks :meth:`step` over the positions; mechanisms override it with a parallel version.
        """
        self.require_recurrent_step()
        state: State = None
        outputs = []
        for t in range(q.shape[2]):
            out_t, state = self.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            outputs.append(out_t)
        return torch.cat(outputs, dim=2), state

    def check_step_inputs(self, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> None:
        self.require_recurrent_step()
        check_qkv(q_t, k_t, v_t)
        if q_t.shape[1] != self.heads or q_t.shape[3] != self.head_dim:
            raise ValueError(
                f"{self.name}.step: q_t has {q_t.shape[1]} heads of dim {q_t.shape[3]}, the mechanism was built "
                f"with heads={self.heads}, head_dim={self.head_dim}"
            )
        if q_t.shape[2] != 1 or k_t.shape[2] != 1:
            raise ValueError(f"{self.name}.step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, dim), "
                             f"got seq lengths {q_t.shape[2]} and {k_t.shape[2]}")

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}"


# -- registry ------------------------------------------------------------------------------------------------
_REGISTRY: Dict[str, Type[Mechanism]] = {}


def register(cls: Type[Mechanism]) -> Type[Mechanism]:
    """Class decorator adding a mechanism to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} must set a non-empty class attribute 'name'")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise ValueError(f"{cls.__qualname__} must declare 'capabilities' as a Capabilities instance")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"mechanism name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> List[str]:
    """Sorted names of the registered mechanisms."""
    return sorted(_REGISTRY)


def mechanism_class(name: str) -> Type[Mechanism]:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; valid choices: {', '.join(available())}")
    return _REGISTRY[name]


def capabilities(name: str) -> Capabilities:
    """The declared :class:`Capabilities` of a registered mechanism."""
    return mechanism_class(name).capabilities


def mechanism_options(name: str) -> Dict[str, Any]:
    """The keyword options a mechanism takes besides ``heads`` and ``head_dim``, with their defaults."""
    signature = inspect.signature(mechanism_class(name).__init__)
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def build_mechanism(name: str, heads: int, head_dim: int, **options: Any) -> Mechanism:
    """Instantiate a registered mechanism; an option it does not take raises an error listing the valid ones."""
    cls = mechanism_class(name)
    valid = mechanism_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(valid) if valid else "none"
        raise TypeError(f"mechanism {name!r} got unknown option(s) {', '.join(unknown)}; valid options: {listed}")
    return cls(heads, head_dim, **options)

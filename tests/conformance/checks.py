"""Reusable conformance checks for attention mechanisms.

Every check takes a mechanism *instance* (or, for :func:`check_declaration`, a class) and raises
``AssertionError`` with a message naming the broken rule. Checks read nothing but the mechanism's declared
:class:`~attnzoo.Capabilities` and its ``heads`` / ``head_dim`` / ``max_length``: where a capability is
declared it is exercised, where it is not the check asserts that using it raises
:class:`~attnzoo.UnsupportedOptionError` naming the option. No check knows any mechanism by name.

Comparisons of quantities that are mathematically equal (padding invariance, no look-ahead, ``step`` against
the parallel form, batch independence) run in float64 with tight tolerances, so they hold for approximate
mechanisms too: approximation error is the same on both sides, a leak is not.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import inspect
import itertools
import math
import re
import sys
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

import attnzoo
from attnzoo import _validation
from attnzoo.functional import softmax_attention_reference
from attnzoo.mechanisms import (
    APPROXIMATE,
    NATIVE_KV,
    CallInput,
    Capabilities,
    Mechanism,
    UnsupportedOptionError,
    mechanism_class,
    shapes_only,
)
from attnzoo.mechanisms.capabilities import PADDED_SIDES
from attnzoo.state import DecodingState, map_tensors, select_batch

HEADS = 2
HEAD_DIM = 8
BATCH = 3
# 11 is a multiple of no block, chunk or bucket size a mechanism is likely to use.
SEQ = 11

# Equal-in-exact-arithmetic comparisons in float64: rounding differences are ~1e-15, real leaks >> 1e-6.
TIGHT = {"rtol": 1e-6, "atol": 1e-8}
# An exact mechanism in float32 against the float64 reference.
FLOAT32 = {"rtol": 1e-4, "atol": 1e-5}
# An exact mechanism in half precision against itself in float64: catches garbage, not rounding.
LOW_PRECISION = {torch.float16: {"rtol": 3e-2, "atol": 3e-2}, torch.bfloat16: {"rtol": 1e-1, "atol": 1e-1}}

Qkv = Tuple[Tensor, Tensor, Tensor]


# -- building ------------------------------------------------------------------------------------------------
def build(
    name: str,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    options: Optional[Dict[str, Any]] = None,
) -> Mechanism:
    """A registered mechanism with ``options`` (default: its declared ``test_options``), in eval mode, of the
    given dtype.

    Randomness drawn at construction (e.g. random features kept in buffers) comes from ``seed`` without
    disturbing the global generator.
    """
    cls = mechanism_class(name)
    options = dict(cls.test_options if options is None else options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mechanism = attnzoo.build_mechanism(name, heads, head_dim, **options)
    return mechanism.to(dtype).eval()


def as_dtype(mechanism: Mechanism, dtype: torch.dtype) -> Mechanism:
    """An eval-mode copy of ``mechanism`` with floating parameters and buffers in ``dtype``."""
    return copy.deepcopy(mechanism).to(dtype).eval()


def fit(mechanism: Mechanism, length: int) -> int:
    """``length`` capped at the mechanism's ``max_length`` and rounded down to its ``length_multiple``."""
    limit = mechanism.max_length
    length = length if limit is None else max(1, min(length, limit))
    multiple = mechanism.capabilities.length_multiple
    return length if multiple is None else max(multiple, length - length % multiple)


def random_qkv(
    mechanism: Mechanism, batch: int, q_len: int, k_len: int, dtype: torch.dtype, seed: int, scale: float = 1.0
) -> Qkv:
    """Standard normal q, k, v (times ``scale``) of shape (batch, heads, len, head_dim); drawn in float64 and
    cast, so every dtype sees the same values."""
    generator = torch.Generator().manual_seed(seed)

    def draw(length: int) -> Tensor:
        shape = (batch, mechanism.heads, length, mechanism.head_dim)
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    return draw(q_len), draw(k_len), draw(k_len)


def padding_pattern(batch: int, k_len: int, *, fully_padded: bool = True) -> Tensor:
    """(batch, k_len) bool key padding mask, True = padding.

    Element 0 has no padding; element 1 is padded at the start, in the middle and at the end (so causal
    rows at the start see no key at all); element 2, if any, is entirely padding (or, with
    ``fully_padded=False``, only its last key); further elements alternate the patterns.
    """
    mask = torch.zeros(batch, k_len, dtype=torch.bool)
    for b in range(batch):
        kind = b % 3
        if kind == 1:
            mask[b, 0] = True
            mask[b, k_len // 2] = True
            mask[b, -2:] = True
        elif kind == 2:
            if fully_padded:
                mask[b] = True
            else:
                mask[b, -1] = True
    return mask


@dataclass(frozen=True)
class Variant:
    """One way of calling a mechanism: lengths, causality, padding, self- or cross-attention."""

    q_len: int
    k_len: int
    causal: bool
    padded: bool
    cross: bool = False

    def describe(self) -> str:
        kind = "cross-attention" if self.cross else "self-attention"
        return (
            f"{kind} q_len={self.q_len} k_len={self.k_len} causal={self.causal} "
            f"key_padding_mask={'yes' if self.padded else 'no'}"
        )


def all_variants(mechanism: Mechanism, length: int = SEQ) -> List[Variant]:
    """Every combination of causal / key padding / self- and cross-attention, supported or not. Cross-attention
    runs with equal lengths too: whether keys come from another sequence is said, never read off the lengths."""
    n = fit(mechanism, length)
    short = fit(mechanism, max(1, n // 2))
    shapes = [(n, n, False), (n, n, True)] + ([(short, n, True), (n, short, True)] if short != n else [])
    return [Variant(lq, lk, c, p, cross) for lq, lk, cross in shapes for c in (False, True) for p in (False, True)]


def unsupported_reasons(mechanism: Mechanism, variant: Variant) -> List[str]:
    """What the mechanism itself says stops it from running ``variant`` (asked with shape-only inputs)."""
    q, k, v = shapes_only(BATCH, mechanism.heads, variant.q_len, variant.k_len, mechanism.head_dim)
    mask = torch.zeros(BATCH, variant.k_len, dtype=torch.bool, device="meta") if variant.padded else None
    return mechanism.unsupported_reasons(q, k, v, variant.causal, mask, cross=variant.cross)


def variants(mechanism: Mechanism, length: int = SEQ) -> List[Variant]:
    """The combinations of :func:`all_variants` the mechanism runs (by its own :meth:`unsupported_reasons`,
    which :func:`check_unsupported_options` holds to the declared capabilities)."""
    return [variant for variant in all_variants(mechanism, length) if not unsupported_reasons(mechanism, variant)]


def call(mechanism: Mechanism, qkv: Qkv, causal: bool, mask: Optional[Tensor], cross: bool = False) -> Tensor:
    q, k, v = qkv
    return mechanism(q, k, v, causal=causal, key_padding_mask=mask, cross=cross)


def variant_inputs(
    mechanism: Mechanism, variant: Variant, dtype: torch.dtype, seed: int, batch: int = BATCH
) -> Tuple[Qkv, Optional[Tensor]]:
    qkv = random_qkv(mechanism, batch, variant.q_len, variant.k_len, dtype, seed)
    mask = padding_pattern(batch, variant.k_len) if variant.padded else None
    return qkv, mask


# -- assertions ----------------------------------------------------------------------------------------------
def assert_finite(x: Tensor, what: str) -> None:
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        first = torch.nonzero(~finite)[0].tolist()
        raise AssertionError(f"{what}: {int((~finite).sum())} non-finite value(s), first at index {first}")


def assert_close(actual: Tensor, expected: Tensor, what: str, *, rtol: float, atol: float) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    assert_finite(actual, what)
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    difference = (a - e).abs()
    bad = ~(difference <= atol + rtol * e.abs())
    if bool(bad.any()):
        first = torch.nonzero(bad)[0].tolist()
        raise AssertionError(
            f"{what}: max abs difference {difference.max().item():.3g} exceeds "
            f"atol={atol:g} + rtol={rtol:g}*|expected| "
            f"({int(bad.sum())} of {bad.numel()} elements), first at index {first}"
        )


def expect_error(
    action: Callable[[], object],
    errors: Union[Type[BaseException], Tuple[Type[BaseException], ...]],
    pattern: str,
    what: str,
) -> None:
    """``action`` must raise one of ``errors`` whose message matches the regex ``pattern`` (case-insensitive)."""
    errors = errors if isinstance(errors, tuple) else (errors,)
    expected = " or ".join(e.__name__ for e in errors)
    try:
        action()
    except errors as error:
        if not re.search(pattern, str(error), flags=re.IGNORECASE):
            raise AssertionError(
                f"{what}: raised {type(error).__name__} as expected, but its message does not name "
                f"/{pattern}/: {error}"
            ) from error
        return
    except Exception as error:  # any other failure is a contract violation, reported as such
        raise AssertionError(
            f"{what}: expected {expected} naming /{pattern}/, got {type(error).__name__}: {error}"
        ) from error
    raise AssertionError(f"{what}: expected {expected} naming /{pattern}/, but nothing was raised")


def causal_settings(mechanism: Mechanism) -> List[bool]:
    """The values of ``causal`` the mechanism declares it runs: False unless it is causal only (capability
    ``non_causal``), True where it declares ``causal``."""
    caps = mechanism.capabilities
    return [causal for causal in (False, True) if (caps.causal if causal else caps.non_causal)]


def expect_unsupported(mechanism: Mechanism, option: str) -> None:
    """Using an undeclared capability raises UnsupportedOptionError naming it."""
    n = fit(mechanism, 6)
    qkv = random_qkv(mechanism, 2, n, n, torch.float32, seed=7)
    q, k, v = qkv
    m = as_dtype(mechanism, torch.float32)
    where = f"{type(mechanism).__name__} (capability {option}=False)"
    plain = causal_settings(mechanism)[0]  # a causality it runs, to call with
    if option == "causal":
        expect_error(lambda: call(m, qkv, True, None), UnsupportedOptionError, r"causal", f"{where}: causal=True")
    elif option == "non_causal":
        expect_error(lambda: call(m, qkv, False, None), UnsupportedOptionError, r"causal=False",
                     f"{where}: causal=False")
    elif option == "key_padding":
        mask = torch.zeros(2, n, dtype=torch.bool)
        expect_error(
            lambda: call(m, qkv, plain, mask), UnsupportedOptionError, r"key_padding_mask", f"{where}: key_padding_mask"
        )
    elif option == "cross":
        longer = random_qkv(mechanism, 2, n, n + 1, torch.float32, seed=8)
        longer = (q, longer[1], longer[2])
        expect_error(lambda: call(m, longer, plain, None), UnsupportedOptionError, r"cross", f"{where}: k_len != q_len")
        for other in (qkv, longer):  # refused when said, whatever the lengths
            expect_error(
                lambda: call(m, other, plain, None, cross=True),
                UnsupportedOptionError,
                r"cross",
                f"{where}: cross=True with q_len={n}, k_len={other[1].shape[2]}",
            )
    elif option == "any_value_width":
        for width in sorted({mechanism.head_dim + 3, max(1, mechanism.head_dim - 1)} - {mechanism.head_dim}):
            other = (q, k, widened_values(v, width, seed=9))
            expect_error(lambda: call(m, other, plain, None), UnsupportedOptionError, r"any_value_width",
                         f"{where}: v with {width} channels")
            if mechanism.capabilities.recurrent_step:
                one = tuple(t[:, :, :1] for t in other)
                expect_error(lambda: m.step(*one, None), UnsupportedOptionError, r"any_value_width",
                             f"{where}: step() with v of {width} channels")
    elif option == "recurrent_step":
        one = (q[:, :, :1], k[:, :, :1], v[:, :, :1])
        expect_error(lambda: m.step(*one, None), UnsupportedOptionError, r"step", f"{where}: step()")
        expect_error(lambda: m.prefill(q, k, v), UnsupportedOptionError, r"step", f"{where}: prefill()")
    else:
        raise ValueError(f"unknown capability {option!r}")


def widened_values(v: Tensor, width: int, seed: int) -> Tensor:
    """Standard normal values shaped like ``v`` but with ``width`` channels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*v.shape[:3], width, generator=generator, dtype=torch.float64).to(v.dtype)


def state_tensors(state: object) -> List[Tensor]:
    found: List[Tensor] = []
    map_tensors(state, lambda t: found.append(t) or t)
    return found


# -- declaration ---------------------------------------------------------------------------------------------
def check_declaration(cls: Type[Mechanism]) -> None:
    """Capabilities, name, constructor signature and ``test_options`` follow the contract."""
    where = cls.__qualname__
    if not isinstance(cls.name, str) or not cls.name:
        raise AssertionError(f"{where}: class attribute 'name' must be a non-empty string, got {cls.name!r}")
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise AssertionError(f"{where}: 'capabilities' must be a Capabilities instance, got {type(caps).__name__}")
    for field in ("complexity", "summary"):
        value = getattr(caps, field)
        if not isinstance(value, str) or not value.strip():
            raise AssertionError(f"{where}: capabilities.{field} must be a non-empty string, got {value!r}")
    limit = caps.max_length
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise AssertionError(f"{where}: capabilities.max_length must be None or a positive int, got {limit!r}")
    if caps.recurrent_step and not caps.causal:
        raise AssertionError(f"{where}: recurrent_step=True needs causal=True (step equals the causal forward)")
    for needs_causal in ("causal_rows", "linear_recurrence"):
        if getattr(caps, needs_causal) and not caps.causal:
            raise AssertionError(f"{where}: {needs_causal}=True needs causal=True (it describes the causal form)")
    multiple = caps.length_multiple
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        raise AssertionError(f"{where}: capabilities.length_multiple must be None or a positive int, got {multiple!r}")
    if multiple is not None and limit is not None and limit % multiple:
        raise AssertionError(f"{where}: max_length={limit} is not a multiple of length_multiple={multiple}")

    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    for p in parameters:
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            raise AssertionError(f"{where}.__init__ takes {p}: a mechanism must not swallow unknown arguments")
    positional = [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    if positional != ["heads", "head_dim"]:
        raise AssertionError(
            f"{where}.__init__ must take (heads, head_dim, *, options...); positional parameters are {positional}"
        )
    options = {p.name: p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    required = [name for name, p in options.items() if p.default is inspect.Parameter.empty]
    if required:
        raise AssertionError(f"{where}: options {required} have no default; every option needs one")

    test_options = cls.test_options
    if not isinstance(test_options, dict):
        raise AssertionError(f"{where}.test_options must be a dict, got {type(test_options).__name__}")
    if not isinstance(cls.test_variants, tuple) or not all(isinstance(v, dict) for v in cls.test_variants):
        raise AssertionError(f"{where}.test_variants must be a tuple of dicts, got {cls.test_variants!r}")
    for label, option_set in [("test_options", test_options)] + [("test_variants", v) for v in cls.test_variants]:
        unknown = sorted(set(option_set) - set(options))
        if unknown:
            raise AssertionError(f"{where}.{label} names {unknown}, which are not options of {where}: {sorted(options)}")
    expect_error(
        lambda: cls(HEADS, HEAD_DIM, **dict(test_options), no_such_option=1),
        TypeError,
        r"no_such_option",
        f"{where}: an unknown keyword option",
    )
    check_bool_options_exercised(cls, options)
    check_option_types(cls)
    check_declared_option_roles(cls, options)
    check_call_inputs(cls)


# The methods that take a mechanism's per-call inputs, each as a keyword-only argument defaulting to None.
_TAKE_CALL_INPUTS = ("attend", "attend_reference")


def check_call_inputs(cls: Type[Mechanism]) -> None:
    """``call_inputs`` is a tuple of :class:`CallInput` with distinct names, and ``attend`` and
    ``attend_reference`` (and ``attend_packed``, for a mechanism that takes packed rows) take exactly those as
    keyword-only arguments defaulting to None: the base class checks each input once and passes it on by
    name, so every per-call input reaches the fast path and its float64 counterpart, and nothing else does."""
    where = cls.__qualname__
    declared = cls.call_inputs
    if not isinstance(declared, tuple) or not all(isinstance(spec, CallInput) for spec in declared):
        raise AssertionError(f"{where}.call_inputs must be a tuple of CallInput, got {declared!r}")
    names = [spec.name for spec in declared]
    if len(set(names)) != len(names):
        raise AssertionError(f"{where}.call_inputs names an input twice: {names}")
    methods = _TAKE_CALL_INPUTS + (("attend_packed",) if cls.capabilities.packed else ())
    for method in methods:
        parameters = inspect.signature(getattr(cls, method)).parameters
        taken = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        for name in names:
            p = parameters.get(name)
            if p is None or p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is not None:
                raise AssertionError(f"{where}.call_inputs declares {name!r}, but {method} takes no keyword-only "
                                     f"{name}=None")
        unlisted = sorted(set(taken) - set(names))
        if unlisted:
            raise AssertionError(f"{where}.{method} takes keyword-only {unlisted}: declare them in call_inputs")


def check_declared_option_roles(cls: Type[Mechanism], options: Dict[str, inspect.Parameter]) -> None:
    """``sweep_option`` and ``length_option`` name integer options of the mechanism; only an approximate
    mechanism has an approximation error to sweep."""
    hints = typing.get_type_hints(cls.__init__)
    for role in ("sweep_option", "length_option"):
        option = getattr(cls, role)
        if option is None:
            continue
        annotation = hints.get(option)
        if typing.get_origin(annotation) is Union:
            (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        if option not in options or annotation is not int:
            raise AssertionError(f"{cls.__qualname__}.{role} = {option!r} must name an int option of its constructor")
    for role in ("scale_option", "window_option", "quiet_option"):
        option = getattr(cls.capabilities, role)
        if option is not None and option not in options:
            raise AssertionError(f"{cls.__qualname__}: capabilities.{role} = {option!r} names no option of its "
                                 f"constructor: {sorted(options)}")
    if cls.sweep_option is not None and cls.capabilities.kind != APPROXIMATE:
        raise AssertionError(
            f"{cls.__qualname__} sweeps {cls.sweep_option!r} but is of kind {cls.capabilities.kind!r}: only an "
            f"approximation of softmax has an error to sweep"
        )


def check_bool_options_exercised(cls: Type[Mechanism], options: Dict[str, inspect.Parameter]) -> None:
    """Every yes/no option is run by the suite both ways: its other value appears in ``test_options`` or in
    one of ``test_variants``, so that capabilities an option narrows (or maths it changes) are checked."""
    option_sets = [cls.test_options, *cls.test_variants]
    for name, parameter in options.items():
        if not isinstance(parameter.default, bool):
            continue
        if not any(option_set.get(name, parameter.default) != parameter.default for option_set in option_sets):
            raise AssertionError(
                f"{cls.__qualname__}: option {name} is never run as {not parameter.default!r} by the conformance "
                f"suite; add {{{name!r}: {not parameter.default!r}}} to test_variants"
            )


def _bad_values(annotation: Any) -> List[Any]:
    """Values of the wrong type (or non-finite) for an option annotated ``annotation``."""
    optional = typing.get_origin(annotation) is Union and type(None) in typing.get_args(annotation)
    if optional:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return ["False", "no", 1, 0.0] + ([] if optional else [None])
    if annotation is int:
        return [1.5, "3", True, float("nan")] + ([] if optional else [None])
    if annotation is float:
        return ["abc", "1", float("nan"), float("inf"), True] + ([] if optional else [None])
    if annotation is str:
        return [3, True] + ([] if optional else [None])
    if typing.get_origin(annotation) in (collections.abc.Sequence, list, tuple):
        return [0.5, "abc", True]
    return []


def check_option_types(cls: Type[Mechanism]) -> None:
    """Every option refuses values of the wrong type, and numbers that are not finite, with a TypeError or
    ValueError naming it, read from the constructor's annotations: a truthy string taken for True, or a NaN
    accepted as a scale, would change the maths silently."""
    hints = typing.get_type_hints(cls.__init__)
    signature = inspect.signature(cls.__init__)
    for name, parameter in signature.parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name not in hints:
            continue
        for bad in _bad_values(hints[name]):
            options = {**cls.test_options, name: bad}

            def construct(options: Dict[str, Any] = options) -> Mechanism:
                with torch.random.fork_rng(devices=[]):
                    return cls(HEADS, HEAD_DIM, **options)

            expect_error(
                construct,
                (TypeError, ValueError),
                rf"\b{name}\b",
                f"{cls.__qualname__}({name}={bad!r})",
            )


# -- parallel form -------------------------------------------------------------------------------------------
def check_output_shape_and_dtype(mechanism: Mechanism) -> None:
    """(batch, heads, q_len, head_dim) output of the input dtype, finite, in float32 and float64, for every
    declared variant; inputs are not modified in place."""
    name = type(mechanism).__name__
    for dtype in (torch.float32, torch.float64):
        m = as_dtype(mechanism, dtype)
        for variant in variants(mechanism):
            qkv, mask = variant_inputs(mechanism, variant, dtype, seed=1)
            originals = [t.clone() for t in qkv] + ([mask.clone()] if mask is not None else [])
            out = call(m, qkv, variant.causal, mask, variant.cross)
            what = f"{name} {dtype} {variant.describe()}"
            expected = (BATCH, mechanism.heads, variant.q_len, mechanism.head_dim)
            if not isinstance(out, Tensor) or tuple(out.shape) != expected:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise AssertionError(
                    f"{what}: output shape {shape}, expected (batch, heads, q_len, head_dim) = {expected}"
                )
            if out.dtype != dtype:
                raise AssertionError(f"{what}: output dtype {out.dtype}, expected the input dtype {dtype}")
            assert_finite(out, what)
            now = list(qkv) + ([mask] if mask is not None else [])
            for label, before, after in zip(("q", "k", "v", "key_padding_mask"), originals, now):
                if not torch.equal(before, after):
                    raise AssertionError(f"{what}: forward modified its input {label} in place")
    if not mechanism.capabilities.cross:
        expect_unsupported(mechanism, "cross")


def check_low_precision(mechanism: Mechanism) -> None:
    """float16 and bfloat16 run on CPU, keep their dtype, give the right shape and finite output (fully
    padded rows included). Exact mechanisms also stay near their float64 result; an approximate estimator may
    be ill-conditioned by design (a random-feature normaliser near zero amplifies rounding), so how well it
    keeps its accuracy in half precision belongs to its own tests."""
    name = type(mechanism).__name__
    reference = as_dtype(mechanism, torch.float64)
    for dtype, tolerance in LOW_PRECISION.items():
        m = as_dtype(mechanism, dtype)
        for variant in variants(mechanism):
            if variant.q_len != variant.k_len:
                continue
            qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=2)
            out = call(m, tuple(t.to(dtype) for t in qkv), variant.causal, mask, variant.cross)
            what = f"{name} {dtype} {variant.describe()}"
            expected_shape = (BATCH, mechanism.heads, variant.q_len, mechanism.head_dim)
            if tuple(out.shape) != expected_shape:
                raise AssertionError(f"{what}: output shape {tuple(out.shape)}, expected {expected_shape}")
            if out.dtype != dtype:
                raise AssertionError(f"{what}: output dtype {out.dtype}, expected the input dtype {dtype}")
            assert_finite(out, what)
            if mechanism.capabilities.exact:
                expected = call(reference, qkv, variant.causal, mask, variant.cross)
                assert_close(out, expected, f"{what} against float64", **tolerance)


def check_unsupported_options(mechanism: Mechanism) -> None:
    """Every capability the mechanism does not declare is refused with UnsupportedOptionError naming it, and
    ``unsupported_reasons`` agrees with the declaration: a call has a reason against it exactly when it uses
    an undeclared capability, every reason is given at once, and calling raises with all of them."""
    caps = mechanism.capabilities
    for option in ("causal", "non_causal", "key_padding", "cross", "recurrent_step", "any_value_width"):
        if not getattr(caps, option):
            expect_unsupported(mechanism, option)
    m = as_dtype(mechanism, torch.float32)
    name = type(mechanism).__name__
    for variant in all_variants(mechanism):
        reasons = unsupported_reasons(mechanism, variant)
        missing = [option for option, used in (("causal", variant.causal), ("non_causal", not variant.causal),
                                                ("key_padding", variant.padded), ("cross", variant.cross))
                   if used and not getattr(caps, option)]
        what = f"{name} {variant.describe()}"
        if bool(reasons) != bool(missing) or len(reasons) < len(missing):
            raise AssertionError(
                f"{what}: unsupported_reasons() gives {reasons}, but the declared capabilities "
                f"{'leave out ' + ', '.join(missing) if missing else 'cover this call'}"
            )
        if reasons:
            qkv, mask = variant_inputs(mechanism, variant, torch.float32, seed=24)
            expect_error(lambda: call(m, qkv, variant.causal, mask, variant.cross), UnsupportedOptionError,
                         "; ".join(map(re.escape, reasons)), f"{what}: a call unsupported_reasons() refuses")


def check_deterministic(mechanism: Mechanism) -> None:
    """In eval mode the same inputs give bit-identical outputs (randomness lives in buffers, not calls)."""
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=3)
        first = call(m, qkv, variant.causal, mask, variant.cross)
        second = call(m, qkv, variant.causal, mask, variant.cross)
        if not torch.equal(first, second):
            difference = (first - second).abs().max().item()
            raise AssertionError(
                f"{type(mechanism).__name__} {variant.describe()}: two eval-mode calls on the same inputs differ "
                f"by {difference:.3g}"
            )


def check_output_depends_on_values(mechanism: Mechanism) -> None:
    """Changing every value changes the output: the mechanism really attends over v."""
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, SEQ)
    q, k, v = random_qkv(mechanism, BATCH, n, n, torch.float64, seed=4)
    causal = causal_settings(mechanism)[0]
    with torch.no_grad():
        before = m(q, k, v, causal=causal)
        after = m(q, k, _perturb(v, (slice(None),), seed=4), causal=causal)
    if float((before - after).abs().max()) < 1e-3:
        raise AssertionError(f"{type(mechanism).__name__}: replacing every value left the output unchanged")


def _perturb(x: Tensor, index: Tuple, seed: int) -> Tensor:
    """A copy of ``x`` with ``x[index]`` replaced by different (larger, shifted) random values."""
    generator = torch.Generator().manual_seed(seed)
    out = x.clone()
    region = out[index]
    out[index] = (torch.randn(region.shape, generator=generator, dtype=torch.float64) * 3.0 + 2.0).to(x.dtype)
    return out


def padding_invariance(
    mechanism: Mechanism, qkv: Qkv, causal: bool, mask: Tensor, what: str, seed: int = 0, cross: bool = False
) -> None:
    """Whatever padded positions hold, no output changes. ``mechanism`` in float64.

    Keys and values at padded positions are replaced by other random values, by NaN and by +-inf: no output
    row may change (rows with every key padded included). In self-attention a padded position is also a
    query, whose own output row is discarded: replacing its query too may change that row only."""
    q, k, v = qkv
    expected = mechanism(q, k, v, causal=causal, key_padding_mask=mask, cross=cross)
    assert_finite(expected, what)
    padded = mask[:, None, :, None].expand_as(k)
    fillers = {
        "other values": (_perturb(k, (slice(None),), seed), _perturb(v, (slice(None),), seed + 1)),
        "NaN": (torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))),
        "+inf keys, -inf values": (torch.full_like(k, float("inf")), torch.full_like(v, -float("inf"))),
    }
    for label, (k_fill, v_fill) in fillers.items():
        k2, v2 = torch.where(padded, k_fill, k), torch.where(padded, v_fill, v)
        actual = mechanism(q, k2, v2, causal=causal, key_padding_mask=mask, cross=cross)
        assert_close(actual, expected, f"{what}: padded keys/values holding {label} changed the output", **TIGHT)
        if cross:
            continue
        q2 = torch.where(padded, q.new_full((), float("nan")) if label == "NaN" else _perturb(q, (slice(None),), seed + 2), q)
        actual = mechanism(q2, k2, v2, causal=causal, key_padding_mask=mask, cross=cross)
        kept = ~mask[:, None, :, None].expand_as(actual)
        assert_close(
            torch.where(kept, actual, 0.0),
            torch.where(kept, expected, 0.0),
            f"{what}: padded positions holding {label} in q, k and v changed the output at unpadded positions",
            **TIGHT,
        )


def check_key_padding(mechanism: Mechanism) -> None:
    """Padded keys and values are ignored (causal and not, self and cross, with a fully padded element)."""
    if not mechanism.capabilities.key_padding:
        expect_unsupported(mechanism, "key_padding")
        return
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        if not variant.padded:
            continue
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=5)
        what = f"{type(mechanism).__name__} {variant.describe()}"
        padding_invariance(m, qkv, variant.causal, mask, what, cross=variant.cross)


def no_lookahead(
    mechanism: Mechanism, qkv: Qkv, mask: Optional[Tensor], cut: int, what: str, seed: int = 0, cross: bool = False
) -> None:
    """With ``causal=True``, changing queries after position ``cut`` and the keys, values and padding that
    query ``cut`` may not see (bottom-right alignment) changes no output row up to ``cut``."""
    q, k, v = qkv
    q_len, k_len = q.shape[2], k.shape[2]
    expected = mechanism(q, k, v, causal=True, key_padding_mask=mask, cross=cross)
    assert_finite(expected, what)
    first_future_key = max(0, cut + 1 + k_len - q_len)
    future_q = (slice(None), slice(None), slice(cut + 1, None))
    future_kv = (slice(None), slice(None), slice(first_future_key, None))
    q2, k2, v2 = _perturb(q, future_q, seed), _perturb(k, future_kv, seed + 1), _perturb(v, future_kv, seed + 2)
    mask2 = None
    if mask is not None:
        mask2 = mask.clone()
        mask2[:, first_future_key:] = ~mask2[:, first_future_key:]
    actual = mechanism(q2, k2, v2, causal=True, key_padding_mask=mask2, cross=cross)
    assert_close(
        actual[:, :, : cut + 1],
        expected[:, :, : cut + 1],
        f"{what}: changing the future (queries > {cut}, keys >= {first_future_key}) changed output rows <= {cut}",
        **TIGHT,
    )


def check_no_lookahead(mechanism: Mechanism) -> None:
    """Causal output at a position depends on no later query, key, value or padding flag."""
    if not mechanism.capabilities.causal:
        expect_unsupported(mechanism, "causal")
        return
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        if not variant.causal:
            continue
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=6)
        for cut in sorted({0, variant.q_len // 2, max(0, variant.q_len - 2)}):
            no_lookahead(m, qkv, mask, cut, f"{type(mechanism).__name__} {variant.describe()}", cross=variant.cross)


class _Traced(torch.nn.Module):
    """A mechanism called with a key padding mask, as ``torch.jit.trace`` takes it (tensors in, tensor out)."""

    def __init__(self, mechanism: Mechanism, causal: bool) -> None:
        super().__init__()
        self.mechanism, self.causal = mechanism, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return self.mechanism(q, k, v, causal=self.causal, key_padding_mask=mask)


def check_traced_matches_eager(mechanism: Mechanism) -> None:
    """A graph traced with one padding mask gives the eager result for another: which code runs may depend on
    shapes and on which arguments are given, never on the values inside a mask (a branch on
    ``mask.any()`` would be frozen into the graph). Traced without a fully padded row, run with one."""
    if not mechanism.capabilities.key_padding:
        return
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, 7)
    q, k, v = random_qkv(mechanism, BATCH, n, n, torch.float64, seed=23)
    partly = padding_pattern(BATCH, n, fully_padded=False)
    fully = padding_pattern(BATCH, n)
    for causal in causal_settings(mechanism):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python values are expected and harmless
            traced = torch.jit.trace(_Traced(m, causal), (q, k, v, partly), check_trace=False)
        what = f"{type(mechanism).__name__} causal={causal}: traced with no fully padded row, run with one"
        with torch.no_grad():
            assert_close(traced(q, k, v, fully), call(m, (q, k, v), causal, fully), what, **TIGHT)


def check_batch_independence(mechanism: Mechanism) -> None:
    """Each batch element's output equals running it alone, and changing other elements leaves it unchanged."""
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        fullest = (mechanism.capabilities.causal, mechanism.capabilities.key_padding)
        if (variant.causal, variant.padded) not in {(causal_settings(mechanism)[0], False), fullest}:
            continue  # the plain call and the one with everything declared suffice
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=9)
        what = f"{type(mechanism).__name__} {variant.describe()}"
        together = call(m, qkv, variant.causal, mask, variant.cross)
        for b in range(BATCH):
            alone = call(
                m, tuple(t[b : b + 1] for t in qkv), variant.causal, None if mask is None else mask[b : b + 1], variant.cross
            )
            assert_close(together[b : b + 1], alone, f"{what}: batch element {b} run with the batch vs alone", **TIGHT)
        others = (slice(1, None),)
        changed = tuple(_perturb(t, others, seed=20 + i) for i, t in enumerate(qkv))
        again = call(m, changed, variant.causal, mask, variant.cross)
        assert_close(again[:1], together[:1], f"{what}: changing batch elements 1.. changed element 0", **TIGHT)


# -- gradients -----------------------------------------------------------------------------------------------
def check_gradients_finite(mechanism: Mechanism) -> None:
    """Backward gives finite gradients for q, k, v (and any parameter) in float32, for every declared variant,
    including a fully padded batch element."""
    m = as_dtype(mechanism, torch.float32)
    for variant in variants(mechanism):
        qkv, mask = variant_inputs(mechanism, variant, torch.float32, seed=10)
        qkv = tuple(t.requires_grad_() for t in qkv)
        m.zero_grad(set_to_none=True)
        out = call(m, qkv, variant.causal, mask, variant.cross)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
        (out * weights).sum().backward()
        what = f"{type(mechanism).__name__} {variant.describe()}"
        for label, t in zip("qkv", qkv):
            if t.grad is None:
                raise AssertionError(f"{what}: no gradient reached {label}")
            assert_finite(t.grad, f"{what}: gradient of {label}")
        for label, parameter in m.named_parameters():
            if parameter.grad is not None:
                assert_finite(parameter.grad, f"{what}: gradient of parameter {label}")


def _heads_split(x: Tensor) -> Tensor:
    """The same values laid out (batch, seq, heads, dim) and seen as (batch, heads, seq, dim): the
    non-contiguous tensors ``MultiHeadAttention`` passes on after splitting its projections into heads."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _every_other(x: Tensor) -> Tensor:
    """The same values at every other position of a buffer twice as long: strided along the sequence (a
    slice of a longer tensor), non-contiguous whatever the head count."""
    wide = x.new_zeros(*x.shape[:2], 2 * x.shape[2], x.shape[3])
    wide[:, :, ::2] = x
    return wide[:, :, ::2]


def check_non_contiguous_inputs(mechanism: Mechanism) -> None:
    """Inputs in the head-split layout (non-contiguous) give the same output and gradients as contiguous ones,
    for every declared variant: no ``view`` of an input that only holds for contiguous memory."""
    m = as_dtype(mechanism, torch.float64)
    # Also at 8 positions, a multiple of the usual chunk and block sizes: no padding copy hides a view there.
    for variant, layout in itertools.product(variants(mechanism) + variants(mechanism, 8), (_heads_split, _every_other)):
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=12)
        what = f"{type(mechanism).__name__} {variant.describe()} with non-contiguous q, k, v ({layout.__name__})"
        results = []
        for arrange in (lambda t: t, layout):
            leaves = tuple(arrange(t.clone()).requires_grad_() for t in qkv)
            m.zero_grad(set_to_none=True)
            try:
                out = call(m, leaves, variant.causal, mask, variant.cross)
                weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(13), dtype=out.dtype)
                (out * weights).sum().backward()
            except RuntimeError as error:
                raise AssertionError(f"{what}: {error}") from error
            results.append((out.detach(), *(t.grad for t in leaves)))
        for label, got, want in zip(("output", "gradient of q", "gradient of k", "gradient of v"), results[1],
                                    results[0]):
            if got is None or want is None:
                raise AssertionError(f"{what}: no {label}")
            assert_close(got, want, f"{what}: {label}", rtol=1e-9, atol=1e-10)


def check_gradcheck(mechanism: Mechanism) -> None:
    """float64 ``torch.autograd.gradcheck`` on small sizes: plain, causal with padding, causal cross-attention
    (each where declared)."""
    m = as_dtype(mechanism, torch.float64)
    caps = mechanism.capabilities
    n = fit(mechanism, 5)
    cases = [Variant(n, n, causal_settings(mechanism)[0], False)]
    if caps.causal or caps.key_padding:
        cases.append(Variant(n, n, caps.causal, caps.key_padding))
    if caps.cross and n > 1:
        cases.append(Variant(n - 1, n, caps.causal, caps.key_padding, cross=True))
    for variant in cases:
        q, k, v = random_qkv(mechanism, 2, variant.q_len, variant.k_len, torch.float64, seed=12)
        mask = padding_pattern(2, variant.k_len) if variant.padded else None
        inputs = tuple(t.requires_grad_() for t in (q, k, v))

        def run(q: Tensor, k: Tensor, v: Tensor, variant: Variant = variant, mask: Optional[Tensor] = mask) -> Tensor:
            return m(q, k, v, causal=variant.causal, key_padding_mask=mask, cross=variant.cross)

        try:
            # Fast mode compares random projections of the Jacobian: any wrong entry shows, at a fraction of
            # the cost of building the full Jacobian.
            torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)
        except GradcheckError as error:
            what = f"{type(mechanism).__name__} {variant.describe()}"
            raise AssertionError(f"{what}: gradcheck failed: {error}") from error


def check_gradients_match_reference(mechanism: Mechanism) -> None:
    """The gradients of q, k and v through the fast path equal those through ``reference()`` (float64): a
    hand-written or recomputing backward is held to the obviously-correct maths, causal and not."""
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        if variant.padded != mechanism.capabilities.key_padding or variant.cross:
            continue  # plain and causal self-attention, with padding where declared
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=25)
        weights = torch.randn(BATCH, mechanism.heads, variant.q_len, mechanism.head_dim,
                              generator=torch.Generator().manual_seed(26), dtype=torch.float64)
        grads = []
        for attend in (m, m.reference):
            inputs = [t.clone().requires_grad_() for t in qkv]
            (attend(*inputs, variant.causal, mask, cross=variant.cross) * weights).sum().backward()
            grads.append([t.grad for t in inputs])
        for label, fast, slow in zip("qkv", *grads):
            assert_close(fast, slow, f"{type(mechanism).__name__} {variant.describe()}: gradient of {label} against "
                                     f"reference()'s", rtol=1e-6, atol=1e-8)


# -- incremental decoding ------------------------------------------------------------------------------------
def _steps(mechanism: Mechanism, qkv: Qkv, start: int, state: object) -> Tuple[List[Tensor], object]:
    q, k, v = qkv
    outputs = []
    for t in range(start, q.shape[2]):
        out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outputs.append(out_t)
    return outputs, state


def _compare_steps(outputs: Sequence[Tensor], full: Tensor, start: int, what: str) -> None:
    for offset, out_t in enumerate(outputs):
        t = start + offset
        expected = full[:, :, t : t + 1]
        assert_close(out_t, expected, f"{what}: step output at position {t} vs the causal forward", **TIGHT)


def check_step_matches_parallel(mechanism: Mechanism) -> None:
    """``step`` from an empty state, token by token, equals the causal parallel forward."""
    if not mechanism.capabilities.recurrent_step:
        expect_unsupported(mechanism, "recurrent_step")
        return
    m = as_dtype(mechanism, torch.float64)
    qkv = random_qkv(mechanism, 2, fit(mechanism, 9), fit(mechanism, 9), torch.float64, seed=13)
    full = call(m, qkv, True, None)
    outputs, _ = _steps(m, qkv, 0, None)
    _compare_steps(outputs, full, 0, type(mechanism).__name__)


def check_prefill_then_step(mechanism: Mechanism) -> None:
    """``prefill`` on a prefix equals the causal forward on it, and stepping on from its state continues it."""
    if not mechanism.capabilities.recurrent_step:
        expect_unsupported(mechanism, "recurrent_step")
        return
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, 9)
    qkv = random_qkv(mechanism, 2, n, n, torch.float64, seed=14)
    full = call(m, qkv, True, None)
    for prefix in sorted({1, n // 2, n}):
        what = f"{type(mechanism).__name__} prefill({prefix} positions)"
        out, state = m.prefill(*(t[:, :, :prefix] for t in qkv))
        assert_close(out, full[:, :, :prefix], f"{what}: output vs the causal forward", **TIGHT)
        outputs, _ = _steps(m, qkv, prefix, state)
        _compare_steps(outputs, full, prefix, f"{what} then step")


def check_step_state_is_explicit(mechanism: Mechanism) -> None:
    """Two sequences decoded in alternation each match their own forward: no state hides on the module."""
    if not mechanism.capabilities.recurrent_step:
        expect_unsupported(mechanism, "recurrent_step")
        return
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, 6)
    streams = [random_qkv(mechanism, 2, n, n, torch.float64, seed=s) for s in (15, 16)]
    fulls = [call(m, qkv, True, None) for qkv in streams]
    states: List[object] = [None, None]
    for t in range(n):
        for i, (qkv, full) in enumerate(zip(streams, fulls)):
            q, k, v = (x[:, :, t : t + 1] for x in qkv)
            out_t, states[i] = m.step(q, k, v, states[i])
            assert_close(
                out_t,
                full[:, :, t : t + 1],
                f"{type(mechanism).__name__}: stream {i} at position {t}, decoded alternately with another stream",
                **TIGHT,
            )


def check_step_state_batch_first(mechanism: Mechanism) -> None:
    """Every tensor in a decoding state has the batch as its first dim, so ``select_batch`` (beam search)
    can reorder and repeat sequences and decoding continues correctly."""
    if not mechanism.capabilities.recurrent_step:
        expect_unsupported(mechanism, "recurrent_step")
        return
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, 7)
    batch = 3 if mechanism.heads != 3 else 4  # differs from heads, so a heads-first state shows
    qkv = random_qkv(mechanism, batch, n, n, torch.float64, seed=17)
    full = call(m, qkv, True, None)
    prefix = max(1, n // 2)
    name = type(mechanism).__name__
    for label, state in (
        ("prefill", m.prefill(*(t[:, :, :prefix] for t in qkv))[1]),
        ("step", _steps(m, tuple(t[:, :, :prefix] for t in qkv), 0, None)[1]),
    ):
        for tensor in state_tensors(state):
            if tensor.dim() == 0 or tensor.shape[0] != batch:
                raise AssertionError(
                    f"{name}: a state tensor from {label} has shape {tuple(tensor.shape)}; every state tensor must "
                    f"have the batch ({batch}) as its first dim"
                )
        index = torch.tensor([2, 0, 0, 1])
        try:
            chosen = select_batch(state, index)
            outputs, _ = _steps(m, tuple(t[index] for t in qkv), prefix, chosen)
        except Exception as error:
            raise AssertionError(
                f"{name}: decoding after select_batch(state from {label}, {index.tolist()}) raised "
                f"{type(error).__name__}: {error}"
            ) from error
        _compare_steps(outputs, full[index], prefix, f"{name}: after select_batch(state from {label})")


class _CallCounter:
    """Counts calls of the given functions while active (by code object, so imports by name count too)."""

    def __init__(self, *functions: Callable) -> None:
        self.codes = {f.__code__: f.__name__ for f in functions}
        self.counts: Dict[str, int] = collections.Counter()

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code in self.codes:
            self.counts[self.codes[frame.f_code]] += 1

    def __enter__(self) -> "_CallCounter":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def check_inputs_validated_once(mechanism: Mechanism) -> None:
    """``forward`` and ``step`` check q, k, v and the padding mask once, at the entry point: the functional
    cores a mechanism calls after :meth:`Mechanism.check_inputs` are their unchecked forms."""
    validators = (_validation.check_qkv, _validation.check_key_padding_mask)
    for variant in variants(mechanism):
        qkv, mask = variant_inputs(mechanism, variant, torch.float32, seed=31)
        with _CallCounter(*validators) as counter:
            call(mechanism, qkv, variant.causal, mask, variant.cross)
        for name in ("check_qkv", "check_key_padding_mask"):
            if counter.counts[name] != 1:
                raise AssertionError(
                    f"{mechanism.name}: {variant.describe()}: {name} ran {counter.counts[name]} times in one "
                    "forward; validate once at the entry point and call the functional core's unchecked form"
                )
    if mechanism.capabilities.recurrent_step:
        q, k, v = random_qkv(mechanism, BATCH, 2, 2, torch.float32, seed=32)
        _, state = mechanism.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
        with _CallCounter(*validators) as counter:
            mechanism.step(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], state)
        if counter.counts["check_qkv"] != 1:
            raise AssertionError(
                f"{mechanism.name}: check_qkv ran {counter.counts['check_qkv']} times in one step; validate once"
            )


def check_step_refuses_foreign_state(mechanism: Mechanism) -> None:
    """``step`` refuses, with an error naming ``state``, a state it cannot continue: one made for another
    batch size (never broadcast), by another mechanism, of another layout (heads, widths), or not a
    DecodingState at all."""
    if not mechanism.capabilities.recurrent_step:
        expect_unsupported(mechanism, "recurrent_step")
        return
    m = as_dtype(mechanism, torch.float64)
    n = fit(mechanism, 4)
    q, k, v = random_qkv(mechanism, 3, n, n, torch.float64, seed=22)
    _, state = m.prefill(q[:1], k[:1], v[:1])
    step_inputs = tuple(t[:, :, :1] for t in (q, k, v))
    one = tuple(t[:1] for t in step_inputs)
    name = type(mechanism).__name__

    def widened(t: Tensor) -> Tensor:
        return torch.cat([t, t], dim=1) if t.dim() > 1 else t

    foreign: List[Tuple[str, object, Tuple[Tensor, ...]]] = [
        ("a batch-1 state for a batch-3 step", state, step_inputs),
        ("a plain dict", dict(state.tensors) if isinstance(state, DecodingState) else {}, one),
        ("a state of another mechanism", _replace_state(state, mechanism="another-mechanism"), one),
        ("a state with every tensor's heads doubled", _replace_state(state, tensors=map_tensors(state.tensors, widened)), one),
        ("a state with a tensor missing", _replace_state(state, tensors=dict(list(state.tensors.items())[1:])), one),
    ]
    for label, bad_state, inputs in foreign:
        expect_error(lambda: m.step(*inputs, bad_state), (TypeError, ValueError), r"\bstate\b", f"{name}.step with {label}")


def _replace_state(state: object, **changes: Any) -> object:
    if not isinstance(state, DecodingState):
        raise AssertionError(f"prefill returned a {type(state).__name__}, not a DecodingState")
    return dataclasses.replace(state, **changes)


# -- exactness, limits, bad input ----------------------------------------------------------------------------
def check_matches_reference(mechanism: Mechanism) -> None:
    """The fast path equals the mechanism's own float64 quadratic ``reference`` in every declared variant
    (float64 tightly, float32 within rounding), and a mechanism declaring kind="exact" has a reference
    equal to exact softmax attention."""
    for variant in variants(mechanism):
        for dtype in (torch.float64, torch.float32):
            m = as_dtype(mechanism, dtype)
            qkv, mask = variant_inputs(mechanism, variant, dtype, seed=18)
            out = call(m, qkv, variant.causal, mask, variant.cross)
            what = f"{type(mechanism).__name__} {dtype} {variant.describe()}"
            assert_finite(out, what)
            with torch.no_grad():
                expected = m.reference(*qkv, variant.causal, mask, cross=variant.cross)
            if expected.dtype != torch.float64:
                raise AssertionError(f"{what}: reference() returned {expected.dtype}, expected float64")
            tolerance = TIGHT if dtype == torch.float64 else FLOAT32
            assert_close(out.double(), expected, f"{what}: differs from its own float64 reference()", **tolerance)
            if mechanism.capabilities.exact:
                exact = softmax_attention_reference(*qkv, variant.causal, mask)
                assert_close(
                    expected,
                    exact,
                    f"{what}: declares kind='exact', i.e. that it computes exact softmax attention, but its "
                    f"reference differs from softmax_attention_reference",
                    **TIGHT,
                )


# float64 inputs on a float32 module against its own reference: float64 rounding only.
FLOAT64_INPUTS = {"rtol": 1e-12, "atol": 1e-12}


def check_float64_inputs_on_float32_module(mechanism: Mechanism) -> None:
    """float64 inputs on a module whose parameters and buffers are float32: the output is float64 and equals
    the module's own ``reference`` (float64 from the same float32 values) to float64 rounding, in every
    declared variant. What it catches: a parameter used in its own float32 arithmetic on the way (a learned
    scalar computed in float32), which leaves a float32 rounding error in a float64 result."""
    m = as_dtype(mechanism, torch.float32)
    for variant in variants(mechanism):
        qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=19)
        what = f"{type(mechanism).__name__} float32 module, float64 inputs, {variant.describe()}"
        out = call(m, qkv, variant.causal, mask, variant.cross)
        if out.dtype != torch.float64:
            raise AssertionError(f"{what}: output dtype {out.dtype}, expected the input dtype torch.float64")
        with torch.no_grad():
            expected = m.reference(*qkv, variant.causal, mask, cross=variant.cross)
        assert_close(out, expected, f"{what}: differs from its own float64 reference()", **FLOAT64_INPUTS)


def check_value_width(mechanism: Mechanism) -> None:
    """v with another head dim than q and k (capability ``any_value_width``; a mechanism without it is held to
    refusing such v by :func:`check_unsupported_options`): the output has v's width in every declared variant,
    equal to the mechanism's float64 reference, and ``step`` decodes it as the causal forward does, from the
    start, after ``prefill``, and with grouped key/value heads where they are shared natively."""
    if not mechanism.capabilities.any_value_width:
        return
    width = mechanism.head_dim + 3
    m = as_dtype(mechanism, torch.float64)
    what = f"{type(mechanism).__name__} with v of head_dim + 3 = {width} channels"
    for variant in variants(mechanism):
        (q, k, v), mask = variant_inputs(mechanism, variant, torch.float64, seed=31)
        wide = (q, k, widened_values(v, width, seed=32))
        out = _declared_to_work(lambda: call(m, wide, variant.causal, mask, variant.cross),
                                f"{what}, {variant.describe()}")
        if not isinstance(out, Tensor) or out.shape[:3] != q.shape[:3] or out.shape[3] != width:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise AssertionError(f"{what}, {variant.describe()}: output shape {shape}, expected "
                                 f"{(*q.shape[:3], width)}")
        with torch.no_grad():
            expected = m.reference(*wide, variant.causal, mask, cross=variant.cross)
        assert_close(out, expected, f"{what}, {variant.describe()}: differs from its float64 reference()", **TIGHT)
    if not mechanism.capabilities.recurrent_step:
        return
    n = fit(mechanism, 9)
    q, k, v = random_qkv(mechanism, 2, n, n, torch.float64, seed=33)
    wide = (q, k, widened_values(v, width, seed=34))
    full = call(m, wide, True, None)
    outputs, _ = _declared_to_work(lambda: _steps(m, wide, 0, None), f"{what}, step by step")
    _compare_steps(outputs, full, 0, what)
    prefix = max(1, n // 2)
    out, state = _declared_to_work(lambda: m.prefill(*(t[:, :, :prefix] for t in wide)), f"{what}, prefill")
    assert_close(out, full[:, :, :prefix], f"{what}: prefill vs the causal forward", **TIGHT)
    outputs, _ = _declared_to_work(lambda: _steps(m, wide, prefix, state), f"{what}, prefill then step")
    _compare_steps(outputs, full, prefix, f"{what}, prefill then step")
    if mechanism.heads > 1 and mechanism.capabilities.grouped_kv == NATIVE_KV:
        grouped = (q, k[:, :1], wide[2][:, :1])
        label = f"{what}, one key/value head"
        outputs, _ = _declared_to_work(lambda: _steps(m, grouped, 0, None), f"{label}, step by step")
        _compare_steps(outputs, call(m, grouped, True, None), 0, label)


def _declared_to_work(action: Callable[[], Any], what: str) -> Any:
    """``action()``, any error it raises reported as the declared capability's failure."""
    try:
        return action()
    except Exception as error:
        raise AssertionError(f"{what}: declares any_value_width=True, but raised {type(error).__name__}: "
                             f"{error}") from error


# Beyond this a rejected length would cost too much memory to build; such limits are effectively None.
_LARGEST_CHECKED_LIMIT = 1 << 16


def check_max_length(mechanism: Mechanism) -> None:
    """A sequence longer than ``max_length`` raises ValueError naming it; the limit itself (or, without one,
    a few hundred positions) runs."""
    limit = mechanism.max_length
    m = as_dtype(mechanism, torch.float32)
    name = type(mechanism).__name__
    if limit is None or limit > _LARGEST_CHECKED_LIMIT:
        n = 257
        out = m(*random_qkv(mechanism, 1, n, n, torch.float32, seed=19), causal=causal_settings(mechanism)[0])
        assert_finite(out, f"{name} (no max_length) at length {n}")
        return
    over = random_qkv(mechanism, 1, limit + 1, limit + 1, torch.float32, seed=19)
    expect_error(
        lambda: m(*over), ValueError, r"max_length", f"{name}: sequence length {limit + 1} > max_length={limit}"
    )
    if mechanism.capabilities.cross:
        q = over[0][:, :, :1]
        expect_error(
            lambda: m(q, over[1], over[2], cross=True),
            ValueError,
            r"max_length",
            f"{name}: key length {limit + 1} > max_length={limit}",
        )
    if limit <= 512:
        out = m(*(t[:, :, :limit] for t in over))
        assert_finite(out, f"{name} at length max_length={limit}")


def check_bad_input(mechanism: Mechanism) -> None:
    """Malformed input raises a clear exception naming the argument, never silent broadcasting."""
    m = as_dtype(mechanism, torch.float32)
    n = fit(mechanism, 6)
    h, d = mechanism.heads, mechanism.head_dim
    q, k, v = random_qkv(mechanism, 2, n, n, torch.float32, seed=21)
    mask = torch.zeros(2, n, dtype=torch.bool)
    pad = mask if mechanism.capabilities.key_padding else None
    randn = torch.randn

    cases: List[Tuple[str, Callable[[], object], Tuple[Type[BaseException], ...], str]] = [
        ("q of rank 3", lambda: m(q[:, 0], k, v), (ValueError,), r"\bq\b"),
        ("k of rank 5", lambda: m(q, k[None], v), (ValueError,), r"\bk\b"),
        ("v of rank 3", lambda: m(q, k, v[:, 0]), (ValueError,), r"\bv\b"),
        ("heads + 1 in q, k, v", lambda: m(randn(2, h + 1, n, d), randn(2, h + 1, n, d), randn(2, h + 1, n, d)),
         (ValueError,), r"heads"),
        ("head_dim + 1 in q, k, v", lambda: m(randn(2, h, n, d + 1), randn(2, h, n, d + 1), randn(2, h, n, d + 1)),
         (ValueError,), r"head_dim"),
        ("k with another head_dim than q", lambda: m(q, randn(2, h, n, d + 1), v), (ValueError,), r"head_dim"),
        ("v with another length than k", lambda: m(q, k, randn(2, h, n + 1, d)), (ValueError,), r"\bv\b"),
        ("k, v with another batch than q", lambda: m(q, k[:1], v[:1]), (ValueError,), r"batch"),
        ("k of another dtype", lambda: m(q, k.double(), v), (TypeError,), r"dtype"),
        ("integer q", lambda: m(q.long(), k, v), (TypeError,), r"\bq\b"),
        ("zero-length sequence", lambda: m(q[:, :, :0], k[:, :, :0], v[:, :, :0]), (ValueError,), r"seq|length"),
        ("key_padding_mask of shape (batch, seq_kv + 1)",
         lambda: m(q, k, v, key_padding_mask=torch.zeros(2, n + 1, dtype=torch.bool)),
         (ValueError, TypeError), r"key_padding_mask"),
        ("key_padding_mask of shape (batch + 1, seq_kv)",
         lambda: m(q, k, v, key_padding_mask=torch.zeros(3, n, dtype=torch.bool)),
         (ValueError, TypeError), r"key_padding_mask"),
        ("float key_padding_mask", lambda: m(q, k, v, key_padding_mask=torch.zeros(2, n)),
         (ValueError, TypeError), r"key_padding_mask"),
        ("key_padding_mask given as a list", lambda: m(q, k, v, key_padding_mask=[[False] * n] * 2),
         (ValueError, TypeError), r"key_padding_mask"),
    ]
    # Yes/no arguments must be bools: "no", None or 2 read as truthy would switch behaviour on silently.
    for value in ("no", "False", None, 1, 2):
        cases.append((f"causal={value!r}", lambda value=value: m(q, k, v, causal=value), (TypeError,), r"\bcausal\b"))
        cases.append((f"cross={value!r}", lambda value=value: m(q, k, v, cross=value), (TypeError,), r"\bcross\b"))
    if pad is not None:
        cases.append(
            ("q of rank 3 with a mask", lambda: m(q[:, 0], k, v, key_padding_mask=pad), (ValueError,), r"\bq\b")
        )
    if mechanism.capabilities.recurrent_step and n > 1:
        cases += [
            ("step with two positions", lambda: m.step(q[:, :, :2], k[:, :, :2], v[:, :, :2], None), (ValueError,),
             r"step|position|seq"),
            ("step with q_t of rank 3", lambda: m.step(q[:, 0, :1], k[:, :, :1], v[:, :, :1], None), (ValueError,),
             r"\bq"),
        ]
    name = type(mechanism).__name__
    for label, action, errors, pattern in cases:
        expect_error(action, errors, pattern, f"{name}: {label}")


# -- property-test cases -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One randomly drawn call: sizes, causality, a padding pattern (True = padding) and a look-ahead cut."""

    batch: int
    heads: int
    q_len: int
    k_len: int
    causal: bool
    padding: Optional[Tuple[Tuple[bool, ...], ...]]
    cut: int
    seed: int
    cross: bool = False

    def mask(self) -> Optional[Tensor]:
        if self.padding is None:
            return None
        return torch.tensor(self.padding, dtype=torch.bool).view(self.batch, self.k_len)

    def describe(self) -> str:
        # Padding rows drawn as strings, x = padded: "x..x."
        rows = None if self.padding is None else ["".join("x" if p else "." for p in row) for row in self.padding]
        return (
            f"batch={self.batch} heads={self.heads} q_len={self.q_len} k_len={self.k_len} causal={self.causal} "
            f"cross={self.cross} padding={rows}"
        )


def case_inputs(mechanism: Mechanism, case: Case, dtype: torch.dtype) -> Qkv:
    return random_qkv(mechanism, case.batch, case.q_len, case.k_len, dtype, seed=case.seed)


def check_case_finite(mechanism: Mechanism, case: Case) -> None:
    """float32 output of the right shape and finite, also for rows with no visible key (fully padded, or
    causal rows before the first key)."""
    m = as_dtype(mechanism, torch.float32)
    out = call(m, case_inputs(mechanism, case, torch.float32), case.causal, case.mask(), case.cross)
    expected = (case.batch, case.heads, case.q_len, mechanism.head_dim)
    if tuple(out.shape) != expected:
        raise AssertionError(
            f"{type(mechanism).__name__} {case.describe()}: output shape {tuple(out.shape)}, expected {expected}"
        )
    assert_finite(out, f"{type(mechanism).__name__} {case.describe()}")


def check_case_padding_invariance(mechanism: Mechanism, case: Case) -> None:
    """Changing the keys and values the case's padding marks changes no output (float64)."""
    if case.padding is None:
        raise ValueError("a padding-invariance case needs a padding pattern")
    m = as_dtype(mechanism, torch.float64)
    qkv = case_inputs(mechanism, case, torch.float64)
    what = f"{type(mechanism).__name__} {case.describe()}"
    padding_invariance(m, qkv, case.causal, case.mask(), what, seed=case.seed, cross=case.cross)


def check_case_no_lookahead(mechanism: Mechanism, case: Case) -> None:
    """Causal output rows up to ``case.cut`` ignore everything after it (float64)."""
    if not case.causal:
        raise ValueError("a look-ahead case must be causal")
    m = as_dtype(mechanism, torch.float64)
    qkv = case_inputs(mechanism, case, torch.float64)
    what = f"{type(mechanism).__name__} {case.describe()} cut={case.cut}"
    no_lookahead(m, qkv, case.mask(), case.cut, what, seed=case.seed, cross=case.cross)


# -- a sequence padded into a batch --------------------------------------------------------------------------
# The same sequence padded or alone: only rounding differs (chunk or block boundaries may move with padding).
PADDED_ALONE = {"rtol": 1e-10, "atol": 1e-10}


def padded_alone_lengths(mechanism: Mechanism) -> Optional[Tuple[int, int]]:
    """(real length, padding) both legal alone and together: the padding a multiple of ``length_multiple``,
    the padded row within ``max_length``. Without a multiple: 7 real positions (a partial block for most block
    sizes) and 5 padded ones (shifting most block grids off their boundaries). None if no padding fits."""
    multiple = mechanism.capabilities.length_multiple or 1
    limit = mechanism.max_length
    pad = multiple * -(-5 // multiple)
    n = multiple * -(-7 // multiple)
    if limit is not None and n + pad > limit:
        pad = multiple
        n = (limit - pad) // multiple * multiple
    return (n, pad) if n >= 1 else None


def _garbage(x: Tensor, padded: Tensor, seed: int) -> Tensor:
    """``x`` with its padded positions (``padded``: (batch, seq) bool) holding huge values, and NaN at every
    other padded position."""
    generator = torch.Generator().manual_seed(seed)
    huge = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.dtype) * 1e6
    huge[:, :, 1::2] = float("nan")
    return torch.where(padded[:, None, :, None], huge, x)


def check_padded_like_alone(mechanism: Mechanism) -> None:
    """A sequence padded on the right, or on the left, gives at its real positions the output it gives alone
    (float64, causal and not as declared), whatever the padded positions of q, k and v hold (huge values,
    NaN): its output does not depend on the batch it is padded into. Against the sequence alone on the sides
    ``Capabilities.padding_invariance`` promises; on every side, the garbage against zeros in the padding
    (what a padded position holds never reaches a real one). One batch: the sequence padded on the right, the
    same padded on the left, and a longer sequence with no padding. The forward and ``reference()`` alike."""
    caps = mechanism.capabilities
    if not caps.key_padding:
        return
    lengths = padded_alone_lengths(mechanism)
    if lengths is None:
        return
    n, pad = lengths
    m = as_dtype(mechanism, torch.float64)
    generator = torch.Generator().manual_seed(31)
    draw = lambda length: torch.randn(1, m.heads, length, m.head_dim, generator=generator,  # noqa: E731
                                      dtype=torch.float64)
    alone, other = [draw(n) for _ in range(3)], [draw(n + pad) for _ in range(3)]
    sides = {"right": slice(0, n), "left": slice(pad, n + pad)}  # the sequence's positions in rows 0 and 1
    mask = torch.ones(3, n + pad, dtype=torch.bool)
    for row, real in enumerate(sides.values()):
        mask[row, real] = False
    mask[2] = False
    zeros = []
    for x, y in zip(alone, other):
        padded = x.new_zeros(2, m.heads, n + pad, m.head_dim)
        for row, real in enumerate(sides.values()):
            padded[row, :, real] = x[0]
        zeros.append(torch.cat([padded, y]))
    garbage = [_garbage(x, mask, seed=40 + i) for i, x in enumerate(zeros)]
    promised = PADDED_SIDES[caps.padding_invariance]
    for causal, (label, run) in itertools.product(causal_settings(mechanism),
                                                  [("forward", m), ("reference()", m.reference)]):
        with torch.no_grad():
            expected, expected_other = run(*alone, causal=causal), run(*other, causal=causal)
            out = run(*garbage, causal=causal, key_padding_mask=mask)
            clean = run(*zeros, causal=causal, key_padding_mask=mask)
        where = f"{type(mechanism).__name__} {label} causal={causal}"
        assert_close(out[2:], expected_other, f"{where}: a sequence of {n + pad} beside padded ones differs from it "
                     f"alone", **PADDED_ALONE)
        for row, (side, real) in enumerate(sides.items()):
            what = f"{where}: a sequence of {n} padded by {pad} on the {side} (huge values and NaN in the padding)"
            actual = out[row : row + 1, :, real]
            assert_close(actual, clean[row : row + 1, :, real], f"{what}: differs from it with zeros in the padding",
                         **PADDED_ALONE)
            if side in promised:
                assert_close(actual, expected, f"{what}: differs from the sequence alone (padding_invariance="
                             f"{caps.padding_invariance!r} promises the {side})", **PADDED_ALONE)

# -- training hooks ------------------------------------------------------------------------------------------
def _training_forward(mechanism: Mechanism, dtype: torch.dtype, seed: int, copy_of: Optional[Mechanism] = None
                      ) -> Tuple[Mechanism, Qkv]:
    """A training-mode copy of ``mechanism`` in ``dtype`` (or ``copy_of`` itself, as it is) after one forward on
    inputs that require grad, as a training step makes it: (the copy, the inputs)."""
    m = as_dtype(mechanism, dtype).train() if copy_of is None else copy_of
    variant = variants(mechanism)[0]
    qkv, mask = variant_inputs(mechanism, variant, dtype, seed=seed)
    qkv = tuple(t.requires_grad_() for t in qkv)
    call(m, qkv, variant.causal, mask, variant.cross)
    return m, qkv


def check_auxiliary_loss(mechanism: Mechanism) -> None:
    """After a training-mode forward, ``auxiliary_loss()`` is None or a finite real scalar tensor of the forward's
    dtype with a gradient path to the inputs or parameters that produced it, and it is taken: a second call
    returns None (a loss added twice, or a graph kept past its step, would follow otherwise)."""
    for dtype in (torch.float32, torch.float64):
        m, qkv = _training_forward(mechanism, dtype, seed=40)
        loss = m.auxiliary_loss()
        if loss is None:
            continue
        what = f"{type(mechanism).__name__} {dtype}: auxiliary_loss()"
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise AssertionError(f"{what} must be None or a scalar tensor, got {shape}")
        if loss.dtype != dtype:
            raise AssertionError(f"{what} is {loss.dtype}, expected the forward's dtype {dtype}")
        assert_finite(loss, what)
        sources = [*qkv, *(p for p in m.parameters() if p.requires_grad)]
        gradients = torch.autograd.grad(loss, sources, allow_unused=True) if loss.requires_grad else []
        if all(gradient is None for gradient in gradients):
            raise AssertionError(f"{what} has no gradient path to the inputs or parameters of the forward that "
                                 f"set it: training could not lower it")
        for gradient in gradients:
            if gradient is not None:
                assert_finite(gradient, f"{what}'s gradient")
        if m.auxiliary_loss() is not None:
            raise AssertionError(f"{what} gave a loss twice: a second call must return None until the next "
                                 f"training-mode forward")


def check_after_optimizer_step(mechanism: Mechanism) -> None:
    """``after_optimizer_step(step, seed)`` between training-mode forwards is deterministic given its arguments,
    whatever the global generator holds: two copies stepped alike have equal state dicts. It keeps every state
    entry's shape, dtype and device and the forward's output shape and dtype, and refuses a step or seed that
    is not an int >= 0, naming it."""
    name = type(mechanism).__name__
    stepped = []
    for global_seed in (1, 2):  # the copies differ only in the global generator's state
        m = as_dtype(mechanism, torch.float64).train()
        layout = {key: (value.shape, value.dtype, value.device) for key, value in m.state_dict().items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(global_seed)
            for step in range(2):
                _training_forward(mechanism, torch.float64, seed=41 + step, copy_of=m)
                m.auxiliary_loss()  # taken by the step, as a training loop does
                m.after_optimizer_step(step, 7)
        after = {key: (value.shape, value.dtype, value.device) for key, value in m.state_dict().items()}
        if after != layout:
            changed = sorted(key for key in set(layout) | set(after) if layout.get(key) != after.get(key))
            raise AssertionError(f"{name}: after_optimizer_step changed the shape, dtype or device of {changed}")
        stepped.append(m.state_dict())
    for key, value in stepped[0].items():
        if not torch.equal(value, stepped[1][key]):
            raise AssertionError(f"{name}: two copies given after_optimizer_step(step, seed=7) alike differ in "
                                 f"{key!r}: the update must draw from (step, seed), not the global generator")
    m.eval()
    variant = variants(mechanism)[0]
    qkv, mask = variant_inputs(mechanism, variant, torch.float64, seed=42)
    out = call(m, qkv, variant.causal, mask, variant.cross)
    if tuple(out.shape) != (BATCH, mechanism.heads, variant.q_len, mechanism.head_dim) or out.dtype != torch.float64:
        raise AssertionError(f"{name}: after after_optimizer_step the forward gives {tuple(out.shape)} "
                             f"{out.dtype}, expected the input's shape and dtype")
    expect_error(lambda: m.after_optimizer_step(-1, 0), ValueError, "step", f"{name}.after_optimizer_step(-1, 0)")
    expect_error(lambda: m.after_optimizer_step(0, 1.5), TypeError, "seed", f"{name}.after_optimizer_step(0, 1.5)")


def check_data_parallel_reasons(mechanism: Mechanism) -> None:
    """``data_parallel_reasons()`` is a list of reasons, each a non-empty string naming the mechanism (empty:
    it trains data-parallel)."""
    reasons = mechanism.data_parallel_reasons()
    what = f"{type(mechanism).__name__}.data_parallel_reasons()"
    if not isinstance(reasons, list):
        raise AssertionError(f"{what} must return a list of strings, got {type(reasons).__name__}")
    for reason in reasons:
        if not isinstance(reason, str) or not reason.strip() or mechanism.name not in reason:
            raise AssertionError(f"{what}: every reason must be a non-empty string naming the mechanism "
                                 f"{mechanism.name!r}, got {reason!r}")


def check_logit_scale(mechanism: Mechanism) -> None:
    """A mechanism declaring a ``scale_option`` built with it reports it (:meth:`Mechanism.logit_scale`, which
    the drop-in reads), and its output follows it: with scale ``s`` it equals, for dot-product logits, the
    output at the default scale of queries times ``s * sqrt(head_dim)``."""
    option = mechanism.capabilities.scale_option
    if option is None:
        if mechanism.logit_scale() is not None:
            raise AssertionError(f"{mechanism.name}: logit_scale() is {mechanism.logit_scale()!r} without a "
                                 f"declared scale_option")
        return
    cls = type(mechanism)

    def built(scale: Optional[float]) -> Mechanism:  # the class's test options, one seed: equal parameters
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            made = cls(mechanism.heads, mechanism.head_dim, **{**dict(cls.test_options), option: scale})
        return made.double().eval()

    scaled = built(0.7)
    if scaled.logit_scale() != 0.7:
        raise AssertionError(f"{mechanism.name}: built with {option}=0.7, logit_scale() gives "
                             f"{scaled.logit_scale()!r}")
    if not mechanism.capabilities.dot_product_logits:
        return
    plain = built(None)
    q, k, v = random_qkv(plain, BATCH, SEQ, SEQ, torch.float64, seed=41)
    causal = causal_settings(plain)[0]
    with torch.no_grad():
        expected = plain(q * 0.7 * math.sqrt(q.shape[-1]), k, v, causal=causal)
        assert_close(scaled(q, k, v, causal=causal), expected, f"{mechanism.name} with {option}=0.7: not the scaled "
                     f"logits", **TIGHT)


def check_attention_weights(mechanism: Mechanism) -> None:
    """A mechanism declaring ``attention_weights`` gives weights that are what its output mixes the values with
    (weights @ v equals the forward output, in every variant), that hide padded keys whatever they hold, and
    that take an additive bias on the logits (-inf hides a key as padding does); one that does not refuses,
    naming the capability."""
    if not mechanism.capabilities.attention_weights:
        q, k, _ = random_qkv(mechanism, BATCH, SEQ, SEQ, torch.float32, seed=42)
        expect_error(lambda: mechanism.attention_weights(q, k), UnsupportedOptionError, "attention_weights",
                     f"{mechanism.name}: attention_weights() without the capability")
        return
    m = as_dtype(mechanism, torch.float64)
    for variant in variants(mechanism):
        (q, k, v), mask = variant_inputs(mechanism, variant, torch.float64, seed=43)
        what = f"{mechanism.name} {variant.describe()}"
        with torch.no_grad():
            out = call(m, (q, k, v), variant.causal, mask, variant.cross)
            weights = m.attention_weights(q, k, mask, causal=variant.causal)
            values = v if mask is None else v.masked_fill(mask[:, None, :, None], 0.0)
            if weights.shape[1] != v.shape[1]:
                values = values.repeat_interleave(weights.shape[1] // v.shape[1], dim=1)
            assert_close(weights @ values, out, f"{what}: attention_weights() @ v is not the output", **TIGHT)
            if mask is not None:
                bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask, -math.inf)[:, None, None, :]
                assert_close(m.attention_weights(q, k, causal=variant.causal, bias=bias), weights,
                             f"{what}: an additive -inf bias does not hide keys as padding does", **TIGHT)


def check_causal_rows(mechanism: Mechanism) -> None:
    """A mechanism declaring ``causal_rows`` gives, causally, the same last rows whatever the earlier queries
    hold (zeros, as a decoder over a cache passes them)."""
    if not (mechanism.capabilities.causal_rows and mechanism.capabilities.causal):
        return  # an option that switched the causal form off leaves no causal rows (the class needs one)
    m = as_dtype(mechanism, torch.float64)
    q, k, v = random_qkv(mechanism, BATCH, SEQ, SEQ, torch.float64, seed=44)
    new = 3
    zeroed = torch.cat([torch.zeros_like(q[:, :, :-new]), q[:, :, -new:]], dim=2)
    with torch.no_grad():
        assert_close(m(zeroed, k, v, causal=True)[:, :, -new:], m(q, k, v, causal=True)[:, :, -new:],
                     f"{mechanism.name}: declares causal_rows, but its last causal rows depend on earlier queries",
                     **TIGHT)



#: Every instance-level check, in the order a failure is easiest to read.
INSTANCE_CHECKS: Tuple[Callable[[Mechanism], None], ...] = (
    check_output_shape_and_dtype,
    check_unsupported_options,
    check_bad_input,
    check_max_length,
    check_deterministic,
    check_output_depends_on_values,
    check_key_padding,
    check_padded_like_alone,
    check_no_lookahead,
    check_batch_independence,
    check_traced_matches_eager,
    check_matches_reference,
    check_float64_inputs_on_float32_module,
    check_value_width,
    check_logit_scale,
    check_attention_weights,
    check_causal_rows,
    check_low_precision,
    check_gradients_finite,
    check_non_contiguous_inputs,
    check_gradcheck,
    check_gradients_match_reference,
    check_step_matches_parallel,
    check_prefill_then_step,
    check_step_state_is_explicit,
    check_step_state_batch_first,
    check_step_refuses_foreign_state,
    check_inputs_validated_once,
    check_auxiliary_loss,
    check_after_optimizer_step,
    check_data_parallel_reasons,
)

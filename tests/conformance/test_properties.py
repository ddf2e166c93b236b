"""Property-based conformance (hypothesis) over random sizes, causality and padding patterns.

Lengths run from 1 to 37 (most are multiples of no block size), batch sizes and head counts from 1 to 3,
padding patterns are arbitrary, fully padded rows included. Derandomized, so every run draws the same
examples.
"""

from functools import lru_cache
from typing import List, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms import Capabilities

from . import checks
from .checks import Case

LONGEST = 37

PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def padding_rows(k_len: int) -> st.SearchStrategy[List[bool]]:
    """One row of a key padding mask: arbitrary, or padded on the right or left (up to entirely)."""
    return st.one_of(
        st.lists(st.booleans(), min_size=k_len, max_size=k_len),
        st.integers(0, k_len).map(lambda n: [False] * (k_len - n) + [True] * n),
        st.integers(0, k_len).map(lambda n: [True] * n + [False] * (k_len - n)),
    )


@st.composite
def cases(
    draw: st.DrawFn,
    caps: Capabilities,
    max_length: Optional[int],
    *,
    causal: Optional[bool] = None,
    padded: Optional[bool] = None,
) -> Case:
    """Random calls a mechanism with ``caps`` accepts. ``causal`` / ``padded``: force on (True) or off (False);
    None draws either where declared."""
    longest = LONGEST if max_length is None else min(LONGEST, max_length)
    batch = draw(st.integers(1, 3), label="batch")
    heads = draw(st.integers(1, 3), label="heads")
    q_len = draw(st.integers(1, longest), label="q_len")
    cross = draw(st.booleans(), label="cross") if caps.cross else False
    k_len = draw(st.integers(1, longest), label="k_len") if cross else q_len
    if causal is None:
        causal = draw(st.booleans(), label="causal") if caps.causal and caps.non_causal else caps.causal
    if padded is None:
        padded = draw(st.booleans(), label="padded") if caps.key_padding else False
    padding = None
    if padded:
        padding = tuple(tuple(draw(padding_rows(k_len), label="padding row")) for _ in range(batch))
    cut = draw(st.integers(0, q_len - 1), label="cut")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    return Case(batch, heads, q_len, k_len, causal, padding, cut, seed, cross)


@lru_cache(maxsize=None)
def max_length(name: str) -> Optional[int]:
    return checks.build(name, heads=1).max_length


def _names(capability: Optional[str] = None) -> List[str]:
    return [n for n in attnzoo.available() if capability is None or getattr(attnzoo.capabilities(n), capability)]


@pytest.mark.parametrize("name", _names())
@PROPERTY_SETTINGS
@given(data=st.data())
def test_output_finite_for_any_sizes_and_padding(name, data):
    case = data.draw(cases(attnzoo.capabilities(name), max_length(name)), label="case")
    checks.check_case_finite(checks.build(name, heads=case.heads, dtype=torch.float32, seed=case.seed), case)


@pytest.mark.parametrize("name", _names("key_padding"))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_padded_keys_are_ignored(name, data):
    case = data.draw(cases(attnzoo.capabilities(name), max_length(name), padded=True), label="case")
    checks.check_case_padding_invariance(checks.build(name, heads=case.heads, seed=case.seed), case)


@pytest.mark.parametrize("name", _names("causal"))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_causal_has_no_lookahead(name, data):
    case = data.draw(cases(attnzoo.capabilities(name), max_length(name), causal=True), label="case")
    checks.check_case_no_lookahead(checks.build(name, heads=case.heads, seed=case.seed), case)

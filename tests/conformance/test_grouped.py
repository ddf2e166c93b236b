"""Every registered mechanism (and its declared variants) against the grouped-query contract
(:mod:`.grouped_checks`), built with four query heads and given two key/value heads."""

import pytest

import attnzoo
from attnzoo.mechanisms import mechanism_class

from . import checks
from .grouped_checks import GROUPED_HEADS, check_grouped

MECHANISMS = attnzoo.available()
CASES = [(name, None) for name in MECHANISMS] + [
    (name, options) for name in MECHANISMS for options in mechanism_class(name).test_variants
]


@pytest.mark.parametrize(
    "name, options", CASES,
    ids=[n + ("" if o is None else "-" + "-".join(f"{k}={v}" for k, v in o.items())) for n, o in CASES],
)
def test_grouped_query_attention(name, options):
    check_grouped(checks.build(name, heads=GROUPED_HEADS, options=options))

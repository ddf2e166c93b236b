"""Every registered mechanism against the contract of :mod:`attnzoo.mechanisms.base`.

Parametrized over ``attnzoo.available()``: a newly registered mechanism is checked with no new test code.
What is exercised follows from its declared ``Capabilities``; it is built with its ``test_options``.
"""

import pytest

import attnzoo
from attnzoo.mechanisms import mechanism_class

from . import checks

MECHANISMS = attnzoo.available()


def test_softmax_is_registered():
    assert "softmax" in MECHANISMS


@pytest.mark.parametrize("name", MECHANISMS)
def test_declaration(name):
    cls = mechanism_class(name)
    assert cls.name == name, f"{cls.__qualname__} is registered as {name!r} but its name is {cls.name!r}"
    assert attnzoo.capabilities(name) is cls.capabilities
    checks.check_declaration(cls)
    checks.expect_error(
        lambda: attnzoo.build_mechanism(name, checks.HEADS, checks.HEAD_DIM, no_such_option=1),
        TypeError,
        r"no_such_option",
        f"build_mechanism({name!r}, ..., no_such_option=1)",
    )


@pytest.mark.parametrize("check", checks.INSTANCE_CHECKS, ids=lambda check: check.__name__[len("check_"):])
@pytest.mark.parametrize("name", MECHANISMS)
def test_conformance(name, check):
    check(checks.build(name))


# Option sets a mechanism declares in ``test_variants`` (options that change its maths or capabilities).
VARIANTS = [(name, options) for name in MECHANISMS for options in mechanism_class(name).test_variants]


@pytest.mark.parametrize("check", checks.INSTANCE_CHECKS, ids=lambda check: check.__name__[len("check_"):])
@pytest.mark.parametrize(
    "name, options", VARIANTS, ids=[f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in VARIANTS]
)
def test_conformance_of_variants(name, options, check):
    check(checks.build(name, options=options))

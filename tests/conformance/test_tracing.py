"""Every registered mechanism traced (``torch.jit.trace``) and compiled to one graph
(``torch.compile(fullgraph=True)``), causal and not where declared, forward and backward equal to eager.

What is already covered elsewhere is not repeated: ``check_traced_matches_eager`` (:mod:`.checks`) traces
without gradients and runs the graph with a mask of other values; ``tests/mechanisms/test_compile.py`` compiles
MultiHeadAttention itself (every form of the call) for a few mechanisms. Here the traced graph's first call
runs with gradients (an in-place write into a view that eager mode accepts can be refused when the graph is
replayed), every option set in ``test_variants`` is traced, and compiling covers the causal and the
non-causal path of each mechanism: through AOTAutograd (``backend="aot_eager"``) on the causal one, dynamo's
graph capture alone (``backend="eager"``, in seconds) on the other.
"""

from __future__ import annotations

import warnings
from typing import List, Optional

import pytest
import torch
from torch import Tensor

import attnzoo
from attnzoo.mechanisms import Mechanism, mechanism_class

from . import checks

MECHANISMS = attnzoo.available()
VARIANTS = [(name, None) for name in MECHANISMS] + [
    (name, options) for name in MECHANISMS for options in mechanism_class(name).test_variants
]
IDS = [n + ("" if o is None else "-" + "-".join(f"{k}={v}" for k, v in o.items())) for n, o in VARIANTS]
LENGTH = 7
CLOSE = {"rtol": 1e-10, "atol": 1e-12}  # float64; the same maths (a compiled kernel may sum in another order)

class _Call(torch.nn.Module):
    """A mechanism as a module of tensors only (what tracing takes), causal or not, with a key padding mask."""

    def __init__(self, mechanism: Mechanism, causal: bool) -> None:
        super().__init__()
        self.mechanism, self.causal = mechanism, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return self.mechanism(q, k, v, causal=self.causal, key_padding_mask=mask)


def _modes(mechanism: Mechanism) -> List[bool]:
    return checks.causal_settings(mechanism)


def _inputs(mechanism: Mechanism):
    n = checks.fit(mechanism, LENGTH)
    qkv = checks.random_qkv(mechanism, checks.BATCH, n, n, torch.float64, seed=31)
    mask = checks.padding_pattern(checks.BATCH, n, fully_padded=False)
    return qkv, (mask if mechanism.capabilities.key_padding else None)


def _forward_backward(module, qkv, mask: Optional[Tensor]) -> List[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = module(*leaves, mask)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _assert_same(got: List[Tensor], expected: List[Tensor], what: str) -> None:
    for label, g, e in zip(("output", "gradient of q", "gradient of k", "gradient of v"), got, expected):
        if g is None:
            raise AssertionError(f"{what}: no {label}")
        checks.assert_close(g, e, f"{what}: {label}", **CLOSE)


@pytest.mark.parametrize("name, options", VARIANTS, ids=IDS)
def test_traced_first_call_with_gradients_matches_eager(name, options, one_thread):
    mechanism = checks.build(name, options=options)
    qkv, mask = _inputs(mechanism)
    for causal in _modes(mechanism):
        module = _Call(mechanism, causal)
        expected = _forward_backward(module, qkv, mask)
        example = tuple(t.detach().clone().requires_grad_() for t in qkv) + (mask,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python values are expected and harmless
            traced = torch.jit.trace(module, example, check_trace=False)
        what = f"{type(mechanism).__name__} causal={causal} traced, first call with gradients"
        _assert_same(_forward_backward(traced, qkv, mask), expected, what)


@pytest.fixture
def fresh_dynamo():
    # Each case compiles new modules of shared classes: without a reset, dynamo's recompilation limit would
    # quietly fall back to eager after a few of them.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", MECHANISMS)
def test_compiles_to_one_graph_and_matches_eager(name, fresh_dynamo, one_thread):
    mechanism = checks.build(name)
    qkv, mask = _inputs(mechanism)
    modes = _modes(mechanism)
    for causal in modes:
        module = _Call(mechanism, causal)
        expected = _forward_backward(module, qkv, mask)
        # AOTAutograd (functionalized graphs, where an in-place write a replay cannot take fails) on the last
        # mode, the causal one where declared; dynamo's graph capture alone on the other, in a third of the time.
        backend = "aot_eager" if causal == modes[-1] else "eager"
        compiled = torch.compile(module, fullgraph=True, backend=backend)
        what = f"{type(mechanism).__name__} causal={causal} compiled with fullgraph=True, backend {backend}"
        _assert_same(_forward_backward(compiled, qkv, mask), expected, what)

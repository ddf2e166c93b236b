"""Mechanisms that rotate part of their maths themselves (capability ``own_rotary``), in a rotary layer.

A :class:`~attnzoo.MultiHeadAttention` with ``rotary=True`` hands such a mechanism its rotary embedding and
unrotated queries and keys. For every registered mechanism and declared variant whose instance declares it:
the rotation reaches the output (it differs without the embedding), decoding from a prefilled prompt steps
through the positions the layer has seen (prefill then steps equal the forward, 1e-10 in float64), and a packed
row restarts the positions at each document (each gives what it gives alone). What the rotation applies to is
each mechanism's own maths, checked against its reference in its own tests.
"""

import pytest
import torch

import attnzoo
from attnzoo import MultiHeadAttention
from attnzoo.mechanisms import UnsupportedOptionError, mechanism_class

from . import checks

MECHANISMS = attnzoo.available()
CASES = [(name, options) for name in MECHANISMS
         for options in (mechanism_class(name).test_options, *mechanism_class(name).test_variants)
         if checks.build(name, options=options).capabilities.own_rotary]
EXACT = {"rtol": 1e-10, "atol": 1e-12}
DIM, HEADS, LENGTH, PROMPT = 32, 4, 13, 4


def _layer(name, options) -> MultiHeadAttention:
    """The mechanism in a rotary layer, with grouped keys and values where it takes them."""
    torch.manual_seed(0)
    try:
        layer = MultiHeadAttention(DIM, HEADS, name, kv_heads=2, rotary=True, rotary_pairs="halves", **options)
    except UnsupportedOptionError:
        torch.manual_seed(0)
        layer = MultiHeadAttention(DIM, HEADS, name, rotary=True, rotary_pairs="halves", **options)
    return layer.double().eval()


def test_some_mechanism_rotates_itself():
    assert CASES, "no registered mechanism declares own_rotary: this file checks nothing"


@pytest.mark.parametrize("name, options", CASES,
                         ids=[f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in CASES])
def test_in_a_rotary_layer(name, options):
    layer = _layer(name, options)
    caps = layer.mechanism.capabilities
    x = torch.randn(2, LENGTH, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x, causal=caps.causal)
        layer.mechanism.use_rotary(None)
        unrotated = layer(x, causal=caps.causal)
        layer.mechanism.use_rotary(layer.rotary)
        assert (out - unrotated).abs().max() > 1e-3, f"{name}: the rotary embedding does not reach the output"
        if caps.recurrent_step and caps.causal:
            prefix, state = layer.prefill(x[:, :PROMPT])
            steps = [prefix]
            for t in range(PROMPT, LENGTH):
                out_t, state = layer.step(x[:, t:t + 1], state)
                steps.append(out_t)
            checks.assert_close(torch.cat(steps, 1), out, f"{name}: prefill and steps against the forward", **EXACT)
        if caps.packed:
            packed = layer(x[:1], causal=caps.causal, cu_seqlens=torch.tensor([0, 6, LENGTH]))
            alone = torch.cat([layer(x[:1, :6], causal=caps.causal), layer(x[:1, 6:], causal=caps.causal)], 1)
            checks.assert_close(packed, alone, f"{name}: a packed row against its documents alone", **EXACT)

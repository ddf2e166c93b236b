"""Attention sinks (``sink_tokens``) of ``local`` and of ``softmax`` with a window: the blockwise path and the
dense form against a mask written out by loops, decoding with sinks plus the window in constant memory, the
sinks' effect, and the refusals that name ``sink_tokens``."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnzoo.functional.blocksparse import (
    SinkLocalPattern,
    blocksparse_attention_unchecked,
    blocksparse_plan,
    window_cache_step,
)
from attnzoo.mechanisms import build_mechanism


def qkv(batch, heads, length, dim, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))


def loop_reference(q, k, v, window, sinks, causal, key_padding_mask=None):
    """Softmax over the keys a loop admits: |i - j| < window or j < sinks, j <= i when causal, not padded."""
    length = q.shape[2]
    allowed = torch.zeros(q.shape[0], 1, length, length, dtype=torch.bool)
    for b, i, j in itertools.product(range(q.shape[0]), range(length), range(length)):
        seen = (abs(i - j) < window or j < sinks) and (j <= i or not causal)
        padded = key_padding_mask is not None and bool(key_padding_mask[b, j])
        allowed[b, 0, i, j] = seen and not padded
    logits = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, -1).nan_to_num(0.0)  # a row with no key: zeros
    return weights @ v


SHAPES = [(3, 2, 2), (4, 4, 3), (5, 1, 4), (2, 2, 1), (6, 3, 64)]  # window, sinks, block size


@pytest.mark.parametrize("window, sinks, block", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_local_blocks_and_dense_plan_match_the_loop(window, sinks, block, causal):
    m = build_mechanism("local", 2, 4, window=window, sink_tokens=sinks, block_size=block).double()
    for length in (1, 5, 13, 22):
        q, k, v = qkv(2, 2, length, 4, seed=length)
        mask = torch.rand(2, length, generator=torch.Generator().manual_seed(length)) < 0.3
        mask[:, 0] = True  # a padded sink stays invisible
        expected = loop_reference(q, k, v, window, sinks, causal, mask)
        torch.testing.assert_close(m.reference(q, k, v, causal, mask), expected, rtol=1e-10, atol=1e-12)
        for dense in (False, True):
            plan = blocksparse_plan(m.pattern(), length, causal, q.device, dense_when_cheaper=dense)
            out = blocksparse_attention_unchecked(q, k, v, m.pattern(), causal, mask, None, plan)
            torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["local", "softmax"])
def test_sinks_change_what_a_query_past_the_window_sees(name):
    q, k, v = qkv(1, 2, 20, 4)
    plain = build_mechanism(name, 2, 4, window=4).double()
    sinks = build_mechanism(name, 2, 4, window=4, sink_tokens=2).double()
    with_sinks, without = sinks(q, k, v, True), plain(q, k, v, True)
    # Queries 0..3 see positions 0 and 1 in their window anyway; later ones see them only as sinks.
    torch.testing.assert_close(with_sinks[:, :, :4], without[:, :, :4], rtol=1e-12, atol=1e-12)
    assert (with_sinks[:, :, 4:] - without[:, :, 4:]).abs().amin() > 1e-6
    torch.testing.assert_close(with_sinks, loop_reference(q, k, v, 4, 2, True), rtol=1e-10, atol=1e-12)


def test_softmax_window_equals_local_with_the_same_sinks():
    q, k, v = qkv(2, 2, 19, 4)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, 15:] = True
    for causal in (False, True):
        exact = build_mechanism("softmax", 2, 4, window=5, sink_tokens=3).double()
        local = build_mechanism("local", 2, 4, window=5, sink_tokens=3, block_size=2).double()
        torch.testing.assert_close(exact(q, k, v, causal, mask), local(q, k, v, causal, mask), rtol=1e-10,
                                   atol=1e-12)
        torch.testing.assert_close(exact.reference(q, k, v, causal, mask),
                                   loop_reference(q, k, v, 5, 3, causal, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["local", "softmax"])
@pytest.mark.parametrize("window, sinks", [(1, 1), (3, 2), (4, 4), (6, 1)])
def test_step_and_prefill_keep_sinks_plus_window_in_constant_memory(name, window, sinks):
    m = build_mechanism(name, 2, 4, window=window, sink_tokens=sinks).double()
    length = 17
    q, k, v = qkv(2, 2, length, 4)
    full = m(q, k, v, True)
    state = None
    for t in range(length):
        out, state = m.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out, full[:, :, t:t + 1], rtol=1e-10, atol=1e-12)
        assert state.tensors["k"].shape == (2, 2, window, 4)
        assert state.tensors["sink_k"].shape == (2, 2, sinks, 4)
    torch.testing.assert_close(state.tensors["sink_k"], k[:, :, :sinks])
    for prompt in (1, sinks, window + sinks + 1):
        out, state = m.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
        torch.testing.assert_close(out, full[:, :, :prompt], rtol=1e-10, atol=1e-12)
        for t in range(prompt, length):
            out, state = m.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
            torch.testing.assert_close(out, full[:, :, t:t + 1], rtol=1e-10, atol=1e-12)


def test_a_state_stepped_twice_while_its_sinks_fill_is_not_overwritten():
    m = build_mechanism("local", 1, 4, window=2, sink_tokens=2).double()
    q, k, v = qkv(1, 1, 3, 4)
    _, state = m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    before = {name: t.clone() for name, t in state.tensors.items()}
    a, _ = m.step(q[:, :, 1:2], k[:, :, 1:2], v[:, :, 1:2], state)
    other = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    m.step(q[:, :, 1:2], other, other, state)  # a branch writing other keys into sink slot 1
    b, _ = m.step(q[:, :, 1:2], k[:, :, 1:2], v[:, :, 1:2], state)
    assert torch.equal(a, b)
    assert all(torch.equal(before[name], t) for name, t in state.tensors.items())


def test_the_step_reads_each_key_once():
    # At position 2 with window 4 the sinks are also in the ring: counting them twice would change the output.
    q, k, v = qkv(1, 1, 3, 4)
    state = None
    for t in range(3):
        out, state = window_cache_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, t, 4, 2)
    torch.testing.assert_close(out, loop_reference(q, k, v, 4, 2, True)[:, :, 2:], rtol=1e-12, atol=1e-12)


def test_the_pattern_reads_the_window_band_plus_the_sink_blocks():
    plan = blocksparse_plan(SinkLocalPattern(16, 4, 8), 4096, True, torch.device("cpu"), dense_when_cheaper=False)
    assert plan.index.shape == (512, 8 * (2 + 1 + 1))  # a 16-wide causal band in blocks of 8, one sink block


@pytest.mark.parametrize("name, options", [
    ("local", {"window": 3, "sink_tokens": 4}),
    ("local", {"window": 3, "sink_tokens": -1}),
    ("local", {"window": 3, "sink_tokens": True}),
    ("local", {"window": 3, "sink_tokens": 2.0}),
    ("local", {"window": 3, "sink_tokens": "2"}),
    ("softmax", {"sink_tokens": 2}),
    ("softmax", {"window": 2, "sink_tokens": 3}),
    ("softmax", {"window": 2, "sink_tokens": False}),
])
def test_bad_sink_tokens_are_refused_at_construction_by_name(name, options):
    with pytest.raises((TypeError, ValueError), match="sink_tokens"):
        build_mechanism(name, 2, 4, **options)


def test_softmax_window_refusals_name_their_argument():
    with pytest.raises(ValueError, match="window"):
        build_mechanism("softmax", 2, 4, window=0)
    with pytest.raises(ValueError, match="window"):
        build_mechanism("softmax", 2, 4, window=3, quiet=True)
    m = build_mechanism("softmax", 2, 4, window=3)
    q, k, v = qkv(1, 2, 5, 4, dtype=torch.float32)
    with pytest.raises(Exception, match="cross"):
        m(q, k, v, cross=True)
    assert build_mechanism("softmax", 2, 4, sink_tokens=0).window is None  # 0: no sinks, plain softmax

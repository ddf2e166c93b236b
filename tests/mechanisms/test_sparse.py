"""Block-sparse attention: the blockwise core against dense masked softmax for every pattern, the patterns'
dense masks against their definitions, memory that never reaches N x N, local's decoding, option checks."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnzoo
from attnzoo.functional.blocksparse import (
    DENSE_SHARE,
    BigBirdPattern,
    DilatedPattern,
    FixedPattern,
    LocalPattern,
    LongformerPattern,
    SinkLocalPattern,
    StridedPattern,
    blocksparse_attention,
    blocksparse_attention_reference,
    blocksparse_attention_unchecked,
    blocksparse_plan,
    blockwise_logits,
    pattern_dense_mask,
)
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from tensor_records import TensorRecorder


def qkv(batch, heads, length, dim, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))


def padding(batch, length, seed=1):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=generator) < 0.3
    mask[-1] = True  # one sequence entirely padded: its rows are zeros
    return mask


# -- dense masks, straight from the definitions (loops) --------------------------------------------------------
def loop_mask(rule, length, causal):
    return torch.tensor([[rule(i, j) and (j <= i or not causal) for j in range(length)] for i in range(length)])


DEFINITIONS = [
    (LocalPattern(4, 3), lambda i, j: abs(i - j) < 4),
    (SinkLocalPattern(4, 3, 2), lambda i, j: abs(i - j) < 4 or j < 3),
    (DilatedPattern(3, 2), lambda i, j: (i - j) % 3 == 0),
    (StridedPattern(4, 2), lambda i, j: abs(i - j) < 4 or (i - j) % 4 == 0),
    (FixedPattern(4, 2, 3), lambda i, j: i // 4 == j // 4 or j % 4 >= 2),
    (LongformerPattern(3, 2, 2), lambda i, j: abs(i - j) < 3 or i < 2 or j < 2),
    # 17 positions in blocks of 3 -> 6 blocks; random rows taken modulo 6.
    (BigBirdPattern(3, 1, 1, torch.tensor([[4], [9], [0], [6], [1], [2], [5]])),
     lambda i, j: abs(i // 3 - j // 3) <= 1 or i < 3 or j < 3 or j // 3 == [4, 3, 0, 0, 1, 2][i // 3]),
]


@pytest.mark.parametrize("pattern, rule", DEFINITIONS, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_matches_definition(pattern, rule, causal):
    assert torch.equal(pattern_dense_mask(pattern, 17, causal), loop_mask(rule, 17, causal))


# -- fast path vs dense masked softmax ---------------------------------------------------------------------
CASES = [
    ("local", {"window": 1, "block_size": 1}),
    ("local", {"window": 3, "block_size": 2}),
    ("local", {"window": 5, "block_size": 4}),
    ("local", {"window": 7, "block_size": 3}),
    ("local", {"window": 50}),
    ("local", {"window": 3, "sink_tokens": 2, "block_size": 2}),
    ("local", {"window": 4, "sink_tokens": 3, "block_size": 5}),
    ("local", {"window": 2, "sink_tokens": 1, "block_size": 1}),
    ("strided", {"pattern": "strided", "stride": 1, "block_size": 2}),
    ("strided", {"pattern": "strided", "stride": 3, "block_size": 2}),
    ("strided", {"pattern": "strided", "stride": 4, "block_size": 4}),
    ("strided", {"pattern": "strided", "stride": 5, "block_size": 3}),
    ("strided", {"pattern": "fixed", "stride": 4, "summary": 1, "block_size": 3}),
    ("strided", {"pattern": "fixed", "stride": 5, "summary": 2, "block_size": 2}),
    ("strided", {"pattern": "fixed", "stride": 3, "summary": 3, "block_size": 4}),
    ("strided", {"pattern": "dilated", "stride": 2, "block_size": 2}),
    ("strided", {"pattern": "dilated", "stride": 4, "block_size": 3}),
    ("strided", {"pattern": "dilated", "stride": 20, "block_size": 3}),
    ("longformer", {"window": 3, "global_tokens": 0, "block_size": 2}),
    ("longformer", {"window": 2, "global_tokens": 1, "block_size": 3}),
    ("longformer", {"window": 4, "global_tokens": 7, "block_size": 2}),
    ("bigbird", {"block_size": 2, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2, "max_seq_len": 32}),
    ("bigbird", {"block_size": 3, "window_blocks": 0, "global_blocks": 0, "random_blocks": 1, "max_seq_len": 32}),
]


@pytest.mark.parametrize("name, options", CASES, ids=lambda x: str(x))
def test_matches_dense_masked_softmax(name, options):
    m = build_mechanism(name, 2, 4, **options).double()
    causal_modes = (False, True) if m.capabilities.causal else (False,)
    for length, causal, padded in itertools.product((1, 6, 13, 21), causal_modes, (False, True)):
        q, k, v = qkv(3, 2, length, 4, seed=length)
        mask = padding(3, length) if padded else None
        out = m(q, k, v, causal, mask)
        expected = m.reference(q, k, v, causal, mask)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12,
                                   msg=lambda s: f"{name} {options} N={length} causal={causal} padded={padded}: {s}")
        if padded:
            assert torch.all(out[-1] == 0)


def test_reference_is_dense_softmax_under_the_mask():
    # The reference equals plain softmax with the pattern's mask written out as -inf logits.
    q, k, v = qkv(2, 2, 10, 4)
    pattern = StridedPattern(3, 2)
    allowed = pattern_dense_mask(pattern, 10, causal=True)
    logits = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~allowed, float("-inf"))
    expected = torch.softmax(logits, -1) @ v
    torch.testing.assert_close(blocksparse_attention_reference(q, k, v, pattern, True), expected)
    torch.testing.assert_close(blocksparse_attention(q, k, v, pattern, True), expected)


def test_block_size_does_not_change_the_output():
    q, k, v = qkv(1, 2, 29, 4)
    for name, options in (("local", {"window": 6}), ("strided", {"pattern": "strided", "stride": 5}),
                          ("strided", {"pattern": "fixed", "stride": 5, "summary": 2})):
        outs = [build_mechanism(name, 2, 4, block_size=b, **options).double()(q, k, v, True) for b in (1, 2, 5, 64)]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=1e-12, atol=1e-12)


def test_float32_close_to_float64():
    q, k, v = qkv(2, 2, 37, 8, dtype=torch.float32)
    for name, options in (("local", {"window": 5, "block_size": 4}), ("strided", {"pattern": "fixed", "stride": 6})):
        m = build_mechanism(name, 2, 8, **options)
        torch.testing.assert_close(m(q, k, v, True).double(), m.reference(q, k, v, True), rtol=1e-4, atol=1e-5)


# -- memory: nothing N x N ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options, per_query", [
    ("local", {"window": 16, "block_size": 8}, 16 + 8),
    ("local", {"window": 16, "block_size": 8, "sink_tokens": 4}, 16 + 8 + 8),
    # block_size divides stride: one block per multiple of the stride.
    ("strided", {"pattern": "strided", "stride": 64, "block_size": 8}, 64 + 8 + 8 * (4096 // 64 + 1)),
    ("strided", {"pattern": "fixed", "stride": 64, "summary": 4, "block_size": 16}, 64 + 16 + 4 * 4096 // 64 + 16),
    ("strided", {"pattern": "dilated", "stride": 64, "block_size": 16}, 4096 // 64),
])
def test_no_quadratic_tensor(name, options, per_query):
    length = 4096
    m = build_mechanism(name, 1, 4, **options)
    plan = blocksparse_plan(m.pattern(), length, True, torch.device("cpu"))
    slots = plan.index.numel()  # gathered key slots over all query blocks
    assert slots <= length * per_query < length * length // 4
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, length, 4, dtype=torch.float32))
    with TensorRecorder() as probe:
        m(q, k, v, True, torch.zeros(1, length, dtype=torch.bool)).sum().backward()
    assert probe.largest <= 4 * length * per_query, (probe.largest, length * length)


def test_local_index_table_independent_of_length():
    widths = {blocksparse_plan(LocalPattern(256, 64), n, True, torch.device("cpu")).index.shape[1]
              for n in (1024, 4096, 16384)}
    assert widths == {320}


# -- local: decoding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 3, 20])
def test_local_step_and_prefill_match_causal_forward(window):
    m = build_mechanism("local", 2, 4, window=window, block_size=2).double()
    q, k, v = qkv(2, 2, 11, 4)
    full = m(q, k, v, True)
    state = None
    for t in range(11):
        out, state = m.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out, full[:, :, t:t + 1])
        assert state.tensors["k"].shape == (2, 2, window, 4)  # constant memory
    out, state = m.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7])
    torch.testing.assert_close(out, full[:, :, :7])
    # The ring holds the last min(7, window) positions; the other slots are marked empty (-1).
    expected = list(range(max(0, 7 - window), 7))
    assert sorted(p for p in state.tensors["positions"][0].tolist() if p >= 0) == expected
    for t in range(7, 11):
        out, state = m.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out, full[:, :, t:t + 1])


def test_local_step_state_leaves_previous_state_intact():
    m = build_mechanism("local", 1, 4, window=2).double()
    q, k, v = qkv(1, 1, 4, 4)
    _, state = m.prefill(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    a, _ = m.step(q[:, :, 2:3], k[:, :, 2:3], v[:, :, 2:3], state)
    b, _ = m.step(q[:, :, 2:3], k[:, :, 2:3], v[:, :, 2:3], state)
    assert torch.equal(a, b)


# -- options and refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options, named", [
    ("local", {"window": 0}, "window"),
    ("local", {"window": 4, "block_size": 0}, "block_size"),
    ("local", {"window": 2.0}, "window"),
    ("local", {"window": 2, "sink_tokens": 3}, "sink_tokens"),
    ("strided", {"stride": 0}, "stride"),
    ("strided", {"block_size": -1}, "block_size"),
    ("strided", {"pattern": "fixed", "stride": 4, "summary": 5}, "summary"),
    ("strided", {"summary": 0}, "summary"),
    ("strided", {"pattern": "banded"}, "pattern"),
    ("longformer", {"global_tokens": -1}, "global_tokens"),
    ("longformer", {"window": 0}, "window"),
    ("bigbird", {"block_size": 0}, "block_size"),
    ("bigbird", {"random_blocks": -1}, "random_blocks"),
    ("bigbird", {"window_blocks": -2}, "window_blocks"),
])
def test_bad_options_are_named(name, options, named):
    with pytest.raises((TypeError, ValueError), match=named):
        build_mechanism(name, 2, 4, **options)


@pytest.mark.parametrize("name", ["local", "strided", "longformer", "bigbird"])
def test_cross_attention_refused(name):
    m = build_mechanism(name, 2, 4)
    q, k, v = qkv(1, 2, 5, 4, dtype=torch.float32)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        m(q, k, v, cross=True)


def test_bigbird_random_blocks_are_seeded_and_reloaded():
    options = {"block_size": 2, "random_blocks": 2, "max_seq_len": 64}
    q, k, v = qkv(1, 2, 40, 4, dtype=torch.float32)
    a = build_mechanism("bigbird", 2, 4, seed=1, **options)
    torch.manual_seed(123)  # the global generator plays no part
    b = build_mechanism("bigbird", 2, 4, seed=1, **options)
    torch.testing.assert_close(a(q, k, v), b(q, k, v), rtol=0, atol=0)
    c = build_mechanism("bigbird", 2, 4, seed=2, **options)
    before = c(q, k, v)
    assert not torch.allclose(before, a(q, k, v))
    c.load_state_dict(a.state_dict())  # the buffer travels with the model
    torch.testing.assert_close(c(q, k, v), a(q, k, v), rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_length"):
        a(*qkv(1, 2, 65, 4, dtype=torch.float32))
    with pytest.raises(UnsupportedOptionError, match="causal"):
        a(q, k, v, causal=True)


def test_registered_as_own_attention():
    for name in ("local", "strided", "longformer", "bigbird"):
        assert name in attnzoo.available()
        assert attnzoo.capabilities(name).kind == "own"


# -- short sequences: one dense masked pass ------------------------------------------------------------------
DENSE_CASES = [
    ("local", {"window": 5, "block_size": 4}),
    ("local", {"window": 5, "block_size": 4, "sink_tokens": 3}),
    ("strided", {"pattern": "strided", "stride": 4, "block_size": 4}),
    ("strided", {"pattern": "fixed", "stride": 4, "summary": 2, "block_size": 4}),
    ("strided", {"pattern": "dilated", "stride": 3, "block_size": 4}),
    ("bigbird", {"block_size": 4, "max_seq_len": 16}),
]


@pytest.mark.parametrize("name, options, causal", [
    (name, options, causal) for name, options in DENSE_CASES for causal in (False, True)
    if attnzoo.capabilities(name).causal or not causal
])
def test_dense_plan_and_blocks_give_the_reference(name, options, causal):
    """A plan with a dense mask (short sequences) and the blockwise plan of the same call both equal the
    float64 reference, key padding included, gradients too."""
    m = build_mechanism(name, 2, 4, **options).double()
    length = 16
    q, k, v = qkv(2, 2, length, 4)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[0, 11:] = True
    expected = m.reference(q, k, v, causal, mask)
    dense = blocksparse_plan(m.pattern(), length, causal, torch.device("cpu"))
    blocks = blocksparse_plan(m.pattern(), length, causal, torch.device("cpu"), dense_when_cheaper=False)
    assert dense.dense is not None and blocks.dense is None
    grads = []
    for plan in (dense, blocks):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blocksparse_attention_unchecked(*inputs, m.pattern(), causal, mask, None, plan)
        torch.testing.assert_close(out[~mask[:, None, :, None].expand_as(out)],
                                   expected[~mask[:, None, :, None].expand_as(out)], atol=1e-10, rtol=1e-10)
        out[~mask[:, None, :, None].expand_as(out)].sum().backward()
        grads.append([t.grad for t in inputs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_the_dense_pass_is_chosen_only_when_the_blocks_cover_half_the_logits():
    cpu = torch.device("cpu")
    for n in (256, 1024, 4096):
        plan = blocksparse_plan(LocalPattern(128, 64), n, False, cpu)
        assert (plan.dense is not None) == (blockwise_logits(plan) >= DENSE_SHARE * n * n)
    assert blocksparse_plan(LocalPattern(128, 64), 256, False, cpu).dense is not None   # 1.25 N^2 in blocks
    assert blocksparse_plan(LocalPattern(128, 64), 4096, False, cpu).dense is None      # 0.08 N^2
    # The mechanisms take it: at N = 256 their plan is dense, and the output is the reference's.
    m = build_mechanism("strided", 2, 4).double()
    q, k, v = qkv(1, 2, 256, 4)
    assert m.plan(256, True, cpu).dense is not None
    torch.testing.assert_close(m(q, k, v, True), m.reference(q, k, v, True), atol=1e-10, rtol=1e-10)

"""Synthesizer: hand-checked cases of every mode, the mixture, parameters, fixed tables and refusals."""

import copy
import math

import pytest
import torch

import attnzoo
from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.synthesizer import (
    factored_synthesizer_attention,
    factored_synthesizer_attention_reference,
    factorized_dense_synthesizer_logits,
    synthesizer_attention,
    synthesizer_attention_reference,
)
from attnzoo.mechanisms import UnsupportedOptionError

HEADS, DIM = 2, 4


def qkv(batch=2, n=6, dim=DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, HEADS, n, dim, generator=g, dtype=torch.float64) for _ in range(3))


def build(**options):
    torch.manual_seed(0)
    return attnzoo.build_mechanism("synthesizer", HEADS, DIM, **{"max_seq_len": 8, **options}).double()


def padding(batch=2, n=6):
    mask = torch.zeros(batch, n, dtype=torch.bool)
    mask[1, 0] = True
    mask[1, 3] = True
    return mask


@pytest.mark.parametrize("causal", [False, True])
def test_random_mode_with_zero_logits_averages_the_visible_values(causal):
    mechanism = build(mode="random")
    with torch.no_grad():
        mechanism.table.zero_()
    q, k, v = qkv()
    mask = padding()
    out = mechanism(q, k, v, causal=causal, key_padding_mask=mask)
    visible = (~mask)[:, None, None, :].double() * (torch.ones(6, 6).tril() if causal else torch.ones(6, 6)).double()
    expected = (visible @ v) / visible.sum(-1, keepdim=True).clamp_min(1)
    expected = expected.masked_fill(visible.sum(-1, keepdim=True) == 0, 0.0)
    torch.testing.assert_close(out, expected)
    # Causal, first key padded: row 0 sees nothing and outputs zeros.
    assert causal is False or torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))


def test_random_mode_uses_the_top_left_block_of_its_table():
    mechanism = build(mode="random")
    q, k, v = qkv(n=5)
    expected = torch.softmax(mechanism.table.detach()[:, :5, :5], dim=-1) @ v
    torch.testing.assert_close(mechanism(q, k, v), expected)
    # The same for every input: queries and keys do not matter.
    torch.testing.assert_close(mechanism(*qkv(n=5, seed=3)[:2], v), expected)


@pytest.mark.parametrize("mode", ["dense", "random", "factorized_dense", "factorized_random"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixture_all_on_dot_products_is_softmax_attention(mode, causal):
    mechanism = build(mode=mode, mix=True, factor=3)
    with torch.no_grad():
        mechanism.mix_logits.copy_(torch.tensor([[-math.inf, 0.0]] * HEADS))
    q, k, v = qkv()
    mask = padding()
    out = mechanism(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal, mask))


def test_mixture_all_on_synthesised_logits_is_the_plain_synthesizer():
    mixed, plain = build(mode="dense", mix=True), build(mode="dense")
    with torch.no_grad():
        mixed.mix_logits.copy_(torch.tensor([[0.0, -math.inf]] * HEADS))
    q, k, v = qkv()
    torch.testing.assert_close(mixed(q, k, v, causal=True), plain(q, k, v, causal=True))


def test_mixture_starts_at_half_and_half():
    mechanism = build(mode="random", mix=True)
    torch.testing.assert_close(mechanism.mix_weights(torch.float64), torch.full((HEADS, 2), 0.5, dtype=torch.float64))
    q, k, v = qkv()
    logits = 0.5 * mechanism.table.detach()[:, :6, :6] + 0.5 * (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
    torch.testing.assert_close(mechanism(q, k, v), torch.softmax(logits, dim=-1) @ v)


def test_dense_row_comes_from_its_own_query_through_the_mlp():
    mechanism = build(mode="dense", hidden=3)
    q, k, v = qkv()
    w1, b1, w2, b2 = (p.detach() for p in (mechanism.w1, mechanism.b1, mechanism.w2, mechanism.b2))
    out = mechanism(q, k, v)
    for b in range(2):
        for h in range(HEADS):
            for i in range(6):
                logits = torch.relu(q[b, h, i] @ w1[h] + b1[h]) @ w2[h, :, :6] + b2[h, :6]
                torch.testing.assert_close(out[b, h, i], torch.softmax(logits, dim=0) @ v[b, h])
    # Changing the other queries leaves row 0 alone.
    q2 = q.clone()
    q2[:, :, 1:] += 1.0
    torch.testing.assert_close(mechanism(q2, k, v)[:, :, 0], out[:, :, 0])


def test_factorized_dense_logits_are_products_of_repeated_factors():
    torch.manual_seed(1)
    q = torch.randn(1, 1, 5, 3, dtype=torch.float64)
    w1, b1 = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 4, dtype=torch.float64)
    a, b = 2, 3  # a * b = 6 >= 5 positions
    w2, b2 = torch.randn(1, 4, a + b, dtype=torch.float64), torch.randn(1, a + b, dtype=torch.float64)
    logits = factorized_dense_synthesizer_logits(q, w1, b1, w2, b2, a)
    both = torch.relu(q @ w1 + b1) @ w2 + b2
    for i in range(5):
        for j in range(5):
            assert torch.isclose(logits[0, 0, i, j], both[0, 0, i, j // b] * both[0, 0, i, a + j % b])


def test_factorized_random_logits_have_rank_factor():
    mechanism = build(mode="factorized_random", factor=2)
    logits = mechanism.logits(qkv(n=8)[0])
    assert logits.shape == (HEADS, 8, 8)
    assert all(int(torch.linalg.matrix_rank(logits[h])) == 2 for h in range(HEADS))


@pytest.mark.parametrize(
    "options, trainable",
    [
        ({"mode": "dense"}, DIM * 5 + 5 + 5 * 8 + 8),
        ({"mode": "factorized_dense", "factor": 3}, DIM * 5 + 5 + (5 + 1) * (3 + 3)),
        ({"mode": "random"}, 8 * 8),
        ({"mode": "factorized_random", "factor": 3}, 2 * 8 * 3),
        ({"mode": "random", "mix": True}, 8 * 8 + 2),
        ({"mode": "random", "fixed": True}, 0),
        ({"mode": "factorized_random", "fixed": True, "mix": True}, 2),
    ],
)
def test_parameter_counts_per_head(options, trainable):
    mechanism = build(hidden=5, **options)
    assert sum(p.numel() for p in mechanism.parameters() if p.requires_grad) == HEADS * trainable


def test_fixed_table_is_a_saved_buffer_that_is_not_trained():
    mechanism = build(mode="random", fixed=True)
    assert not any(p.requires_grad for p in mechanism.parameters())
    assert "table" in dict(mechanism.named_buffers()) and "table" in mechanism.state_dict()
    q, k, v = (t.requires_grad_() for t in qkv())
    mechanism(q, k, v).sum().backward()
    assert v.grad is not None and mechanism.table.grad is None
    # Trainable: the table gets a gradient.
    learned = build(mode="random")
    learned(*qkv()).sum().backward()
    assert learned.table.grad is not None and learned.table.grad.abs().sum() > 0


def test_initialisation_is_deterministic_from_the_global_seed():
    for mode in ("dense", "random", "factorized_dense", "factorized_random"):
        first, second = build(mode=mode), build(mode=mode)
        for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
            assert torch.equal(a, b), name


def test_functional_fast_path_matches_reference_with_shared_and_per_batch_logits():
    q, k, v = qkv(batch=3)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, :2] = True
    mask[2] = True  # every key padded: zeros
    mix = torch.softmax(torch.randn(HEADS, 2, dtype=torch.float64), dim=-1)
    for logits in (torch.randn(HEADS, 6, 6, dtype=torch.float64), torch.randn(3, HEADS, 6, 6, dtype=torch.float64)):
        for causal in (False, True):
            for weights in (None, mix):
                out = synthesizer_attention(q, k, v, logits, causal, mask, mix=weights)
                expected = synthesizer_attention_reference(q, k, v, logits, causal, mask, mix=weights)
                torch.testing.assert_close(out, expected)
                assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("rank", [2, DIM + 3])
@pytest.mark.parametrize("shared", [False, True])
def test_factored_logits_match_the_materialised_reference(rank, shared):
    q, k, v = qkv(batch=3)
    g = torch.Generator().manual_seed(5)
    lead = (HEADS,) if shared else (3, HEADS)
    left, right = (torch.randn(*lead, 6, rank, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, 2:4] = True
    mask[2] = True
    mix = torch.softmax(torch.randn(HEADS, 2, generator=g, dtype=torch.float64), dim=-1)
    for causal in (False, True):
        for padding in (None, mask):
            for weights in (None, mix):
                out = factored_synthesizer_attention(q, k, v, left, right, causal, padding, mix=weights)
                expected = factored_synthesizer_attention_reference(q, k, v, left, right, causal, padding, mix=weights)
                torch.testing.assert_close(out, expected)
                # Materialised, the same logits give the same attention.
                logits = left @ right.transpose(-1, -2)
                torch.testing.assert_close(synthesizer_attention(q, k, v, logits, causal, padding, mix=weights), out)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
def test_causal_blocks_change_nothing_values_or_gradients(chunk_size):
    q, k, v = qkv(batch=2, n=11)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, [0, 5, 9, 10]] = True
    mix = torch.softmax(torch.randn(HEADS, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64), -1)
    logits = torch.randn(HEADS, 11, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = []
    for size in (chunk_size, 11):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, logits)]
        out = synthesizer_attention(*inputs[:3], inputs[3], True, mask, mix=mix, chunk_size=size)
        (out * torch.arange(out.numel(), dtype=torch.float64).view_as(out).sin()).sum().backward()
        grads.append([out.detach()] + [t.grad for t in inputs])
        reference = synthesizer_attention_reference(q, k, v, logits, True, mask, mix=mix)
        torch.testing.assert_close(out, reference)
    for blocked, whole in zip(*grads):
        torch.testing.assert_close(blocked, whole)


def test_functional_arguments_are_checked():
    q, k, v = qkv()
    logits = torch.zeros(HEADS, 6, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits"):
        synthesizer_attention(q, k, v, logits[:, :5])
    with pytest.raises(ValueError, match="mix"):
        synthesizer_attention(q, k, v, logits, mix=torch.zeros(HEADS, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="self-attention"):
        synthesizer_attention(q[:, :, :5], k, v, logits)
    with pytest.raises(TypeError, match="causal"):
        synthesizer_attention(q, k, v, logits, causal=1)
    with pytest.raises(ValueError, match="chunk_size"):
        synthesizer_attention(q, k, v, logits, chunk_size=0)
    with pytest.raises(ValueError, match="left"):
        factored_synthesizer_attention(q, k, v, logits[:, :5], logits)
    with pytest.raises(ValueError, match="rank"):
        factored_synthesizer_attention(q, k, v, logits, logits[..., :5])


@pytest.mark.parametrize(
    "options, error, pattern",
    [
        ({"mode": "sparse"}, ValueError, "mode"),
        ({"mode": "factorized_random", "factor": 0}, ValueError, "factor"),
        ({"factor": 2.0}, TypeError, "factor"),
        ({"hidden": 0}, ValueError, "hidden"),
        ({"max_seq_len": 0}, ValueError, "max_seq_len"),
        ({"fixed": True}, ValueError, "fixed"),
        ({"mode": "random", "fixed": "True"}, TypeError, "fixed"),
        ({"mix": 1}, TypeError, "mix"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_options_are_named(options, error, pattern):
    with pytest.raises(error, match=pattern):
        build(**options)


def test_sequences_longer_than_max_seq_len_and_cross_attention_are_refused():
    mechanism = build(mode="random")
    assert mechanism.max_length == 8
    q, k, v = qkv(n=9)
    with pytest.raises(UnsupportedOptionError, match="max_seq_len"):
        mechanism(q, k, v)
    q, k, v = qkv(n=4)
    for keys in ((k, v), qkv(n=3)[1:]):
        with pytest.raises(UnsupportedOptionError, match="cross-attention"):
            mechanism(q, *keys, cross=True)
    with pytest.raises(UnsupportedOptionError, match="cross-attention"):
        mechanism(q, *qkv(n=3)[1:])


@pytest.mark.parametrize("mode", ["dense", "factorized_random"])
def test_half_precision_keeps_its_dtype_and_stays_close(mode):
    mechanism = build(mode=mode, factor=2)
    q, k, v = qkv()
    expected = mechanism(q, k, v, causal=True, key_padding_mask=padding())
    for dtype in (torch.float16, torch.bfloat16):
        half = copy.deepcopy(mechanism).to(dtype)
        out = half(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, key_padding_mask=padding())
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=5e-2, rtol=5e-2)

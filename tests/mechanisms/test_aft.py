"""Attention Free Transformer (Zhai et al. 2021): the reference against hand-computed cases, the fast paths of
every variant against it, the variants against each other, the stabilisers, the recurrent form of AFT-simple
and the options."""

import pytest
import torch

import attnzoo
from attnzoo import UnsupportedOptionError
from attnzoo.functional.aft import (
    aft_full,
    aft_reference,
    aft_simple,
    aft_simple_prefill,
    aft_simple_step,
    local_position_bias,
)


def tensors(*shapes, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype) for shape in shapes]


def qkv(q_len, k_len=None, batch=2, heads=2, dim=4, seed=0, **kwargs):
    k_len = q_len if k_len is None else k_len
    return tensors((batch, heads, q_len, dim), (batch, heads, k_len, dim), (batch, heads, k_len, dim),
                   seed=seed, **kwargs)


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -2:] = True
    mask[-1, 0] = True
    mask[-1, length // 2] = True
    return mask


def build(variant="simple", heads=2, dim=4, bias_scale=1.0, seed=1, **options):
    """An AFT in float64 whose position biases (full, local) are of standard deviation ``bias_scale``."""
    torch.manual_seed(seed)
    mechanism = attnzoo.build_mechanism("aft", heads, dim, variant=variant, **options).double()
    if mechanism.position_bias is not None:
        with torch.no_grad():
            mechanism.position_bias.normal_(0.0, bias_scale)
    return mechanism


def dense_bias(mechanism, length):
    """w written out pair by pair from the definitions of full and local."""
    w = torch.zeros(mechanism.heads, length, length, dtype=torch.float64)
    for t in range(length):
        for u in range(length):
            if mechanism.variant == "full":
                w[:, t, u] = mechanism.position_bias[:, t, u]
            elif abs(t - u) < mechanism.window:
                w[:, t, u] = mechanism.position_bias[:, t, u - t + min(mechanism.window, mechanism.max_seq_len) - 1]
    return w


# -- the reference ----------------------------------------------------------------------------------------------
def test_simple_with_constant_keys_is_the_gated_mean_of_the_values():
    q, _, v = qkv(6)
    k = torch.full_like(v, 0.7)
    gated_mean = torch.sigmoid(q) * v.mean(dim=2, keepdim=True)
    prefix_mean = torch.sigmoid(q) * v.cumsum(2) / torch.arange(1, 7, dtype=torch.float64).view(1, 1, 6, 1)
    for causal, expected in ((False, gated_mean), (True, prefix_mean)):
        torch.testing.assert_close(aft_reference(q, k, v, None, causal), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(aft_simple(q, k, v, causal, chunk_size=4), expected, rtol=1e-12, atol=1e-12)


def test_reference_is_the_formula_entry_by_entry():
    q, k, v = qkv(5, batch=1, heads=2, dim=3)
    (w,) = tensors((2, 5, 5), seed=3)
    for causal in (False, True):
        expected = torch.zeros_like(q)
        for h in range(2):
            for t in range(5):
                for j in range(3):
                    seen = range(t + 1) if causal else range(5)
                    weights = [torch.exp(k[0, h, u, j] + w[h, t, u]) for u in seen]
                    total = sum(weights)
                    mixed = sum(weight * v[0, h, u, j] for weight, u in zip(weights, seen))
                    expected[0, h, t, j] = torch.sigmoid(q[0, h, t, j]) * mixed / total
        torch.testing.assert_close(aft_reference(q, k, v, w, causal), expected, rtol=1e-12, atol=1e-12)


def test_local_position_bias_layout():
    mechanism = build("local", max_seq_len=9, window=3)
    torch.testing.assert_close(mechanism.dense_position_bias(7), dense_bias(mechanism, 7), rtol=0, atol=0)
    narrow = build("local", max_seq_len=9, window=1)  # the diagonal only
    w = narrow.dense_position_bias(6)
    assert torch.equal(w, torch.diag_embed(narrow.position_bias[:, :6, 0]))
    assert local_position_bias(narrow.position_bias, 6, 1).shape == (2, 6, 6)


# -- fast paths against the reference -----------------------------------------------------------------------------
@pytest.mark.parametrize("variant, window", [("simple", 3), ("full", 3), ("local", 1), ("local", 3), ("local", 6)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 7, 16])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_reference(variant, window, causal, length, chunk_size, padded):
    # local: windows below and above chunk_size, and covering all of a short sequence
    mechanism = build(variant, max_seq_len=16, window=window, chunk_size=chunk_size)
    q, k, v = qkv(length)
    mask = padding(2, length) if padded and length > 2 else None
    out = mechanism(q, k, v, causal=causal, key_padding_mask=mask)
    expected = aft_reference(q, k, v, None if variant == "simple" else dense_bias(mechanism, length), causal, mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lengths", [(3, 10), (10, 3), (1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_simple_cross_attention_bottom_right_aligned(lengths, causal):
    q, k, v = qkv(*lengths)
    mask = padding(2, lengths[1])
    out = aft_simple(q, k, v, causal, mask, chunk_size=4)
    torch.testing.assert_close(out, aft_reference(q, k, v, None, causal, mask), rtol=1e-10, atol=1e-12)


def test_full_with_zero_biases_is_simple():
    full, simple = build("full", max_seq_len=12, chunk_size=4), build("simple", chunk_size=4)
    with torch.no_grad():
        full.position_bias.zero_()
    q, k, v = qkv(11)
    mask = padding(2, 11)
    for causal in (False, True):
        torch.testing.assert_close(full(q, k, v, causal=causal, key_padding_mask=mask),
                                   simple(q, k, v, causal=causal, key_padding_mask=mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [10, 11, 50])
def test_local_with_a_window_covering_everything_is_full(window):
    full, local = build("full", max_seq_len=10), build("local", max_seq_len=10, window=window)
    with torch.no_grad():  # the band of row t holds w[t, t - r + 1 .. t + r - 1], r = min(window, max_seq_len)
        for t in range(10):
            for u in range(10):
                local.position_bias[:, t, u - t + 9] = full.position_bias[:, t, u]
    q, k, v = qkv(10)
    mask = padding(2, 10)
    for causal in (False, True):
        torch.testing.assert_close(local(q, k, v, causal=causal, key_padding_mask=mask),
                                   full(q, k, v, causal=causal, key_padding_mask=mask), rtol=1e-12, atol=1e-12)


def test_gradients_of_the_position_biases():
    q, k, v = qkv(6, batch=1, heads=1, dim=2)
    (w,) = tensors((1, 6, 6), seed=4)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, w))
    mask = torch.tensor([[False, True, False, False, False, True]])
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v, w: aft_full(q, k, v, w, causal, mask, chunk_size=4), inputs, eps=1e-6, atol=1e-7,
            fast_mode=True,
        )
    # local: band entries reaching outside the sequence get no gradient
    local = build("local", heads=1, dim=2, max_seq_len=6, window=2)
    local(q.detach(), k.detach(), v.detach()).sum().backward()
    grad = local.position_bias.grad
    assert grad[0, 0, 0] == 0 and grad[0, 5, 2] == 0 and bool((grad[0, 1:5] != 0).all())


# -- stability, padding -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["simple", "full", "local"])
@pytest.mark.parametrize("causal", [False, True])
def test_large_keys_and_biases_in_float32(variant, causal):
    # Keys climbing by 3 per position (about 100 over the sequence) on top of noise of scale 5, biases of
    # scale 10: exp() overflows float32 without the shifts.
    mechanism = build(variant, max_seq_len=36, window=4, bias_scale=10.0, chunk_size=4)
    q, k, v = qkv(36, dtype=torch.float32)
    k = 5.0 * k + 3.0 * torch.arange(36, dtype=torch.float32).view(1, 1, 36, 1)
    mask = padding(2, 36)
    expected = mechanism.reference(q, k, v, causal, mask)
    out = mechanism.float()(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["simple", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_element_gives_zeros_and_finite_gradients(variant, causal):
    mechanism = build(variant, max_seq_len=7, chunk_size=3)
    q, k, v = (t.requires_grad_() for t in qkv(7))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1] = True
    out = mechanism(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_half_precision_runs_in_float32():
    q, k, v = qkv(20)
    for causal in (False, True):
        out = aft_simple(q.half(), k.half(), v.half(), causal)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.double(), aft_simple(q, k, v, causal), rtol=2e-2, atol=2e-3)


# -- recurrent form -----------------------------------------------------------------------------------------------
def test_prefill_then_step_continues_the_causal_form():
    q, k, v = qkv(11)
    k = k + torch.arange(11, dtype=torch.float64).view(1, 1, 11, 1) * 4.0  # the running maximum moves
    full = aft_simple(q, k, v, True, chunk_size=4)
    out, state = aft_simple_prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], chunk_size=4)
    torch.testing.assert_close(out, full[:, :, :6], rtol=1e-12, atol=1e-12)
    for t in range(6, 11):
        out_t, state = aft_simple_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t : t + 1], rtol=1e-10, atol=1e-12)
    assert {name: tuple(t.shape) for name, t in state.items()} == {name: (2, 2, 4) for name in ("num", "den", "max")}


# -- options and capabilities -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"variant": "global"}, "variant"),
        ({"variant": "Full"}, "variant"),
        ({"window": 0}, "window"),
        ({"window": -3}, "window"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_options_are_named(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        attnzoo.build_mechanism("aft", 2, 4, **options)


@pytest.mark.parametrize("variant", ["full", "local"])
def test_sequences_longer_than_max_seq_len_are_refused(variant):
    mechanism = build(variant, max_seq_len=8, window=3)
    assert mechanism.max_length == 8
    q, k, v = qkv(9)
    with pytest.raises(UnsupportedOptionError, match=r"max_seq_len=8.*|max_length=8") as error:
        mechanism(q, k, v)
    assert "max_seq_len" in str(error.value) and "max_length" in str(error.value)
    assert mechanism(q[:, :, :8], k[:, :, :8], v[:, :, :8]).shape == (2, 2, 8, 4)


def test_simple_ignores_max_seq_len():
    mechanism = build("simple", max_seq_len=4)
    assert mechanism.max_length is None and mechanism.position_bias is None
    q, k, v = qkv(9)
    assert mechanism(q, k, v, causal=True).shape == (2, 2, 9, 4)


@pytest.mark.parametrize("variant", ["full", "local"])
def test_full_and_local_narrow_their_capabilities_naming_the_variant(variant):
    mechanism = build(variant, max_seq_len=8)
    caps = mechanism.capabilities
    assert not caps.cross and not caps.recurrent_step and caps.causal and caps.key_padding
    q, k, v = qkv(4, 6)
    with pytest.raises(UnsupportedOptionError, match=f"variant='{variant}'.*cross"):
        mechanism(q, k, v, cross=True)
    with pytest.raises(UnsupportedOptionError, match=f"variant='{variant}'"):
        mechanism.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    assert attnzoo.capabilities("aft").cross and attnzoo.capabilities("aft").kind == "own"


def test_parameters_follow_the_variant():
    assert build("full", heads=3, max_seq_len=10).position_bias.shape == (3, 10, 10)
    assert build("local", heads=3, max_seq_len=10, window=4).position_bias.shape == (3, 10, 7)
    assert build("local", heads=3, max_seq_len=10, window=40).position_bias.shape == (3, 10, 19)
    torch.manual_seed(0)
    first = attnzoo.build_mechanism("aft", 2, 4, variant="full", max_seq_len=5)
    torch.manual_seed(0)
    second = attnzoo.build_mechanism("aft", 2, 4, variant="full", max_seq_len=5)
    assert torch.equal(first.position_bias, second.position_bias)
    assert float(first.position_bias.detach().abs().max()) < 0.2  # small at initialisation
    assert "variant='full'" in repr(first)


def test_values_of_another_width_are_refused_naming_v():
    mechanism = build("simple")
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match=r"\bv\b.*head_dim"):
        mechanism(q, k, v[..., :1])
    with pytest.raises(ValueError, match=r"\bv\b.*head_dim"):
        mechanism.step(q[:, :, :1], k[:, :, :1], v[:, :, :1, :1], None)


def test_bad_input_to_the_functional_forms_is_named():
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="position_bias"):
        aft_full(q, k, v, torch.zeros(2, 5, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="seq_q"):
        aft_full(q, k[:, :, :3], v[:, :, :3], torch.zeros(2, 4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="head_dim"):
        aft_simple(q, k, v[..., :3])
    with pytest.raises(ValueError, match="chunk_size"):
        aft_simple(q, k, v, True, chunk_size=0)
    with pytest.raises(ValueError, match="one position"):
        aft_simple_step(q, k, v, None)

"""Nyström attention: exactness with one landmark per position, error falling with more landmarks, the
pseudo-inverse iteration converging, padding of every shape, half precision, options and capabilities.

The conformance suite (tests/conformance) holds the mechanism to the common contract, its fast path to its own
float64 reference() included; these tests hold it to softmax attention and to the paper's maths."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.nystrom import (
    iterative_pinv,
    nystrom_attention,
    nystrom_attention_reference,
    pinv_iterations_reference,
    segment_sizes,
)
from attnzoo.mechanisms import UnsupportedOptionError


def qkv(batch=2, heads=2, q_len=128, k_len=None, dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_len = q_len if k_len is None else k_len
    return tuple(torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64).to(dtype)
                 for n in (q_len, k_len, k_len))


def relative_error(out, exact):
    return float((out.double() - exact).norm() / exact.norm())


# -- accuracy against softmax ---------------------------------------------------------------------------------
def test_one_landmark_per_position_is_exact_softmax_up_to_the_pinv_iterations():
    """With landmarks == N, F = A = B = S (the softmax matrix) and F pinv(A) B = S: the only error left is the
    pseudo-inverse iteration's. Measured on N=128, head_dim 16, standard normal q, k, v (S has condition number
    ~8e3, the slow case for the iteration), max abs error against softmax_attention_reference:

        6 iterations (default), float64: 3.95e-2 (relative 6.1e-2)    tolerance 6e-2
        12 iterations, float64:           7.2e-4                       tolerance 1.5e-3
        20 iterations, float64:           3.2e-14                      tolerance 1e-10
        20 iterations, float32:           1.7e-5                       tolerance 1e-4
    """
    q, k, v = qkv()
    exact = softmax_attention_reference(q, k, v)
    for iterations, dtype, tolerance in ((6, torch.float64, 6e-2), (12, torch.float64, 1.5e-3),
                                         (20, torch.float64, 1e-10), (20, torch.float32, 1e-4)):
        mechanism = attnzoo.build_mechanism("nystrom", 2, 16, landmarks=128, pinv_iterations=iterations)
        out = mechanism(*(t.to(dtype) for t in (q, k, v)))
        error = float((out.double() - exact).abs().max())
        assert error < tolerance, f"{iterations} iterations, {dtype}: max abs error {error:.3g} >= {tolerance:g}"
    # More landmarks than positions: still one per position, the same output.
    many = attnzoo.build_mechanism("nystrom", 2, 16, landmarks=1000, pinv_iterations=20)
    torch.testing.assert_close(many(q, k, v), exact, rtol=0, atol=1e-10)


def test_error_against_softmax_falls_with_more_landmarks():
    """Relative (Frobenius) error against exact softmax attention, N=128, head_dim 16, batch 2, heads 2,
    standard normal q, k, v (seed 0), 6 pseudo-inverse iterations, float64:

        landmarks    8       16      32      64      128
        error        0.726   0.664   0.549   0.453   0.061 (= the iteration's error alone, see above)

    For comparison, the exact pseudo-inverse (torch.linalg.pinv) of the same landmark kernels gives 3.2, 2.0,
    9.0 and 13.3 at 8-64 landmarks: A is ill-conditioned, and the few iterations damp its smallest singular
    directions, which the exact inverse blows up. That is why reference() uses the iteration too.
    """
    q, k, v = qkv()
    exact = softmax_attention_reference(q, k, v)
    errors = [relative_error(nystrom_attention(q, k, v, landmarks=m), exact) for m in (8, 16, 32, 64)]
    expected = [0.726, 0.664, 0.549, 0.453]
    assert all(a > b for a, b in zip(errors, errors[1:])), f"errors {errors} do not fall with more landmarks"
    for got, want in zip(errors, expected):
        assert abs(got - want) < 5e-3, f"errors {errors}, recorded {expected}"


# -- the pseudo-inverse ---------------------------------------------------------------------------------------
def test_iteration_converges_to_the_exact_pseudo_inverse():
    """On a softmax matrix (square, 32 x 32) and a rectangular one (12 x 20, as in cross-attention) the distance
    to torch.linalg.pinv shrinks as the iterations grow and ends at rounding level; the fast, batched
    iteration equals the written-out float64 one; a zero matrix gives zeros."""
    g = torch.Generator().manual_seed(3)
    square = torch.softmax(torch.randn(32, 32, generator=g, dtype=torch.float64), dim=-1)
    wide = torch.softmax(torch.randn(12, 20, generator=g, dtype=torch.float64), dim=-1)
    for a in (square, wide):
        exact = torch.linalg.pinv(a)
        floor = 1e-12 * float(exact.abs().max())  # rounding level
        distances = [float((iterative_pinv(a, n) - exact).abs().max()) for n in range(1, 25)]
        assert all(y < x or y < floor for x, y in zip(distances, distances[1:])), distances
        assert distances[0] > 1.0 and distances[-1] < floor, distances
        batched = torch.stack([a, 2 * a])[None]  # (1, 2, m, n): the scaling is per matrix
        fast = iterative_pinv(batched, 6)
        torch.testing.assert_close(fast[0, 0], pinv_iterations_reference(a, 6), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fast[0, 1], pinv_iterations_reference(2 * a, 6), rtol=1e-10, atol=1e-12)
    zero = torch.zeros(2, 5, 5, dtype=torch.float64, requires_grad=True)
    z = iterative_pinv(zero, 6)
    assert torch.equal(z, torch.zeros_like(z))
    z.sum().backward()
    assert torch.isfinite(zero.grad).all()


def test_iteration_runs_in_float32_for_half_precision_inputs():
    """The pseudo-inverse of half-precision inputs is computed in float32: the output stays near float64's."""
    q, k, v = qkv(q_len=64, dim=16)
    mechanism = attnzoo.build_mechanism("nystrom", 2, 16, landmarks=16)
    expected = mechanism(q, k, v)
    for dtype, tolerance in ((torch.float16, 2e-2), (torch.bfloat16, 1e-1)):
        out = mechanism(*(t.to(dtype) for t in (q, k, v)))
        assert out.dtype == dtype and torch.isfinite(out).all()
        error = float((out.double() - expected).abs().max())
        assert error < tolerance, f"{dtype}: max abs error {error:.3g} against float64"


# -- padding --------------------------------------------------------------------------------------------------
def test_segments_cover_every_position_with_sizes_differing_by_at_most_one():
    assert segment_sizes(11, 4) == [3, 3, 3, 2]
    assert segment_sizes(4096, 256) == [16] * 256
    assert segment_sizes(5, 8) == [1] * 5  # one landmark per position
    for length in range(1, 40):
        for landmarks in (1, 3, 7, 16, 64):
            sizes = segment_sizes(length, landmarks)
            assert sum(sizes) == length and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("cross", [False, True])
def test_random_padding_patterns_match_the_reference_and_hide_what_they_pad(cross):
    """Random masks (fully padded elements and fully padded segments among them), lengths that are no
    multiple of the landmark count: finite, equal to the float64 reference, and NaN/inf at padded positions
    (of q too, in self-attention) changes no unpadded output."""
    g = torch.Generator().manual_seed(5)
    for trial in range(12):
        q_len = int(torch.randint(1, 30, (), generator=g))
        k_len = int(torch.randint(1, 30, (), generator=g)) if cross else q_len
        landmarks = int(torch.randint(1, 9, (), generator=g))
        mask = torch.rand(3, k_len, generator=g) < torch.tensor([[0.2], [0.6], [0.9]])
        if trial % 2 == 0:
            mask[2] = True  # element 2 entirely padded every other trial
        q, k, v = qkv(batch=3, q_len=q_len, k_len=k_len, dim=8, seed=trial)
        mechanism = attnzoo.build_mechanism("nystrom", 2, 8, landmarks=landmarks)
        out = mechanism(q, k, v, key_padding_mask=mask, cross=cross)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, mechanism.reference(q, k, v, False, mask, cross=cross), rtol=1e-7, atol=1e-9)
        padded = mask[:, None, :, None]
        poisoned = [torch.where(padded, torch.full_like(t, math.nan), t) for t in (k, v)]
        q2 = q if cross else torch.where(padded, torch.full_like(q, math.inf), q)
        again = mechanism(q2, *poisoned, key_padding_mask=mask, cross=cross)
        kept = torch.ones_like(out, dtype=torch.bool) if cross else ~padded.expand_as(out)
        torch.testing.assert_close(again[kept], out[kept], rtol=1e-10, atol=1e-12)


def test_a_segment_of_nothing_but_padding_and_a_fully_padded_element():
    """Segment 1 of element 0 (positions 3-5 of 12, 4 landmarks) is all padding: no division by zero, the
    same output as with that landmark removed (the reference removes it); element 1 is all padding: zeros,
    with finite gradients."""
    q, k, v = (t.float().requires_grad_() for t in qkv(q_len=12, dim=8))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 3:6] = True
    mask[1] = True
    mechanism = attnzoo.build_mechanism("nystrom", 2, 8, landmarks=4)
    out = mechanism(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    expected = mechanism.reference(q.detach(), k.detach(), v.detach(), False, mask)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_finite_with_any_padding(dtype):
    q, k, v = qkv(batch=3, q_len=13, dim=8, dtype=dtype)
    mask = torch.zeros(3, 13, dtype=torch.bool)
    mask[1, :7] = True  # whole segments padded
    mask[2] = True
    for options in ({"landmarks": 4}, {"landmarks": 32}, {"landmarks": 4, "conv_kernel": 3}):
        mechanism = attnzoo.build_mechanism("nystrom", 2, 8, **options).to(dtype)
        out = mechanism(q, k, v, key_padding_mask=mask)
        assert out.dtype == dtype and torch.isfinite(out).all(), options
        assert torch.equal(out[2], torch.zeros_like(out[2]))


# -- the convolution residual ---------------------------------------------------------------------------------
def test_conv_residual_adds_a_depthwise_convolution_of_each_heads_values():
    q, k, v = qkv(q_len=10, dim=8)
    torch.manual_seed(1)
    with_conv = attnzoo.build_mechanism("nystrom", 2, 8, landmarks=4, conv_kernel=5).double()
    plain = attnzoo.build_mechanism("nystrom", 2, 8, landmarks=4)
    weight = with_conv.conv_weight.detach()
    assert weight.shape == (2, 5)
    residual = torch.stack(
        [F.conv1d(v[:, h].transpose(1, 2).reshape(-1, 1, 10), weight[h].view(1, 1, 5), padding=2)
         .reshape(2, 8, 10).transpose(1, 2) for h in range(2)], dim=1)
    torch.testing.assert_close(with_conv(q, k, v) - plain(q, k, v), residual, rtol=1e-10, atol=1e-12)
    with_conv(q, k, v).sum().backward()
    assert with_conv.conv_weight.grad is not None and torch.isfinite(with_conv.conv_weight.grad).all()


# -- options and capabilities ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, error, named",
    [
        ({"landmarks": 0}, ValueError, "landmarks"),
        ({"landmarks": -3}, ValueError, "landmarks"),
        ({"landmarks": 2.0}, TypeError, "landmarks"),
        ({"pinv_iterations": 0}, ValueError, "pinv_iterations"),
        ({"pinv_iterations": True}, TypeError, "pinv_iterations"),
        ({"conv_kernel": 0}, ValueError, "conv_kernel"),
        ({"conv_kernel": 4}, ValueError, "conv_kernel"),
        ({"conv_kernel": "3"}, TypeError, "conv_kernel"),
    ],
)
def test_bad_options_are_named(options, error, named):
    with pytest.raises(error, match=named):
        attnzoo.build_mechanism("nystrom", 2, 8, **options)


def test_functional_arguments_are_checked():
    q, k, v = qkv(q_len=6, dim=8)
    with pytest.raises(ValueError, match="landmarks"):
        nystrom_attention(q, k, v, landmarks=0)
    with pytest.raises(ValueError, match="pinv_iterations"):
        nystrom_attention(q, k, v, pinv_iterations=0)
    with pytest.raises(ValueError, match="query_padding_mask"):
        nystrom_attention(q, k, v, query_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="conv_weight"):
        nystrom_attention(q, k, v, conv_weight=torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="conv_weight"):
        nystrom_attention(q[:, :, :5], k, v, conv_weight=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="iterations"):
        iterative_pinv(torch.eye(3), 0)


def test_declaration_and_capabilities():
    cls = attnzoo.mechanisms.mechanism_class("nystrom")
    assert cls.sweep_option == "landmarks" and cls.capabilities.kind == "approximate"
    # bench/peers.py sizes the nystrom-attention peer from this option's default.
    assert attnzoo.mechanism_options("nystrom")["landmarks"] == 64
    caps = attnzoo.capabilities("nystrom")
    assert not caps.causal and caps.cross and caps.key_padding and not caps.recurrent_step
    q, k, v = qkv(q_len=6, dim=8, dtype=torch.float32)
    mechanism = attnzoo.build_mechanism("nystrom", 2, 8)
    with pytest.raises(UnsupportedOptionError, match="causal"):
        mechanism(q, k, v, causal=True)
    with_conv = attnzoo.build_mechanism("nystrom", 2, 8, conv_kernel=3)
    assert not with_conv.capabilities.cross and with_conv.capabilities.limited_by == "conv_kernel=3"
    with pytest.raises(UnsupportedOptionError, match="conv_kernel=3"):
        with_conv(q, k, v, cross=True)
    assert "landmarks=64" in repr(mechanism) and "conv_kernel=3" in repr(with_conv)


def test_cross_attention_takes_landmarks_from_each_sequence():
    """Query landmarks from the queries, key landmarks from the keys: with one landmark per position on both
    sides (and enough iterations) cross-attention is exact softmax attention too."""
    q, k, v = qkv(q_len=9, k_len=20, dim=8)
    mechanism = attnzoo.build_mechanism("nystrom", 2, 8, landmarks=32, pinv_iterations=40)
    torch.testing.assert_close(mechanism(q, k, v, cross=True), softmax_attention_reference(q, k, v),
                               rtol=0, atol=1e-9)

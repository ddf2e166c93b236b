"""FNet token mixing: the fast path against the FFT definition and hand-checked cases, padding, refusals."""

import math

import numpy as np
import pytest
import torch

import attnzoo
from attnzoo.functional.fnet import fourier_mixing, fourier_mixing_reference
from attnzoo.mechanisms import UnsupportedOptionError


def values(batch=2, heads=3, n=7, d=8, dtype=torch.float64, seed=0):
    return torch.randn(batch, heads, n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_constant_sequence_goes_to_the_zero_frequency():
    v = torch.full((1, 2, 6, 4), 0.5, dtype=torch.float64)
    out = fourier_mixing(v)
    expected = torch.zeros_like(v)
    expected[..., 0, 0] = 0.5 * 6 * 4  # the sum of every entry; every other frequency cancels
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(fourier_mixing(v, normalized=True), expected / math.sqrt(24), atol=1e-12, rtol=0)


def test_single_impulse_gives_a_cosine():
    v = torch.zeros(1, 1, 5, 4, dtype=torch.float64)
    v[0, 0, 2, 1] = 1.0
    k, l = torch.meshgrid(torch.arange(5.0, dtype=torch.float64), torch.arange(4.0, dtype=torch.float64), indexing="ij")
    expected = torch.cos(2 * math.pi * (2 * k / 5 + 1 * l / 4))
    torch.testing.assert_close(fourier_mixing(v)[0, 0], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n, d", [(1, 1), (2, 3), (7, 8), (8, 5), (16, 2), (11, 16)])
def test_equals_the_numpy_and_torch_fft_definition(n, d):
    v = values(n=n, d=d)
    expected = np.fft.fft2(v.numpy(), axes=(-2, -1)).real
    np.testing.assert_allclose(fourier_mixing(v).numpy(), expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(fourier_mixing(v), torch.fft.fft(torch.fft.fft(v, dim=-1), dim=-2).real)
    torch.testing.assert_close(fourier_mixing_reference(v), torch.from_numpy(expected), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("normalized", [False, True])
def test_float32_and_gradients_match_the_reference(normalized):
    v = values(n=9, d=6).requires_grad_()
    weights = values(n=9, d=6, seed=1)
    grads = []
    for mix in (fourier_mixing, fourier_mixing_reference):
        v.grad = None
        (mix(v, normalized=normalized) * weights).sum().backward()
        grads.append(v.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-10)
    out32 = fourier_mixing(v.detach().float(), normalized=normalized)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), fourier_mixing_reference(v.detach(), normalized=normalized),
                               atol=1e-4, rtol=1e-4)


def test_padding_zeroes_positions_but_they_still_count_in_the_length():
    v = values(batch=2, n=6, d=4)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, -2:] = True
    mask[1, 0] = True
    out = fourier_mixing(v, mask)
    # The transform of v with zeros at the padded positions, over all 6 positions ...
    zeroed = v.masked_fill(mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, fourier_mixing(zeroed))
    # ... which is not the transform of the shorter, unpadded sequence.
    assert not torch.allclose(out[0, :, :4], fourier_mixing(v[0:1, :, :4])[0])
    # Whatever the padded positions hold changes nothing.
    filled = v.masked_fill(mask[:, None, :, None], float("nan"))
    torch.testing.assert_close(fourier_mixing(filled, mask), out)


def test_mechanism_ignores_queries_and_keys_and_gives_them_zero_gradients():
    mechanism = attnzoo.build_mechanism("fnet", 3, 8)
    assert not list(mechanism.parameters())
    q, k, v = (values(seed=s).requires_grad_() for s in (1, 2, 3))
    out = mechanism(q, k, v)
    torch.testing.assert_close(out, fourier_mixing(v.detach()))
    torch.testing.assert_close(mechanism(values(seed=4), values(seed=5), v), out)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))
    assert v.grad.abs().sum() > 0


def test_mechanism_in_half_precision_keeps_its_dtype():
    mechanism = attnzoo.build_mechanism("fnet", 3, 8, normalized=True)
    v = values()
    for dtype in (torch.float16, torch.bfloat16):
        out = mechanism(v.to(dtype), v.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), fourier_mixing(v, normalized=True), atol=5e-2, rtol=5e-2)


def test_mechanism_refuses_causal_and_cross_attention():
    mechanism = attnzoo.build_mechanism("fnet", 3, 8)
    v = values()
    with pytest.raises(UnsupportedOptionError, match="causal"):
        mechanism(v, v, v, causal=True)
    with pytest.raises(UnsupportedOptionError, match="cross-attention"):
        mechanism(v, v, v, cross=True)
    with pytest.raises(UnsupportedOptionError, match="cross-attention"):
        mechanism(v, values(n=5), values(n=5))


def test_bad_arguments_are_named():
    v = values()
    with pytest.raises(ValueError, match=r"\bv\b"):
        fourier_mixing(v[0])
    with pytest.raises(TypeError, match=r"\bv\b"):
        fourier_mixing(v.long())
    with pytest.raises(ValueError, match="key_padding_mask"):
        fourier_mixing(v, torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="normalized"):
        fourier_mixing(v, normalized="yes")
    with pytest.raises(TypeError, match="normalized"):
        attnzoo.build_mechanism("fnet", 3, 8, normalized=1)

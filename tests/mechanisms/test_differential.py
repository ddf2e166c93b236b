"""Differential attention beyond the conformance suite: the fused path against the float64 definition,
lambda and its re-parametrisation, the norm, grouped keys never repeated, packed batches, bad input."""

import math

import pytest
import torch

import attnzoo
from attnzoo.functional.differential import (
    differential_attention,
    differential_attention_reference,
    lambda_init_for,
    packed_differential_attention,
)
from attnzoo.functional.softmax import softmax_attention_reference
from tensor_records import TensorRecorder


def inputs(batch=2, heads=4, kv_heads=4, q_len=9, k_len=9, dim=8, dim_v=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, k_len, dim_v, generator=generator, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("k_len", [9, 5])
def test_fused_path_and_gradients_equal_the_definition(causal, kv_heads, k_len):
    q, k, v = inputs(kv_heads=kv_heads, k_len=k_len)
    lambda_ = torch.tensor(0.35, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, k_len, dtype=torch.bool)
    mask[1, 1] = mask[1, -1] = True
    out = differential_attention(q, k, v, lambda_, 0.2, causal, mask)
    groups = 4 // kv_heads
    expected = differential_attention_reference(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                lambda_, 0.2, causal, mask)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, lambda_), grad),
                    torch.autograd.grad(expected, (q, k, v, lambda_), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_definition_written_out():
    """Halves of q and k, the scale of a half, the difference, RMS over the value dimension, 1 - lambda_init."""
    q, k, v = inputs()
    first = softmax_attention_reference(q[..., :4], k[..., :4], v, True, scale=0.5)
    second = softmax_attention_reference(q[..., 4:], k[..., 4:], v, True, scale=0.5)
    difference = first - 0.3 * second
    expected = 0.9 * difference / (difference.square().mean(-1, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(differential_attention(q, k, v, 0.3, 0.1, True), expected, rtol=1e-12, atol=1e-12)


def test_lambda_init_and_the_reparametrised_lambda_follow_the_paper():
    assert lambda_init_for(1) == pytest.approx(0.2)
    assert lambda_init_for(4) == pytest.approx(0.8 - 0.6 * math.exp(-0.9))
    assert lambda_init_for(100) == pytest.approx(0.8, abs=1e-9)
    mechanism = attnzoo.build_mechanism("differential", 4, 8, layer_index=3)
    assert mechanism.lambda_init == pytest.approx(lambda_init_for(3))
    with torch.no_grad():
        for p, value in zip((mechanism.lambda_q1, mechanism.lambda_k1, mechanism.lambda_q2, mechanism.lambda_k2),
                            (0.5, 0.25, 0.1, 0.2)):
            p.fill_(value)
    expected = math.exp(4 * 0.125) - math.exp(4 * 0.02) + lambda_init_for(3)
    assert float(mechanism.lambda_().detach()) == pytest.approx(expected)
    # lambda learns: the output's gradient reaches all four vectors.
    q, k, v = (x.float().detach() for x in inputs())
    mechanism(q, k, v, causal=True).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mechanism.parameters())


def test_odd_head_dim_and_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="head_dim must be even.*head_dim=7"):
        attnzoo.build_mechanism("differential", 2, 7)
    q, k, v = inputs(dim=7)
    with pytest.raises(ValueError, match="head_dim"):
        differential_attention(q, k, v, 0.5, 0.2)
    with pytest.raises(ValueError, match="layer_index"):
        attnzoo.build_mechanism("differential", 2, 8, layer_index=0)
    q, k, v = inputs()
    with pytest.raises(ValueError, match="lambda_"):
        differential_attention(q, k, v, torch.tensor(math.nan), 0.2)
    with pytest.raises(ValueError, match="lambda_"):
        differential_attention(q, k, v, torch.ones(2), 0.2)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_keys_and_values_are_never_repeated(causal):
    batch, heads, keys, dim = 2, 8, 200, 8
    mechanism = attnzoo.build_mechanism("differential", heads, dim)
    q = torch.randn(batch, heads, 3, dim, requires_grad=True)
    k, v = (torch.randn(batch, 1, keys, dim, requires_grad=True) for _ in range(2))
    with TensorRecorder() as recorded:
        out = mechanism(q, k, v, causal=causal, cross=True)
        out.square().sum().backward()
    # Keys or values repeated to the 8 query heads (or their halves) would be at least this large.
    assert recorded.largest_floating < batch * heads * keys * dim // 2


def test_packed_rows_equal_each_document_alone():
    q, k, v = inputs(batch=1, q_len=12, k_len=12)
    offsets = torch.tensor([0, 5, 7, 12])
    out = packed_differential_attention(q, k, v, 0.4, 0.2, offsets, causal=True)
    for start, end in ((0, 5), (5, 7), (7, 12)):
        alone = differential_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], 0.4, 0.2, True)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_both_maps_run_on_the_fused_kernel_nothing_n_by_n(causal):
    """Halves of head_dim / 2 against values of head_dim would send SDPA to its math path, which makes the
    (N, N) weights: the queries keep their width instead."""
    batch, heads, seq, dim = 1, 2, 512, 8
    mechanism = attnzoo.build_mechanism("differential", heads, dim)
    q, k, v = (torch.randn(batch, heads, seq, dim, requires_grad=True) for _ in range(3))
    with TensorRecorder() as recorded:
        mechanism(q, k, v, causal=causal).square().sum().backward()
    assert recorded.largest_floating < batch * heads * seq * seq // 8

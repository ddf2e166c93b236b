"""Based (functional.based, mechanism ``based``) beyond the conformance suite: the Taylor kernel, the linear
part against the quadratic form written from the paper, the window part, lengths that cross chunks and window
blocks, decoding past the ring's wrap, and the option errors."""

from __future__ import annotations

import pytest
import torch

from attnzoo.functional.based import (
    based_attention_reference,
    based_attention_unchecked,
    taylor_feature_dim,
    taylor_features,
)
from attnzoo.functional.blocksparse import LocalPattern, blocksparse_attention_reference
from attnzoo.mechanisms import build_mechanism


def _inputs(batch=2, heads=2, length=90, dim=8, features=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64) for _ in range(3))
    q_proj, k_proj = (torch.randn(heads, dim, features, generator=generator, dtype=torch.float64) / dim ** 0.5
                      for _ in range(2))
    return q, k, v, q_proj, k_proj


def test_taylor_kernel():
    a, b = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    dot = (a * b).sum(-1)
    kernel = (taylor_features(a) * taylor_features(b)).sum(-1)
    torch.testing.assert_close(kernel, 1 + dot + dot ** 2 / 2)
    assert taylor_features(a).shape[-1] == taylor_feature_dim(6) == 43


def _linear_part(q, k, v, q_proj, k_proj, causal, mask):
    """Quadratic Taylor linear attention as the paper writes it: weights 1 + s + s^2/2, s = q'.k' / sqrt(m)."""
    s = torch.einsum("bhnd,hdm->bhnm", q, q_proj) @ torch.einsum("bhnd,hdm->bhnm", k, k_proj).transpose(-1, -2)
    weights = 1 + s / q_proj.shape[-1] ** 0.5 + (s / q_proj.shape[-1] ** 0.5) ** 2 / 2
    n = q.shape[2]
    if causal:
        weights = weights * torch.ones(n, n, dtype=weights.dtype).tril()
    if mask is not None:
        weights = weights.masked_fill(mask[:, None, None, :], 0.0)
    return (weights @ v.masked_fill(mask[:, None, :, None], 0.0) if mask is not None else weights @ v) / \
        weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_parts_and_fast_path(causal, padded):
    q, k, v, q_proj, k_proj = _inputs()
    mask = None
    if padded:
        mask = torch.zeros(2, q.shape[2], dtype=torch.bool)
        mask[1, :5] = True
        mask[1, 70:] = True
    expected = based_attention_reference(q, k, v, q_proj, k_proj, 5, causal, mask)
    by_parts = _linear_part(q, k, v, q_proj, k_proj, causal, mask) + \
        blocksparse_attention_reference(q, k, v, LocalPattern(5, 5), causal, mask)
    keep = slice(None) if mask is None else ~mask[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(expected[keep], by_parts[keep], rtol=1e-10, atol=1e-12)
    out = based_attention_unchecked(q, k, v, q_proj, k_proj, 5, causal, mask, 16)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)


def test_decoding_past_the_window():
    torch.manual_seed(0)
    mechanism = build_mechanism("based", 2, 8, feature_dim=4, window=6, chunk_size=8).double()
    q, k, v, _, _ = _inputs(length=40)
    full = mechanism(q, k, v, causal=True)
    out, state = mechanism.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9])
    torch.testing.assert_close(out, full[:, :, :9], rtol=1e-9, atol=1e-11)
    for t in range(9, 40):
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t:t + 1], rtol=1e-9, atol=1e-11)
    assert state.tensors["kv"].shape == (2, 2, taylor_feature_dim(4), 9)


@pytest.mark.parametrize("option", ["feature_dim", "window", "chunk_size"])
def test_bad_options_name_the_option(option):
    with pytest.raises(ValueError, match=option):
        build_mechanism("based", 2, 8, **{option: 0})
    with pytest.raises(TypeError, match=option):
        build_mechanism("based", 2, 8, **{option: 2.5})

"""linformer: exactness at full rank, error against rank, sharing modes and their parameter counts, layerwise
sharing, padding, lengths and bad options. The conformance suite covers the rest of the contract."""

import copy
import math

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.linformer import (
    linformer_attention,
    linformer_attention_reference,
    linformer_attention_unchecked,
)
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism, capabilities, mechanism_class
from attnzoo.mechanisms.linformer import LinformerAttention, pooling_projection


def build(heads=2, head_dim=8, **options):
    options = {"rank": 4, "max_seq_len": 12, **options}
    return build_mechanism("linformer", heads, head_dim, **options).double()


def qkv(length=12, batch=2, heads=2, dim=8, seed=0, k_len=None, dim_v=None):
    g = torch.Generator().manual_seed(seed)
    k_len = length if k_len is None else k_len
    draw = lambda n, d: torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)  # noqa: E731
    return draw(length, dim), draw(k_len, dim), draw(k_len, dim if dim_v is None else dim_v)


def relative_error(out, expected):
    return float((out - expected).detach().norm() / expected.detach().norm())


def perturb(mechanism, seed=1):
    """Move the projections away from their initial value, so that two mechanisms differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mechanism.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mechanism


def test_declaration():
    caps = capabilities("linformer")
    assert (caps.causal, caps.cross, caps.key_padding, caps.recurrent_step) == (False, True, True, False)
    assert caps.kind == "approximate"
    cls = mechanism_class("linformer")
    assert (cls.sweep_option, cls.length_option) == ("rank", "max_seq_len")
    assert attnzoo.mechanism_options("linformer") == {"rank": 256, "max_seq_len": 4096, "sharing": "headwise"}
    assert build(max_seq_len=12).max_length == 12


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
def test_identity_projections_give_exact_softmax(sharing):
    n = 10
    m = build(rank=n, max_seq_len=n, sharing=sharing)
    with torch.no_grad():  # the pooling initialisation is already the identity at rank == max_seq_len
        for p in m.parameters():
            p.copy_(torch.eye(n, dtype=torch.float64).expand_as(p))
    q, k, v = qkv(n)
    expected = softmax_attention_reference(q, k, v)
    torch.testing.assert_close(m(q, k, v), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.reference(q, k, v), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(pooling_projection(n, n), torch.eye(n))


def test_error_against_softmax_falls_with_rank():
    """Relative error ||linformer - softmax|| / ||softmax|| at initialisation (mean pooling of equal spans),
    N=128, head_dim 16, standard normal q, k, v (generator seed 0), measured:

        rank   16      32      64      96      128
        error  0.740   0.707   0.608   0.494   0 (E = F = I)

    Uniform attention (the mean of the values) is at 0.769. Entries drawn N(0, 1/rank) instead give about
    12, 7, 2.8, 1.4 at rank 16, 32, 64, 128 (see ``pooling_projection``)."""
    q, k, v = qkv(128, heads=2, dim=16, seed=0)
    exact = softmax_attention_reference(q, k, v)
    errors = []
    for rank in (16, 32, 64, 96, 128):
        m = build(heads=2, head_dim=16, rank=rank, max_seq_len=128)
        with torch.no_grad():
            errors.append(relative_error(m(q, k, v), exact))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] < relative_error(v.mean(dim=2, keepdim=True).expand_as(v), exact)
    assert errors[-1] < 1e-12
    assert [round(e, 3) for e in errors[:4]] == [0.740, 0.707, 0.608, 0.494]


def test_pooling_columns_are_means_of_equal_spans():
    p = pooling_projection(12, 5)
    torch.testing.assert_close(p.sum(dim=0), torch.ones(5))  # every column a mean
    torch.testing.assert_close(p.sum(dim=1), torch.full((12,), 5 / 12))  # every position counts alike
    assert int((p > 0).sum(dim=1).max()) == 2
    assert torch.equal(pooling_projection(8, 2), torch.tensor([[0.25, 0.0]] * 4 + [[0.0, 0.25]] * 4))


@pytest.mark.parametrize(
    "sharing, count",
    [("none", 2 * 3 * 12 * 4), ("headwise", 2 * 12 * 4), ("kv", 12 * 4)],
)
def test_parameter_counts_of_sharing_modes(sharing, count):
    m = build(heads=3, sharing=sharing)
    assert sum(p.numel() for p in m.parameters()) == count
    e, f = m.projections()
    assert (e is f) == (sharing == "kv")
    assert e.shape == (3 if sharing == "none" else 1, 12, 4)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
def test_fast_path_matches_reference_with_trained_projections(sharing):
    m = perturb(build(heads=3, sharing=sharing))
    q, k, v = qkv(11, heads=3)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 3] = mask[1, -2:] = True
    torch.testing.assert_close(m(q, k, v, key_padding_mask=mask), m.reference(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


def test_layerwise_sharing_ties_one_tensor():
    first, second = perturb(build(sharing="kv"), seed=1), perturb(build(sharing="kv"), seed=2)
    q, k, v = qkv(11)
    assert not torch.allclose(first(q, k, v), second(q, k, v))
    assert second.share_projection_from(first) is second
    assert second.proj_e is first.proj_e and second.proj_f is None
    assert sum(p.numel() for p in nn.ModuleList([first, second]).parameters()) == 12 * 4  # the paper's layerwise
    torch.testing.assert_close(second(q, k, v), first(q, k, v))

    # Gradients of both layers reach the one tensor: their sum.
    weights = torch.randn(2, 2, 11, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    separate = []
    for layer_input in (qkv(11, seed=4), qkv(11, seed=5)):
        alone = copy.deepcopy(first)
        (alone(*layer_input) * weights).sum().backward()
        separate.append(alone.proj_e.grad)
    (first(*qkv(11, seed=4)) * weights + second(*qkv(11, seed=5)) * weights).sum().backward()
    torch.testing.assert_close(first.proj_e.grad, separate[0] + separate[1])

    # Changing it changes both layers.
    before = (first(q, k, v), second(q, k, v))
    with torch.no_grad():
        first.proj_e.mul_(1.5)
    assert not torch.allclose(first(q, k, v), before[0]) and not torch.allclose(second(q, k, v), before[1])

    # Copies and dtype changes keep the tie (the conformance suite deep-copies and casts).
    pair = copy.deepcopy(nn.ModuleList([first, second])).float()
    assert pair[1].proj_e is pair[0].proj_e and pair[0].proj_e.dtype == torch.float32


def test_headwise_sharing_across_layers_ties_both_projections():
    first, second = build(), build()
    second.share_projection_from(first)
    assert second.proj_e is first.proj_e and second.proj_f is first.proj_f
    assert sum(p.numel() for p in nn.ModuleList([first, second]).parameters()) == 2 * 12 * 4


def test_layerwise_sharing_in_an_encoder():
    """The recipe of the class docstring."""
    torch.manual_seed(0)
    options = {"max_seq_len": 16, "rank": 4, "sharing": "kv"}
    encoder = attnzoo.Encoder(dim=16, heads=2, depth=3, self_attention="linformer", self_attention_options=options)
    separate = sum(p.numel() for p in encoder.parameters())
    first = encoder.layers[0].self_attention.mechanism
    for layer in encoder.layers[1:]:
        layer.self_attention.mechanism.share_projection_from(first)
    assert sum(p.numel() for p in encoder.parameters()) == separate - 2 * 16 * 4
    x = torch.randn(2, 13, 16)
    encoder(x).square().sum().backward()
    assert first.proj_e.grad is not None and bool(first.proj_e.grad.abs().sum() > 0)


def test_share_projection_from_refuses_other_shapes():
    with pytest.raises(TypeError, match=r"\bother\b"):
        build().share_projection_from(nn.Linear(2, 2))
    for options in ({"sharing": "kv"}, {"rank": 3}, {"max_seq_len": 13}):
        with pytest.raises(ValueError, match=r"\bother\b"):
            build().share_projection_from(build(**options))
    with pytest.raises(ValueError, match=r"heads"):
        build(heads=2, sharing="none").share_projection_from(build(heads=3, sharing="none"))
    build(heads=2).share_projection_from(build(heads=3))  # one matrix for all heads: heads may differ


def test_padding_takes_no_part():
    m = perturb(build())
    q, k, v = qkv(12)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 9:] = True
    # Zeroed before the projection, trailing padding adds nothing: the same as the shorter sequence.
    torch.testing.assert_close(m(q, k, v, key_padding_mask=mask, cross=True)[:, :, :9],
                               m(q[:, :, :9], k[:, :, :9], v[:, :, :9]))
    # Whatever padded positions hold; an element padded throughout yields zeros.
    mask[1] = True
    k2, v2 = k.clone(), v.clone()
    k2[mask[:, None, :, None].expand_as(k2)] = float("nan")
    v2[mask[:, None, :, None].expand_as(v2)] = float("inf")
    out = m(q, k2, v2, key_padding_mask=mask)
    torch.testing.assert_close(out, m(q, k, v, key_padding_mask=mask))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_shorter_sequences_use_the_leading_rows():
    m = perturb(build(max_seq_len=12))
    q, k, v = qkv(7)
    before = m(q, k, v)
    with torch.no_grad():
        m.proj_e[:, 7:] += 5.0
        m.proj_f[:, 7:] -= 5.0
    torch.testing.assert_close(m(q, k, v), before)
    with torch.no_grad():
        m.proj_e[:, 6, 0] += 1.0  # (a constant row would shift every logit alike)
    assert not torch.allclose(m(q, k, v), before)


def test_lengths():
    m = build(max_seq_len=12)
    m(*qkv(12))
    with pytest.raises(UnsupportedOptionError, match=r"max_seq_len=12.*max_length") as error:
        m(*qkv(13))
    assert "13" in str(error.value)
    # Cross-attention: the keys are limited, the queries (not projected) are not.
    assert m(*qkv(20, k_len=12), cross=True).shape == (2, 2, 20, 8)
    with pytest.raises(UnsupportedOptionError, match=r"key length 13 exceeds max_seq_len=12"):
        m(*qkv(3, k_len=13), cross=True)
    with pytest.raises(UnsupportedOptionError, match=r"\bcausal\b"):
        m(*qkv(12), causal=True)
    with pytest.raises(ValueError, match=r"max_length"):
        attnzoo.MultiHeadAttention(16, 2, "linformer", rank=4, max_seq_len=8)(torch.randn(1, 9, 16))


@pytest.mark.parametrize(
    "options, pattern, error",
    [
        ({"rank": 0}, r"\brank\b", ValueError),
        ({"rank": -3}, r"\brank\b", ValueError),
        ({"rank": 2.0}, r"\brank\b", TypeError),
        ({"max_seq_len": 0}, r"\bmax_seq_len\b", ValueError),
        ({"rank": 13, "max_seq_len": 12}, r"rank=13 exceeds max_seq_len=12", UnsupportedOptionError),
        ({"sharing": "layerwise"}, r"\bsharing\b", ValueError),
        ({"sharing": None}, r"\bsharing\b", ValueError),
    ],
)
def test_bad_options(options, pattern, error):
    with pytest.raises(error, match=pattern):
        build_mechanism("linformer", 2, 8, **{"rank": 4, "max_seq_len": 12, **options})


def test_functional_checks_and_matches_reference():
    q, k, v = qkv(6, k_len=9, dim_v=5)
    g = torch.Generator().manual_seed(7)
    e = torch.randn(2, 10, 4, generator=g, dtype=torch.float64)
    f = torch.randn(1, 10, 4, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 2] = True
    out = linformer_attention(q, k, v, e, f, mask, scale=0.5)
    assert out.shape == (2, 2, 6, 5)
    torch.testing.assert_close(out, linformer_attention_reference(q, k, v, e, f, mask, scale=0.5))
    # One matrix for keys and values (projected in one matmul), even with a value width of its own.
    torch.testing.assert_close(linformer_attention_unchecked(q, k, v, e, e, None, None),
                               linformer_attention_reference(q, k, v, e, e))
    q, k, v = qkv(6, k_len=9)
    torch.testing.assert_close(linformer_attention_unchecked(q, k, v, f, f, mask, None),
                               linformer_attention_reference(q, k, v, f, f, mask))
    with pytest.raises(ValueError, match=r"key_projection has 8 rows"):
        linformer_attention(q, k, v, e[:, :8], f)
    with pytest.raises(ValueError, match=r"value_projection must have shape"):
        linformer_attention(q, k, v, e, torch.zeros(3, 10, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"share the rank"):
        linformer_attention(q, k, v, e, f[:, :, :3])
    with pytest.raises(ValueError, match=r"\bscale\b"):
        linformer_attention(q, k, v, e, f, scale=-1.0)


def test_half_precision_stays_close():
    m = perturb(build())
    q, k, v = qkv(12)
    expected = m(q, k, v)
    for dtype, tolerance in ((torch.float16, 2e-2), (torch.bfloat16, 1e-1)):
        out = copy.deepcopy(m).to(dtype)(*(t.to(dtype) for t in (q, k, v)))
        assert out.dtype == dtype
        assert relative_error(out.double(), expected) < tolerance


def test_repr_names_the_options():
    assert "rank=4, max_seq_len=12, sharing='kv'" in repr(build(sharing="kv"))


def test_pooling_at_the_default_sizes_averages_whole_blocks():
    m = build_mechanism("linformer", 2, 8)  # rank 256 of 4096 positions: blocks of 16
    assert isinstance(m, LinformerAttention) and m.proj_e.shape == (1, 4096, 256)
    assert torch.equal(m.proj_e[0], torch.eye(256).repeat_interleave(16, dim=0) / 16)
    assert math.isclose(float(m.proj_f.detach().sum()), 256.0)

"""Feature maps: samplers, FAVOR+ unbiasedness and stabilisers, seeded explicit redraws, buffers, Hedgehog's
learned softmax features, bad input."""

import io
import math

import pytest
import torch

from attnzoo.feature_maps import (
    EluFeatureMap,
    FavorPositiveFeatures,
    FavorTrigFeatures,
    HedgehogFeatureMap,
    ReluFeatureMap,
    exp_features,
    gaussian_projection,
    orthogonal_projection,
    redraw_generator,
    resolve_feature_map,
)
from attnzoo.functional import linear_attention
from attnzoo.functional.features import hedgehog_decoding_weights, hedgehog_features, hedgehog_features_decoding


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_elu_and_relu_maps():
    x = torch.tensor([[-2.0, 0.0, 3.0]]).view(1, 1, 1, 3)
    torch.testing.assert_close(EluFeatureMap()(x), torch.tensor([math.exp(-2.0), 1.0, 4.0]).view(1, 1, 1, 3))
    torch.testing.assert_close(ReluFeatureMap()(x), torch.tensor([0.0, 0.0, 3.0]).view(1, 1, 1, 3))
    assert isinstance(resolve_feature_map("elu"), EluFeatureMap)


def test_orthogonal_projection_blocks_are_orthogonal_with_chi_norms():
    dim = 16
    w = orthogonal_projection(40, dim, generator=seeded(0), dtype=torch.float64)
    assert w.shape == (40, dim)
    directions = w / w.norm(dim=1, keepdim=True)
    for block in (directions[:16], directions[16:32], directions[32:]):
        gram = block @ block.T
        torch.testing.assert_close(gram, torch.eye(len(block), dtype=torch.float64), atol=1e-12, rtol=0)
    # Squared chi(d) norms have mean d; over 2048 rows the standard error is sqrt(2 d / 2048) = 0.125, so a
    # tolerance of 0.75 is six standard errors.
    norms = orthogonal_projection(2048, dim, generator=seeded(1), dtype=torch.float64).norm(dim=1)
    assert abs(norms.pow(2).mean().item() - dim) < 0.75
    # Not all rows share one norm (which a plain orthogonal matrix times sqrt(d) would).
    assert norms.std() > 0.3


def test_samplers_are_seeded():
    for sampler in (gaussian_projection, orthogonal_projection):
        assert torch.equal(sampler(8, 4, generator=seeded(3)), sampler(8, 4, generator=seeded(3)))
        assert not torch.equal(sampler(8, 4, generator=seeded(3)), sampler(8, 4, generator=seeded(4)))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("orthogonal", [False, True])
def test_favor_positive_features_estimate_the_softmax_kernel(symmetric, orthogonal):
    dim = 8
    g = seeded(5)
    q, k = (0.5 * torch.randn(1, 1, 6, dim, generator=g, dtype=torch.float64) for _ in "qk")
    features = FavorPositiveFeatures(dim, 16384, symmetric=symmetric, orthogonal=orthogonal, generator=seeded(6))
    features = features.double()
    estimate = features(q) @ features(k).transpose(-1, -2)
    exact = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(dim))
    # Relative variance of one positive feature is exp(|q' + k'|^2) - 1 <= e - 1 here (|q'|, |k'| <= ~0.7), so
    # with 16384 features the relative standard deviation is below 1.3%; 8% is six standard deviations.
    assert ((estimate - exact).abs() / exact).max() < 0.08


@pytest.mark.parametrize("symmetric", [False, True])
def test_favor_plus_plus_features_estimate_the_softmax_kernel(symmetric):
    dim, nb_features, a = 8, 16384, -0.1
    g = seeded(5)
    q, k = (0.7 * torch.randn(1, 1, 6, dim, generator=g, dtype=torch.float64) for _ in "qk")
    features = FavorPositiveFeatures(dim, nb_features, symmetric=symmetric, generator=seeded(6)).double()
    quadratic = torch.full((1, 1, 1, 1), a, dtype=torch.float64)
    estimate = features(q, quadratic) @ features(k, quadratic).transpose(-1, -2)
    exact = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(dim))
    # Relative variance of one feature: ((1-4A)^2/(1-8A))^(d/2) exp(|q'+k'|^2/(1-8A)) - 1 (iid rows; orthogonal
    # rows only lower it). Every entry must lie within six of its standard deviations; leaving out D, or a
    # wrong B, shifts the entries by a factor (here 1.4^2 for D), dozens of standard deviations.
    pair_sq = ((q.unsqueeze(-2) + k.unsqueeze(-3)) * dim**-0.25).pow(2).sum(-1)
    moment = ((1 - 4 * a) ** 2 / (1 - 8 * a)) ** (dim / 2) * torch.exp(pair_sq / (1 - 8 * a))
    std = ((moment - 1) / nb_features).sqrt()
    assert (((estimate - exact).abs() / exact) / std).max() < 6


def test_favor_plus_plus_coefficient_minimises_the_second_moment():
    dim = 16
    features = FavorPositiveFeatures(dim, 8, generator=seeded(0)).double()
    zeros = torch.zeros(1, 1, 4, dim, dtype=torch.float64)
    assert torch.equal(features.optimal_quadratic(zeros, zeros, self_attention=True),
                       torch.zeros(1, 1, 1, 1, dtype=torch.float64))
    q = 1.5 * torch.randn(2, 3, 7, dim, generator=seeded(1), dtype=torch.float64)
    k = 1.5 * torch.randn(2, 3, 9, dim, generator=seeded(2), dtype=torch.float64)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, -4:] = True
    a = features.optimal_quadratic(q, k, mask, self_attention=False)
    assert a.shape == (2, 3, 1, 1) and (a < 0).all()
    # Padded keys are left out: the same as dropping them.
    torch.testing.assert_close(a[1:], features.optimal_quadratic(q[1:], k[1:, :, :5], self_attention=False))

    # The mean over pairs of the log second moment, written out directly, is smallest at the returned A.
    def mean_log_moment(a, b, h):
        qs, ks = q[b, h] * dim**-0.25, k[b, h, ~mask[b]] * dim**-0.25
        pair_sq = (qs[:, None] + ks[None]).pow(2).sum(-1)
        return (dim / 2 * math.log((1 - 4 * a) ** 2 / (1 - 8 * a)) + pair_sq / (1 - 8 * a)).mean().item()

    for b in range(2):
        for h in range(3):
            best = a[b, h].item()
            for step in (-0.02, 0.02):
                assert mean_log_moment(best, b, h) < mean_log_moment(best + step, b, h)


@pytest.mark.parametrize("features, quadratic", [
    (FavorPositiveFeatures(8, 32, generator=seeded(0)), None),
    (FavorPositiveFeatures(8, 32, symmetric=False, generator=seeded(0)), None),
    (FavorPositiveFeatures(8, 32, generator=seeded(0)), -0.3),
    (FavorPositiveFeatures(8, 32, symmetric=False, generator=seeded(0)), -0.3),
    (FavorTrigFeatures(8, 32, generator=seeded(0)), None),
])
def test_stabilised_features_differ_only_by_factors_that_cancel(features, quadratic):
    features = features.double()
    x = 3.0 * torch.randn(2, 3, 10, 8, generator=seeded(1), dtype=torch.float64)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, -3:] = True
    extra = {}
    if quadratic is not None:  # one A per (batch, head), all different
        extra["quadratic"] = quadratic * torch.linspace(0.5, 1.5, 6, dtype=torch.float64).view(2, 3, 1, 1)
    exact = features(x, **extra)
    stable_k, log_scale = features.key_features(x, mask, **extra)
    assert log_scale.shape == (2, 3, 1, 1)
    # Padded keys get zero features (the attention core would drop them anyway); the others are exact.
    keep = ~mask[:, None, :, None]
    torch.testing.assert_close(stable_k * torch.exp(log_scale), exact * keep, rtol=1e-10, atol=0)
    ratio = features.query_features(x, **extra) / exact
    # One positive factor per query row.
    torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-10, atol=0)
    assert (ratio > 0).all()


def test_positive_features_of_large_inputs_are_finite_and_keep_their_largest_entry():
    features = FavorPositiveFeatures(64, 64, generator=seeded(0))
    x = 100.0 * torch.randn(1, 2, 32, 64, generator=seeded(1))
    phi_q = features.query_features(x)
    phi_k, _ = features.key_features(x)
    assert torch.isfinite(phi_q).all() and torch.isfinite(phi_k).all()
    # The stabiliser divides by the row maximum: every query row keeps an entry of exactly 1.
    torch.testing.assert_close(phi_q.amax(-1), torch.ones(1, 2, 32))


def test_padded_keys_do_not_set_the_key_scale():
    features = FavorPositiveFeatures(8, 16, generator=seeded(0)).double()
    x = torch.randn(1, 1, 5, 8, generator=seeded(1), dtype=torch.float64)
    huge = x.clone()
    huge[0, 0, -1] = 1000.0
    mask = torch.tensor([[False, False, False, False, True]])
    torch.testing.assert_close(features.key_features(huge, mask)[1], features.key_features(x, mask)[1])


@pytest.mark.parametrize("features", [FavorPositiveFeatures(8, 16, generator=seeded(0)),
                                      FavorTrigFeatures(8, 16, generator=seeded(0))])
def test_padded_keys_of_any_size_get_zero_features_and_gradients(features):
    x = torch.randn(1, 1, 5, 8, generator=seeded(1))
    x[0, 0, -1] = 1000.0  # its features would overflow float32 by far
    x.requires_grad_()
    mask = torch.tensor([[False, False, False, False, True]])
    phi, _ = features.key_features(x, mask)
    assert torch.isfinite(phi).all() and (phi[0, 0, -1] == 0).all()
    phi.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[0, 0, -1] == 0).all()


def test_exp_features_gradients():
    g = seeded(2)
    p = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    offset = torch.randn(2, 3, 1, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 1, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for symmetric in (False, True):
        assert torch.autograd.gradcheck(lambda a, b: exp_features(a, b, symmetric), (p, offset))
        assert torch.autograd.gradcheck(lambda a, b, c: exp_features(a, b, symmetric, c), (p, offset, bias))


def test_exp_features_bias_must_not_widen_the_logits():
    p, offset = torch.randn(4, 5), torch.zeros(4, 1)
    for symmetric in (False, True):
        with pytest.raises(ValueError, match="bias of shape"):
            exp_features(p, offset, symmetric, torch.zeros(2, 1, 1, 5))
        assert exp_features(p, offset, symmetric, torch.zeros(5, dtype=torch.float64)).dtype == torch.float32


def test_redraw_is_explicit_and_seeded():
    features = FavorPositiveFeatures(8, 16, generator=seeded(0))
    x = torch.randn(1, 1, 4, 8)
    before = features.projection.clone()
    for mode in (features.train, features.eval):
        mode()
        features.query_features(x)
        features.key_features(x)
        assert torch.equal(features.projection, before)
    features.redraw(seeded(7))
    first = features.projection.clone()
    assert not torch.equal(first, before)
    features.redraw(seeded(7))
    assert torch.equal(features.projection, first)


def test_redraw_interval_counts_explicit_training_steps_only():
    features = FavorPositiveFeatures(8, 16, redraw_interval=2, generator=seeded(0))
    start = features.projection.clone()
    features.eval()
    assert not features.after_optimizer_step(0, 1) and not features.after_optimizer_step(1, 1)
    assert torch.equal(features.projection, start)
    features.train()
    assert not features.after_optimizer_step(2, 1)
    assert torch.equal(features.projection, start)
    assert features.after_optimizer_step(3, 1)
    assert not torch.equal(features.projection, start)
    # Without an interval nothing is ever redrawn implicitly.
    fixed = FavorPositiveFeatures(8, 16, generator=seeded(0))
    assert not fixed.after_optimizer_step(0, 1)


def test_redraws_have_one_way_in():
    """Scheduled redraws go through the training hook alone (per mechanism, or hooks.after_optimizer_step over
    a model); the model-wide helper and the generator-taking step counters that duplicated it are gone."""
    import attnzoo.feature_maps
    import attnzoo.training.checkpoint
    from attnzoo.mechanisms import PerformerAttention

    assert not hasattr(attnzoo.feature_maps, "redraw_random_features")
    assert not hasattr(attnzoo.feature_maps.RandomFeatureMap, "maybe_redraw")
    assert not any(hasattr(PerformerAttention, name) for name in ("maybe_redraw_features", "redraw_features"))
    assert not hasattr(attnzoo.training.checkpoint, "latest_step")


def test_the_training_hook_redraws_from_the_generator_of_seed_and_step():
    features = FavorPositiveFeatures(8, 16, redraw_interval=1, generator=seeded(0))
    twin = FavorPositiveFeatures(8, 16, redraw_interval=1, generator=seeded(0))
    assert features.after_optimizer_step(3, 7)
    twin.redraw(redraw_generator(7, 3))
    assert torch.equal(features.projection, twin.projection)
    assert not FavorPositiveFeatures(8, 16, generator=seeded(0)).after_optimizer_step(3, 7)  # no interval
    features.eval()
    assert not features.after_optimizer_step(4, 7)  # evaluation counts no steps
    with pytest.raises(ValueError, match="seed"):
        features.after_optimizer_step(0, -1)


def test_state_dict_round_trip_gives_identical_features():
    a = FavorPositiveFeatures(8, 16, generator=seeded(0))
    b = FavorPositiveFeatures(8, 16, generator=seeded(1))
    x = torch.randn(1, 2, 5, 8)
    assert not torch.equal(a.query_features(x), b.query_features(x))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer))
    assert torch.equal(a.query_features(x), b.query_features(x))
    assert torch.equal(linear_attention(x, x, x, a), linear_attention(x, x, x, b))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FavorPositiveFeatures(8, 0), "nb_features"),
        (lambda: FavorPositiveFeatures(8, 15), "nb_features must be even"),
        (lambda: FavorTrigFeatures(8, 7), "nb_features must be even"),
        (lambda: FavorPositiveFeatures(0, 16), "head_dim"),
        (lambda: FavorPositiveFeatures(8, 16, redraw_interval=0), "redraw_interval"),
        (lambda: resolve_feature_map("softmax"), "feature_map"),
    ],
)
def test_bad_options_name_the_option(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_head_dim_mismatch_is_an_error():
    features = FavorPositiveFeatures(8, 16)
    with pytest.raises(ValueError, match="head_dim=8"):
        features.query_features(torch.randn(1, 1, 3, 6))


@pytest.mark.parametrize("symmetric", [False, True])
def test_favor_halves_keep_antithetic_pairs_together(symmetric):
    features = FavorPositiveFeatures(8, 12, symmetric=symmetric, generator=torch.Generator().manual_seed(0))
    second = features.second_half()
    assert second.dtype == torch.bool and second.shape == (12,)
    assert int(second.sum()) == 6
    if symmetric:  # feature i and i + 6 come from the projections w_i and -w_i
        assert torch.equal(second[:6], second[6:])
    with pytest.raises(ValueError, match="nb_features=2"):
        FavorPositiveFeatures(8, 2, symmetric=True).second_half()


# -- Hedgehog ---------------------------------------------------------------------------------------------------
def _hedgehog_written_out(x, weight, bias):
    """[softmax(y), softmax(-y)] with y = x W_h + b_h, head by head, exp over the sum of exp."""
    heads = []
    for h in range(x.shape[1]):
        y = x[:, h] @ weight[h] + bias[h]
        pos, neg = torch.exp(y), torch.exp(-y)
        heads.append(torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], dim=-1))
    return torch.stack(heads, dim=1)


def test_hedgehog_features_are_the_two_softmaxes_of_each_heads_map():
    g = seeded(0)
    x = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(3, 4, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    features = hedgehog_features(x, weight, bias)
    torch.testing.assert_close(features, _hedgehog_written_out(x, weight, bias), rtol=1e-14, atol=1e-14)
    assert features.shape == (2, 3, 5, 12) and bool((features > 0).all())
    torch.testing.assert_close(features[..., :6].sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    torch.testing.assert_close(hedgehog_features(x, weight, None), hedgehog_features(x, weight, torch.zeros(3, 6)))
    # Large inputs: softmax subtracts its maximum, so nothing overflows (float32, logits of 1e4).
    huge = hedgehog_features(1e4 * x.float(), weight.float(), None)
    assert bool(torch.isfinite(huge).all()) and huge.dtype == torch.float32


def test_hedgehog_features_gradients():
    """The hand-written backward (from the output alone) against finite differences, for x, W and b."""
    g = seeded(1)
    x = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(hedgehog_features, (x, weight, bias))


@pytest.mark.parametrize("batch", [1, 2])
def test_hedgehog_paths_without_gradient_and_for_decoding_equal_the_function(batch):
    """Without a gradient the map skips its autograd Function, and with one row it takes the batched product
    directly: the same features bit for bit as the Function's path. A decoding step's form (the logits and
    their negation stacked, one softmax) equals them too, also for a None bias."""
    g = seeded(2)
    x = torch.randn(batch, 3, 5, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 6, generator=g, dtype=torch.float64)
    with_function = hedgehog_features(x, weight, bias)
    assert with_function.grad_fn is not None
    with torch.no_grad():
        plain = hedgehog_features(x, weight, bias)
        for b in (bias, None):
            decoding = hedgehog_features_decoding(x, *hedgehog_decoding_weights(weight, b, torch.float64))
            torch.testing.assert_close(decoding, hedgehog_features(x, weight, b), rtol=1e-14, atol=1e-14)
            assert decoding.shape == (batch, 3, 5, 12)
    assert torch.equal(plain, with_function.detach())
    torch.testing.assert_close(with_function, _hedgehog_written_out(x, weight, bias), rtol=1e-14, atol=1e-14)


def test_hedgehog_map_starts_as_the_identity_or_a_seeded_draw():
    square = HedgehogFeatureMap(3, 4)
    assert square.nb_features == 8 and square.bias.shape == (3, 4)
    torch.testing.assert_close(square.weight, torch.eye(4).expand(3, 4, 4))
    assert not bool(square.bias.any())
    assert {name for name, _ in square.named_parameters()} == {"weight", "bias"}
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    expected = torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)
    torch.testing.assert_close(square.double()(x), expected)
    features, log_scale = square.double().key_features(x)
    assert log_scale is None and torch.equal(features, square.double().query_features(x))
    wide, again = HedgehogFeatureMap(3, 4, 6, generator=seeded(5)), HedgehogFeatureMap(3, 4, 6, generator=seeded(5))
    assert wide.weight.shape == (3, 4, 6) and wide.nb_features == 12 and torch.equal(wide.weight, again.weight)
    assert not torch.equal(wide.weight, HedgehogFeatureMap(3, 4, 6, generator=seeded(6)).weight)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: HedgehogFeatureMap(0, 4), "heads"),
        (lambda: HedgehogFeatureMap(2, 4, 0), "feature_dim"),
        (lambda: HedgehogFeatureMap(2, 4, 1.5), "feature_dim"),
        (lambda: HedgehogFeatureMap(2, 4)(torch.randn(1, 3, 5, 4)), "heads=2"),
        (lambda: HedgehogFeatureMap(2, 4)(torch.randn(1, 2, 5, 6)), "head_dim=4"),
        (lambda: hedgehog_features(torch.randn(1, 2, 5, 4), torch.randn(2, 3, 6)), "weight"),
        (lambda: hedgehog_features(torch.randn(1, 2, 5, 4), torch.randn(2, 4, 6), torch.randn(2, 5)), "bias"),
    ],
)
def test_hedgehog_bad_input_names_it(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()

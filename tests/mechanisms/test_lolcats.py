"""LoLCATs attention (functional.lolcats, mechanism ``lolcats``) beyond the conformance suite: the fast path
against the float64 reference and both against a per-token recurrence written here from the definition,
gradients of every learned parameter, the window covering the sequence (exact softmax), padding on either side
across window blocks, decoding past the ring's wrap, memory, parameters and options."""

from __future__ import annotations

import math

import pytest
import torch

from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.lolcats import LolcatsWeights, lolcats_attention_reference, lolcats_attention_unchecked
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from attnzoo.mechanisms.capabilities import PADDED_RIGHT
from tensor_records import TensorRecorder


def _weights(heads=2, dim=8, features=3, seed=0, requires_grad=False, decay=False):
    """Random (non-identity) maps and window factors, so that every parameter matters; with ``decay``, decay
    logits around 1 (lambda about 0.6 to 0.85: a key's weight visibly shrinks over a few positions)."""
    g = torch.Generator().manual_seed(seed)
    made = LolcatsWeights(
        torch.randn(heads, dim, features, generator=g, dtype=torch.float64),
        torch.randn(heads, features, generator=g, dtype=torch.float64),
        torch.randn(heads, dim, features, generator=g, dtype=torch.float64),
        torch.randn(heads, features, generator=g, dtype=torch.float64),
        torch.randn(heads, generator=g, dtype=torch.float64),
        1.0 + 0.5 * torch.rand(heads, generator=g, dtype=torch.float64) if decay else None,
    )
    return LolcatsWeights(*(None if w is None else w.requires_grad_(requires_grad) for w in made))


def _decay(weights, h):
    """lambda_h, or 1 without a decay."""
    return 1.0 if weights.decay_logit is None else torch.sigmoid(weights.decay_logit[h])


def _inputs(batch=2, heads=2, length=40, dim=8, seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
            for _ in range(3)]


def _phi(x, weight, bias):
    """Hedgehog's features written out: softmax of x W + b and of its negation."""
    y = x @ weight + bias
    return torch.cat([torch.exp(y) / torch.exp(y).sum(-1), torch.exp(-y) / torch.exp(-y).sum(-1)])


def _by_recurrence(q, k, v, weights, window, scale, sinks=0):
    """Causal LoLCATs token by token, as a decoder runs it: the last ``window`` keys kept in a list, the keys
    that leave it folded into a linear state ``sum phi_k(k_j) [v_j, 1]^T`` (the first ``sinks`` kept in the
    list instead, for good), and each output the kept keys' ``f exp(s - max s)`` terms plus ``phi_q(q) .
    state``, divided by their last column. With a decay, the state is multiplied by lambda at every position
    before the leaving key joins it."""
    batch, heads, length, _ = q.shape
    out = torch.zeros_like(v)
    for b in range(batch):
        for h in range(heads):
            f = torch.sigmoid(weights.window_factor[h])
            state = torch.zeros(2 * weights.query_weight.shape[-1], v.shape[-1] + 1, dtype=torch.float64)
            kept = []
            for i in range(length):
                kept.append(i)
                leaving = i - window  # the key that leaves the window now, unless it is a sink
                state = _decay(weights, h) * state
                if leaving >= sinks:
                    j = kept.pop(kept.index(leaving))
                    phi_k = _phi(k[b, h, j], weights.key_weight[h], weights.key_bias[h])
                    state = state + torch.outer(phi_k, torch.cat([v[b, h, j], torch.ones(1, dtype=torch.float64)]))
                logits = torch.stack([scale * q[b, h, i] @ k[b, h, j] for j in kept])
                sums = sum(f * torch.exp(s - logits.max()) * torch.cat([v[b, h, j], torch.ones(1, dtype=torch.float64)])
                           for s, j in zip(logits, kept))
                sums = sums + _phi(q[b, h, i], weights.query_weight[h], weights.query_bias[h]) @ state
                out[b, h, i] = sums[:-1] / sums[-1]
    return out


def _by_query(q, k, v, weights, window, scale, sinks=0):
    """Non-causal LoLCATs query by query from the definition: keys with ``|i - j| < window`` and the first
    ``sinks`` by softmax terms relative to their largest logit, the others by Hedgehog's kernel (times
    ``lambda^(|i - j| - window)`` with a decay)."""
    batch, heads, length, _ = q.shape
    out = torch.zeros_like(v)
    for b in range(batch):
        for h in range(heads):
            f = torch.sigmoid(weights.window_factor[h])
            for i in range(length):
                near = [j for j in range(length) if abs(i - j) < window or j < sinks]
                top = max(scale * q[b, h, i] @ k[b, h, j] for j in near)
                phi_q = _phi(q[b, h, i], weights.query_weight[h], weights.query_bias[h])
                terms = [f * torch.exp(scale * q[b, h, i] @ k[b, h, j] - top) if j in near
                         else phi_q @ _phi(k[b, h, j], weights.key_weight[h], weights.key_bias[h])
                         * _decay(weights, h) ** (abs(i - j) - window)
                         for j in range(length)]
                out[b, h, i] = sum(t * v[b, h, j] for j, t in enumerate(terms)) / sum(terms)
    return out


@pytest.mark.parametrize("window, sinks, decay", [(1, 0, False), (3, 0, False), (8, 0, False), (30, 0, False),
                                                 (1, 1, False), (3, 2, False), (8, 4, False), (30, 4, False),
                                                 (1, 0, True), (3, 2, True), (8, 0, True)])
def test_reference_and_fast_path_are_the_recurrence(window, sinks, decay):
    q, k, v = _inputs(length=23)
    weights = _weights(decay=decay)
    scale = 0.4
    expected = _by_recurrence(q, k, v, weights, window, scale, sinks)
    reference = lolcats_attention_reference(q, k, v, weights, window, True, None, scale, sinks)
    fast = lolcats_attention_unchecked(q, k, v, weights, window, True, None, scale, 4, None, sinks)
    torch.testing.assert_close(reference, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window, sinks, decay", [(1, 0, False), (4, 0, False), (30, 0, False), (1, 1, False),
                                                 (4, 3, False), (1, 0, True), (4, 3, True)])
def test_non_causal_reference_and_fast_path_follow_the_definition(window, sinks, decay):
    q, k, v = _inputs(batch=1, length=17)
    weights = _weights(decay=decay)
    expected = _by_query(q, k, v, weights, window, 8 ** -0.5, sinks)
    torch.testing.assert_close(lolcats_attention_reference(q, k, v, weights, window, False, None, None, sinks),
                               expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lolcats_attention_unchecked(q, k, v, weights, window, False, None, None, 4, None,
                                                           sinks), expected, rtol=1e-12, atol=1e-12)


# (length, window, chunk): windows of one block and of a band of several (blocks of min(window, 64)), lengths
# ending inside a block, the linear part empty (window >= length) and a single position.
SHAPES = [(90, 5, 4), (150, 70, 16), (130, 64, 32), (41, 64, 8), (1, 3, 4), (65, 1, 64)]


@pytest.mark.parametrize("sinks, decay", [(0, False), (4, False), (4, True)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length, window, chunk", SHAPES)
def test_fast_path_matches_reference(causal, length, window, chunk, sinks, decay):
    sinks = min(sinks, window)
    q, k, v = _inputs(length=length)
    weights = _weights(decay=decay)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[1, : length // 4] = True
    mask[1, length - length // 5 :] = True
    for padding in (None, mask):
        expected = lolcats_attention_reference(q, k, v, weights, window, causal, padding, None, sinks)
        actual = lolcats_attention_unchecked(q, k, v, weights, window, causal, padding, None, chunk, None, sinks)
        torch.testing.assert_close(actual, expected, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("sinks, decay", [(0, False), (3, False), (3, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_of_every_parameter_match_the_reference(causal, sinks, decay):
    """q, k, v, both maps' weights and biases, the window factor and the decay: the hand-written window
    backward (with the gradient through each row's maximum, and the sinks' gradients summed over the query
    blocks) and the kernelized core's against autograd on the reference."""
    q, k, v = _inputs(length=75, requires_grad=True)
    weights = _weights(requires_grad=True, decay=decay)
    mask = torch.zeros(2, 75, dtype=torch.bool)
    mask[0, 1] = True  # a padded sink
    mask[0, 5:9] = True
    mask[1, 60:] = True
    leaves = [q, k, v, *(w for w in weights if w is not None)]
    cotangent = torch.randn(2, 2, 75, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    fast = lolcats_attention_unchecked(q, k, v, weights, 20, causal, mask, None, 8, None, sinks)
    reference = lolcats_attention_reference(q, k, v, weights, 20, causal, mask, None, sinks)
    expected = torch.autograd.grad((reference * cotangent).sum(), leaves)
    actual = torch.autograd.grad((fast * cotangent).sum(), leaves)
    names = ["q", "k", "v", *LolcatsWeights._fields]
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")
        assert bool(e.abs().max() > 0), name


@pytest.mark.parametrize("sinks, decay", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_fast_path_gradcheck(causal, sinks, decay):
    q, k, v = _inputs(batch=1, length=10, dim=4, requires_grad=True)
    weights = _weights(dim=4, features=2, requires_grad=True, decay=decay)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 7] = True

    def attend(q, k, v, *parameters):
        return lolcats_attention_unchecked(q, k, v, LolcatsWeights(*parameters), 3, causal, mask, None, 2, None,
                                           sinks)

    assert torch.autograd.gradcheck(attend, (q, k, v, *(w for w in weights if w is not None)))


@pytest.mark.parametrize("causal", [True, False])
def test_a_window_over_the_whole_sequence_is_exact_softmax(causal):
    """With every key in the window the linear terms are gone and the window's weight cancels."""
    mechanism = build_mechanism("lolcats", 2, 8, window=40).double()
    with torch.no_grad():
        mechanism.window_factor.fill_(3.0)
    q, k, v = _inputs(length=40)
    with torch.no_grad():
        torch.testing.assert_close(mechanism(q, k, v, causal=causal), softmax_attention_reference(q, k, v, causal),
                                   rtol=1e-12, atol=1e-12)


def test_parameters_and_their_start():
    mechanism = build_mechanism("lolcats", 3, 8)
    assert {name for name, _ in mechanism.named_parameters()} == {
        "query_map.weight", "query_map.bias", "key_map.weight", "key_map.bias", "window_factor"}
    assert mechanism.window == 64 and mechanism.feature_dim == 8 and mechanism.scale is None
    # Both maps start as the identity (feature_dim == head_dim), as two separate parameters; biases at zero.
    for feature_map in (mechanism.query_map, mechanism.key_map):
        assert torch.equal(feature_map.weight, torch.eye(8).expand(3, 8, 8)) and not bool(feature_map.bias.any())
    assert mechanism.query_map.weight is not mechanism.key_map.weight
    # f = sigmoid(window_factor) starts at window_weight, 0.1 as in LoLCATs' released conversion configs.
    torch.testing.assert_close(mechanism.window_factor, torch.full((3,), math.log(0.1 / 0.9)))
    torch.testing.assert_close(torch.sigmoid(mechanism.window_factor), torch.full((3,), 0.1))
    narrow = build_mechanism("lolcats", 3, 8, feature_dim=5, window_weight=0.5)
    assert narrow.query_map.weight.shape == (3, 8, 5) and not bool(narrow.window_factor.any())
    assert not torch.equal(narrow.query_map.weight, narrow.key_map.weight)  # two draws
    assert narrow.state_layout(torch.float32)["kv"] == ((3, 10, 9), torch.float32)
    # With a decay: one more parameter, lambda = sigmoid(decay_logit) starting at the option's value.
    decayed = build_mechanism("lolcats", 3, 8, decay=0.999)
    assert {name for name, _ in decayed.named_parameters()} - {name for name, _ in mechanism.named_parameters()} \
        == {"decay_logit"}
    torch.testing.assert_close(torch.sigmoid(decayed.decay_logit), torch.full((3,), 0.999))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_on_either_side_across_window_blocks(side):
    """A sequence padded with NaN and huge keys gives at its positions what it gives alone, with the padding
    moving it across the window's blocks and the linear part's chunks."""
    mechanism = build_mechanism("lolcats", 2, 8, window=64, feature_dim=4, chunk_size=16).double()
    q, k, v = _inputs(batch=1, length=150)
    pad = 37
    garbage = torch.full((1, 2, pad, 8), float("nan"), dtype=torch.float64)
    garbage[:, :, ::2] = 1e6

    def padded(x):
        return torch.cat([garbage, x], 2) if side == "left" else torch.cat([x, garbage], 2)

    mask = torch.zeros(1, 150 + pad, dtype=torch.bool)
    mask[:, :pad] = side == "left"
    mask[:, 150:] = side == "right"
    real = slice(pad, None) if side == "left" else slice(0, 150)
    with torch.no_grad():
        alone = mechanism(q, k, v, causal=True)
        together = mechanism(padded(q), padded(k), padded(v), causal=True, key_padding_mask=mask)
    torch.testing.assert_close(together[:, :, real], alone, rtol=1e-12, atol=1e-12)


def _drawn(**options):
    """A float64 ``lolcats`` (2 heads of 8) with every parameter drawn from N(0, 1), so that each one matters."""
    mechanism = build_mechanism("lolcats", 2, 8, **options).double()
    with torch.no_grad():
        for parameter in mechanism.parameters():
            parameter.normal_()
    return mechanism


@pytest.mark.parametrize("sinks, decay", [(0, None), (4, None), (4, 0.9)])
def test_decoding_past_the_ring_wrap_and_branching(sinks, decay):
    mechanism = _drawn(window=6, feature_dim=3, sink_tokens=sinks, decay=decay)
    q, k, v = _inputs(length=40)
    with torch.no_grad():
        full = mechanism(q, k, v, causal=True)
        out, state = mechanism.prefill(q[:, :, :10], k[:, :, :10], v[:, :, :10])
        outputs, sizes = [out], set()
        for t in range(10, 40):
            if t == 25:
                branch = state
            out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            outputs.append(out_t)
            sizes.add(tuple((name, tuple(x.shape)) for name, x in sorted(state.tensors.items())))
        torch.testing.assert_close(torch.cat(outputs, 2), full, rtol=1e-12, atol=1e-12)
        assert len(sizes) == 1  # constant size: ring of 6, linear state of 2 * 3 rows
        assert dict(next(iter(sizes)))["kv"] == (2, 2, 6, 9) and dict(next(iter(sizes)))["k"] == (2, 2, 6, 8)
        assert dict(next(iter(sizes))).get("sink_k") == ((2, 2, sinks, 8) if sinks else None)
        # A state stepped from twice gives the same outputs: the first step wrote nothing into it.
        again, _ = mechanism.step(q[:, :, 25:26], k[:, :, 25:26], v[:, :, 25:26], branch)
        torch.testing.assert_close(again, full[:, :, 25:26], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sinks, decay", [(0, None), (3, None), (0, 0.9)])
def test_decoding_many_wraps_equals_the_parallel_form(sinks, decay):
    """Steps after a prompt, across several wraps of the ring (batch 2, so the features' batched product over
    rows is taken, not the one-row one), equal the parallel form at 1e-10 in float64: the ring copied with
    its slot written, the sinks read only once behind the window, the leaving key's features from the
    query's product."""
    mechanism = _drawn(window=5, feature_dim=4, sink_tokens=sinks, decay=decay)
    q, k, v = _inputs(length=37)
    with torch.no_grad():
        full = mechanism(q, k, v, causal=True)
        out, state = mechanism.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7])
        outputs = [out]
        for t in range(7, 37):
            out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, 2), full, rtol=1e-10, atol=1e-10)


def test_decoding_follows_parameters_changed_in_place():
    """The step's prepared parameters (the stacked maps, f_h) are kept between steps: a parameter
    changed in place (an optimiser's update) is seen by the next step."""
    mechanism = _drawn(window=4, feature_dim=3, sink_tokens=2, decay=0.9)
    q, k, v = _inputs(length=12)
    with torch.no_grad():
        _, state = mechanism.prefill(q[:, :, :11], k[:, :, :11], v[:, :, :11])
        before, _ = mechanism.step(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], state)
        for parameter in (mechanism.key_map.weight, mechanism.query_map.bias, mechanism.window_factor,
                          mechanism.decay_logit):
            parameter.mul_(1.5)  # (a constant added to a map would not change its softmaxes)
            _, state = mechanism.prefill(q[:, :, :11], k[:, :, :11], v[:, :, :11])  # kv holds phi_k
            after, _ = mechanism.step(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], state)
            assert not torch.allclose(after, before)
            full = mechanism(q, k, v, causal=True)[:, :, 11:]
            torch.testing.assert_close(after, full, rtol=1e-12, atol=1e-12)
            before = after


def test_decoding_a_mechanism_made_under_inference_mode():
    """Parameters made under ``torch.inference_mode`` track no version: the step remakes its prepared
    parameters each time instead of keying on it, and still equals the parallel form."""
    q, k, v = _inputs(length=9)
    with torch.inference_mode():
        mechanism = _drawn(window=3, feature_dim=2, sink_tokens=1)
        full = mechanism(q, k, v, causal=True)
        _, state = mechanism.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7])
        for t in (7, 8):
            out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            torch.testing.assert_close(out_t, full[:, :, t : t + 1], rtol=1e-12, atol=1e-12)


def test_decoding_step_gradients():
    """A step under autograd (no prepared parameters kept; every parameter reached by plain ops) against
    finite differences, for the query, the new key and value, and a key leaving the window."""
    mechanism = _drawn(window=3, feature_dim=2, sink_tokens=1)
    q, k, v = _inputs(batch=1, length=6)
    with torch.no_grad():
        _, state = mechanism.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5])
    ring_k = state.tensors["k"].clone().requires_grad_(True)

    def step(q_t, k_t, v_t, ring):
        tensors = {**state.tensors, "k": ring}
        return mechanism.step(q_t, k_t, v_t, type(state)(state.mechanism, state.length, tensors))[0]

    inputs = [x[:, :, 5:].clone().requires_grad_(True) for x in (q, k, v)]
    assert torch.autograd.gradcheck(step, (*inputs, ring_k))
    out = step(*inputs, ring_k)
    out.sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in mechanism.parameters())


@pytest.mark.parametrize("prompt", [0, 2, 9])
def test_decoding_with_sinks_from_a_prompt_shorter_than_them(prompt):
    """The sinks written while decoding (a prompt shorter than them, or none) and the keys that leave the
    window after them joining the linear state: the steps equal the parallel form."""
    mechanism = _drawn(window=3, feature_dim=3, sink_tokens=3)
    q, k, v = _inputs(length=16)
    with torch.no_grad():
        full = mechanism(q, k, v, causal=True)
        state, outputs = None, []
        if prompt:
            out, state = mechanism.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
            outputs.append(out)
        for t in range(prompt, 16):
            out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, 2), full, rtol=1e-12, atol=1e-12)


def test_sinks_left_padded_are_refused_by_declaration():
    """The sinks are a row's first positions: with them the mechanism declares right padding only."""
    assert build_mechanism("lolcats", 2, 8).capabilities.padding_invariance != PADDED_RIGHT
    assert PADDED_RIGHT == \
        build_mechanism("lolcats", 2, 8, sink_tokens=4).capabilities.padding_invariance


def test_memory_stays_linear_in_the_length():
    """Forward and backward make no tensor near N x N: the window's tiles and the linear part's chunks."""
    mechanism = build_mechanism("lolcats", 2, 16, window=32, chunk_size=32)
    q, k, v = (torch.randn(1, 2, 1024, 16, requires_grad=True) for _ in range(3))
    with TensorRecorder() as recorded:
        mechanism(q, k, v, causal=True).sum().backward()
    assert recorded.largest_floating <= 2 * 1024 * 2 * 32  # heads * N * (two blocks of the window)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"window": 0}, "window"),
        ({"feature_dim": 0}, "feature_dim"),
        ({"window_weight": 0.0}, "window_weight"),
        ({"window_weight": 1.0}, "window_weight"),
        ({"scale": -1.0}, "scale"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"sink_tokens": 65}, "sink_tokens"),
        ({"sink_tokens": "4"}, "sink_tokens"),
        ({"decay": 0.0}, "decay"),
        ({"decay": 1.0}, "decay"),
        ({"decay": "0.9"}, "decay"),
        ({"rotate_features": "no"}, "rotate_features"),
    ],
)
def test_bad_options_name_the_option(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_mechanism("lolcats", 2, 8, **options)


def test_cross_attention_is_refused_naming_it():
    q, k, v = _inputs(length=6)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        build_mechanism("lolcats", 2, 8).double()(q, k, v, cross=True)


@pytest.mark.parametrize("sinks, decay", [(0, None), (2, 0.9)])
def test_in_a_rotary_layer_unrotated_features_leave_only_the_window_rotated(sinks, decay):
    """``rotate_features=False``: the layer hands the mechanism unrotated queries and keys and its rotary
    embedding; the window's logits are the rotated ones, the features the projected ones, as the reference
    given both computes them."""
    from attnzoo import MultiHeadAttention

    torch.manual_seed(0)
    options = dict(window=3, feature_dim=4, chunk_size=4, sink_tokens=sinks, decay=decay)
    layer = MultiHeadAttention(32, 4, "lolcats", kv_heads=4, rotary=True, rotary_pairs="halves",
                               rotate_features=False, **options).double()
    with torch.no_grad():
        for parameter in layer.mechanism.parameters():
            parameter.normal_()
    x = torch.randn(2, 13, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = (layer._split_heads(proj(x)) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    rotary, weights = layer.rotary, layer.mechanism.weights()
    apart = lolcats_attention_reference(q, k, v, weights, 3, True, None, None, sinks, rotary(q), rotary(k))
    rotated = lolcats_attention_reference(rotary(q), rotary(k), v, weights, 3, True, None, None, sinks)
    with torch.no_grad():
        out = layer(x, causal=True)
        torch.testing.assert_close(out, layer._output(apart, x), rtol=1e-10, atol=1e-12)
        assert (out - layer._output(rotated, x)).abs().max() > 1e-3  # the difference the test can see
        # Decoding keeps the window's keys unrotated too; that steps and packed rows agree with the forward in a
        # rotary layer is the conformance suite's (tests/conformance/test_own_rotary.py).
        assert "feature_k" in layer.mechanism.state_layout(torch.float64)
    # Where the caller rotates (a Hugging Face model's own attention) the option cannot be honoured.
    assert build_mechanism("lolcats", 2, 8, rotate_features=False).capabilities.own_rotary
    assert not build_mechanism("lolcats", 2, 8).capabilities.own_rotary

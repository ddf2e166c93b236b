"""Liger attention (functional.liger, mechanism ``liger``) beyond the conformance suite: the gated linear part
against the per-token recurrence written from the paper, strong decays, the window rotated and the linear part
not inside a rotary layer, fla's GLA reference, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo import MultiHeadAttention, UnsupportedOptionError
from attnzoo.functional.blocksparse import LocalPattern, blocksparse_attention_reference
from attnzoo.functional.liger import gated_channels_unchecked, liger_attention_reference, liger_features
from attnzoo.mechanisms import build_mechanism


def _inputs(batch=2, heads=4, kv_heads=2, length=37, dim=8, dim_v=6, seed=0, dtype=torch.float64, spread=3.0):
    generator = torch.Generator().manual_seed(seed)
    q = spread * torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype)
    k = spread * torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, dim_v, generator=generator, dtype=dtype)
    return q, k, v


def _recurrence(q, k, v, normalizer):
    """Liger's gated linear part, one token at a time as the paper writes it: per query head (its key/value
    head's keys), S_t = diag(exp(logsigmoid(k_t) / normalizer)) S_{t-1} + softmax(k_t) v_t^T, o_t = softmax(q_t) S_t."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    state = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outputs = []
    for t in range(q.shape[2]):
        decay = torch.exp(F.logsigmoid(k[:, :, t]) / normalizer)
        state = decay[..., None] * state + torch.softmax(k[:, :, t], -1)[..., None] * v[:, :, t, None, :]
        outputs.append((torch.softmax(q[:, :, t], -1)[..., None] * state).sum(-2))
    return torch.stack(outputs, 2)


@pytest.mark.parametrize("normalizer", [16.0, 0.05])  # 0.05: decays of e^-60 a step, past the single reference
@pytest.mark.parametrize("chunk", [4, 64])
def test_the_gated_linear_part_is_the_papers_recurrence(normalizer, chunk):
    q, k, v = _inputs()
    phi_q, phi_k, log_gate = liger_features(q, k, normalizer, None)
    out, state = gated_channels_unchecked(phi_q, phi_k, v, log_gate, True, chunk)
    expected = _recurrence(q, k, v, normalizer)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    # The state after the sequence continues it: the last position again, from the state before it.
    _, before = gated_channels_unchecked(phi_q[:, :, :-1], phi_k[:, :, :-1], v[:, :, :-1], log_gate[:, :, :-1],
                                         True, chunk)
    again, after = gated_channels_unchecked(phi_q[:, :, -1:], phi_k[:, :, -1:], v[:, :, -1:], log_gate[:, :, -1:],
                                            True, chunk, before)
    torch.testing.assert_close(again, expected[:, :, -1:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(after, state, rtol=1e-10, atol=1e-12)


def test_the_mechanism_is_half_window_half_recurrence_and_its_gradients_are_the_references():
    q, k, v = _inputs(length=23)
    module = build_mechanism("liger", 4, 8, window=5, chunk_size=4, gate_normalizer=0.5)
    expected = 0.5 * (blocksparse_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                      LocalPattern(5, 5), True, None) + _recurrence(q, k, v, 0.5))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = module(*leaves, causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = liger_attention_reference(*ref_leaves, ref_leaves[0], ref_leaves[1], 5, 0, 0.5, False, True)
    ref_grads = torch.autograd.grad((reference * weights).sum(), ref_leaves)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-11)


def test_normalize_divides_the_recurrence_by_its_own_weights():
    q, k, v = _inputs(length=23)
    module = build_mechanism("liger", 4, 8, window=5, chunk_size=4, normalize=True)
    ones = torch.ones_like(v[..., :1])
    sums = _recurrence(q, k, torch.cat([v, ones], -1), 16.0)
    window = blocksparse_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             LocalPattern(5, 5), True, None)
    out = module(q, k, v, causal=True)
    torch.testing.assert_close(out, 0.5 * (window + sums[..., :-1] / sums[..., -1:]), rtol=1e-10, atol=1e-12)
    # The outputs are averages of the values: within their range, which the sums are not.
    assert out.abs().max() <= v.abs().max() and sums[..., :-1].abs().max() > v.abs().max()


def test_strong_decays_stay_finite_in_float32():
    q, k, v = _inputs(length=200, dtype=torch.float32, spread=30.0)
    extreme = build_mechanism("liger", 4, 8, window=8, gate_normalizer=0.01)  # log decays down to -3000 a step
    assert torch.isfinite(extreme(q, k, v, causal=True)).all()
    # Where float32's cumulative sums keep their digits (log decays down to about -30 a step), it is accurate.
    module = build_mechanism("liger", 4, 8, window=8, gate_normalizer=1.0)
    torch.testing.assert_close(module(q, k, v, causal=True).double(), module.reference(q, k, v, causal=True),
                               rtol=1e-4, atol=2e-4)


def _layer(**options):
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, "liger", kv_heads=2, rotary=True, rotary_pairs="halves", window=3,
                              chunk_size=4, **options).double()


def _projected(layer, x):
    return [layer._split_heads(proj(x)) for proj in (layer.q_proj, layer.k_proj, layer.v_proj)]


@pytest.mark.parametrize("sinks", [0, 2])
def test_in_a_rotary_layer_only_the_window_is_rotated(sinks):
    layer = _layer(sink_tokens=sinks)
    x = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = _projected(layer, x)
    rotary = layer.rotary
    as_liger = liger_attention_reference(q, k, v, rotary(q), rotary(k), 3, sinks, 16.0, False, True)
    both_rotated = liger_attention_reference(rotary(q), rotary(k), v, rotary(q), rotary(k), 3, sinks, 16.0, False,
                                            True)
    out = layer(x, causal=True)
    torch.testing.assert_close(out, layer._output(as_liger, x), rtol=1e-10, atol=1e-12)
    assert (out - layer._output(both_rotated, x)).abs().max() > 1e-3  # the difference the test can see
    # Decoding and packed rows in a rotary layer: the conformance suite (tests/conformance/test_own_rotary.py).


def test_a_llama_drop_in_is_refused_as_its_keys_arrive_rotated():
    transformers = pytest.importorskip("transformers")
    from attnzoo.dropin import use_attnzoo

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UnsupportedOptionError, match="own_rotary"):
        use_attnzoo(transformers.LlamaForCausalLM(config), "liger")


@pytest.mark.parametrize("options, match", [({"window": 0}, "window"), ({"sink_tokens": 5, "window": 4}, "sink"),
                                            ({"gate_normalizer": 0.0}, "gate_normalizer"),
                                            ({"gate_normalizer": "16"}, "gate_normalizer"),
                                            ({"chunk_size": 0}, "chunk_size")])
def test_bad_options_are_refused_naming_them(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_mechanism("liger", 2, 8, **options)


def test_equals_fla_gla_reference():
    """fla's ``naive_recurrent_gla`` (per-channel gates ``gk``, query scale ``d_k ** -0.5`` fixed, float32) on
    Liger's features and gates, the scale undone on the queries: Liger's linear part (scale 1)."""
    pytest.importorskip("fla", reason='flash-linear-attention (fla-core) is in the "peers" extra')
    from fla.ops.gla.naive import naive_recurrent_gla

    q, k, v = _inputs(kv_heads=4, length=100, dtype=torch.float32)
    phi_q, phi_k, log_gate = liger_features(q, k, 4.0, None)
    ours, _ = gated_channels_unchecked(phi_q, phi_k, v, log_gate, True, 32)
    fla = [x.transpose(1, 2).contiguous() for x in (phi_q * q.shape[-1] ** 0.5, phi_k, v, log_gate)]
    theirs = naive_recurrent_gla(*fla)[0].transpose(1, 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * max(1.0, float(theirs.abs().max())))

"""Regression tests for defects found by trying the library as a new and as an adversarial user.

Each test names the defect it guards. The conformance suite holds every mechanism to the general rule behind
each (capabilities honest for every option set, padded positions invisible whatever they hold, yes/no options
typed, decoding states checked); these tests pin the concrete cases that were found.
"""

import math

import pytest
import torch

import attnzoo
from attnzoo import MultiHeadAttention, UnsupportedOptionError, build_mechanism
from attnzoo.mechanisms.softmax import CACHE_BLOCK
from attnzoo.state import DecodingState, select_batch


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- self- or cross-attention is said, never guessed from the lengths ---------------------------------------
def test_favor_plus_plus_cross_attention_ignores_padding_appended_to_the_context():
    """optimal_features=True in cross-attention: padding the context until it is as long as the queries used to
    make it drop the queries at padded key indices from its statistics (outputs moved by up to 4.6e-3)."""
    mha = MultiHeadAttention(32, 2, "performer", nb_features=64, seed=0, optimal_features=True).double()
    torch.manual_seed(0)
    x, context = randn(2, 12, 32, seed=1), randn(2, 3, 32, seed=2)
    outputs = []
    for padded in (8, 9):  # 9 padded keys make the context as long as the queries
        extended = torch.cat([context, randn(2, padded, 32, seed=3)], dim=1)
        mask = torch.zeros(2, 3 + padded, dtype=torch.bool)
        mask[:, 3:] = True
        outputs.append(mha(x, extended, key_padding_mask=mask))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)


def test_mechanisms_take_cross_explicitly():
    mechanism = build_mechanism("softmax", 2, 8)
    q, k = randn(1, 2, 5, 8), randn(1, 2, 7, 8)
    with pytest.raises(ValueError, match="cross=True"):
        mechanism(q, k, k)
    assert mechanism(q, k, k, cross=True).shape == (1, 2, 5, 8)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        build_mechanism("retention", 2, 8)(q, q, q, cross=True)  # refused even with equal lengths


def test_gated_rfa_declares_no_cross_attention_and_refuses_it_at_any_length():
    mechanism = build_mechanism("rfa", 2, 8, nb_features=16, seed=0, gated=True)
    assert not mechanism.capabilities.cross and mechanism.capabilities.limited_by == "gated=True"
    assert attnzoo.capabilities("rfa").cross  # the class without the option still can
    q = randn(1, 2, 6, 8, dtype=torch.float32)
    for k_len in (6, 9):
        k = randn(1, 2, k_len, 8, dtype=torch.float32)
        with pytest.raises(UnsupportedOptionError, match="gated=True"):
            mechanism(q, k, k, cross=True)
    mha = MultiHeadAttention(16, 2, "rfa", nb_features=16, seed=0, gated=True)
    with pytest.raises(UnsupportedOptionError, match="cross-attention"):
        mha(randn(1, 6, 16, dtype=torch.float32), context=randn(1, 6, 16, dtype=torch.float32))


# -- yes/no options are bools ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, option", [
    ("performer", "shrinkage"), ("performer", "orthogonal"), ("performer", "symmetric"), ("rfa", "gated"),
    ("retention", "normalize"), ("softmax", "quiet"),
])
@pytest.mark.parametrize("value", ["False", "no", 0, None])
def test_truthy_values_are_refused_for_yes_no_options(name, option, value):
    with pytest.raises(TypeError, match=option):
        build_mechanism(name, 2, 8, **{option: value})


@pytest.mark.parametrize("value", ["no", 2, None, "False"])
def test_truthy_values_are_refused_for_causal(value):
    mha = MultiHeadAttention(16, 2)
    x = randn(1, 4, 16, dtype=torch.float32)
    with pytest.raises(TypeError, match="causal"):
        mha(x, causal=value)
    with pytest.raises(TypeError, match="causal"):
        attnzoo.functional.softmax_attention(*(randn(1, 2, 4, 8),) * 3, causal=value)
    with pytest.raises(TypeError, match="causal"):
        attnzoo.functional.linear_attention(*(randn(1, 2, 4, 8),) * 3, causal=value)


# -- numeric options: type, finiteness and range, named --------------------------------------------------------
@pytest.mark.parametrize("name, options, match", [
    ("softmax", {"scale": float("nan")}, "scale"),
    ("softmax", {"scale": float("inf")}, "scale"),
    ("softmax", {"scale": "abc"}, "scale"),
    ("softmax", {"scale": 0.0}, "scale"),
    ("rfa", {"sharpness": float("inf")}, "sharpness"),
    ("rfa", {"sharpness": "1"}, "sharpness"),
    ("retention", {"decays": 0.9}, "decays"),
    ("retention", {"decays": [0.9, float("nan")]}, "decays"),
    ("gla", {"gate_temperature": float("nan")}, "gate_temperature"),
    ("performer", {"nb_features": 32.0}, "nb_features"),
    ("performer", {"redraw_interval": 0}, "redraw_interval"),
])
def test_numeric_options_are_checked_at_construction(name, options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_mechanism(name, 2, 8, **options)


@pytest.mark.parametrize("kwargs, match", [
    ({"context_dim": 0}, "context_dim"),
    ({"context_dim": True}, "context_dim"),
    ({"context_dim": -3}, "context_dim"),
    ({"dropout": True}, "dropout"),
    ({"dropout": 1.0}, "dropout"),
    ({"dropout": float("nan")}, "dropout"),
    ({"bias": "yes"}, "bias"),
    ({"rotary": 1}, "rotary"),
])
def test_multi_head_attention_options_are_checked(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        MultiHeadAttention(16, 2, **kwargs)


def test_input_dtype_other_than_the_module_s_is_named():
    mha = MultiHeadAttention(16, 2, context_dim=8)
    with pytest.raises(TypeError, match=r"\bx\b.*float64"):
        mha(randn(1, 4, 16))
    with pytest.raises(TypeError, match=r"\bcontext\b.*float64"):
        mha(randn(1, 4, 16, dtype=torch.float32), context=randn(1, 3, 8))


# -- decoding states are checked --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["softmax", "linear", "performer", "gla"])
def test_a_state_of_another_batch_or_mechanism_is_refused(name):
    options = {"nb_features": 16, "seed": 0} if name == "performer" else {}
    mechanism = build_mechanism(name, 2, 8, **options).double()
    q = randn(3, 2, 4, 8)
    _, state = mechanism.prefill(q[:1], q[:1], q[:1])
    step = tuple(t[:, :, :1] for t in (q, q, q))
    with pytest.raises(ValueError, match=r"\bstate\b.*batch"):
        mechanism.step(*step, state)  # a batch-1 state is never broadcast to a batch-3 step
    with pytest.raises(TypeError, match=r"\bstate\b"):
        mechanism.step(*(t[:1] for t in step), dict(state.tensors))
    other = "linear" if name != "linear" else "softmax"
    _, foreign = build_mechanism(other, 2, 8).double().prefill(q[:1], q[:1], q[:1])
    with pytest.raises(ValueError, match=rf"\bstate\b.*{other!r}"):
        mechanism.step(*(t[:1] for t in step), foreign)


def test_multi_head_attention_refuses_a_foreign_state():
    mha = MultiHeadAttention(16, 2)
    with pytest.raises(TypeError, match="state"):
        mha.step(randn(1, 1, 16, dtype=torch.float32), {"k": torch.zeros(1)})


# -- padded positions are invisible, whatever they hold ----------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"quiet": True}])
def test_softmax_ignores_nan_and_inf_in_padded_keys_and_values(options):
    mechanism = build_mechanism("softmax", 2, 8, **options).double()
    q, k, v = randn(2, 2, 6, 8, seed=1), randn(2, 2, 6, 8, seed=2), randn(2, 2, 6, 8, seed=3)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 2] = mask[1, 5] = True
    expected = mechanism(q, k, v, key_padding_mask=mask)
    k[1, :, 2], v[1, :, 2], v[1, :, 5] = float("nan"), float("inf"), float("nan")
    for causal in (False, True):
        torch.testing.assert_close(mechanism(q, k, v, causal=causal, key_padding_mask=mask),
                                   mechanism(q, k.nan_to_num(0), v.nan_to_num(0, 0, 0), causal=causal,
                                             key_padding_mask=mask))
    torch.testing.assert_close(mechanism(q, k, v, key_padding_mask=mask), expected)


def test_favor_plus_plus_takes_a_nan_key_that_is_padding():
    mechanism = build_mechanism("performer", 2, 8, nb_features=16, seed=0, optimal_features=True).double()
    q, k, v = randn(1, 2, 6, 8, seed=1), randn(1, 2, 6, 8, seed=2), randn(1, 2, 6, 8, seed=3)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, -1] = True
    expected = mechanism(q, k, v, key_padding_mask=mask)
    k[:, :, -1] = float("nan")
    torch.testing.assert_close(mechanism(q, k, v, key_padding_mask=mask), expected)


# -- traced and compiled graphs are correct for any mask ----------------------------------------------------------
def test_softmax_has_no_branch_on_mask_values():
    """``torch.compile(fullgraph=True)`` refuses a branch on a tensor's value; today's SDPA happens to return
    zeros for fully masked rows itself, older ones returned NaN, so a frozen branch is a real hazard."""
    attend = torch.compile(attnzoo.functional.softmax_attention, backend="eager", fullgraph=True)
    q = randn(3, 2, 5, 8, dtype=torch.float32)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, -2:] = True
    attend(q, q, q, False, mask)
    mask[2] = True
    out = attend(q, q, q, False, mask)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, attnzoo.functional.softmax_attention(q, q, q, False, mask))


# -- the KV cache grows in blocks, and every state stays valid however it is reused ------------------------------
def _decode(mha, x, state=None, start=0):
    outputs = []
    for t in range(start, x.shape[1]):
        y_t, state = mha.step(x[:, t : t + 1], state)
        outputs.append(y_t)
    return torch.cat(outputs, dim=1), state


def test_kv_cache_crosses_block_boundaries_and_matches_the_forward():
    mha = MultiHeadAttention(16, 2).double().eval()
    n = CACHE_BLOCK + 40
    x = randn(2, n, 16)
    full = mha(x, causal=True)
    _, state = mha.prefill(x[:, : CACHE_BLOCK - 3])
    stepped, state = _decode(mha, x, state, start=CACHE_BLOCK - 3)
    torch.testing.assert_close(stepped, full[:, CACHE_BLOCK - 3 :], rtol=1e-10, atol=1e-10)
    assert state.position == n and state.mechanism.tensors["k"].shape[2] % CACHE_BLOCK == 0


def test_kv_cache_branching_from_one_state_keeps_both_branches_right():
    """A step writes into the cache's free room; stepping twice from one state must not let the second
    branch overwrite what the first one wrote (copy-on-write)."""
    mha = MultiHeadAttention(16, 2).double().eval()
    x = randn(1, 8, 16)
    a, b = randn(1, 1, 16, seed=5), randn(1, 1, 16, seed=6)
    _, state = mha.prefill(x)
    y_a, state_a = mha.step(a, state)
    y_b, state_b = mha.step(b, state)
    y_a2, _ = mha.step(b, state_a)  # continue branch a after branch b wrote into the shared room
    torch.testing.assert_close(y_a, mha(torch.cat([x, a], 1), causal=True)[:, -1:])
    torch.testing.assert_close(y_b, mha(torch.cat([x, b], 1), causal=True)[:, -1:])
    torch.testing.assert_close(y_a2, mha(torch.cat([x, a, b], 1), causal=True)[:, -1:])


def test_kv_cache_follows_select_batch():
    mechanism = build_mechanism("softmax", 2, 8).double()
    q = randn(3, 2, 6, 8)
    _, state = mechanism.prefill(q[:, :, :4], q[:, :, :4], q[:, :, :4])
    index = torch.tensor([2, 2, 0])
    chosen = select_batch(state, index)
    assert isinstance(chosen, DecodingState) and chosen.length == 4
    out, _ = mechanism.step(*(t[index][:, :, 4:5] for t in (q, q, q)), chosen)
    full = mechanism(q[index][:, :, :5], q[index][:, :, :5], q[index][:, :, :5], causal=True)
    torch.testing.assert_close(out, full[:, :, -1:])


def test_numbers_are_finite_after_long_decoding():
    mha = MultiHeadAttention(16, 2).eval()
    with torch.no_grad():
        out, _ = _decode(mha, randn(1, 3 * CACHE_BLOCK // 2, 16, dtype=torch.float32))
    assert math.isfinite(float(out.abs().sum()))

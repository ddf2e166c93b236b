"""The short causal convolution (:mod:`attnzoo.functional.short_convolution`) against its float64 loop, with
padding, packed rows and decoding steps; and the ``conv_size`` option of ``delta`` and ``gated_delta`` that
runs it on q, k and v: steps equal the parallel form, packed rows equal documents alone, padding is
invisible, and the default leaves the mechanisms as they were."""

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import short_conv, short_conv_reference, short_conv_state, short_conv_step
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from attnzoo.models import LanguageModel

EXACT = {"rtol": 0.0, "atol": 1e-10}
CHANNELS = (3, 4)  # (heads, head_dim)-like channel dims


def _conv_inputs(batch, length, kernel, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, *CHANNELS, generator=g, dtype=torch.float64)
    weight = torch.randn(*CHANNELS, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(*CHANNELS, generator=g, dtype=torch.float64)
    return x, weight, bias


def _mask(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 0] = mask[0, length // 2] = True
    mask[1, -2:] = True
    return mask


# -- the functional form ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", [1, 2, 4])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_short_conv_equals_the_loop_and_conv1d(kernel, silu, with_bias):
    x, weight, bias = _conv_inputs(2, 7, kernel)
    bias = bias if with_bias else None
    out = short_conv(x, weight, bias, silu=silu)
    torch.testing.assert_close(out, short_conv_reference(x, weight, bias, silu=silu), **EXACT)
    # torch.nn.Conv1d on the sequence left-padded with kernel - 1 zeros, channels flattened
    width = CHANNELS[0] * CHANNELS[1]
    flat = F.pad(x.flatten(2).transpose(1, 2), (kernel - 1, 0))
    conv = F.conv1d(flat, weight.reshape(width, 1, kernel), None if bias is None else bias.reshape(width),
                    groups=width).transpose(1, 2).reshape(x.shape)
    torch.testing.assert_close(out, F.silu(conv) if silu else conv, **EXACT)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_padded_positions_contribute_nothing_whatever_they_hold(poison):
    x, weight, bias = _conv_inputs(2, 9, 4)
    mask = _mask(2, 9)
    out = short_conv(x, weight, bias, silu=True, key_padding_mask=mask)
    torch.testing.assert_close(out, short_conv_reference(x, weight, bias, silu=True, key_padding_mask=mask), **EXACT)
    poisoned = x.masked_fill(mask[:, :, None, None], poison)
    again = short_conv(poisoned, weight, bias, silu=True, key_padding_mask=mask)
    torch.testing.assert_close(again, out, rtol=0.0, atol=0.0)
    # a padded position is a zero input: padding at the start is what the zeros before the start are
    torch.testing.assert_close(out[0, 1:4], short_conv(x[:1, 1:4], weight, bias, silu=True)[0], **EXACT)


def test_gradients_do_not_reach_padded_positions_or_turn_nan():
    x, weight, bias = _conv_inputs(2, 9, 4)
    mask = _mask(2, 9)
    x = x.masked_fill(mask[:, :, None, None], float("nan")).requires_grad_()
    short_conv(x, weight, bias, silu=True, key_padding_mask=mask).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[mask] == 0).all()


def test_packed_rows_restart_the_window_at_each_document():
    x, weight, bias = _conv_inputs(1, 10, 4)
    cu_seqlens = torch.tensor([0, 1, 4, 8, 10])
    out = short_conv(x, weight, bias, silu=True, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(out, short_conv_reference(x, weight, bias, silu=True, cu_seqlens=cu_seqlens), **EXACT)
    alone = [short_conv(x[:, start:end], weight, bias, silu=True) for start, end in [(0, 1), (1, 4), (4, 8), (8, 10)]]
    torch.testing.assert_close(out, torch.cat(alone, dim=1), **EXACT)


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_steps_and_a_prefix_state_continue_the_parallel_form(kernel):
    x, weight, bias = _conv_inputs(2, 8, kernel)
    full = short_conv(x, weight, bias, silu=True)
    state, outputs = None, []
    for t in range(8):
        out_t, state = short_conv_step(x[:, t : t + 1], state, weight, bias, silu=True)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, **EXACT)
    torch.testing.assert_close(state, short_conv_state(x, kernel), rtol=0.0, atol=0.0)
    for split in (1, 2, 5):  # a prefix shorter than the window is zero-filled in front
        state = short_conv_state(x[:, :split], kernel)
        out_t, _ = short_conv_step(x[:, split : split + 1], state, weight, bias, silu=True)
        torch.testing.assert_close(out_t, full[:, split : split + 1], **EXACT)


def test_a_padded_prefix_leaves_zeros_in_the_state():
    x, _, _ = _conv_inputs(2, 5, 4)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, -1] = True
    x = x.masked_fill(mask[:, :, None, None], float("nan"))
    state = short_conv_state(x, 4, key_padding_mask=mask)
    assert state.shape == (2, 3, *CHANNELS) and torch.isfinite(state).all() and (state[0, -1] == 0).all()


@pytest.mark.parametrize("call, match", [
    (lambda x, w, b: short_conv(x[:, :, 0], w, b), r"\bweight\b"),
    (lambda x, w, b: short_conv(x, w[..., :0], b), r"\bweight\b"),
    (lambda x, w, b: short_conv(x, w, b[0]), r"\bbias\b"),
    (lambda x, w, b: short_conv(x[:, :, 0, 0], w[0, 0], b[0, 0]), r"\bx\b"),
    (lambda x, w, b: short_conv(x, w, b, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), r"key_padding_mask"),
    (lambda x, w, b: short_conv(x, w, b, cu_seqlens=torch.tensor([0, 5])), r"cu_seqlens"),
    (lambda x, w, b: short_conv_step(x, None, w, b), r"\bx_t\b"),
    (lambda x, w, b: short_conv_step(x[:, :1], x[:, :2], w, b), r"\bstate\b"),
    (lambda x, w, b: short_conv_state(x, 0), r"\bkernel\b"),
    (lambda x, w, b: short_conv(x, w, b, silu="False"), r"\bsilu\b"),
    (lambda x, w, b: short_conv_step(x[:, :1], None, w, b, silu=1), r"\bsilu\b"),
    (lambda x, w, b: short_conv_reference(x, w, b, silu="yes"), r"\bsilu\b"),
    (lambda x, w, b: short_conv_step(x[:, :1], torch.zeros(2, 3, *x.shape[2:], dtype=torch.int64), w, b),
     r"\bstate\b"),
    (lambda x, w, b: short_conv_step(x[:, :1], torch.zeros(2, 3, *x.shape[2:], device="meta"), w, b),
     r"\bstate\b"),
    (lambda x, w, b: short_conv(x, w.to("meta"), b), r"\bweight\b"),
    (lambda x, w, b: short_conv(x, w, b.to("meta")), r"\bbias\b"),
])
def test_bad_arguments_are_refused_naming_them(call, match):
    x, weight, bias = _conv_inputs(2, 5, 4)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, weight, bias)


# -- the conv_size option of delta and gated_delta ----------------------------------------------------------------
HEADS, HEAD_DIM = 2, 4
MECHANISMS = ["delta", "gated_delta"]


def _mechanism(name, conv_size, chunk_size=4):
    torch.manual_seed(0)
    return build_mechanism(name, HEADS, HEAD_DIM, chunk_size=chunk_size, conv_size=conv_size).double().eval()


def _qkv(batch, length, seed=1, kv_heads=HEADS):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("causal", [True, False])
def test_convolved_mechanism_equals_its_float64_reference(name, causal):
    m = _mechanism(name, 4)
    q, k, v = _qkv(2, 11)
    mask = _mask(2, 11)
    for key_padding_mask in (None, mask):
        out = m(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        expected = m.reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        keep = slice(None) if key_padding_mask is None else ~key_padding_mask  # padded rows are not compared
        torch.testing.assert_close(out.transpose(1, 2)[keep], expected.transpose(1, 2)[keep], **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
def test_the_convolution_changes_the_output_and_sees_only_the_past(name):
    q, k, v = _qkv(1, 9)
    plain, convolved = _mechanism(name, 0)(q, k, v, causal=True), _mechanism(name, 4)(q, k, v, causal=True)
    assert (plain - convolved).abs().max() > 1e-3
    m = _mechanism(name, 4)
    later = [x.clone() for x in (q, k, v)]
    for x in later:
        x[:, :, 5:] = torch.randn_like(x[:, :, 5:])
    torch.testing.assert_close(m(*later, causal=True)[:, :, :5], m(q, k, v, causal=True)[:, :, :5], **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("conv_size", [1, 2, 4])
def test_steps_and_prefill_carry_the_convolution(name, conv_size):
    m = _mechanism(name, conv_size)
    q, k, v = _qkv(2, 9)
    full = m(q, k, v, causal=True)
    state, outputs = None, []
    for t in range(9):
        out_t, state = m.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), full, **EXACT)
    expected_keys = {"state"} | ({"q_conv", "k_conv", "v_conv"} if conv_size > 1 else set())
    assert set(state.tensors) == expected_keys
    for split in (1, 2, 6):
        _, prefix_state = m.prefill(q[:, :, :split], k[:, :, :split], v[:, :, :split])
        out_t, _ = m.step(q[:, :, split : split + 1], k[:, :, split : split + 1], v[:, :, split : split + 1],
                          prefix_state)
        torch.testing.assert_close(out_t, full[:, :, split : split + 1], **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
def test_packed_documents_restart_the_convolution(name):
    m = _mechanism(name, 4)
    q, k, v = _qkv(1, 12)
    spans = [(0, 2), (2, 7), (7, 12)]
    packed = m(q, k, v, causal=True, cu_seqlens=torch.tensor([0, 2, 7, 12]))
    alone = [m(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True) for s, e in spans]
    torch.testing.assert_close(packed, torch.cat(alone, dim=2), **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_padded_positions_are_invisible_through_the_convolution(name, poison):
    m = _mechanism(name, 4)
    q, k, v = _qkv(2, 10)
    mask = _mask(2, 10)
    out = m(q, k, v, causal=True, key_padding_mask=mask)
    poisoned = [x.masked_fill(mask[:, None, :, None], poison) for x in (q, k, v)]
    again = m(*poisoned, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(again[~mask[:, None, :, None].expand_as(out)], out[~mask[:, None, :, None].expand_as(out)],
                               rtol=0.0, atol=0.0)
    # padding at the start is the zeros before the start: element 0 from position 1 on is the sequence alone
    alone = m(q[:1, :, 1:5], k[:1, :, 1:5], v[:1, :, 1:5], causal=True)
    torch.testing.assert_close(out[:1, :, 1:5], alone, **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
def test_grouped_keys_and_values_are_repeated_before_the_convolution(name):
    m = _mechanism(name, 4)
    q, k, v = _qkv(2, 7, kv_heads=1)
    torch.testing.assert_close(m(q, k, v, causal=True), m(q, k.expand_as(q), v.expand_as(q), causal=True), **EXACT)


@pytest.mark.parametrize("name", MECHANISMS)
def test_the_default_adds_no_parameter_and_no_state(name):
    m = _mechanism(name, 0)
    assert not any("conv" in key for key in m.state_dict())
    assert set(m.state_layout(torch.float32)) == {"state"}
    assert "conv_size" not in repr(m)
    assert {f"{x}_conv" for x in "qkv"} <= set(_mechanism(name, 4).state_dict())


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("value, error", [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)])
def test_bad_conv_sizes_are_refused_naming_the_option(name, value, error):
    with pytest.raises(error, match="conv_size"):
        build_mechanism(name, HEADS, HEAD_DIM, conv_size=value)


@pytest.mark.parametrize("name", MECHANISMS)
def test_values_of_another_width_are_refused_naming_conv_size(name):
    m = _mechanism(name, 4)
    q, k, _ = _qkv(1, 5)
    v = torch.randn(1, HEADS, 5, HEAD_DIM + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="conv_size"):
        m(q, k, v, causal=True)
    with pytest.raises(ValueError, match="conv_size"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    assert _mechanism(name, 0)(q, k, v, causal=True).shape[-1] == HEAD_DIM + 1  # the rule itself takes any width


@pytest.mark.parametrize("name", MECHANISMS)
def test_cross_attention_stays_refused(name):
    q, k, v = _qkv(1, 5)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        _mechanism(name, 4)(q, k, v, cross=True)


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_language_model_decodes_through_the_convolution_like_its_forward(name):
    torch.manual_seed(0)
    model = LanguageModel(11, dim=16, heads=2, depth=2, max_length=16, self_attention=name,
                          self_attention_options={"conv_size": 4, "chunk_size": 4}).double().eval()
    sequence = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    full = model(sequence)
    logits, state = model.prefill(sequence[:, :3])
    steps = [logits]
    for t in range(3, 9):
        logits, state = model.step(sequence[:, t], state)
        steps.append(logits[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **EXACT)

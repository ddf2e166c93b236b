"""Forgetting attention beyond the conformance suite: the blockwise kernel and its hand-written backward
against the float64 (N, N) reference, the reference against independent definitions, nothing N x N made,
precision with strong gates, decoding, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.functional.forgetting import (
    forgetting_attention,
    forgetting_attention_reference,
    forgetting_attention_unchecked,
)
from attnzoo.functional.softmax import softmax_attention_reference
from tensor_records import TensorRecorder


def inputs(batch=2, heads=4, kv_heads=4, seq=13, dim=8, dim_v=6, dtype=torch.float64, seed=0, strength=2.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim_v, generator=generator, dtype=dtype)
    log_forget = -torch.rand(batch, heads, seq, generator=generator, dtype=dtype) * strength
    return [x.requires_grad_() for x in (q, k, v, log_forget)]


def padding(batch=2, seq=13):
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[1, :3] = mask[1, 7] = mask[1, -1] = True
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_blockwise_kernel_and_backward_equal_the_reference(causal, kv_heads, padded, block_size):
    q, k, v, log_forget = inputs(kv_heads=kv_heads)
    mask = padding() if padded else None
    out = forgetting_attention(q, k, v, log_forget, causal, mask, block_size=block_size)
    expected = forgetting_attention_reference(q, k, v, log_forget, causal, mask)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, log_forget), grad)
    want = torch.autograd.grad(expected, (q, k, v, log_forget), grad)
    for name, a, b in zip("q k v log_forget".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


def test_gradcheck_of_the_hand_written_backward():
    q, k, v, log_forget = inputs(batch=1, heads=2, kv_heads=1, seq=7, dim=4, dim_v=3)
    mask = torch.tensor([[False, False, True, False, False, False, False]])
    for causal in (True, False):
        assert torch.autograd.gradcheck(
            lambda *x: forgetting_attention(*x, causal, mask, block_size=3), (q, k, v, log_forget)
        )


def test_the_reference_with_gates_of_one_is_softmax_attention():
    q, k, v, _ = inputs()
    for causal in (True, False):
        zero = torch.zeros(2, 4, 13, dtype=torch.float64)
        torch.testing.assert_close(forgetting_attention_reference(q, k, v, zero, causal, padding()),
                                   softmax_attention_reference(q, k, v, causal, padding()), rtol=1e-12, atol=1e-12)


def test_the_reference_with_a_constant_gate_is_a_distance_bias():
    """log f = log(gamma) everywhere: D_ij = -(i - j) log(1 / gamma) causally, -|i - j| log(1 / gamma) not."""
    q, k, v, _ = inputs()
    gamma = 0.7
    gates = torch.full((2, 4, 13), math.log(gamma), dtype=torch.float64)
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    for causal in (True, False):
        bias = -(i - j).abs().double() * math.log(1 / gamma)
        logits = q @ k.transpose(-1, -2) / math.sqrt(8) + bias
        if causal:
            logits = logits.masked_fill(j > i, -math.inf)
        expected = torch.softmax(logits, -1) @ v
        torch.testing.assert_close(forgetting_attention_reference(q, k, v, gates, causal), expected,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_nothing_n_by_n_is_made_forward_or_backward(causal):
    batch, heads, seq, block = 1, 2, 256, 32
    q, k, v, log_forget = inputs(batch=batch, heads=heads, kv_heads=heads, seq=seq, dim=8, dim_v=8,
                                 dtype=torch.float32)
    with TensorRecorder() as sizes:
        out = forgetting_attention(q, k, v, log_forget, causal, block_size=block)
        out.square().sum().backward()
    # One block's logits: every row against `block` keys. The (N, N) matrix would be 8 times larger.
    assert sizes.largest <= batch * heads * seq * block
    assert sizes.largest < batch * heads * seq * seq / 4


def test_float32_keeps_its_precision_with_strong_gates_over_a_long_sequence():
    """Cumulative gates reach about -5000 here: summed in float64 and each block's bias formed in float64, the
    float32 kernel stays as close to the float64 definition as plain float32 softmax is (gates summed in
    float32 would be off by 3e-4)."""
    seq = 512
    q, k, v, log_forget = inputs(batch=1, heads=2, kv_heads=2, seq=seq, dim=16, dim_v=16, dtype=torch.float32,
                                 strength=20.0)
    with torch.no_grad():
        out = forgetting_attention(q, k, v, log_forget, True, block_size=64)
        c = log_forget.double().cumsum(-1)
        logits = q.double() @ k.double().transpose(-1, -2) / 4 + (c[..., :, None] - c[..., None, :])
        logits = logits.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -math.inf)
        expected = torch.softmax(logits, -1) @ v.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_mechanism_gates_from_the_keys_and_decodes_long_streams():
    torch.manual_seed(0)
    mechanism = attnzoo.build_mechanism("forgetting", 4, 8, block_size=16).double()
    q, k, v = (torch.randn(2, 4, 270, 8, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped: two key/value heads
    full = mechanism(q, k, v, causal=True)
    out, state = mechanism.prefill(q[:, :, :230], k[:, :, :230], v[:, :, :230])
    assert state.tensors["k"].shape[1] == 2 and state.tensors["log_gate"].dtype == torch.float64
    steps = []
    for t in range(230, 270):  # crosses the cache's growth at 256 positions
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        steps.append(out_t)
    torch.testing.assert_close(torch.cat(steps, 2), full[:, :, 230:], rtol=1e-10, atol=1e-10)
    expected_gates = F.logsigmoid(torch.einsum("bhnd,hd->bhn", k.repeat_interleave(2, 1),
                                               mechanism.gate_weight) + mechanism.gate_bias[:, None])
    torch.testing.assert_close(state.tensors["log_gate"][:, :, :270], expected_gates.cumsum(-1))


def test_bad_gates_and_options_are_refused_naming_them():
    q, k, v, log_forget = inputs()
    with torch.no_grad():
        for bad, message in ((log_forget.abs(), "<= 0"), (log_forget.masked_fill(log_forget < -1, math.nan), "finite"),
                             (log_forget[:, :2], "shape"), (log_forget.masked_fill(log_forget < -1, -math.inf), "finite")):
            with pytest.raises(ValueError, match=f"log_forget.*{message}|{message}.*log_forget|log_forget must"):
                forgetting_attention(q, k, v, bad, True)
        # A padded position's gate may hold anything.
        nan_at_padding = log_forget.masked_fill(padding()[:, None, :], math.nan)
        assert torch.isfinite(forgetting_attention(q, k, v, nan_at_padding, True, padding())).all()
    with pytest.raises(ValueError, match="block_size"):
        forgetting_attention(q, k, v, log_forget, True, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        attnzoo.build_mechanism("forgetting", 4, 8, block_size=-1)
    with pytest.raises(ValueError, match="seq"):
        forgetting_attention(q, k[:, :, :5], v[:, :, :5], log_forget, True)


def test_the_unchecked_form_takes_half_precision_in_a_float32_kernel():
    q, k, v, log_forget = (x.detach() for x in inputs(dtype=torch.float32))
    out = forgetting_attention_unchecked(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_forget, True, None, None, 4)
    assert out.dtype == torch.bfloat16
    expected = forgetting_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_forget, True)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_the_gate_parameters_get_the_gradient_of_the_definition():
    mechanism = attnzoo.build_mechanism("forgetting", 2, 8, block_size=4, gate_bias_init=1.0).double()
    q, k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(2, 2, 11, 8, dtype=torch.float64)
    mask = padding(2, 11)
    (mechanism(q, k, v, causal=True, key_padding_mask=mask) * grad).sum().backward()
    fast = [p.grad.clone() for p in (mechanism.gate_weight, mechanism.gate_bias)]
    mechanism.zero_grad()
    (mechanism.reference(q, k, v, True, mask) * grad).sum().backward()
    for got, want in zip(fast, (mechanism.gate_weight.grad, mechanism.gate_bias.grad)):
        assert want.abs().max() > 1e-3
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

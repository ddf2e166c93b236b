"""Efficient attention (Shen et al. 2021): the reference against the formula written out by hand, the chunked
causal path and its hand-written backward against the reference, the running-maximum stabiliser, padding,
cross-attention, the recurrent form and bad input."""

import pytest
import torch

import attnzoo
from attnzoo.functional.efficient import (
    efficient_attention,
    efficient_attention_prefill,
    efficient_attention_reference,
    efficient_attention_step,
)


def tensors(*shapes, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype) for shape in shapes]


def qkv(q_len, k_len, batch=2, heads=2, dim=5, dim_v=3, seed=0, **kwargs):
    return tensors((batch, heads, q_len, dim), (batch, heads, k_len, dim), (batch, heads, k_len, dim_v),
                   seed=seed, **kwargs)


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -2:] = True  # right padding
    mask[-1, 0] = True  # and a padded key at the start
    mask[-1, length // 2] = True
    return mask


def test_reference_is_the_formula_with_explicit_softmaxes():
    q, k, v = qkv(6, 9)
    by_hand = torch.softmax(q, dim=-1) @ (torch.softmax(k, dim=2).transpose(-1, -2) @ v)
    torch.testing.assert_close(efficient_attention_reference(q, k, v), by_hand, rtol=1e-12, atol=1e-12)


def test_causal_reference_is_a_softmax_over_each_prefix():
    q, k, v = qkv(7, 7)
    expected = torch.empty(2, 2, 7, 3, dtype=torch.float64)
    for i in range(7):
        context = torch.softmax(k[:, :, : i + 1], dim=2).transpose(-1, -2) @ v[:, :, : i + 1]  # (d, d_v)
        expected[:, :, i] = (torch.softmax(q[:, :, i : i + 1], dim=-1) @ context)[:, :, 0]
    torch.testing.assert_close(efficient_attention_reference(q, k, v, causal=True), expected, rtol=1e-12, atol=1e-12)


def test_padded_keys_leave_the_softmax_over_positions():
    q, k, v = qkv(4, 6, batch=1)
    mask = torch.tensor([[False, True, False, False, True, False]])
    kept = ~mask[0]
    expected = efficient_attention_reference(q, k[:, :, kept], v[:, :, kept])
    fast = efficient_attention(q, k, v, key_padding_mask=mask)
    for out in (fast, efficient_attention_reference(q, k, v, False, mask)):
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 7, 33])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_reference(causal, length, chunk_size, padded):
    q, k, v = qkv(length, length)
    mask = padding(2, length) if padded and length > 2 else None
    out = efficient_attention(q, k, v, causal, mask, chunk_size=chunk_size)
    torch.testing.assert_close(out, efficient_attention_reference(q, k, v, causal, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lengths", [(3, 10), (10, 3), (1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_lengths_bottom_right_aligned(lengths, causal):
    q, k, v = qkv(*lengths)
    mask = padding(2, lengths[1])
    out = efficient_attention(q, k, v, causal, mask, chunk_size=4)
    torch.testing.assert_close(out, efficient_attention_reference(q, k, v, causal, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lengths", [(9, 9), (5, 9), (9, 4)])
def test_hand_written_backward_passes_gradcheck(lengths):
    q, k, v = (t.requires_grad_() for t in qkv(*lengths, batch=2, heads=1, dim=3, dim_v=2))
    mask = padding(2, lengths[1])
    assert torch.autograd.gradcheck(
        lambda q, k, v: efficient_attention(q, k, v, True, mask, chunk_size=4), (q, k, v), eps=1e-6, atol=1e-7,
        fast_mode=True,
    )


def test_gradient_through_the_prefill_state():
    # The state's sums are shifted by its running maximum, which carries no gradient: what a state stands for,
    # the unshifted sums, and what a step computes from it are differentiated correctly.
    q, k, v = (t.requires_grad_() for t in qkv(7, 7, batch=1, heads=1, dim=3, dim_v=2))

    def state_and_output(q, k, v):
        out, state = efficient_attention_prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], chunk_size=4)
        scale = state["max"].exp()
        step, _ = efficient_attention_step(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], state)
        return out, state["num"] * scale.unsqueeze(-1), state["den"] * scale, step

    assert torch.autograd.gradcheck(state_and_output, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


def test_running_maximum_keeps_drifting_keys_exact_in_float32():
    # Key features climbing by 3 per position (300 over the sequence): exp() overflows float32 without a
    # shift, and a single shift for the whole sequence would underflow its start. Chunks of 4 see a rise of 9.
    q, k, v = qkv(100, 100, dtype=torch.float32)
    k = k + 3.0 * torch.arange(100, dtype=torch.float32).view(1, 1, 100, 1)
    mask = padding(2, 100)
    expected = efficient_attention_reference(q, k, v, True, mask)
    out = efficient_attention(q, k, v, True, mask, chunk_size=4)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    # The step shifts by the exact running maximum at every position.
    state, outputs = None, []
    for t in range(100):
        out_t, state = efficient_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outputs.append(out_t)
    causal = efficient_attention_reference(q, k, v, True)
    torch.testing.assert_close(torch.cat(outputs, dim=2).double(), causal, rtol=1e-4, atol=1e-5)


def test_large_keys_in_float32_non_causal():
    q, k, v = qkv(40, 40, dtype=torch.float32)
    out = efficient_attention(q, k * 500.0, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), efficient_attention_reference(q, k * 500.0, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_element_gives_zeros_and_finite_gradients(causal):
    q, k, v = (t.requires_grad_() for t in qkv(7, 7))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1] = True
    out = efficient_attention(q, k, v, causal, mask, chunk_size=3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_prefill_then_step_continues_the_causal_form():
    q, k, v = qkv(11, 11)
    full = efficient_attention(q, k, v, True, chunk_size=4)
    out, state = efficient_attention_prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], chunk_size=4)
    torch.testing.assert_close(out, full[:, :, :6], rtol=1e-12, atol=1e-12)
    for t in range(6, 11):
        out_t, state = efficient_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t : t + 1], rtol=1e-10, atol=1e-12)
    assert state["num"].shape == (2, 2, 5, 3) and state["den"].shape == state["max"].shape == (2, 2, 5)


def test_half_precision_runs_in_float32():
    q, k, v = qkv(20, 20, dim=8, dim_v=8)
    for causal in (False, True):
        expected = efficient_attention(q, k, v, causal)
        out = efficient_attention(q.half(), k.half(), v.half(), causal)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-3)


def test_mechanism_wires_the_options():
    mechanism = attnzoo.build_mechanism("efficient", 2, 5, chunk_size=3).double()
    q, k, v = qkv(8, 8, dim=5, dim_v=5)
    torch.testing.assert_close(mechanism(q, k, v, causal=True), efficient_attention(q, k, v, True, chunk_size=3))
    assert "chunk_size=3" in repr(mechanism)
    assert attnzoo.capabilities("efficient").kind == "own"


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_bad_chunk_size_is_named(bad):
    with pytest.raises((TypeError, ValueError), match="chunk_size"):
        attnzoo.build_mechanism("efficient", 2, 4, chunk_size=bad)
    q, k, v = qkv(3, 3)
    with pytest.raises((TypeError, ValueError), match="chunk_size"):
        efficient_attention(q, k, v, True, chunk_size=bad)


def test_bad_input_to_the_functional_forms_is_named():
    q, k, v = qkv(3, 3)
    with pytest.raises(TypeError, match="causal"):
        efficient_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="key_padding_mask"):
        efficient_attention(q, k, v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="prefill"):
        efficient_attention_prefill(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="one position"):
        efficient_attention_step(q, k, v, None)

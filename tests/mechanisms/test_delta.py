"""The delta rule (``delta``, ``gated_delta``) and its functional core: the chunked form equals the float64
per-position recurrence, across chunk boundaries, with padding, initial states, steps and gradients; bad gates
are refused naming the argument. The conformance suite covers the mechanisms' contract."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import (
    delta_rule,
    delta_rule_prefill,
    delta_rule_reference,
    delta_rule_step,
    gated_delta_rule,
    gated_delta_rule_step,
)
from attnzoo.mechanisms import build_mechanism

B, H, D = 2, 3, 8


def _inputs(length, dtype=torch.float64, seed=0, d_v=D):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, length, D, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, length, d_v, generator=g, dtype=dtype)
    beta = torch.rand(B, H, length, generator=g, dtype=dtype)
    log_decay = -2.0 * torch.rand(B, H, length, generator=g, dtype=dtype)
    return q, k, v, beta, log_decay


def _padding(length):
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[0, length // 2] = True
    mask[1, -(length // 3 + 1):] = True
    return mask


def _run(gated, q, k, v, beta, log_decay, **options):
    if gated:
        return gated_delta_rule(q, k, v, beta, log_decay, **options)
    return delta_rule(q, k, v, beta, **options)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 3, 4, 5, 13])
def test_chunked_equals_the_recurrence(gated, causal, length):
    q, k, v, beta, log_decay = _inputs(length, seed=length, d_v=5)
    mask = _padding(length)
    expected = delta_rule_reference(q, k, v, beta, log_decay if gated else None, causal=causal,
                                    key_padding_mask=mask)
    for chunk_size in (1, 4, 64):
        out = _run(gated, q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("gated", [False, True])
def test_steps_and_prefill_continue_the_recurrence(gated):
    q, k, v, beta, log_decay = _inputs(11, seed=3)
    expected = delta_rule_reference(q, k, v, beta, log_decay if gated else None)
    gates = (beta, log_decay) if gated else (beta, None)
    out, state = delta_rule_prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], *(g[:, :, :6] for g in gates[:1]),
                                    None if not gated else log_decay[:, :, :6], chunk_size=4)
    outputs = [out]
    for t in range(6, 11):
        one = lambda x: x[:, :, t : t + 1]  # noqa: E731
        if gated:
            out_t, state = gated_delta_rule_step(one(q), one(k), one(v), one(beta), one(log_decay), state)
        else:
            out_t, state = delta_rule_step(one(q), one(k), one(v), one(beta), state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)
    assert state.shape == (B, H, D, D)


@pytest.mark.parametrize("gated", [False, True])
def test_initial_state_splits_a_sequence(gated):
    q, k, v, beta, log_decay = _inputs(10, seed=4)
    full = _run(gated, q, k, v, beta, log_decay, chunk_size=4)
    head = delta_rule_prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7], beta[:, :, :7],
                              log_decay[:, :, :7] if gated else None, chunk_size=4)[1]
    tail = [x[:, :, 7:] for x in (q, k, v, beta, log_decay)]
    torch.testing.assert_close(_run(gated, *tail, chunk_size=4, initial_state=head), full[:, :, 7:],
                               rtol=0, atol=1e-10)
    reference_tail = delta_rule_reference(*tail[:4], tail[4] if gated else None, initial_state=head)
    torch.testing.assert_close(reference_tail, full[:, :, 7:], rtol=0, atol=1e-10)


def test_float32_long_sequence_stays_close():
    q, k, v, beta, log_decay = _inputs(150, seed=5)  # three chunks of 64
    expected = delta_rule_reference(q, k, v, beta, log_decay)
    out = gated_delta_rule(*(x.float() for x in (q, k, v, beta, log_decay)))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gated", [False, True])
def test_gradients_match_the_recurrence(gated):
    q, k, v, beta, log_decay = _inputs(9, seed=6)
    mask = _padding(9)
    weights = torch.randn(B, H, 9, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = []
    for fast in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_decay)]
        if fast:
            out = _run(gated, *leaves, key_padding_mask=mask, chunk_size=4)
        else:
            out = delta_rule_reference(*leaves[:4], leaves[4] if gated else None, key_padding_mask=mask)
        (out * weights).sum().backward()
        grads.append([x.grad for x in leaves])
    for label, fast, slow in zip(("q", "k", "v", "beta", "log_decay"), *grads):
        if not gated and label == "log_decay":
            assert fast is None and slow is None
            continue
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10, msg=f"gradient of {label}")


def test_gradcheck_of_the_chunked_form():
    q, k, v, beta, log_decay = (x.requires_grad_() for x in _inputs(6, seed=8))
    mask = _padding(6)
    torch.autograd.gradcheck(
        lambda *xs: gated_delta_rule(*xs, key_padding_mask=mask, chunk_size=4), (q, k, v, beta, log_decay),
        fast_mode=True,
    )


@pytest.mark.parametrize("gated", [False, True])
def test_padded_positions_may_hold_anything(gated):
    q, k, v, beta, log_decay = _inputs(7, seed=9)
    mask = _padding(7)
    clean = _run(gated, q, k, v, beta, log_decay, key_padding_mask=mask, chunk_size=4)
    dirty = [x.clone() for x in (k, v, beta, log_decay)]
    for x in dirty:
        x[mask[:, None].expand(B, H, 7)] = float("nan")
    out = _run(gated, q, *dirty[:3], dirty[3], key_padding_mask=mask, chunk_size=4)
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


@pytest.mark.parametrize("name, value", [("beta", float("nan")), ("beta", float("inf")),
                                         ("log_decay", float("nan")), ("log_decay", float("-inf")),
                                         ("log_decay", 0.5)])
def test_bad_gates_are_refused_naming_them(name, value):
    q, k, v, beta, log_decay = _inputs(5)
    gates = {"beta": beta, "log_decay": log_decay}
    gates[name] = gates[name].clone()
    gates[name][1, 2, 3] = value
    with pytest.raises(ValueError, match=name):
        gated_delta_rule(q, k, v, gates["beta"], gates["log_decay"])


def test_bad_arguments_are_refused_naming_them():
    q, k, v, beta, log_decay = _inputs(5)
    with pytest.raises(ValueError, match="beta"):
        delta_rule(q, k, v, beta[:, :, :4])
    with pytest.raises(TypeError, match="log_decay"):
        gated_delta_rule(q, k, v, beta, None)
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match="scale"):
        delta_rule(q, k, v, beta, scale=float("nan"))
    with pytest.raises(ValueError, match="initial_state"):
        delta_rule(q, k, v, beta, initial_state=torch.zeros(B, H, D, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="state"):
        delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], torch.zeros(B, H, D, 3))


def test_scale_defaults_to_inverse_sqrt_head_dim():
    q, k, v, beta, _ = _inputs(6)
    torch.testing.assert_close(delta_rule(q, k, v, beta), delta_rule(q, k, v, beta, scale=1 / math.sqrt(D)))
    torch.testing.assert_close(delta_rule(q, k, v, beta, scale=2.0), delta_rule(2 * q, k, v, beta, scale=1.0))


def test_the_delta_rule_recalls_what_plain_addition_blurs():
    """Writing the same (unit) key twice with beta = 1 replaces its value: the state returns the latest one."""
    k = F.normalize(torch.randn(1, 1, 1, D, dtype=torch.float64), dim=-1).expand(1, 1, 2, D)
    v = torch.randn(1, 1, 2, D, dtype=torch.float64)
    out = delta_rule(k, k, v, torch.ones(1, 1, 2, dtype=torch.float64), scale=1.0)
    torch.testing.assert_close(out[:, :, 1], v[:, :, 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["delta", "gated_delta"])
def test_mechanism_gates_are_in_their_domain(name):
    torch.manual_seed(0)
    mechanism = build_mechanism(name, 4, D).double()
    k = 10 * torch.randn(2, 4, 12, D, dtype=torch.float64)
    _, unit_k, _, beta, log_decay = mechanism._gated_inputs(k, k, k, None, mechanism._fast_conv)
    assert ((beta > 0) & (beta < 1)).all()
    torch.testing.assert_close(unit_k.norm(dim=-1), torch.ones(2, 4, 12, dtype=torch.float64))
    if name == "delta":
        assert log_decay is None
    else:
        assert (log_decay <= 0).all() and torch.isfinite(log_decay).all()


def test_gated_delta_heads_start_with_short_to_long_memories():
    mechanism = build_mechanism("gated_delta", 4, D).double()
    k = torch.zeros(1, 4, 1, D, dtype=torch.float64)  # the decay of the bias alone
    decay = mechanism.log_decay(k).exp().flatten()
    torch.testing.assert_close(decay[0], torch.tensor(math.exp(-0.001), dtype=torch.float64))
    torch.testing.assert_close(decay[-1], torch.tensor(math.exp(-1.6), dtype=torch.float64))

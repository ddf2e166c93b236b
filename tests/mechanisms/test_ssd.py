"""Mamba-2's SSD core (``attnzoo.functional.ssd``): the chunked form against the float64 per-token recurrence
(causal and bidirectional, across chunk boundaries, grouped B/C, padding, packed rows, prefill then step),
bad input refused naming the argument, and the ``ssd`` mechanism equal to the core with dt from the keys."""

import pytest
import torch
import torch.nn.functional as F

from attnzoo import build_mechanism
from attnzoo.functional import ssd, ssd_prefill, ssd_reference, ssd_step
from attnzoo.functional.linear import kernel_attention_reference

TIGHT = dict(rtol=1e-10, atol=1e-10)


def inputs(batch=2, heads=4, seq=13, head_dim=3, groups=2, state_dim=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    x = randn(batch, heads, seq, head_dim)
    dt = F.softplus(randn(batch, heads, seq))
    A = -torch.rand(heads, generator=g, dtype=torch.float64).to(dtype) * 2
    B, C = randn(batch, groups, seq, state_dim), randn(batch, groups, seq, state_dim)
    D = randn(heads)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunked_form_matches_the_per_token_recurrence(chunk_size, causal, groups):
    x, dt, A, B, C, D = inputs(groups=groups)
    expected = ssd_reference(x, dt, A, B, C, D=D, causal=causal)
    torch.testing.assert_close(ssd(x, dt, A, B, C, D=D, causal=causal, chunk_size=chunk_size), expected, **TIGHT)
    torch.testing.assert_close(ssd(x, dt, A, B, C, causal=causal, chunk_size=chunk_size),
                               ssd_reference(x, dt, A, B, C, causal=causal), **TIGHT)


def test_reference_is_the_recurrence_written_out():
    """The reference against the definition spelled out for one head: h_t = exp(dt A) h + dt B x^T."""
    x, dt, A, B, C, D = inputs(batch=1, heads=1, groups=1, seq=6)
    h = torch.zeros(5, 3, dtype=torch.float64)
    rows = []
    for t in range(6):
        h = torch.exp(dt[0, 0, t] * A[0]) * h + dt[0, 0, t] * torch.outer(B[0, 0, t], x[0, 0, t])
        rows.append(C[0, 0, t] @ h + D[0] * x[0, 0, t])
    torch.testing.assert_close(ssd_reference(x, dt, A, B, C, D=D)[0, 0], torch.stack(rows), **TIGHT)


def test_equals_decayed_linear_attention_with_grouped_queries_and_keys():
    """SSD is linear attention with q = C, k = dt B, v = x, log decay dt A and no normaliser."""
    x, dt, A, B, C, _ = inputs(groups=2)
    expanded = [t.repeat_interleave(2, dim=1) for t in (B, C)]
    expected = kernel_attention_reference(expanded[1], expanded[0] * dt.unsqueeze(-1), x, True,
                                          log_decay=dt * A.view(1, -1, 1), normalizer="none")
    torch.testing.assert_close(ssd(x, dt, A, B, C, chunk_size=4), expected, **TIGHT)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_positions_write_nothing_whatever_they_hold(causal):
    x, dt, A, B, C, D = inputs()
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, 3] = mask[1, 9:] = True
    mask[0, 0] = True
    expected = ssd_reference(x, dt, A, B, C, D=D, causal=causal, key_padding_mask=mask)
    kept = ~mask[:, None, :, None]
    out = ssd(x, dt, A, B, C, D=D, causal=causal, key_padding_mask=mask, chunk_size=4)
    torch.testing.assert_close(out.masked_fill(~kept, 0), expected.masked_fill(~kept, 0), **TIGHT)
    nan = float("nan")
    spoiled = [t.masked_fill(mask[:, None, :, None], nan) for t in (x, B, C)]
    out2 = ssd(spoiled[0], dt.masked_fill(mask[:, None], nan), A, spoiled[1], spoiled[2], D=D, causal=causal,
               key_padding_mask=mask, chunk_size=4)
    torch.testing.assert_close(out2.masked_fill(~kept, 0), out.masked_fill(~kept, 0), **TIGHT)
    # A padded position is absent: the unpadded positions of element 1 before the tail give what they give alone.
    alone = [t[1:, :, :9] for t in (x, dt, B, C)]
    keep = torch.arange(9) != 3
    alone = [t[:, :, keep] for t in alone]
    if causal:
        torch.testing.assert_close(ssd(alone[0], alone[1], A, alone[2], alone[3], D=D, chunk_size=4)[0],
                                   out[1][:, :9][:, keep], **TIGHT)


def test_packed_documents_each_get_what_they_get_alone():
    x, dt, A, B, C, D = inputs(batch=1, seq=19)
    cu_seqlens = torch.tensor([0, 3, 11, 12, 19])
    out = ssd(x, dt, A, B, C, D=D, cu_seqlens=cu_seqlens, chunk_size=4)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        part = [t[:, :, start:end] for t in (x, dt, B, C)]
        torch.testing.assert_close(out[:, :, start:end], ssd_reference(*part[:2], A, *part[2:], D=D), **TIGHT)


@pytest.mark.parametrize("prompt", [1, 4, 7])
def test_prefill_then_step_equals_the_parallel_form(prompt):
    x, dt, A, B, C, D = inputs()
    expected = ssd_reference(x, dt, A, B, C, D=D)
    y, state = ssd_prefill(x[:, :, :prompt], dt[:, :, :prompt], A, B[:, :, :prompt], C[:, :, :prompt], D=D,
                           chunk_size=4)
    assert state.shape == (2, 4, 5, 3)
    rows = [y]
    for t in range(prompt, 13):
        y_t, state = ssd_step(x[:, :, t:t + 1], dt[:, :, t:t + 1], A, B[:, :, t:t + 1], C[:, :, t:t + 1], state, D=D)
        rows.append(y_t)
    torch.testing.assert_close(torch.cat(rows, dim=2), expected, **TIGHT)
    # From no state at all.
    y_0, _ = ssd_step(x[:, :, :1], dt[:, :, :1], A, B[:, :, :1], C[:, :, :1], None, D=D)
    torch.testing.assert_close(y_0, expected[:, :, :1], **TIGHT)


def test_gradients_match_the_reference():
    x, dt, A, B, C, D = (t.requires_grad_() for t in inputs(seq=9))
    grads = torch.autograd.grad(ssd(x, dt, A, B, C, D=D, chunk_size=4).square().sum(), (x, dt, A, B, C, D))
    expected = torch.autograd.grad(ssd_reference(x, dt, A, B, C, D=D).square().sum(), (x, dt, A, B, C, D))
    for name, got, want in zip("x dt A B C D".split(), grads, expected):
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_float32_and_bfloat16_follow_float64():
    x, dt, A, B, C, D = inputs(seq=70)
    expected = ssd_reference(x, dt, A, B, C, D=D)
    out32 = ssd(*(t.float() for t in (x, dt, A, B, C)), D=D.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)
    out16 = ssd(*(t.bfloat16() for t in (x, dt, A, B, C)), D=D.bfloat16())
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), expected, rtol=0.05, atol=0.1)


def bad(**changes):
    x, dt, A, B, C, D = inputs()
    arguments = dict(x=x, dt=dt, A=A, B=B, C=C, D=D)
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("changes, match", [
    (dict(dt=torch.ones(2, 4, 12, dtype=torch.float64)), "dt must have shape"),
    (dict(A=torch.zeros(3, dtype=torch.float64)), "A must have shape"),
    (dict(A=torch.full((4,), 0.5, dtype=torch.float64)), "A must be finite and <= 0"),
    (dict(A=torch.full((4,), float("nan"), dtype=torch.float64)), "A must be finite"),
    (dict(dt=torch.full((2, 4, 13), -0.1, dtype=torch.float64)), "dt must be finite and >= 0"),
    (dict(dt=torch.full((2, 4, 13), float("inf"), dtype=torch.float64)), "dt must be finite"),
    (dict(B=torch.zeros(2, 3, 13, 5, dtype=torch.float64), C=torch.zeros(2, 3, 13, 5, dtype=torch.float64)),
     "groups of B and C"),
    (dict(C=torch.zeros(2, 2, 13, 4, dtype=torch.float64)), "C must have the shape of B"),
    (dict(D=torch.zeros(4, 1, dtype=torch.float64)), "D must have shape"),
    (dict(D=torch.full((4,), float("inf"), dtype=torch.float64)), "D must be finite"),
    (dict(x=torch.zeros(2, 4, 13, 3, dtype=torch.long)), "x"),
])
def test_bad_input_is_refused_naming_it(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ssd(**bad(**changes))


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="chunk_size"):
        ssd(**bad(), chunk_size=0)
    with pytest.raises(ValueError, match="cu_seqlens needs causal=True"):
        ssd(**bad(), causal=False, cu_seqlens=torch.tensor([0, 13]))
    with pytest.raises(ValueError, match="batch must be 1"):
        ssd(**bad(), cu_seqlens=torch.tensor([0, 13]))
    x, dt, A, B, C, D = inputs(seq=2)
    with pytest.raises(ValueError, match="one position"):
        ssd_step(x, dt, A, B, C, None)
    with pytest.raises(ValueError, match="state must have shape"):
        ssd_step(x[:, :, :1], dt[:, :, :1], A, B[:, :, :1], C[:, :, :1], torch.zeros(2, 4, 3, 5, dtype=torch.float64))


def test_dt_at_padded_positions_may_hold_anything():
    arguments = bad(dt=torch.full((2, 4, 13), float("nan"), dtype=torch.float64).index_fill(2, torch.arange(10), 1.0))
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[:, 10:] = True
    assert torch.isfinite(ssd(**arguments, key_padding_mask=mask)[:, :, :10]).all()


# -- the mechanism -------------------------------------------------------------------------------------------
def test_mechanism_is_the_core_with_the_step_size_from_the_keys():
    torch.manual_seed(0)
    mechanism = build_mechanism("ssd", 4, 6, chunk_size=4).double()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 11, 6, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        mechanism.dt_bias.copy_(torch.randn(4, generator=g))  # steps of order one: decays far from 1
    dt = F.softplus(torch.einsum("bhnd,hd->bhn", k, mechanism.dt_weight) + mechanism.dt_bias[:, None])
    A = -torch.exp(mechanism.A_log)
    for causal in (True, False):
        expected = ssd_reference(v, dt, A, k, q, causal=causal)
        torch.testing.assert_close(mechanism(q, k, v, causal=causal), expected.detach(), **TIGHT)


def test_mechanism_initialisation_follows_mamba2():
    mechanism = build_mechanism("ssd", 8, 16)
    steps = F.softplus(mechanism.dt_bias.detach())
    torch.testing.assert_close(steps[[0, -1]], torch.tensor([0.001, 0.1]))
    torch.testing.assert_close(torch.exp(mechanism.A_log.detach())[[0, -1]], torch.tensor([1.0, 16.0]))
    single = build_mechanism("ssd", 1, 16)
    torch.testing.assert_close(F.softplus(single.dt_bias.detach()), torch.tensor([0.001]))

"""RWKV-7 (``rwkv7``) and its functional core, the DPLR delta rule: the chunked form equals the float64
per-position reference and a recurrence written here as the paper writes it (RWKV's (d_v x d_k) state, row
vectors), forward and gradients, across chunk boundaries, with padding, strong decays, initial states, steps
and prefill, in both forms of the causal chunked core (the chunk-start form and the general one); RWKV-7's fused
vectors equal the op-by-op maps; bad input is refused naming the argument. The conformance suite covers the
mechanism's contract."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import (
    dplr_delta_rule,
    dplr_delta_rule_prefill,
    dplr_delta_rule_reference,
    dplr_delta_rule_step,
)
from attnzoo.functional.dplr import dplr_delta_rule_unchecked, fused
from attnzoo.functional.dplr.gentle import fits_gentle
from attnzoo.functional.dplr import rwkv7 as rwkv7_maps
from attnzoo.functional.dplr.rwkv7 import rwkv7_vectors, rwkv7_vectors_reference
from attnzoo.mechanisms import build_mechanism

B, H, D = 2, 3, 8


def _inputs(length, dtype=torch.float64, seed=0, d_v=5, strength=2.0):
    """q, k, v, a = -kappa, b = kappa * alpha, log_decay (per channel, down to -strength per step)."""
    g = torch.Generator().manual_seed(seed)
    q, k, kappa = (torch.randn(B, H, length, D, generator=g, dtype=dtype) for _ in range(3))
    kappa = F.normalize(kappa, dim=-1)
    alpha = torch.rand(B, H, length, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, length, d_v, generator=g, dtype=dtype)
    log_decay = -strength * torch.rand(B, H, length, D, generator=g, dtype=dtype)
    return q, k, v, -kappa, kappa * alpha, log_decay


def _padding(length):
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[0, length // 2] = True
    mask[1, -(length // 3 + 1):] = True
    return mask


def paper_recurrence(r, k, v, kappa, alpha, w, scale, with_state=False):
    """RWKV-7 as the paper writes it, one position at a time: the state S (d_v x d_k) and row vectors,
    ``S_t = S_{t-1} (diag(w_t) - kappa_t^T (alpha_t * kappa_t)) + v_t^T k_t``, ``o_t = S_t r_t^T`` (here
    times ``scale``). w is the decay itself, in (0, 1). With ``with_state``: (outputs, the last state)."""
    state = r.new_zeros(r.shape[0], r.shape[1], v.shape[-1], k.shape[-1])
    outputs = []
    for t in range(r.shape[2]):
        row = lambda x: x[:, :, t, None, :]  # noqa: E731  (B, H, 1, d)
        transition = torch.diag_embed(w[:, :, t]) - row(kappa).transpose(-1, -2) @ row(alpha * kappa)
        state = state @ transition + row(v).transpose(-1, -2) @ row(k)
        outputs.append(state @ row(r).transpose(-1, -2) * scale)
    out = torch.cat(outputs, dim=-1).transpose(-1, -2)
    return (out, state) if with_state else out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 3, 4, 5, 13, 40])
def test_chunked_equals_the_reference(causal, length):
    inputs = _inputs(length, seed=length)
    mask = _padding(length)
    expected = dplr_delta_rule_reference(*inputs, causal=causal, key_padding_mask=mask)
    for chunk_size in (1, 2, 4, 16, 64):
        out = dplr_delta_rule(*inputs, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


def test_reference_and_chunked_equal_the_paper_recurrence_with_gradients():
    q, k, v, a, b, log_decay = _inputs(21, seed=3)
    kappa = -a
    alpha = b / kappa
    leaves = [x.clone().requires_grad_() for x in (q, k, v, kappa, alpha, log_decay)]
    ours = dplr_delta_rule(leaves[0], leaves[1], leaves[2], -leaves[3], leaves[3] * leaves[4], leaves[5],
                           chunk_size=8)
    theirs_leaves = [x.clone().requires_grad_() for x in (q, k, v, kappa, alpha, log_decay)]
    r_, k_, v_, kappa_, alpha_, ld_ = theirs_leaves
    theirs = paper_recurrence(r_, k_, v_, kappa_, alpha_, ld_.exp(), 1 / math.sqrt(D))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    torch.testing.assert_close(dplr_delta_rule_reference(q, k, v, a, b, log_decay), theirs, rtol=0, atol=1e-10)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), leaves)
    expected = torch.autograd.grad((theirs * weights).sum(), theirs_leaves)
    for name, got, want in zip(("q", "k", "v", "kappa", "alpha", "log_decay"), grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.fixture(params=["gentle", "general"])
def form(request, monkeypatch):
    """Which form the causal chunked path takes (functional/dplr/fused.py): the chunk-start form where every
    chunk's decay spans little (functional/dplr/gentle.py), which these inputs allow, or the general one, forced.
    Checks, after the test, that the form asked for ran."""
    taken = []

    def fits(g):
        taken.append(fits_gentle(g) and request.param == "gentle")
        return taken[-1]

    monkeypatch.setattr(fused, "fits_gentle", fits)
    yield request.param
    assert taken and taken == [request.param == "gentle"] * len(taken)


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 16])
def test_causal_backward_equals_the_reference_with_padding_and_initial_state(chunk_size, form):
    """The causal chunked form has a hand-written backward (functional/dplr/fused.py), in two forms: every
    input's gradient, the initial state's included, equals autograd's through the float64 reference."""
    inputs = _inputs(13, seed=11)
    mask = _padding(13)
    initial = torch.randn(B, H, D, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    ours = [x.clone().requires_grad_() for x in (*inputs, initial)]
    theirs = [x.clone().requires_grad_() for x in (*inputs, initial)]
    out = dplr_delta_rule(*ours[:6], key_padding_mask=mask, chunk_size=chunk_size, initial_state=ours[6])
    expected = dplr_delta_rule_reference(*theirs[:6], key_padding_mask=mask, initial_state=theirs[6])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), ours)
    wanted = torch.autograd.grad((expected * weights).sum(), theirs)
    for name, got, want in zip(("q", "k", "v", "a", "b", "log_decay", "initial_state"), grads, wanted):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_gradcheck_of_the_causal_chunked_form_and_its_final_state(form):
    inputs = [x[:1, :1] for x in _inputs(7, seed=13, d_v=3)]
    initial = torch.randn(1, 1, D, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    leaves = [x.clone().requires_grad_() for x in (*inputs, initial)]
    torch.autograd.gradcheck(
        lambda *xs: dplr_delta_rule_unchecked(*xs[:6], None, None, True, 4, xs[6]), leaves, fast_mode=True,
    )


def _one_channel_decaying(span, chunk, seed):
    """Inputs whose channel 3 falls by ``span`` over every chunk of ``chunk`` positions, the others not at all."""
    q, k, v, a, b, _ = _inputs(2 * chunk, seed=seed)
    log_decay = torch.zeros_like(k)
    log_decay[..., 3] = -span / chunk
    return [q, k, v, a, b, log_decay]


def test_the_gentle_form_is_taken_up_to_a_quarter_of_the_exponent_range(monkeypatch):
    """The chunk-start form applies while every chunk's cumulative log decay stays above -log(max)/4 of the
    dtype (22.2 in float32): on either side of the bound the form that ran is the one expected, and both equal
    the float64 reference, gradients included."""
    bound = math.log(torch.finfo(torch.float32).max) / 4
    taken = []
    monkeypatch.setattr(fused, "fits_gentle", lambda g: taken.append(fits_gentle(g)) or taken[-1])
    for span, gentle in ((bound - 0.05, True), (bound + 0.05, False)):
        inputs = _one_channel_decaying(span, 16, seed=31)
        expected = dplr_delta_rule_reference(*inputs)
        leaves = [x.float().requires_grad_() for x in inputs]
        out = dplr_delta_rule(*leaves, chunk_size=16)
        assert taken[-1] == gentle
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
        grads = torch.autograd.grad((out * weights.float()).sum(), leaves)
        theirs = [x.clone().requires_grad_() for x in inputs]
        wanted = torch.autograd.grad((dplr_delta_rule_reference(*theirs) * weights).sum(), theirs)
        for got, want in zip(grads, wanted):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fraction", [4, 2])
def test_large_inputs_stay_finite_near_the_bound(fraction):
    """Inside the chunk-start form some sums run up to e^span above their final size (functional/dplr/gentle.py).
    Inputs of size 1e8 in float32 give finite outputs and gradients just under its bound (a quarter of the
    exponent range) and just under half of it, which the form would overflow at and must leave to the general
    one."""
    span = math.log(torch.finfo(torch.float32).max) / fraction - 0.05
    q, k, v, a, b, log_decay = _one_channel_decaying(span, 16, seed=33)
    leaves = [x.float().requires_grad_() for x in (1e8 * q, 1e8 * k, 1e8 * v, a, b, log_decay)]
    out = dplr_delta_rule(*leaves, chunk_size=16)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_strong_decays_stay_exact_and_finite():
    """A channel decaying by e^-60 a step overflows any factorisation about one point per chunk in float32;
    every factor here is exp of a difference <= 0, so float32 stays finite and near float64, gradients too."""
    inputs = list(_inputs(64, seed=5, strength=60.0))
    expected = dplr_delta_rule_reference(*inputs)
    torch.testing.assert_close(dplr_delta_rule(*inputs, chunk_size=64), expected, rtol=0, atol=1e-10)
    leaves = [x.float().requires_grad_() for x in inputs]
    out = dplr_delta_rule(*leaves, chunk_size=64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_padded_positions_hold_anything():
    inputs = list(_inputs(13, seed=7))
    mask = _padding(13)
    expected = dplr_delta_rule(*inputs, key_padding_mask=mask, chunk_size=4)
    spoiled = [x.masked_fill(mask[:, None, :, None], float("nan")) for x in inputs]
    spoiled[5] = spoiled[5].masked_fill(mask[:, None, :, None], float("inf"))  # a growing "decay" too
    out = dplr_delta_rule(*spoiled, key_padding_mask=mask, chunk_size=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_steps_and_prefill_continue_the_recurrence():
    inputs = _inputs(19, seed=11)
    initial = torch.randn(B, H, D, 5, dtype=torch.float64)
    expected = dplr_delta_rule_reference(*inputs, initial_state=initial)
    head, state = dplr_delta_rule_prefill(*(x[:, :, :9] for x in inputs), chunk_size=4, initial_state=initial)
    outputs = [head]
    for t in range(9, 19):
        out_t, state = dplr_delta_rule_step(*(x[:, :, t:t + 1] for x in inputs), state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_mechanism_equals_the_paper_recurrence_with_its_maps_written_out(causal):
    torch.manual_seed(0)
    module = build_mechanism("rwkv7", H, D, chunk_size=4, decay_rank=3, a_rank=2).double()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, 11, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = module(q, k, v, causal=causal)

    def lora(bias, down, up, act):
        return act(torch.einsum("bhnd,hdr->bhnr", k, down)) @ up.unsqueeze(0) + bias[:, None, :]

    w = torch.exp(-math.exp(-0.5) * torch.sigmoid(lora(module.w0, module.w1, module.w2, torch.tanh)))
    alpha = torch.sigmoid(lora(module.a0, module.a1, module.a2, lambda x: x))
    kappa = F.normalize(k * module.k_k[:, None, :], dim=-1)
    replacement = k * (1 + (alpha - 1) * module.k_a[:, None, :])
    theirs, state = paper_recurrence(q, replacement, v, kappa, alpha, w, 1 / math.sqrt(D), with_state=True)
    if not causal:  # every query reads the state after the whole sequence
        theirs = q @ state.transpose(-1, -2) / math.sqrt(D)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    params = [q, k, v, module.w1, module.a2, module.k_k, module.k_a]
    for got, want in zip(torch.autograd.grad(ours.sum(), params), torch.autograd.grad(theirs.sum(), params)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def _vector_maps(dtype=torch.float64):
    """An rwkv7 module's maps, moved off their initial values (its up maps start small), as (decay maps, rate
    maps, k_k, k_a), and its parameters in that order."""
    torch.manual_seed(4)
    module = build_mechanism("rwkv7", H, D, decay_rank=3, a_rank=2).to(dtype)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    maps = ((module.w0, module.w1, module.w2), (module.a0, module.a1, module.a2), module.k_k, module.k_a)
    return maps, [module.w0, module.w1, module.w2, module.a0, module.a1, module.a2, module.k_k, module.k_a]


@pytest.mark.parametrize("tile, length", [(1024, 7), (3, 7), (3, 0)])
def test_fused_vectors_equal_the_op_by_op_maps_with_every_gradient(tile, length, monkeypatch):
    """The hand-written backward runs tile by tile of positions: one tile, three (the last one short), and an
    empty sequence."""
    monkeypatch.setattr(rwkv7_maps, "_BACKWARD_TILE", tile)
    maps, parameters = _vector_maps()
    k = torch.randn(B, H, length, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if length:
        k[1, 2, 3] = 0.0  # a zeroed (padded) key: the removal key's norm is clamped there
    weights = [torch.randn(B, H, length, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6 + i))
               for i in range(4)]
    results = []
    for vectors in (rwkv7_vectors, rwkv7_vectors_reference):
        leaf = k.clone().requires_grad_()
        outs = vectors(leaf, *maps)
        loss = sum((out * weight).sum() for out, weight in zip(outs, weights))
        results.append((outs, torch.autograd.grad(loss, [leaf] + parameters)))
    (ours, our_grads), (theirs, their_grads) = results
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    for got, want in zip(our_grads, their_grads):  # the clamped row's gradient is about 1e12: relative
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_decay_maps_tanh_is_within_2e_7_of_tanh():
    """The decay map's tanh is computed as 2 sigmoid(2x) - 1 (faster on CPUs): its absolute error, against tanh
    in float64, is within 2e-7 in float32 and 1e-15 in float64, over the whole range where tanh is not +-1."""
    x = torch.linspace(-20.0, 20.0, 400_001, dtype=torch.float64)
    for dtype, bound in ((torch.float32, 2e-7), (torch.float64, 1e-15)):
        error = (rwkv7_maps._tanh(x.to(dtype)).double() - torch.tanh(x)).abs().max().item()
        assert error <= bound, (dtype, error)


def test_fused_vectors_pass_gradcheck_and_refuse_a_second_derivative():
    maps, _ = _vector_maps()
    k = torch.randn(1, H, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)

    def vectors(k, w0, w1, w2, a0, a1, a2, k_k, k_a):
        return rwkv7_vectors(k, (w0, w1, w2), (a0, a1, a2), k_k, k_a)

    inputs = (k, *maps[0], *maps[1], maps[2], maps[3])
    assert torch.autograd.gradcheck(vectors, inputs)
    (grad,) = torch.autograd.grad(vectors(*inputs)[1].pow(3).sum(), k, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_mechanism_step_and_prefill_equal_the_forward():
    torch.manual_seed(0)
    module = build_mechanism("rwkv7", H, D, chunk_size=4).double()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, 10, D, generator=g, dtype=torch.float64) for _ in range(3))
    expected = module(q, k, v, causal=True)
    out, state = module.prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6])
    outputs = [out]
    for t in range(6, 10):
        out_t, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)


def test_bad_input_is_refused_naming_it():
    q, k, v, a, b, log_decay = _inputs(6)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        dplr_delta_rule(q, k, v, a, b, -log_decay + 0.1)
    with pytest.raises(ValueError, match="b must be finite"):
        dplr_delta_rule(q, k, v, a, b.masked_fill(torch.ones_like(b, dtype=torch.bool), float("nan")), log_decay)
    with pytest.raises(ValueError, match="a must have the keys' shape"):
        dplr_delta_rule(q, k, v, a[..., :-1], b, log_decay)
    with pytest.raises(TypeError, match="log_decay must be a floating tensor"):
        dplr_delta_rule(q, k, v, a, b, log_decay.long())
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        dplr_delta_rule(q, k, v, a, b, log_decay, chunk_size=24)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        dplr_delta_rule(q, k, v, a, b, log_decay, initial_state=torch.zeros(B, H, D, D))
    with pytest.raises(ValueError, match="a step takes one position"):
        dplr_delta_rule_step(q, k, v, a, b, log_decay, None)
    for option, value in (("chunk_size", 12), ("decay_rank", 0), ("a_rank", -1)):
        with pytest.raises(ValueError, match=option):
            build_mechanism("rwkv7", H, D, **{option: value})

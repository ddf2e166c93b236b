"""Kimi Delta Attention (``kda``) and the per-channel decay of the delta rule's functional core: the chunked form
equals the float64 per-position reference and a recurrence written here from the paper's equations (forward
and gradients, across chunk boundaries, with padding), steps and prefill continue it, a decay equal on every
channel is ``gated_delta``'s core, strong decays stay finite, and bad gates are refused naming the argument.
The conformance suite covers the mechanism's contract; tests/mechanisms/test_fla_reference.py compares with
fla's ``naive_recurrent_kda`` and ``naive_chunk_kda``."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import delta_rule_reference, gated_delta_rule, gated_delta_rule_step
from attnzoo.functional.delta import delta_rule_prefill
from attnzoo.functional.delta import channels
from attnzoo.functional.delta.channels import DecayedProducts
from attnzoo.mechanisms import build_mechanism

B, H, D = 2, 3, 8


def _inputs(length, dtype=torch.float64, seed=0, d_v=D, strength=2.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, length, D, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, length, d_v, generator=g, dtype=dtype)
    beta = torch.rand(B, H, length, generator=g, dtype=dtype)
    log_decay = -strength * torch.rand(B, H, length, D, generator=g, dtype=dtype)
    return q, k, v, beta, log_decay


def _padding(length):
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[0, length // 2] = True
    mask[1, -(length // 3 + 1):] = True
    return mask


def _paper_recurrence(q, k, v, beta, log_decay, causal=True):
    """Kimi Linear's KDA, one token at a time: ``S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t
    k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(d_k)``; non-causal, every query reads the last state."""
    length, d_k = q.shape[2], q.shape[3]
    state = q.new_zeros(B, H, d_k, v.shape[3])
    eye = torch.eye(d_k, dtype=q.dtype)
    outputs = []
    for t in range(length):
        k_t = k[:, :, t, :, None]
        alpha = torch.diag_embed(log_decay[:, :, t].exp())
        b_t = beta[:, :, t, None, None]
        state = (eye - b_t * k_t @ k_t.mT) @ alpha @ state + b_t * k_t @ v[:, :, t, None, :]
        outputs.append(state.mT @ q[:, :, t, :, None] / math.sqrt(d_k))
    if not causal:
        return q @ state / math.sqrt(d_k)
    return torch.cat(outputs, dim=-1).mT


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 5, 13])
def test_chunked_equals_the_reference_and_the_paper(causal, length):
    q, k, v, beta, log_decay = _inputs(length, seed=length, d_v=5)
    mask = _padding(length)
    expected = delta_rule_reference(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask)
    for chunk_size in (1, 3, 4, 64):
        out = gated_delta_rule(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    paper = _paper_recurrence(q, k, v, beta, log_decay, causal)
    torch.testing.assert_close(gated_delta_rule(q, k, v, beta, log_decay, causal=causal, chunk_size=4), paper,
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_equal_the_paper_recurrence(causal):
    q, k, v, beta, log_decay = _inputs(11, seed=6)
    grads = []
    for fn in (lambda *xs: gated_delta_rule(*xs, causal=causal, chunk_size=4),
               lambda *xs: _paper_recurrence(*xs, causal=causal)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_decay)]
        weights = torch.randn(B, H, 11, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        (fn(*leaves) * weights).sum().backward()
        grads.append([x.grad for x in leaves])
    for label, fast, slow in zip(("q", "k", "v", "beta", "log_decay"), *grads):
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10, msg=lambda m: f"d{label}: {m}")


def test_gradcheck_with_padding():
    q, k, v, beta, log_decay = (x.requires_grad_() for x in _inputs(6, seed=8))
    mask = _padding(6)
    assert torch.autograd.gradcheck(
        lambda *xs: gated_delta_rule(*xs, key_padding_mask=mask, chunk_size=4), (q, k, v, beta, log_decay))


def test_steps_and_prefill_continue_the_forward():
    q, k, v, beta, log_decay = _inputs(10, seed=4)
    full = gated_delta_rule(q, k, v, beta, log_decay, chunk_size=4)
    head, state = delta_rule_prefill(*(x[:, :, :7] for x in (q, k, v, beta, log_decay)), chunk_size=4)
    outs = [head]
    for t in range(7, 10):
        out_t, state = gated_delta_rule_step(*(x[:, :, t:t + 1] for x in (q, k, v, beta, log_decay)), state)
        outs.append(out_t)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=0, atol=1e-10)


def test_a_decay_equal_on_every_channel_is_gated_delta():
    q, k, v, beta, log_decay = _inputs(13, seed=2)
    scalar = log_decay[..., 0]
    for causal in (True, False):
        per_channel = gated_delta_rule(q, k, v, beta, scalar.unsqueeze(-1).expand_as(k), causal=causal, chunk_size=4)
        torch.testing.assert_close(per_channel, gated_delta_rule(q, k, v, beta, scalar, causal=causal, chunk_size=4),
                                   rtol=0, atol=1e-12)


def test_channels_decay_independently():
    """A channel that does not decay keeps what was written to it; the others forget: the decay is per channel."""
    q, k, v, beta, _ = _inputs(9, seed=3)
    log_decay = torch.full((B, H, 9, D), -50.0, dtype=torch.float64)
    log_decay[..., 0] = 0.0
    out = gated_delta_rule(q, k, v, beta, log_decay, chunk_size=4)
    torch.testing.assert_close(out, _paper_recurrence(q, k, v, beta, log_decay), rtol=0, atol=1e-10)
    scalar = gated_delta_rule(q, k, v, beta, log_decay.amax(-1), chunk_size=4)
    assert (out - scalar).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strong_decays_stay_finite(dtype):
    """Log decays of -200 per position: exp of a cumulative sum over a chunk under- and overflows in any dtype;
    the chunked form never forms one (functional/delta/channels.py). Outputs and gradients stay finite and equal
    the reference."""
    q, k, v, beta, log_decay = _inputs(40, dtype=dtype, seed=5, strength=200.0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_decay)]
    out = gated_delta_rule(*leaves, chunk_size=32)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    expected = delta_rule_reference(q, k, v, beta, log_decay).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 8, 12])
def test_decayed_products_equal_their_definition(chunk):
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(2, 2, chunk, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, chunk, 5, generator=g, dtype=torch.float64, requires_grad=True)
    log_decay = (-3 * torch.rand(2, chunk, 5, generator=g, dtype=torch.float64)).requires_grad_()
    cumulative = log_decay.cumsum(-2)
    gaps = (cumulative.unsqueeze(-2) - cumulative.unsqueeze(-3)).exp()  # (2, C, C, 5): exp(g_t - g_j)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    expected = torch.einsum("bstc,btjc,bjc->bstj", x, gaps, y) * lower
    torch.testing.assert_close(DecayedProducts.apply(x, y, cumulative), expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *xs: DecayedProducts.apply(xs[0], xs[1], xs[2].cumsum(-2)),
                                    (x, y, log_decay))


def _products_by_definition(x, y, cumulative):
    lower = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).tril()
    gaps = cumulative.unsqueeze(-2) - cumulative.unsqueeze(-3)  # (.., C, C, d): g_t - g_j
    gaps = gaps.masked_fill(~lower.unsqueeze(-1), float("-inf")).exp()  # masked before exp: no overflow
    return torch.einsum("bstc,btjc,bjc->bstj", x, gaps, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decayed_products_mix_both_forms_by_chunk(dtype):
    """Chunks whose decay spans little take one reference (one matmul), the others are split in halves, and the
    halves again until a block spans little enough (or is one position); a call mixing them equals the
    definition in value and gradient, and the strong chunks are the ones told apart (the bound is the dtype's:
    log(max), 88 in float32, 709 in float64)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 16, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 16, 5, generator=g, dtype=torch.float64, requires_grad=True)
    per_step = torch.tensor([0.1, 2.0, 200.0, 0.5, 60.0, 3.0], dtype=torch.float64).view(6, 1, 1)
    cumulative = (-per_step * torch.rand(6, 16, 5, generator=g, dtype=torch.float64)).cumsum(-2)
    split = channels.chunk_factors(cumulative.to(dtype)).split
    strong = {2, 4} if dtype == torch.float32 else {2}
    assert split is not None and set(split.tolist()) == strong
    _check_products_against_definition(x, y, cumulative, dtype, g)


def _check_products_against_definition(x, y, cumulative, dtype, generator):
    """DecayedProducts in ``dtype`` equals the float64 definition, forward and backward (x, y float64 leaves)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, y)]
    out = DecayedProducts.apply(leaves[0], leaves[1], cumulative.to(dtype))
    expected = _products_by_definition(x, y, cumulative)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.double(), expected.detach(), rtol=0, atol=tolerance)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64).tril()
    out.backward(grad.to(dtype))
    for leaf, want in zip(leaves, torch.autograd.grad(expected, [x, y], grad)):
        torch.testing.assert_close(leaf.grad.double(), want, rtol=0, atol=10 * tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_reference_holds_up_to_the_bound(dtype):
    """A chunk whose decay spans just under the bound (log(max) of the dtype: factors up to e^44 in float32)
    takes one reference and still equals the definition, forward and backward; just over it, it splits."""
    g = torch.Generator().manual_seed(7)
    bound = math.log(torch.finfo(dtype).max)
    x = torch.randn(2, 2, 16, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 16, 5, generator=g, dtype=torch.float64, requires_grad=True)
    falls = torch.rand(2, 16, 5, generator=g, dtype=torch.float64).cumsum(1)
    falls = (falls - falls[:, :1]) / (falls[:, -1:] - falls[:, :1])  # 0 at the first position, 1 at the last
    spans = torch.tensor([0.97 * bound, 1.03 * bound], dtype=torch.float64).view(2, 1, 1)
    cumulative = -spans * falls - 0.5  # every channel falls by exactly its chunk's span
    assert channels.chunk_factors(cumulative.to(dtype)).split.tolist() == [1]
    _check_products_against_definition(x, y, cumulative, dtype, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decay_factors_from_the_single_reference_equal_the_exponentials(dtype):
    """exp(g) and exp(g_C - g) taken from the single-reference factors (gentle chunks) and by exp itself (strong
    chunks, and every chunk of a traced graph) equal the exponentials, relative to each value."""
    g = torch.Generator().manual_seed(6)
    per_step = torch.tensor([0.1, 2.0, 200.0, 0.5, 60.0, 3.0], dtype=torch.float64).view(6, 1, 1)
    cumulative = (-per_step * torch.rand(6, 16, 5, generator=g, dtype=torch.float64)).cumsum(-2)
    cumulative = cumulative.to(dtype).double()  # the exponentials of the very values the factors see
    factors = channels.chunk_factors(cumulative.to(dtype))
    assert factors.split is not None and 0 < factors.split.numel() < 6
    # g - r is rounded where exp(g) is not: a relative error up to |g| times the dtype's epsilon (|g| < 60 here).
    tolerance = 1e-5 if dtype == torch.float32 else 1e-13
    smallest = torch.finfo(dtype).tiny / tolerance  # below it a float32 product may flush toward zero
    for got, want in zip(channels.decay_factors(factors),
                         (cumulative.exp(), (cumulative[..., -1:, :] - cumulative).exp())):
        seen = want > smallest
        torch.testing.assert_close(got.double()[seen], want[seen], rtol=tolerance, atol=0)
        assert bool((got.double()[~seen] <= smallest).all())


def test_decayed_products_of_many_columns_equal_one_at_a_time():
    """The shared-factor form (rwkv7 takes its rows against k and b at once) equals the single products, forward
    and backward, with gentle and strong chunks mixed."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2, 8, 5, generator=g)
    ys = [torch.randn(4, 8, 5, generator=g) for _ in range(2)]
    per_step = torch.tensor([0.1, 300.0, 1.0, 30.0]).view(4, 1, 1)
    cumulative = (-per_step * torch.rand(4, 8, 5, generator=g)).cumsum(-2)
    grads = [torch.randn(4, 2, 8, 8, generator=g).tril() for _ in range(2)]
    for together, alone in zip(channels.decayed_products_many(x.unbind(1), ys, cumulative),
                               [channels.decayed_products_unchecked(x, y, cumulative) for y in ys]):
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)
    grad_x, grad_ys = channels.decayed_products_backward_many(grads, x.unbind(1), ys, cumulative)
    singles = [channels.decayed_products_backward(grad, x, y, cumulative) for grad, y in zip(grads, ys)]
    torch.testing.assert_close(grad_x, singles[0][0] + singles[1][0], rtol=0, atol=1e-5)
    for got, single in zip(grad_ys, singles):
        torch.testing.assert_close(got, single[1], rtol=0, atol=1e-5)


def test_decayed_products_in_a_traced_graph_always_take_the_recursion():
    """A traced graph holds one path: traced on gentle decays, it still gives the right products for strong ones
    (the single-reference form would overflow there)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 8, 5, generator=g)
    y = torch.randn(2, 8, 5, generator=g)
    gentle = (-0.1 * torch.rand(2, 8, 5, generator=g)).cumsum(-2)
    strong = (-300.0 * torch.rand(2, 8, 5, generator=g)).cumsum(-2)
    traced = torch.jit.trace(channels.decayed_products_unchecked, (x, y, gentle))
    torch.testing.assert_close(traced(x, y, strong).double(),
                               _products_by_definition(x.double(), y.double(), strong.double()), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, value", [("beta", float("nan")), ("beta", 2.5), ("beta", -0.1),
                                         ("log_decay", float("nan")), ("log_decay", float("-inf")),
                                         ("log_decay", 0.5)])
def test_bad_gates_are_refused_naming_them(name, value):
    q, k, v, beta, log_decay = _inputs(5)
    gates = {"beta": beta, "log_decay": log_decay}
    gates[name] = gates[name].clone()
    gates[name][1, 2, 3] = value
    with pytest.raises(ValueError, match=name):
        gated_delta_rule(q, k, v, gates["beta"], gates["log_decay"])


def test_bad_shapes_are_refused_naming_them():
    q, k, v, beta, log_decay = _inputs(5)
    with pytest.raises(ValueError, match=r"log_decay must have shape .*\(batch, heads, seq, d_k\)"):
        gated_delta_rule(q, k, v, beta, log_decay[..., :3])
    with pytest.raises(ValueError, match="log_decay"):
        gated_delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], log_decay[:, :, :1, :2], None)
    with pytest.raises(TypeError, match="log_decay"):
        gated_delta_rule(q, k, v, beta, log_decay.to(torch.int64))


def test_padded_positions_hold_anything():
    q, k, v, beta, log_decay = _inputs(7, seed=9)
    mask = _padding(7)
    clean = gated_delta_rule(q, k, v, beta, log_decay, key_padding_mask=mask, chunk_size=4)
    dirty = [x.clone() for x in (k, v, beta, log_decay)]
    for x in dirty:
        x.transpose(1, 2)[mask] = float("nan")  # (batch, seq, heads, ...) indexed by the (batch, seq) mask
    dirty[3][1, :, -1] = 5.0  # a positive "log decay" where padded is never read
    out = gated_delta_rule(q, *dirty, key_padding_mask=mask, chunk_size=4)
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


def test_mechanism_gate_is_per_channel_in_its_domain():
    torch.manual_seed(0)
    mechanism = build_mechanism("kda", 4, D, gate_rank=3).double()
    k = 10 * torch.randn(2, 4, 12, D, dtype=torch.float64)
    _, unit_k, _, beta, log_decay = mechanism._gated_inputs(k, k, k, None, mechanism._fast_conv)
    assert log_decay.shape == (2, 4, 12, D)
    assert (log_decay <= 0).all() and torch.isfinite(log_decay).all()
    assert ((beta > 0) & (beta < 1)).all()
    torch.testing.assert_close(unit_k.norm(dim=-1), torch.ones(2, 4, 12, dtype=torch.float64))
    assert (log_decay.std(-1) > 0).all()  # channels differ


def test_mechanism_heads_start_like_gated_delta():
    kda, gated = build_mechanism("kda", 4, D).double(), build_mechanism("gated_delta", 4, D).double()
    k = torch.zeros(1, 4, 1, D, dtype=torch.float64)  # the decay of the bias alone
    torch.testing.assert_close(kda.log_decay(k), gated.log_decay(k).unsqueeze(-1).expand(1, 4, 1, D))


def test_gate_rank_is_checked_and_shapes_the_map():
    assert build_mechanism("kda", 2, D, gate_rank=5).gate_down.shape == (2, D, 5)
    with pytest.raises(ValueError, match="gate_rank"):
        build_mechanism("kda", 2, D, gate_rank=0)

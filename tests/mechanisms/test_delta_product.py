"""Gated DeltaProduct (``delta_product``) and its functional core: the chunked form (the gated delta rule on the
interleaved steps, read at each position's last) equals the float64 reference and a per-token recurrence
written here from the paper, forward and gradients, across chunk boundaries, with padding and initial states;
step and prefill continue it; one step per position is the gated delta rule; bad input is refused naming the
argument. The conformance suite covers the mechanism's contract."""

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import (
    delta_product,
    delta_product_prefill,
    delta_product_reference,
    delta_product_step,
    gated_delta_rule,
)
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism

B, H, D, D_V = 2, 3, 8, 5


def _inputs(length, steps, seed=0, dtype=torch.float64, d_v=D_V):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, length, D, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, length, steps, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, length, steps, d_v, generator=g, dtype=dtype)
    beta = 2 * torch.rand(B, H, length, steps, generator=g, dtype=dtype)  # the whole allowed range [0, 2]
    log_decay = -torch.rand(B, H, length, generator=g, dtype=dtype)
    return q, k, v, beta, log_decay


def _padding(length):
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[0, length // 2] = True
    mask[1, -(length // 3 + 1):] = True
    return mask


def _paper(q, k, v, beta, log_decay, mask=None, causal=True, state=None):
    """Siems et al. 2025, one position at a time: decay the state once (by a scalar, or with a log decay per key
    channel (B, H, N, d_k) each key channel's row of it), apply the n_h generalised Householder steps
    ``S <- (I - beta k k^T) S + beta k v^T`` in order, read ``S^T q / sqrt(d)``; a padded position leaves the
    state as it was."""
    batch, heads, length, steps, d_k = k.shape
    eye = torch.eye(d_k, dtype=q.dtype)
    state = torch.zeros(batch, heads, d_k, v.shape[-1], dtype=q.dtype) if state is None else state
    outputs = []
    for t in range(length):
        new = state
        if log_decay is not None:
            decay = log_decay[:, :, t].exp()
            new = state * (decay[..., None, None] if log_decay.dim() == 3 else decay[..., :, None])
        for j in range(steps):
            k_j, v_j, b_j = k[:, :, t, j, :, None], v[:, :, t, j, :, None], beta[:, :, t, j, None, None]
            new = (eye - b_j * k_j @ k_j.mT) @ new + b_j * k_j @ v_j.mT
        state = new if mask is None else torch.where(mask[:, t, None, None, None], state, new)
        outputs.append(state.mT @ q[:, :, t, :, None] / d_k ** 0.5)
    out = torch.cat(outputs, dim=-1).mT
    return out if causal else q @ state / d_k ** 0.5


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 5, 13])
def test_chunked_and_reference_equal_the_paper_recurrence(steps, gated, causal, length):
    q, k, v, beta, log_decay = _inputs(length, steps, seed=length + 10 * steps)
    log_decay = log_decay if gated else None
    mask = _padding(length)
    expected = _paper(q, k, v, beta, log_decay, mask, causal)
    reference = delta_product_reference(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-10)
    for chunk_size in (1, 4, 64):
        out = delta_product(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_equal_the_paper_recurrences(steps, gated, causal):
    """The hand-written backward (read positions every n_h steps) against autograd through the recurrence."""
    inputs = _inputs(11, steps, seed=steps)
    leaves = [x.clone().requires_grad_() for x in (inputs if gated else inputs[:4])]
    log_decay = leaves[4] if gated else None
    initial = torch.randn(B, H, D, D_V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask = _padding(11)
    weights = torch.randn(B, H, 11, D_V, dtype=torch.float64)
    ours = delta_product(*leaves[:4], log_decay, causal=causal, key_padding_mask=mask, chunk_size=4,
                         initial_state=initial)
    theirs = _paper(*leaves[:4], log_decay, mask, causal, state=initial)
    grads = torch.autograd.grad((ours * weights).sum(), leaves)
    expected = torch.autograd.grad((theirs * weights).sum(), leaves)
    for name, grad, want in zip("q k v beta log_decay".split(), grads, expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_gradcheck_of_the_chunked_form():
    q, k, v, beta, log_decay = (x.requires_grad_() for x in _inputs(5, 2, seed=7, d_v=3))
    assert torch.autograd.gradcheck(lambda *x: delta_product(*x, chunk_size=2), (q, k, v, beta, log_decay))


def test_steps_and_prefill_continue_the_recurrence():
    q, k, v, beta, log_decay = _inputs(11, 2, seed=3)
    expected = _paper(q, k, v, beta, log_decay)
    out, state = delta_product_prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], beta[:, :, :6], log_decay[:, :, :6],
                                       chunk_size=4)
    outputs = [out]
    for t in range(6, 11):
        one = slice(t, t + 1)
        out_t, state = delta_product_step(q[:, :, one], k[:, :, one], v[:, :, one], beta[:, :, one],
                                          log_decay[:, :, one], state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)
    assert state.shape == (B, H, D, D_V)


def test_initial_state_splits_a_sequence():
    q, k, v, beta, log_decay = _inputs(10, 3, seed=4)
    whole = delta_product(q, k, v, beta, log_decay, chunk_size=3)
    first, state = delta_product_prefill(*(x[:, :, :4] for x in (q, k, v, beta, log_decay)), chunk_size=3)
    second = delta_product(*(x[:, :, 4:] for x in (q, k, v, beta, log_decay)), chunk_size=3, initial_state=state)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=0, atol=1e-10)


def test_one_step_per_position_is_the_gated_delta_rule():
    q, k, v, beta, log_decay = _inputs(13, 1, seed=8)
    beta = beta / 2
    ours = delta_product(q, k, v, beta, log_decay, chunk_size=4)
    theirs = gated_delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], log_decay, chunk_size=4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_padded_positions_write_nothing_and_do_not_decay():
    """Whatever a padded position holds (NaN and inf included), the others' outputs are those of the sequence
    without it."""
    q, k, v, beta, log_decay = _inputs(9, 2, seed=9)
    mask = torch.zeros(B, 9, dtype=torch.bool)
    mask[:, 4] = True
    garbage = [x.clone() for x in (k, v, beta, log_decay)]
    for x, value in zip(garbage, (float("nan"), float("inf"), float("nan"), 5.0)):
        x[:, :, 4] = value
    out = delta_product(q, *garbage, key_padding_mask=mask, chunk_size=4)
    keep = [0, 1, 2, 3, 5, 6, 7, 8]
    alone = delta_product(*(x[:, :, keep] for x in (q, k, v, beta, log_decay)), chunk_size=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, keep], alone, rtol=0, atol=1e-10)


def _broken(name):
    q, k, v, beta, log_decay = _inputs(5, 2)
    if name == "k rank":
        k = k[:, :, :, 0]
    elif name == "steps":
        v = v[:, :, :, :1]
    elif name == "beta shape":
        beta = beta[:, :, :4]
    elif name == "beta range":
        beta = beta.clone().index_fill_(2, torch.tensor([1]), 2.5)
    elif name == "beta negative":
        beta = beta.clone().index_fill_(2, torch.tensor([1]), -0.1)
    elif name == "beta nan":
        beta = beta.clone().index_fill_(2, torch.tensor([1]), float("nan"))
    elif name == "log_decay positive":
        log_decay = log_decay.clone().index_fill_(2, torch.tensor([2]), 0.1)
    elif name == "log_decay shape":
        log_decay = log_decay[:, :, :4]
    return q, k, v, beta, log_decay


@pytest.mark.parametrize("broken, match", [
    ("k rank", r"k must have shape \(batch, heads, seq, n_h, d_k\)"),
    ("steps", "same number n_h >= 1 of steps"),
    ("beta shape", "beta must have shape"),
    ("beta range", r"beta must be in \[0, 2\]"),
    ("beta negative", r"beta must be in \[0, 2\]"),
    ("beta nan", "beta must be finite"),
    ("log_decay positive", "log_decay must be <= 0"),
    ("log_decay shape", "log_decay must have shape"),
])
def test_bad_input_is_refused_naming_it(broken, match):
    with pytest.raises(ValueError, match=match):
        delta_product(*_broken(broken))


def test_bad_step_state_and_chunk_are_refused():
    q, k, v, beta, log_decay = _inputs(3, 2)
    with pytest.raises(ValueError, match="a step takes one position"):
        delta_product_step(q, k, v, beta, log_decay, None)
    one = [x[:, :, :1] for x in (q, k, v, beta, log_decay)]
    with pytest.raises(ValueError, match="state must have shape"):
        delta_product_step(*one, torch.zeros(B, H, D, D))
    with pytest.raises(ValueError, match="chunk_size"):
        delta_product(q, k, v, beta, log_decay, chunk_size=0)


@pytest.mark.parametrize("options, match", [
    ({"householder_steps": 0}, "householder_steps"),
    ({"householder_steps": 1.5}, "householder_steps"),
    ({"negative_eigenvalues": "False"}, "negative_eigenvalues"),
])
def test_bad_options_are_refused_naming_them(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_mechanism("delta_product", H, D, **options)


# -- a decay per key channel with n_h steps: the per-channel products at a stride --------------------------------
def _channel_decay(length, seed):
    """A log decay per key channel, (B, H, length, D), in [-1, 0]."""
    return -torch.rand(B, H, length, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(params=["kernel", "plain"])
def core_path(request, monkeypatch):
    """The causal chunked form by the hand-written kernel (eager), or by the plain operations torch.compile
    traces (taken here by reporting a compilation to the core)."""
    if request.param == "plain":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    return request.param


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_a_decay_per_key_channel_with_steps_equals_the_paper(core_path, steps, causal):
    q, k, v, beta, _ = _inputs(9, steps, seed=20 + steps)
    log_decay, mask = _channel_decay(9, steps), _padding(9)
    expected = _paper(q, k, v, beta, log_decay, mask, causal)
    reference = delta_product_reference(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-10)
    for chunk_size in (1, 4):
        out = delta_product(q, k, v, beta, log_decay, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("steps", [2, 3])
def test_gradients_with_a_decay_per_key_channel_equal_the_paper(core_path, steps):
    """The backward at a stride with the per-channel products: every input's gradient, the decay's per
    channel included, against autograd through the recurrence."""
    q, k, v, beta, _ = _inputs(10, steps, seed=30 + steps)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, _channel_decay(10, 40 + steps))]
    initial = torch.randn(B, H, D, D_V, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    mask, weights = _padding(10), torch.randn(B, H, 10, D_V, dtype=torch.float64)
    ours = delta_product(*leaves, key_padding_mask=mask, chunk_size=4, initial_state=initial)
    theirs = _paper(*leaves, mask, state=initial)
    grads = torch.autograd.grad((ours * weights).sum(), leaves)
    expected = torch.autograd.grad((theirs * weights).sum(), leaves)
    for name, grad, want in zip("q k v beta log_decay".split(), grads, expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_steps_continue_a_prefill_with_a_decay_per_key_channel():
    q, k, v, beta, _ = _inputs(8, 2, seed=50)
    log_decay = _channel_decay(8, 51)
    expected = _paper(q, k, v, beta, log_decay)
    out, state = delta_product_prefill(*(x[:, :, :5] for x in (q, k, v, beta, log_decay)), chunk_size=2)
    outputs = [out]
    for t in range(5, 8):
        out_t, state = delta_product_step(*(x[:, :, t:t + 1] for x in (q, k, v, beta, log_decay)), state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)


def test_a_decay_equal_on_every_channel_is_the_scalar_decay(core_path):
    q, k, v, beta, log_decay = _inputs(11, 2, seed=60)
    per_channel = log_decay.unsqueeze(-1).expand(*log_decay.shape, D)
    torch.testing.assert_close(delta_product(q, k, v, beta, per_channel, chunk_size=4),
                               delta_product(q, k, v, beta, log_decay, chunk_size=4), rtol=0, atol=1e-12)


# -- the mechanism ------------------------------------------------------------------------------------------
def _mechanism(seed=0, **options):
    torch.manual_seed(seed)
    module = build_mechanism("delta_product", H, D, chunk_size=4, **options).double()
    with torch.no_grad():  # parameters away from their initial values, so that every one matters
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return module


def _mechanism_by_hand(module, q, k, v, mask):
    """The parametrisation of docs/delta_product.md written out, then the paper's recurrence."""
    raw_k = k.masked_fill(mask[:, None, :, None], 0.0)
    v = v.masked_fill(mask[:, None, :, None], 0.0)
    logits = torch.einsum("bhnd,hjd->bhnj", raw_k, module.beta_weight) + module.beta_bias[:, None]
    beta = (2 if module.negative_eigenvalues else 1) * torch.sigmoid(logits)
    step = F.softplus(torch.einsum("bhnd,hd->bhn", raw_k, module.decay_weight) + module.dt_bias[:, None])
    log_decay = -module.A_log.exp()[:, None] * step
    keys, values = [F.normalize(raw_k, dim=-1)], [v]
    for j in range(module.householder_steps - 1):  # steps 2 .. n_h: W_j k and U_j v
        keys.append(F.normalize(torch.einsum("hed,bhnd->bhne", module.key_maps[:, j], raw_k), dim=-1))
        values.append(torch.einsum("hed,bhnd->bhne", module.value_maps[:, j], v))
    return _paper(F.normalize(q, dim=-1), torch.stack(keys, dim=3), torch.stack(values, dim=3), beta, log_decay,
                  mask)


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("negative_eigenvalues", [False, True])
def test_mechanism_equals_its_definition_forward_and_gradients(steps, negative_eigenvalues):
    module = _mechanism(householder_steps=steps, negative_eigenvalues=negative_eigenvalues)
    g = torch.Generator().manual_seed(steps)
    q, k, v = (torch.randn(B, H, 10, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = _padding(10)
    ours = module(q, k, v, causal=True, key_padding_mask=mask)
    theirs = _mechanism_by_hand(module, q, k, v, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    leaves = [q, k, v, *module.parameters()]
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((ours * weights).sum(), leaves)
    expected = torch.autograd.grad((theirs * weights).sum(), leaves)
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-10)


def test_one_householder_step_is_gated_delta_at_equal_parameters():
    torch.manual_seed(0)
    gated = build_mechanism("gated_delta", H, D, chunk_size=4, conv_size=3).double()
    product = build_mechanism("delta_product", H, D, chunk_size=4, conv_size=3, householder_steps=1).double()
    with torch.no_grad():
        for name in ("decay_weight", "A_log", "dt_bias", "q_conv", "k_conv", "v_conv"):
            getattr(product, name).copy_(getattr(gated, name))
        product.beta_weight.copy_(gated.beta_weight[:, None])
        product.beta_bias.copy_(gated.beta_bias[:, None])
    q, k, v = torch.randn(3, B, H, 13, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).unbind(0)
    mask = _padding(13)
    for causal in (True, False):
        torch.testing.assert_close(product(q, k, v, causal=causal, key_padding_mask=mask),
                                   gated(q, k, v, causal=causal, key_padding_mask=mask), rtol=0, atol=1e-12)
    ours, theirs = product.prefill(q, k, v), gated.prefill(q, k, v)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-12)
    step_ours = product.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], ours[1])[0]
    step_theirs = gated.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], theirs[1])[0]
    torch.testing.assert_close(step_ours, step_theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"conv_size": 3, "householder_steps": 3, "negative_eigenvalues": True}])
def test_mechanism_prefill_and_steps_equal_the_forward(options):
    module = _mechanism(**options)
    q, k, v = torch.randn(3, B, H, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).unbind(0)
    expected = module(q, k, v, causal=True)
    out, state = module.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5])
    outputs = [out]
    for t in range(5, 9):
        out_t, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, rtol=0, atol=1e-10)


def test_the_steps_are_distinct_at_initialisation():
    """The maps of the later steps start away from the identity (the first step's key and value) and from each
    other, so the steps are not one repeated reflection; one step has no maps."""
    torch.manual_seed(0)
    module = build_mechanism("delta_product", H, D, householder_steps=3)
    eye = torch.eye(D)
    for maps in (module.key_maps, module.value_maps):
        assert maps.shape == (H, 2, D, D)
        assert all((maps[:, j] - eye).abs().max() > 0.1 for j in (0, 1))
        assert (maps[:, 0] - maps[:, 1]).abs().max() > 0.1
    assert not hasattr(build_mechanism("delta_product", H, D, householder_steps=1), "key_maps")


def test_value_width_is_free_with_one_step_only():
    """The value maps of the later steps need v as wide as head_dim; one step takes any width, as gated_delta."""
    q, k = torch.randn(2, B, H, 6, D, dtype=torch.float64).unbind(0)
    v = torch.randn(B, H, 6, D + 3, dtype=torch.float64)
    assert _mechanism(householder_steps=1)(q, k, v, causal=True).shape == (B, H, 6, D + 3)
    with pytest.raises(UnsupportedOptionError, match="householder_steps=2"):
        _mechanism(householder_steps=2)(q, k, v, causal=True)

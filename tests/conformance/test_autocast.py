"""Every registered mechanism, and both gated blocks, under ``torch.autocast("cpu", torch.bfloat16)``.

Forward and backward run under autocast with float32 inputs and parameters, in every declared variant
(causal, key padding, cross-attention) of every option set in ``test_variants``: the output and the gradients
of q, k and v must be finite, the gradients float32 (the dtype of the inputs), and all of them close to the
same call without autocast. Inputs already in bfloat16 (what autocast's projections hand a mechanism inside a
model) must give finite bfloat16 gradients.

Closeness is measured in root mean square over a whole tensor, ``rms(autocast - float32) <= rtol *
rms(float32) + ATOL``, so that one element whose true value is a cancellation (a gradient that is zero in exact
arithmetic, a normaliser near zero) does not decide the verdict; what it catches is a tensor gone wrong, not
rounding. ``rtol`` depends on the mechanism's kind (:data:`RTOL`). Inputs are standard normal times
:data:`SCALE`: random-feature estimators are ill-conditioned by design for large logits (check_low_precision
in :mod:`.checks` leaves their half-precision accuracy to their own tests), and at this scale they are not.
"""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch
from torch import Tensor

import attnzoo
from attnzoo.functional import allowed_mask
from attnzoo.mechanisms import APPROXIMATE, EXACT, OWN, GauAttention, Mechanism, SoftmaxAttention, mechanism_class

from . import checks

SCALE = 0.5
LENGTH = 7  # a multiple of no chunk, block or bucket size of the test options; 3 for the shorter side
# Measured worst relative RMS differences (at SEQ 11 and 7, every variant): exact 0.004, own 0.007,
# approximate 0.12. bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 0.004), and an exact mechanism
# rounds a few times along each path. An attention of its own computes a fixed function too, through more
# steps (decays, feature maps, chunked states), so a little more. An approximate one may make discrete choices
# from the rounded inputs: clustered attention can move a query into another cluster (its approximation
# changes, not by rounding), hence the widest bound.
RTOL = {EXACT: 0.02, OWN: 0.05, APPROXIMATE: 0.25}
# Gradients are O(1); a gradient that is zero in exact arithmetic comes out ~1e-7 in float32.
ATOL = 1e-3
AUTOCAST = torch.bfloat16

MECHANISMS = attnzoo.available()
VARIANTS = [(name, None) for name in MECHANISMS] + [
    (name, options) for name in MECHANISMS for options in mechanism_class(name).test_variants
]


def _rms(x: Tensor) -> float:
    return float(x.detach().to(torch.float64).square().mean().sqrt()) if x.numel() else 0.0


def assert_rms_close(actual: Tensor, expected: Tensor, what: str, rtol: float) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    checks.assert_finite(actual, what)
    difference = _rms(actual.to(torch.float64) - expected.to(torch.float64))
    bound = rtol * _rms(expected) + ATOL
    if not difference <= bound:
        raise AssertionError(
            f"{what}: RMS difference {difference:.3g} from float32 exceeds rtol={rtol:g} * RMS "
            f"{_rms(expected):.3g} + atol={ATOL:g}"
        )


def forward_backward(
    mechanism: Mechanism, qkv: checks.Qkv, variant: checks.Variant, mask: Optional[Tensor], autocast: bool, what: str
) -> List[Tensor]:
    """[output, grad q, grad k, grad v] of one call (a fixed random weighting of the output as the loss), the
    whole of it under bfloat16 autocast or none of it. A failure to run is reported as an AssertionError
    naming the call."""
    leaves = tuple(t.detach().clone().requires_grad_() for t in qkv)
    mechanism.zero_grad(set_to_none=True)
    try:
        with torch.autocast("cpu", AUTOCAST, enabled=autocast):
            out = checks.call(mechanism, leaves, variant.causal, mask, variant.cross)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
        (out.float() * weights).sum().backward()
    except Exception as error:  # a crash under autocast is the failure this check exists for
        raise AssertionError(f"{what}: raised {type(error).__name__}: {error}") from error
    for label, leaf in zip("qkv", leaves):
        if leaf.grad is None:
            raise AssertionError(f"{what}: no gradient reached {label}")
    return [out] + [leaf.grad for leaf in leaves]


def check_autocast_matches_float32(mechanism: Mechanism) -> None:
    """Every declared variant under bfloat16 autocast, float32 inputs: finite, float32 gradients, close to
    float32 within the kind's :data:`RTOL`."""
    m = checks.as_dtype(mechanism, torch.float32)
    rtol = RTOL[m.capabilities.kind]
    name = type(mechanism).__name__
    for variant in checks.variants(m, LENGTH):
        qkv = checks.random_qkv(m, checks.BATCH, variant.q_len, variant.k_len, torch.float32, seed=4, scale=SCALE)
        mask = checks.padding_pattern(checks.BATCH, variant.k_len) if variant.padded else None
        what = f"{name} under bfloat16 autocast, {variant.describe()}"
        expected = forward_backward(m, qkv, variant, mask, False, what + " (float32)")
        actual = forward_backward(m, qkv, variant, mask, True, what)
        for label, got, want in zip(("output", "gradient of q", "gradient of k", "gradient of v"), actual, expected):
            if label != "output" and got.dtype != torch.float32:
                raise AssertionError(f"{what}: {label} is {got.dtype}, expected float32 (the input's dtype)")
            assert_rms_close(got, want, f"{what}: {label}", rtol)


def check_autocast_with_bfloat16_inputs(mechanism: Mechanism) -> None:
    """The call with every declared option at once, on bfloat16 inputs under autocast (as a model's
    projections under autocast give them): finite output and bfloat16 gradients."""
    m = checks.as_dtype(mechanism, torch.float32)
    caps = m.capabilities
    fullest = [v for v in checks.variants(m, LENGTH) if (v.causal, v.padded) == (caps.causal, caps.key_padding)]
    variant = fullest[0]
    qkv, mask = checks.variant_inputs(m, variant, torch.float64, seed=5)
    qkv = tuple((t * SCALE).to(AUTOCAST) for t in qkv)
    what = f"{type(mechanism).__name__} under bfloat16 autocast, bfloat16 inputs, {variant.describe()}"
    out, *grads = forward_backward(m, qkv, variant, mask, True, what)
    checks.assert_finite(out, f"{what}: output")
    for label, grad in zip("qkv", grads):
        if grad.dtype != AUTOCAST:
            raise AssertionError(f"{what}: gradient of {label} is {grad.dtype}, expected bfloat16 (the input's)")
        checks.assert_finite(grad, f"{what}: gradient of {label}")


@pytest.mark.parametrize(
    "name, options", VARIANTS,
    ids=[n + ("" if o is None else "-" + "-".join(f"{k}={v}" for k, v in o.items())) for n, o in VARIANTS],
)
def test_autocast_matches_float32(name, options, one_thread):
    mechanism = checks.build(name, options=options)
    check_autocast_matches_float32(mechanism)
    check_autocast_with_bfloat16_inputs(mechanism)


# -- decoding under autocast ------------------------------------------------------------------------------------
# The decoding inputs a model hands a mechanism under autocast: bfloat16 (its projections' output) or float32.
DECODING_INPUTS = (torch.float32, torch.bfloat16)
# Known not to hold yet, by (mechanism, input dtype): strict, so a fix shows up as an unexpected pass.


def check_decoding_state_under_autocast(mechanism: Mechanism, dtype: torch.dtype) -> None:
    """``prefill`` then ``step``, and ``step`` from the start, under bfloat16 autocast on inputs of ``dtype``:
    every state each call returns is laid out as :meth:`Mechanism.state_layout` declares for that dtype (the
    layout :meth:`Mechanism.check_state` holds the next step to), and every output is finite. A state whose
    declared working dtype (float32) came out in autocast's bfloat16 is refused by the next step."""
    if not mechanism.capabilities.recurrent_step:
        return
    m = checks.as_dtype(mechanism, torch.float32)
    n = checks.fit(m, LENGTH)
    q, k, v = checks.random_qkv(m, 2, n, n, dtype, seed=6, scale=SCALE)
    name = type(mechanism).__name__
    for prefix in sorted({0, 1, n // 2}):
        start = f"prefill({prefix} positions)" if prefix else "step from the start"
        what = f"{name} under bfloat16 autocast, {dtype} inputs, {start}"
        call = "prefill"
        try:
            with torch.autocast("cpu", AUTOCAST):
                state = None
                if prefix:
                    out, state = m.prefill(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix])
                    checks.assert_finite(out, f"{what}: prefill output")
                    m.check_state(state, q[:, :, :1])
                for t in range(prefix, n):
                    call = f"step at position {t}"
                    out, state = m.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
                    checks.assert_finite(out, f"{what}: {call} output")
                    m.check_state(state, q[:, :, :1])
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(f"{what}: {call} raised, or gave a state the next step refuses: "
                                 f"{type(error).__name__}: {error}") from error


DECODING = [
    pytest.param(name, options, dtype, id=f"{name_id}-{str(dtype).split('.')[-1]}")
    for (name, options), name_id in zip(VARIANTS, [
        n + ("" if o is None else "-" + "-".join(f"{k}={v}" for k, v in o.items())) for n, o in VARIANTS])
    if mechanism_class(name).capabilities.recurrent_step
    for dtype in DECODING_INPUTS
]


@pytest.mark.parametrize("name, options, dtype", DECODING)
def test_decoding_state_under_autocast(name, options, dtype, one_thread):
    check_decoding_state_under_autocast(checks.build(name, options=options), dtype)


# -- the gated blocks in a model ---------------------------------------------------------------------------------
VOCAB = 11
BLOCKS = [("gau", None), ("gau", {"scores": "softmax"}), ("flash_gau", {"chunk_size": 3}),
          ("flash_gau", {"chunk_size": 4, "scores": "softmax"})]
# A whole model under autocast rounds its projections and feed-forward layers too: measured worst 0.006 on
# the logits and 0.02 on the parameters' gradients.
MODEL_RTOL = 0.1


def _model_forward_backward(model: torch.nn.Module, run, autocast: bool, what: str) -> List[Tensor]:
    model.zero_grad(set_to_none=True)
    try:
        with torch.autocast("cpu", AUTOCAST, enabled=autocast):
            out = run(model)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(12))
        (out.float() * weights).sum().backward()
    except Exception as error:
        raise AssertionError(f"{what}: raised {type(error).__name__}: {error}") from error
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return [out.float()] + grads


def check_model_autocast(model: torch.nn.Module, run, what: str) -> None:
    names = ["output"] + [f"gradient of {n}" for n, _ in model.named_parameters()]
    expected = _model_forward_backward(model, run, False, what + " (float32)")
    actual = _model_forward_backward(model, run, True, what)
    for label, got, want in zip(names, actual, expected):
        assert_rms_close(got, want, f"{what}: {label}", MODEL_RTOL)


@pytest.mark.parametrize("block, options", BLOCKS, ids=[f"{b}-{o}" for b, o in BLOCKS])
def test_gated_blocks_train_under_autocast(block, options, one_thread):
    """Both gated blocks, causal (a language model with padding) and not (an encoder with a key padding mask),
    forward and backward under bfloat16 autocast: finite and close to float32."""
    torch.manual_seed(0)
    lm = attnzoo.LanguageModel(VOCAB, dim=16, heads=2, depth=1, block=block, block_options=options)
    sequence = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    check_model_autocast(lm, lambda m: m(sequence, padding_mask=mask), f"LanguageModel block={block!r} {options}")
    encoder = attnzoo.Encoder(16, 2, 1, block=block, block_options=options)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2))
    check_model_autocast(encoder, lambda m: m(x, key_padding_mask=mask), f"Encoder block={block!r} {options}")


# -- the check can fail ----------------------------------------------------------------------------------------
class _ScoresSavingInputs(torch.autograd.Function):
    """q k^T by hand: under autocast the forward's matmul gives bfloat16, so the backward (outside autocast)
    multiplies a bfloat16 gradient by the float32 inputs it saved."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k)
        return q @ k.transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, k = ctx.saved_tensors
        return grad @ k, grad.transpose(-1, -2) @ q


class _NanGradientUnderAutocast(torch.autograd.Function):
    """The identity, whose backward gives NaN after a forward under autocast."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.autocast = torch.is_autocast_enabled("cpu")
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad * float("nan") if ctx.autocast else grad


class CrashesUnderAutocast(SoftmaxAttention):
    name = "crashes-under-autocast"

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        scores = _ScoresSavingInputs.apply(q, k) * q.shape[-1] ** -0.5
        allowed = allowed_mask(q.shape[0], q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return (torch.softmax(scores, dim=-1).nan_to_num(0.0).to(v.dtype) @ v).to(v.dtype)


class NanGradient(SoftmaxAttention):
    name = "nan-gradient"

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(_NanGradientUnderAutocast.apply(q), k, v, causal, key_padding_mask, cross)


class CoarseUnderAutocast(SoftmaxAttention):
    """Rounds its output to 3 significant bits under autocast (float8 e4m3): runs, stays finite, is wrong."""

    name = "coarse-under-autocast"

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        out = super().attend(q, k, v, causal, key_padding_mask, cross)
        return out.to(torch.float8_e4m3fn).to(out.dtype) if torch.is_autocast_enabled("cpu") else out


@pytest.mark.parametrize(
    "toy, message",
    [(CrashesUnderAutocast, r"under bfloat16 autocast.*raised RuntimeError"),
     (NanGradient, r"gradient of q: \d+ non-finite"),
     (CoarseUnderAutocast, r"output: RMS difference")],
)
def test_the_autocast_check_can_fail(toy, message):
    with pytest.raises(AssertionError, match=message):
        check_autocast_matches_float32(toy(checks.HEADS, checks.HEAD_DIM))


def test_the_bfloat16_inputs_check_can_fail():
    with pytest.raises(AssertionError, match=r"bfloat16 inputs.*gradient of q: \d+ non-finite"):
        check_autocast_with_bfloat16_inputs(NanGradient(checks.HEADS, checks.HEAD_DIM))


def test_the_model_check_can_fail():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    check_model_autocast(model, lambda m: m(x), "plain")  # passes: autocast rounding only

    def nan_under_autocast(m):
        return _NanGradientUnderAutocast.apply(m(x))

    with pytest.raises(AssertionError, match=r"gradient of 0\.weight: \d+ non-finite"):
        check_model_autocast(model, nan_under_autocast, "nan")


class StateInAutocastDtype(GauAttention):
    """gau whose prefill passes its values through a matmul: under autocast they come out bfloat16, where its
    layout declares float32 (the working dtype)."""

    name = "state-in-autocast-dtype"

    def attend_prefill(self, q, k, v):
        out, tensors = super().attend_prefill(q, k, v)
        eye = torch.eye(tensors["v"].shape[-1], dtype=tensors["v"].dtype)
        return out, {**tensors, "v": tensors["v"] @ eye}


def test_the_decoding_state_check_can_fail():
    mechanism = StateInAutocastDtype(checks.HEADS, checks.HEAD_DIM)
    with pytest.raises(AssertionError, match=r"prefill\(1 positions\).*state tensor 'v' is torch.bfloat16"):
        check_decoding_state_under_autocast(mechanism, torch.bfloat16)

"""The conformance checks can fail: each one rejects a toy mechanism broken in exactly the way it guards.

The toys are never registered. ``GoodToy`` (exact softmax with a KV cache) and ``MinimalToy`` (no optional
capability at all) pass every check, so each broken toy, one defect away from ``GoodToy``, fails because of
its defect and nothing else.
"""

import math
from dataclasses import replace
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, find, settings
from torch import Tensor

from attnzoo._validation import check_qkv
from attnzoo.functional import allowed_mask, softmax_attention
from attnzoo.functional.softmax import softmax_weights
from attnzoo.mechanisms import CallInput, Mechanism, SoftmaxAttention

from . import checks
from .checks import Case
from .grouped_checks import GROUPED_HEADS, check_grouped
from .test_properties import cases

CAPS = SoftmaxAttention.capabilities


class GoodToy(SoftmaxAttention):
    """Exact softmax attention under another name: the baseline every broken toy departs from."""

    name = "toy"


class MinimalToy(GoodToy):
    """Non-causal self-attention only, no padding, no step: exercises the 'refused' side of every check."""

    name = "minimal-toy"
    capabilities = replace(CAPS, causal=False, cross=False, key_padding=False, recurrent_step=False)
    step = Mechanism.step
    prefill = Mechanism.prefill


class BoundedToy(GoodToy):
    name = "bounded-toy"
    capabilities = replace(CAPS, max_length=16)


# -- one defect each -----------------------------------------------------------------------------------------
class SwallowsKwargs(GoodToy):
    def __init__(self, heads: int, head_dim: int, **options: object) -> None:
        super().__init__(heads, head_dim)


class WrongDtype(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, causal, key_padding_mask, cross).float()


class OneRowPerKey(GoodToy):
    """Cross-attention returns one row per key instead of per query."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if q.shape[2] != k.shape[2]:
            q = k
        return super().attend(q, k, v, causal, key_padding_mask, cross)


class UpcastsHalf(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if q.dtype in (torch.float16, torch.bfloat16):
            return super().attend(q.float(), k.float(), v.float(), causal, key_padding_mask, cross)
        return super().attend(q, k, v, causal, key_padding_mask, cross)


class LiesAboutCausal(GoodToy):
    """Declares no causal support but silently accepts causal=True (and ignores it)."""

    capabilities = replace(CAPS, causal=False, recurrent_step=False)
    step = Mechanism.step
    prefill = Mechanism.prefill

    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        super().check_inputs(q, k, v, False, key_padding_mask, cross)


class CausalOnlyToy(GoodToy):
    """Causal self-attention only (capability non_causal=False): every check calls it causally."""

    name = "causal-only-toy"
    capabilities = replace(CAPS, non_causal=False)


class LiesAboutNonCausal(CausalOnlyToy):
    """Declares no non-causal form but silently runs causal=False (as causal)."""

    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        super().check_inputs(q, k, v, True, key_padding_mask, cross)


class Nondeterministic(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        out = super().attend(q, k, v, causal, key_padding_mask, cross)
        return out + 1e-3 * torch.randn_like(out)


class IgnoresValues(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, q.clone(), causal, key_padding_mask, cross)


class MasksWeightsOnly(GoodToy):
    """Gives padded keys zero weight but multiplies by their values all the same (0 * NaN = NaN)."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if key_padding_mask is None:
            return super().attend(q, k, v, causal, None, cross)
        weights = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
            key_padding_mask[:, None, None, :], -math.inf), dim=-1)
        allowed = allowed_mask(q.shape[0], q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
        weights = torch.where(allowed, weights, 0.0).nan_to_num(0.0)
        return weights @ v


class BranchesOnMaskValues(GoodToy):
    """Takes a shortcut when no row is fully padded, decided by looking at the mask's values."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if key_padding_mask is not None and not bool(key_padding_mask.all(-1).any()):
            return super().attend(q, k, v, causal, key_padding_mask, cross)
        return 2.0 * super().attend(q, k, v, causal, key_padding_mask, cross)


class GuessesCrossFromLengths(GoodToy):
    """Declares no cross-attention but takes equal lengths for self-attention, even when told otherwise."""

    capabilities = replace(CAPS, cross=False)

    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        super().check_inputs(q, k, v, causal, key_padding_mask, k.shape[2] != q.shape[2])


class TruthyCausal(GoodToy):
    """Reads causal as a truth value."""

    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        super().check_inputs(q, k, v, bool(causal), key_padding_mask, cross)

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, bool(causal), key_padding_mask, cross)


class IgnoresPadding(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, causal, None, cross)


class PeeksAtFuture(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, False, key_padding_mask, cross)


class MixesBatch(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k + 0.1 * k.mean(0, keepdim=True), v, causal, key_padding_mask, cross)


class AnchorsBlocksAtTheRow(GoodToy):
    """Scales its output per block of 3 positions counted from the padded row's start: padding on the left
    moves the grid (right padding does not), yet it declares padding_invariance="either"."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        out = super().attend(q, k, v, causal, key_padding_mask, cross)
        grid = torch.arange(q.shape[2], device=q.device) // 3 % 2
        return out * (1.0 + 0.5 * grid.to(out.dtype)).view(1, 1, -1, 1)


class ScalesByRowLength(GoodToy):
    """Scales its logits by the padded row's length: padding on either side changes every output."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q * math.sqrt(8.0 / k.shape[2]), k, v, causal, key_padding_mask, cross)


class ReadsTheRowsFirstPosition(GoodToy):
    """Adds the value at the row's first position, padded or not; declares no padding invariance at all,
    which never excuses what a padded position holds reaching a real one."""

    capabilities = replace(CAPS, padding_invariance="neither")

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, causal, key_padding_mask, cross) + 1e-3 * v[:, :, :1]


def _masked_softmax(q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]):
    """Textbook masked softmax: rows with no visible key come out as 0/0."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = allowed_mask(q.shape[0], q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    if allowed is None:
        return logits.softmax(-1) @ v, None
    return logits.masked_fill(~allowed, -math.inf).softmax(-1) @ v, allowed


class DriftsFromReference(GoodToy):
    """Declares itself approximate, yet its fast path does not compute what its reference does."""

    capabilities = replace(CAPS, kind="approximate")

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return softmax_attention(q, k, v, causal, key_padding_mask, scale=0.9 / math.sqrt(q.shape[-1]))


class NaNOnEmptyRows(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return _masked_softmax(q, k, v, causal, key_padding_mask)[0]


class NaNGradientOnEmptyRows(GoodToy):
    """Zeroes empty rows after the fact: the forward is finite, the backward through 0/0 is not."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        out, allowed = _masked_softmax(q, k, v, causal, key_padding_mask)
        if allowed is None:
            return out
        return torch.where(allowed.any(-1, keepdim=True), out, torch.zeros_like(out))


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 1.5 * grad


class WrongGradient(GoodToy):
    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return _ScaleGradient.apply(super().attend(q, k, v, causal, key_padding_mask, cross))


class ForgetfulStep(GoodToy):
    def step(self, q_t, k_t, v_t, state):
        return super().step(q_t, k_t, v_t, None)


class PrefillKeepsLastPosition(GoodToy):
    """Its prefill state forgets every position of the prompt but the last."""

    def attend_prefill(self, q, k, v):
        out, cache = super().attend_prefill(q, k, v)
        cache["k"][:, :, : q.shape[2] - 1] = 0.0
        cache["v"][:, :, : q.shape[2] - 1] = 0.0
        return out, cache


class StateOnModule(GoodToy):
    """Keeps the KV cache on the module and hands out only a position counter."""

    def state_layout(self, dtype):
        return {"t": ((), torch.long)}

    def attend_step(self, q_t, k_t, v_t, tensors, length):
        if tensors is None:
            self.cache_k, self.cache_v = k_t, v_t
        else:
            self.cache_k = torch.cat([self.cache_k, k_t], dim=2)
            self.cache_v = torch.cat([self.cache_v, v_t], dim=2)
        out = softmax_attention(q_t, self.cache_k, self.cache_v)
        return out, {"t": torch.full((q_t.shape[0],), self.cache_k.shape[2])}

    attend_prefill = Mechanism.attend_prefill


def _heads_first(state):
    return replace(state, tensors={n: t.transpose(0, 1) if t.dim() > 1 else t for n, t in state.tensors.items()})


class HeadsFirstState(GoodToy):
    """Hands out its KV cache as (heads, batch, t, head_dim)."""

    def step(self, q_t, k_t, v_t, state):
        out, state = super().step(q_t, k_t, v_t, None if state is None else _heads_first(state))
        return out, _heads_first(state)

    def prefill(self, q, k, v):
        out, state = super().prefill(q, k, v)
        return out, _heads_first(state)


class TrustsAnyState(GoodToy):
    """Continues from whatever state it is given."""

    def check_state(self, state, q_t, kv_heads=None, value_width=None):
        pass


class DropsValueChannels(GoodToy):
    """Declares any_value_width=True but attends with only the first head_dim channels of v."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v[..., : self.head_dim], causal, key_padding_mask, cross)


class StateForHeadDimValues(GoodToy):
    """Decodes v of another width, but lays its state out for head_dim values: the second step is refused."""

    def state_layout(self, dtype, kv_heads=None, value_width=None):
        return super().state_layout(dtype, kv_heads)


class GroupedStateForHeadDimValues(GoodToy):
    """Lays its state out for wider values, except with grouped key/value heads."""

    def state_layout(self, dtype, kv_heads=None, value_width=None):
        return super().state_layout(dtype, kv_heads, None if kv_heads is not None else value_width)


class PrefillsForHeadDimValues(GoodToy):
    """Steps with wider values from an empty state, but its prefill keeps only head_dim value channels."""

    def attend_prefill(self, q, k, v):
        return super().attend_prefill(q, k, v[..., : self.head_dim])


class TakesAnyValueWidthUndeclared(GoodToy):
    """Declares any_value_width=False but runs v of any width."""

    capabilities = replace(CAPS, any_value_width=False)

    def value_width_reason(self, width):
        return None


class IgnoresMaxLength(BoundedToy):
    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        check_qkv(q, k, v)


class NoValidation(GoodToy):
    def check_inputs(self, q, k, v, causal, key_padding_mask, cross=False):
        pass


class ViewsItsInputs(GoodToy):
    """Flattens each head's queries with ``view``, which only works when positions are contiguous."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        flat = q.view(q.shape[0], q.shape[1], -1)
        return super().attend(flat.view(q.shape), k, v, causal, key_padding_mask, cross)


class ValidatesTwice(GoodToy):
    """Calls the checked functional entry point after forward() has already checked everything."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return softmax_attention(q, k, v, causal, key_padding_mask)


class HookedToy(GoodToy):
    """Correct training hooks: a penalty on the keys as its auxiliary loss, a buffer redrawn after every optimiser
    step from (step, seed), and a reason against data parallelism naming it."""

    name = "hooked-toy"
    # Its constructor takes no option, so none plays a role.
    capabilities = replace(CAPS, scale_option=None, window_option=None, quiet_option=None)

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.register_buffer("probe", torch.zeros(heads, head_dim))
        self.penalty: Optional[Tensor] = None

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        if self.training:
            self.penalty = k.pow(2).mean()
        return super().attend(q, k, v, causal, key_padding_mask, cross)

    def auxiliary_loss(self):
        loss, self.penalty = self.penalty, None
        return loss

    def update_after_step(self, step, seed):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        self.probe.copy_(torch.randn(self.probe.shape, generator=generator, dtype=self.probe.dtype))

    def data_parallel_reasons(self):
        return [f"{self.name} keeps a probe per rank"]


class DetachedAuxiliaryLoss(HookedToy):
    def auxiliary_loss(self):
        loss = super().auxiliary_loss()
        return None if loss is None else loss.detach()


class AuxiliaryLossGivenTwice(HookedToy):
    def auxiliary_loss(self):
        return self.penalty


class AuxiliaryLossInFloat32(HookedToy):
    def auxiliary_loss(self):
        loss = super().auxiliary_loss()
        return None if loss is None else loss.float()


class RedrawsFromTheGlobalGenerator(HookedToy):
    def update_after_step(self, step, seed):
        self.probe.copy_(torch.randn(self.probe.shape, dtype=self.probe.dtype))


class RedrawsInFloat32(HookedToy):
    def update_after_step(self, step, seed):
        self.probe = torch.zeros(self.probe.shape, dtype=torch.float32)


class StepUnchecked(HookedToy):
    def after_optimizer_step(self, step, seed):
        self.update_after_step(step, seed)


class LearnedGainInItsOwnDtype(GoodToy):
    """A learned output gain exp(g) computed in its parameter's dtype: float32 rounding in a float64 result."""

    capabilities = replace(CAPS, scale_option=None, window_option=None, quiet_option=None)  # takes no option

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.gain = torch.nn.Parameter(torch.tensor(0.1))

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend(q, k, v, causal, key_padding_mask, cross) * torch.exp(self.gain)

    def attend_reference(self, q, k, v, causal, key_padding_mask, cross):
        return super().attend_reference(q, k, v, causal, key_padding_mask, cross) * torch.exp(self.gain.double())


class RefusesWithoutSayingWhy(GoodToy):
    def data_parallel_reasons(self):
        return [""]


class RefusesWithAString(GoodToy):
    def data_parallel_reasons(self):
        return "toy keeps state per rank"


class IgnoresItsScale(GoodToy):
    """Declares a scale option (softmax's) and attends at 1/sqrt(head_dim) whatever it says."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        return softmax_attention(q, k, v, causal, key_padding_mask)


class WeightsWithoutItsScale(GoodToy):
    def attend_weights(self, q, k, key_padding_mask, causal, bias):
        return softmax_weights(q, k, causal, key_padding_mask, bias=bias)


class RowsReadEarlierQueries(GoodToy):
    """Declares causal_rows, but each query is averaged with the ones before it."""

    capabilities = replace(CAPS, causal_rows=True)

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        running = q.cumsum(dim=2) / torch.arange(1, q.shape[2] + 1, dtype=q.dtype).view(1, 1, -1, 1)
        return super().attend(running, k, v, causal, key_padding_mask, cross)


class ScaleOptionItLacks(GoodToy):
    capabilities = replace(CAPS, scale_option="temperature")


def toy(cls, heads: int = checks.HEADS, **options) -> Mechanism:
    return cls(heads, checks.HEAD_DIM, **options).double().eval()


# -- the checks pass on correct toys -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [GoodToy, MinimalToy, BoundedToy, HookedToy, CausalOnlyToy],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("check", checks.INSTANCE_CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_correct_toys_pass(cls, check):
    check(toy(cls))


@pytest.mark.parametrize("cls", [GoodToy, MinimalToy, BoundedToy], ids=lambda c: c.__name__)
def test_correct_toy_declarations_pass(cls):
    checks.check_declaration(cls)


# -- and fail on broken ones ---------------------------------------------------------------------------------
BROKEN = [
    (checks.check_output_shape_and_dtype, WrongDtype, {}, r"output dtype torch.float32, expected the input dtype"),
    (checks.check_output_shape_and_dtype, OneRowPerKey, {}, r"cross-attention .* output shape"),
    (checks.check_low_precision, UpcastsHalf, {}, r"float16 .* output dtype torch.float32"),
    (checks.check_unsupported_options, LiesAboutCausal, {}, r"causal=True: expected UnsupportedOptionError"),
    (checks.check_unsupported_options, LiesAboutNonCausal, {}, r"causal=False: expected UnsupportedOptionError"),
    (checks.check_deterministic, Nondeterministic, {}, r"two eval-mode calls"),
    (checks.check_output_depends_on_values, IgnoresValues, {}, r"replacing every value"),
    (checks.check_key_padding, IgnoresPadding, {}, r"padded keys/values holding other values changed the output"),
    (checks.check_key_padding, MasksWeightsOnly, {}, r"padded keys/values holding NaN changed the output"),
    (checks.check_padded_like_alone, AnchorsBlocksAtTheRow, {},
     r"padded by 5 on the left .*differs from the sequence alone \(padding_invariance='either'"),
    (checks.check_padded_like_alone, ScalesByRowLength, {},
     r"padded by 5 on the right .*differs from the sequence alone"),
    (checks.check_padded_like_alone, ReadsTheRowsFirstPosition, {},
     r"padded by 5 on the left .*differs from it with zeros in the padding"),
    (checks.check_no_lookahead, PeeksAtFuture, {}, r"changing the future"),
    (checks.check_batch_independence, MixesBatch, {}, r"batch element"),
    (checks.check_traced_matches_eager, BranchesOnMaskValues, {}, r"traced with no fully padded row, run with one"),
    (checks.check_matches_reference, GoodToy, {"scale": 1.0}, r"reference differs from softmax_attention_reference"),
    (checks.check_matches_reference, DriftsFromReference, {}, r"differs from its own float64 reference"),
    (checks.check_matches_reference, NaNOnEmptyRows, {}, r"non-finite"),
    (checks.check_float64_inputs_on_float32_module, LearnedGainInItsOwnDtype, {},
     r"float32 module, float64 inputs.*differs from its own float64 reference"),
    (checks.check_gradients_finite, NaNGradientOnEmptyRows, {}, r"gradient of v: .* non-finite"),
    (checks.check_gradcheck, WrongGradient, {}, r"gradcheck failed"),
    (checks.check_gradients_match_reference, WrongGradient, {}, r"gradient of q against reference"),
    (checks.check_step_matches_parallel, ForgetfulStep, {}, r"step output at position 1"),
    (checks.check_prefill_then_step, PrefillKeepsLastPosition, {}, r"then step: step output"),
    (checks.check_step_state_is_explicit, StateOnModule, {}, r"decoded alternately"),
    (checks.check_step_state_batch_first, HeadsFirstState, {}, r"batch \(3\) as its first dim"),
    (checks.check_step_refuses_foreign_state, TrustsAnyState, {}, r"batch-1 state for a batch-3 step: expected"),
    (checks.check_value_width, DropsValueChannels, {}, r"head_dim \+ 3 = 11 channels.*output shape"),
    (checks.check_value_width, StateForHeadDimValues, {}, r"step by step: declares any_value_width=True, but "
                                                          r"raised ValueError: .*state tensor 'v'"),
    (checks.check_value_width, PrefillsForHeadDimValues, {}, r"prefill vs the causal forward: shape"),
    (checks.check_unsupported_options, TakesAnyValueWidthUndeclared, {},
     r"v with 7 channels: expected UnsupportedOptionError"),
    (checks.check_unsupported_options, GuessesCrossFromLengths, {}, r"cross=True with q_len=6, k_len=6: expected"),
    (checks.check_bad_input, TruthyCausal, {}, r"causal='no': expected TypeError"),
    (checks.check_max_length, IgnoresMaxLength, {}, r"max_length=16: expected ValueError"),
    (checks.check_bad_input, NoValidation, {}, r"q of rank 3: .*does not name"),
    (checks.check_non_contiguous_inputs, ViewsItsInputs, {}, r"view size is not compatible"),
    (checks.check_inputs_validated_once, ValidatesTwice, {}, r"check_qkv ran 2 times in one forward"),
    (checks.check_auxiliary_loss, DetachedAuxiliaryLoss, {}, r"no gradient path"),
    (checks.check_auxiliary_loss, AuxiliaryLossGivenTwice, {}, r"gave a loss twice"),
    (checks.check_auxiliary_loss, AuxiliaryLossInFloat32, {}, r"float64: auxiliary_loss\(\) is torch.float32"),
    (checks.check_after_optimizer_step, RedrawsFromTheGlobalGenerator, {}, r"differ in 'probe'.*global generator"),
    (checks.check_after_optimizer_step, RedrawsInFloat32, {}, r"changed the shape, dtype or device of \['probe'\]"),
    (checks.check_after_optimizer_step, StepUnchecked, {}, r"after_optimizer_step\(-1, 0\): expected ValueError"),
    (checks.check_logit_scale, IgnoresItsScale, {}, r"scale=0.7: not the scaled logits"),
    (checks.check_attention_weights, WeightsWithoutItsScale, {"scale": 0.5}, r"attention_weights\(\) @ v is not"),
    (checks.check_causal_rows, RowsReadEarlierQueries, {}, r"last causal rows depend on earlier queries"),
    (checks.check_data_parallel_reasons, RefusesWithoutSayingWhy, {}, r"non-empty string naming"),
    (checks.check_data_parallel_reasons, RefusesWithAString, {}, r"must return a list of strings, got str"),
]


@pytest.mark.parametrize(
    "check, cls, options, message", BROKEN, ids=[f"{c.__name__[6:]}-{k.__name__}" for c, k, _, _ in BROKEN]
)
def test_check_rejects_broken_toy(check, cls, options, message):
    with pytest.raises(AssertionError, match=message):
        check(toy(cls, heads=1, **options))  # one head: a failing gradcheck builds the full Jacobian to report


def test_value_width_check_rejects_a_grouped_state_laid_out_for_head_dim_values():
    with pytest.raises(AssertionError, match=r"one key/value head, step by step: declares any_value_width=True"):
        checks.check_value_width(toy(GroupedStateForHeadDimValues, heads=2))
    checks.check_value_width(toy(GoodToy, heads=2))


@pytest.mark.parametrize("cls, declared", [(AnchorsBlocksAtTheRow, "right"), (ScalesByRowLength, "neither")],
                         ids=lambda x: getattr(x, "__name__", x))
def test_padding_check_holds_a_mechanism_to_its_declared_sides(cls, declared):
    """Declaring the sides a mechanism is invariant to is what the padding check reads: the toys that fail it
    pass once they declare what they do."""

    class Declared(cls):
        capabilities = replace(CAPS, padding_invariance=declared)

    checks.check_padded_like_alone(toy(Declared, heads=1))


def test_padding_check_reads_the_reference_too(monkeypatch):
    """A reference that lets a padded value's NaN through (times zero, still NaN) fails the padding check,
    though the fast path is sound."""
    from attnzoo.mechanisms import softmax as softmax_module

    sound = softmax_module.softmax_attention_reference

    def leaky(q, k, v, causal, key_padding_mask, *, quiet, scale):
        out = sound(q, k, v, causal, key_padding_mask, quiet=quiet, scale=scale)
        return out + 0.0 * v.sum(2, keepdim=True)

    checks.check_padded_like_alone(toy(GoodToy, heads=1))
    monkeypatch.setattr(softmax_module, "softmax_attention_reference", leaky)
    with pytest.raises(AssertionError, match=r"reference\(\) causal=False: .* padded by 5 on the right .*non-finite"):
        checks.check_padded_like_alone(toy(GoodToy, heads=1))


def test_every_instance_check_has_a_broken_toy():
    guarded = {check for check, _, _, _ in BROKEN}
    assert set(checks.INSTANCE_CHECKS) <= guarded, set(checks.INSTANCE_CHECKS) - guarded


def test_declaration_check_rejects_swallowed_kwargs():
    with pytest.raises(AssertionError, match=r"must not swallow unknown arguments"):
        checks.check_declaration(SwallowsKwargs)


def test_declaration_check_rejects_step_without_causal():
    class StepWithoutCausal(GoodToy):
        capabilities = replace(CAPS, causal=False)

    with pytest.raises(AssertionError, match=r"recurrent_step=True needs causal=True"):
        checks.check_declaration(StepWithoutCausal)


def test_declaration_check_rejects_unknown_test_options():
    class MisspelledTestOption(GoodToy):
        test_options = {"quite": True}

    with pytest.raises(AssertionError, match=r"test_options names \['quite'\]"):
        checks.check_declaration(MisspelledTestOption)


def test_declaration_check_rejects_an_option_role_naming_no_option():
    with pytest.raises(AssertionError, match=r"capabilities.scale_option = 'temperature' names no option"):
        checks.check_declaration(ScaleOptionItLacks)


def test_declaration_check_rejects_undeclared_call_input():
    class TakesAnUndeclaredArgument(GoodToy):
        def attend(self, q, k, v, causal, key_padding_mask, cross, *, extra=None):
            return super().attend(q, k, v, causal, key_padding_mask, cross)

    with pytest.raises(AssertionError, match=r"attend takes keyword-only \['extra'\]: declare them in call_inputs"):
        checks.check_declaration(TakesAnUndeclaredArgument)


def test_declaration_check_rejects_call_input_attend_does_not_take():
    class DeclaresAnInputItLacks(GoodToy):
        call_inputs = (CallInput("global_mask", "positions"),)

    with pytest.raises(AssertionError, match=r"declares 'global_mask', but attend takes no keyword-only"):
        checks.check_declaration(DeclaresAnInputItLacks)


def test_declaration_check_rejects_call_input_without_reference():
    class NoReferenceCounterpart(GoodToy):
        call_inputs = (CallInput("extra", "positions"),)

        def attend(self, q, k, v, causal, key_padding_mask, cross, *, extra=None):
            return super().attend(q, k, v, causal, key_padding_mask, cross)

    with pytest.raises(AssertionError, match=r"declares 'extra', but attend_reference takes no keyword-only"):
        checks.check_declaration(NoReferenceCounterpart)


def test_overriding_what_the_base_class_checks_is_refused_at_class_creation():
    with pytest.raises(TypeError, match=r"overrides forward\(\).*implement attend\(\) instead"):
        class OwnForward(GoodToy):
            def forward(self, q, k, v, causal=False, key_padding_mask=None, *, cross=False):
                return super().forward(q, k, v, causal, key_padding_mask, cross=cross)
    with pytest.raises(TypeError, match=r"overrides reference\(\).*implement attend_reference\(\) instead"):
        class OwnReference(GoodToy):
            def reference(self, q, k, v, causal=False, key_padding_mask=None, *, cross=False):
                return super().reference(q, k, v, causal, key_padding_mask, cross=cross)


# -- property checks -----------------------------------------------------------------------------------------
FULLY_PADDED = Case(batch=2, heads=2, q_len=5, k_len=5, causal=False,
                    padding=((False,) * 5, (True,) * 5), cut=2, seed=3)
PARTLY_PADDED = Case(batch=2, heads=2, q_len=6, k_len=6, causal=True,
                     padding=((False,) * 6, (True, False, False, True, False, True)), cut=2, seed=4)


@pytest.mark.parametrize(
    "check, cls, case",
    [
        (checks.check_case_finite, NaNOnEmptyRows, FULLY_PADDED),
        (checks.check_case_padding_invariance, IgnoresPadding, PARTLY_PADDED),
        (checks.check_case_no_lookahead, PeeksAtFuture, PARTLY_PADDED),
    ],
    ids=["finite", "padding", "lookahead"],
)
def test_property_check_rejects_broken_toy_and_passes_good_one(check, cls, case):
    check(toy(GoodToy, heads=case.heads), case)
    with pytest.raises(AssertionError):
        check(toy(cls, heads=case.heads), case)


def _fails(check: Callable, cls: type, case: Case) -> bool:
    try:
        check(toy(cls, heads=case.heads), case)
    except AssertionError:
        return True
    return False


SEARCH = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    "check, cls, force",
    [
        (checks.check_case_finite, NaNOnEmptyRows, {}),
        (checks.check_case_padding_invariance, IgnoresPadding, {"padded": True}),
        (checks.check_case_no_lookahead, PeeksAtFuture, {"causal": True}),
    ],
    ids=["finite", "padding", "lookahead"],
)
def test_property_strategy_finds_the_defect(check, cls, force):
    """Within the property tests' example budget, the strategy draws a case that exposes the defect."""
    found = find(cases(CAPS, None, **force), lambda case: _fails(check, cls, case), settings=SEARCH)
    assert _fails(check, cls, found)


# -- grouped-query attention ---------------------------------------------------------------------------------
class TilesKeyValueHeads(GoodToy):
    """Repeats grouped k, v by tiling: query head h reads key/value head h % kv_heads, not h // groups."""

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        tiles = q.shape[1] // k.shape[1]
        return super().attend(q, k.repeat(1, tiles, 1, 1), v.repeat(1, tiles, 1, 1), causal, key_padding_mask, cross)


class RepeatsIntoItsCache(GoodToy):
    """Declares grouped_kv='native' but repeats grouped keys/values into its KV cache."""

    def state_layout(self, dtype, kv_heads=None):
        return super().state_layout(dtype)

    def attend_prefill(self, q, k, v):
        return super().attend_prefill(q, *self._repeated(q, k, v))

    def attend_step(self, q_t, k_t, v_t, tensors, length):
        return super().attend_step(q_t, *self._repeated(q_t, k_t, v_t), tensors, length)

    @staticmethod
    def _repeated(q, k, v):
        groups = q.shape[1] // k.shape[1]
        return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


class SaysNoButAccepts(GoodToy):
    """Declares grouped_kv='none' but silently runs grouped keys/values."""

    capabilities = replace(CAPS, grouped_kv="none")

    def unsupported_reasons(self, q, k, v, causal=False, key_padding_mask=None, *, cross=False):
        return Mechanism.unsupported_reasons(self, q, k[:, :1].expand(q.shape), v[:, :1].expand(q.shape), causal,
                                             key_padding_mask, cross=cross)

    def check_grouping(self, q, k, v, *, refuse=True):
        super().check_grouping(q, k, v, refuse=False)


@pytest.mark.parametrize("cls", [GoodToy, MinimalToy], ids=lambda c: c.__name__)
def test_correct_toys_pass_the_grouped_checks(cls):
    check_grouped(toy(cls, heads=GROUPED_HEADS))


@pytest.mark.parametrize(
    "cls, message",
    [
        (TilesKeyValueHeads, r"kv_heads=2 heads=4: output: grouped keys/values differ"),
        (RepeatsIntoItsCache, r"declares grouped_kv='native' but its state holds"),
        (SaysNoButAccepts, r"grouped k, v: expected UnsupportedOptionError"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_grouped_checks_reject_broken_toys(cls, message):
    with pytest.raises(AssertionError, match=message):
        check_grouped(toy(cls, heads=GROUPED_HEADS))

"""Conformance checks of grouped-query attention (k, v with ``kv_heads`` < ``heads`` heads).

A mechanism declaring ``grouped_kv="native"`` or ``"repeat"`` must give, on grouped keys and values, exactly
(float64) what it gives on the keys and values repeated to one head per query head (query head h reading
key/value head ``h // (heads // kv_heads)``), forward and gradients (the gradient of a shared key is the sum
of its repeats' gradients), and likewise through ``prefill`` and ``step``. One declaring ``"none"`` refuses
grouped inputs naming kv_heads. A native one's decoding state holds fewer numbers than the repeated one's.
No check knows a mechanism by name.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from attnzoo.functional.grouped import repeat_kv
from attnzoo.mechanisms import NATIVE_KV, NO_GROUPED_KV, Mechanism, UnsupportedOptionError

from .checks import BATCH, Variant, call, expect_error, fit, random_qkv, state_tensors, variant_inputs, variants

GROUPED_HEADS = 4
"""Query heads of the grouped checks: two groups of two, so a wrong pairing of query and key/value heads shows."""
KV_HEADS = 2
EXACT = {"rtol": 1e-10, "atol": 1e-10}


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, **EXACT, equal_nan=True):
        error = (actual - expected).abs().nan_to_num(nan=float("inf")).max().item()
        raise AssertionError(f"{what}: grouped keys/values differ from the repeated ones by up to {error:.3g}")


def grouped_inputs(mechanism: Mechanism, variant: Variant, seed: int) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """float64 q (batch, heads, ...) and k, v with :data:`KV_HEADS` heads (the first heads of random ones)."""
    (q, k, v), mask = variant_inputs(mechanism, variant, torch.float64, seed)
    return q, k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous(), mask


def _summed_repeats(grad: Tensor) -> Tensor:
    """The gradient of repeated keys/values (batch, heads, ...) summed back onto the shared heads."""
    return grad.unflatten(1, (KV_HEADS, grad.shape[1] // KV_HEADS)).sum(2)


def _forward_and_grads(mechanism: Mechanism, qkv: Tuple[Tensor, Tensor, Tensor], variant: Variant,
                       mask: Optional[Tensor], grad_out: Optional[Tensor]) -> Tuple[Tensor, List[Tensor]]:
    leaves = [x.detach().requires_grad_() for x in qkv]
    out = call(mechanism, tuple(leaves), variant.causal, mask, variant.cross)
    if grad_out is None:
        return out.detach(), []
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def check_grouped_refused(mechanism: Mechanism) -> None:
    """A mechanism declaring ``grouped_kv="none"`` refuses grouped k, v (forward, step) naming kv_heads."""
    n = fit(mechanism, 6)
    q, k, v = random_qkv(mechanism, 2, n, n, torch.float64, seed=41)
    k, v = k[:, :KV_HEADS], v[:, :KV_HEADS]
    expect_error(lambda: mechanism(q, k, v), UnsupportedOptionError, r"kv_heads", f"{mechanism.name}: grouped k, v")
    if mechanism.capabilities.recurrent_step:
        one = (q[:, :, :1], k[:, :, :1], v[:, :, :1])
        expect_error(lambda: mechanism.step(*one, None), UnsupportedOptionError, r"kv_heads", f"{mechanism.name}.step")


def check_grouped_matches_repeated(mechanism: Mechanism) -> None:
    """Forward and gradients on grouped k, v equal those on the repeated k, v, in every supported variant."""
    groups = mechanism.heads // KV_HEADS
    for index, variant in enumerate(variants(mechanism)):
        q, k, v, mask = grouped_inputs(mechanism, variant, seed=50 + index)
        repeated = (q, repeat_kv(k, groups), repeat_kv(v, groups))
        expected, _ = _forward_and_grads(mechanism, repeated, variant, mask, None)
        grad_out = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(index))
        expected, (grad_q_r, grad_k_r, grad_v_r) = _forward_and_grads(mechanism, repeated, variant, mask, grad_out)
        out, (grad_q, grad_k, grad_v) = _forward_and_grads(mechanism, (q, k, v), variant, mask, grad_out)
        what = f"{mechanism.name}: {variant.describe()} kv_heads={KV_HEADS} heads={mechanism.heads}"
        _close(out, expected, f"{what}: output")
        _close(grad_q, grad_q_r, f"{what}: gradient of q")
        _close(grad_k, _summed_repeats(grad_k_r), f"{what}: gradient of k (the sum over its query heads)")
        _close(grad_v, _summed_repeats(grad_v_r), f"{what}: gradient of v (the sum over its query heads)")


def check_grouped_decoding(mechanism: Mechanism) -> None:
    """``prefill`` then ``step`` on grouped k, v equal them on the repeated k, v; a native mechanism's state is
    smaller than the repeated one's, and a state made for the repeated heads is refused naming ``state``."""
    if not mechanism.capabilities.recurrent_step:
        return
    n = fit(mechanism, 7)
    q, k, v = random_qkv(mechanism, BATCH, n, n, torch.float64, seed=61)
    k, v = k[:, :KV_HEADS], v[:, :KV_HEADS]
    groups = mechanism.heads // KV_HEADS
    k_r, v_r = repeat_kv(k, groups), repeat_kv(v, groups)
    prompt = n - 2
    out, state = mechanism.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
    out_r, state_r = mechanism.prefill(q[:, :, :prompt], k_r[:, :, :prompt], v_r[:, :, :prompt])
    _close(out, out_r, f"{mechanism.name}: prefill on grouped k, v")
    if mechanism.capabilities.grouped_kv == NATIVE_KV:
        size, size_r = (sum(t.numel() for t in state_tensors(s)) for s in (state, state_r))
        if size >= size_r:
            raise AssertionError(
                f"{mechanism.name} declares grouped_kv='native' but its state holds {size} numbers for "
                f"kv_heads={KV_HEADS}, as many as the {size_r} of the repeated keys/values"
            )
        one = (q[:, :, prompt : prompt + 1], k[:, :, prompt : prompt + 1], v[:, :, prompt : prompt + 1])
        expect_error(lambda: mechanism.step(*one, state_r), (ValueError, TypeError), r"state",
                     f"{mechanism.name}.step with a state of heads instead of kv_heads")
    for t in range(prompt, n):
        out, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        out_r, state_r = mechanism.step(q[:, :, t : t + 1], k_r[:, :, t : t + 1], v_r[:, :, t : t + 1], state_r)
        _close(out, out_r, f"{mechanism.name}: step {t} on grouped k, v")


def check_grouped_bad_input(mechanism: Mechanism) -> None:
    """kv_heads not dividing heads, and k, v with different head counts: errors naming them, for every
    mechanism whatever it declares."""
    n = fit(mechanism, 6)
    q, k, v = random_qkv(mechanism, 2, n, n, torch.float64, seed=71)
    expect_error(lambda: mechanism(q, k[:, :3], v[:, :3]), ValueError, r"kv_heads=3.*divide",
                 f"{mechanism.name}: k, v of 3 heads for 4 query heads")
    expect_error(lambda: mechanism(q, k[:, :2], v[:, :1]), ValueError, r"k and v",
                 f"{mechanism.name}: k of 2 heads, v of 1")


def check_grouped(mechanism: Mechanism) -> None:
    """Every grouped-query check that the mechanism's declaration calls for."""
    if mechanism.heads % KV_HEADS or mechanism.heads == KV_HEADS:
        raise ValueError(f"build the mechanism with a multiple of {KV_HEADS} heads above it, got {mechanism.heads}")
    check_grouped_bad_input(mechanism)
    if mechanism.capabilities.grouped_kv == NO_GROUPED_KV:
        check_grouped_refused(mechanism)
        return
    check_grouped_matches_repeated(mechanism)
    check_grouped_decoding(mechanism)

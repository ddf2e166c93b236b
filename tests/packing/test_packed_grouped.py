"""Packed rows (``cu_seqlens``) with grouped keys and values: a mechanism whose grouping is native gets them
with ``kv_heads`` heads on its packed path too and never makes the repeated keys or values (every tensor an
operation returns is inspected), and its packed output equals the packed output on the repeated ones."""

from typing import List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnzoo
from attnzoo.mechanisms.registry import _REGISTRY
from attnzoo.mechanisms.capabilities import NATIVE_KV

# 6 query heads on 3 key/value heads: heads 0 and 1 share key/value head 0. No other size here is 6.
HEADS, KV_HEADS, HEAD_DIM, LENGTH = 6, 3, 8, 37
CU_SEQLENS = torch.tensor([0, 5, 21, 22, LENGTH])

NATIVE_PACKING = sorted(name for name, cls in _REGISTRY.items()
                        if cls.capabilities.grouped_kv == NATIVE_KV and cls.capabilities.packed)
CASES = [(name, causal) for name in NATIVE_PACKING for causal in (False, True)
         if not causal or _REGISTRY[name].capabilities.causal]


class RepeatedHeads(TorchDispatchMode):
    """Records every tensor an operation allocates (views are not) laid out (batch, ``HEADS``, seq > 1, dim)
    whose heads 0 and 1 are equal and not constant: keys or values repeated to the query heads, whole or per
    document (or something computed from them alone). Tensors made from the queries differ from head to head."""

    def __init__(self) -> None:
        super().__init__()
        self.repeated: List[Tuple[str, Tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and not func.is_view and self._repeats(tensor):
                self.repeated.append((str(func), tuple(tensor.shape)))
        return out

    @staticmethod
    def _repeats(tensor: torch.Tensor) -> bool:
        if not tensor.is_floating_point() or tensor.dim() != 4 or tensor.shape[1] != HEADS or tensor.shape[2] < 2:
            return False
        first, second = tensor[:, 0], tensor[:, 1]
        return torch.equal(first, second) and not (first == first.flatten()[0]).all()


def grouped_inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, LENGTH, HEAD_DIM, generator=generator, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, LENGTH, HEAD_DIM, generator=generator, dtype=dtype, requires_grad=True)
            for _ in range(2))
    return q, k, v


def build(name):
    """The mechanism with its conformance options, its parameters perturbed: an initialisation may give every
    head the same parameters, and what is computed from them alone would then repeat across heads."""
    mechanism = attnzoo.build_mechanism(name, HEADS, HEAD_DIM, **_REGISTRY[name].test_options)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in mechanism.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return mechanism


def test_the_native_packing_mechanisms_are_many():
    assert {"softmax", "linear", "performer", "efficient", "differential", "local"} <= set(NATIVE_PACKING)


@pytest.mark.parametrize("name, causal", CASES)
def test_native_mechanisms_never_repeat_keys_or_values_on_packed_rows(name, causal):
    mechanism = build(name)
    q, k, v = grouped_inputs()
    with RepeatedHeads() as seen:
        out = mechanism(q, k, v, causal, cu_seqlens=CU_SEQLENS)
        out.square().sum().backward()
    assert out.shape == (1, HEADS, LENGTH, HEAD_DIM)
    assert seen.repeated == []


def test_the_repeat_check_sees_a_repeating_mechanism():
    mechanism = attnzoo.build_mechanism("rfa", HEADS, HEAD_DIM, nb_features=16, seed=0)
    assert mechanism.capabilities.grouped_kv == "repeat"
    with RepeatedHeads() as seen:
        mechanism(*grouped_inputs(), True, cu_seqlens=CU_SEQLENS)
    assert seen.repeated


@pytest.mark.parametrize("name, causal", CASES)
def test_packed_grouped_equals_packed_repeated(name, causal):
    mechanism = build(name).double()
    q, k, v = grouped_inputs(torch.float64, seed=1)
    grad = torch.randn(1, HEADS, LENGTH, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = mechanism(q, k, v, causal, cu_seqlens=CU_SEQLENS)
    grads = torch.autograd.grad((out * grad).sum(), (q, k, v))
    groups = HEADS // KV_HEADS
    repeated = [x.detach().repeat_interleave(groups, dim=1).requires_grad_() for x in (k, v)]
    out_r = mechanism(q, *repeated, causal, cu_seqlens=CU_SEQLENS)
    grads_r = torch.autograd.grad((out_r * grad).sum(), (q, *repeated))
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(grads[0], grads_r[0], rtol=0, atol=1e-10)
    for got, want in zip(grads[1:], grads_r[1:]):  # a key/value head's gradient sums its query heads'
        torch.testing.assert_close(got, want.unflatten(1, (KV_HEADS, groups)).sum(2), rtol=0, atol=1e-10)

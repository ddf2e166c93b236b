"""Grouped-query inputs on the fixed sparse patterns: the blockwise core gathers each key/value head once for
the query heads sharing it, never making the repeated keys or values (every tensor created is recorded); the
same in packed rows; local's decoding state holds kv_heads."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from attnzoo.functional.grouped import repeat_kv
from attnzoo.mechanisms import build_mechanism
from tensor_records import TensorRecorder

BATCH, HEADS, KV_HEADS, DIM, LENGTH = 2, 8, 1, 32, 256
MECHANISMS = [
    ("local", {"window": 5, "block_size": 4}),
    ("local", {"window": 5, "block_size": 4, "sink_tokens": 2}),
    ("strided", {"pattern": "strided", "stride": 16, "block_size": 4}),
    ("strided", {"pattern": "fixed", "stride": 16, "summary": 1, "block_size": 4}),
    ("longformer", {"window": 5, "global_tokens": 2, "block_size": 4}),
    ("bigbird", {"block_size": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1}),
]
IDS = [f"{name}-{'-'.join(str(v) for v in options.values())}" for name, options in MECHANISMS]


def repeated(sizes: TensorRecorder, batch: int = BATCH) -> List[Tuple[str, Tuple[int, ...]]]:
    """Tensors as large as 1.5 times the queries: the gathered key blocks of every query head would be
    (each block reads several blocks of keys); the queries, outputs, logits and masks are not (head_dim 32
    over at most 20 keys per block), nor the keys gathered once per key/value head."""
    return sizes.at_least(1.5 * batch * HEADS * LENGTH * DIM)


def inputs(batch=BATCH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, LENGTH, DIM, generator=generator, requires_grad=True)
    k = torch.randn(batch, KV_HEADS, LENGTH, DIM, generator=generator, requires_grad=True)
    v = torch.randn(batch, KV_HEADS, LENGTH, DIM, generator=generator, requires_grad=True)
    return q, k, v


# bigbird is non-causal (its random blocks look ahead).
CAUSAL_CASES = [(name, options, causal) for name, options in MECHANISMS for causal in (False, True)
                if not (causal and name == "bigbird")]


@pytest.mark.parametrize("name, options, causal", CAUSAL_CASES,
                         ids=[f"{n}-{'-'.join(str(v) for v in o.values())}-causal={c}" for n, o, c in CAUSAL_CASES])
def test_grouped_keys_are_never_repeated(name, options, causal):
    mechanism = build_mechanism(name, HEADS, DIM, **options)
    assert mechanism.capabilities.grouped_kv == "native"
    mask = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    mask[1, -5:] = True
    with TensorRecorder() as sizes:
        out = mechanism(*inputs(), causal=causal, key_padding_mask=mask)
        out.square().sum().backward()
    assert out.shape == (BATCH, HEADS, LENGTH, DIM)
    assert repeated(sizes) == []


@pytest.mark.parametrize("name, options", MECHANISMS, ids=IDS)
def test_packed_grouped_keys_are_never_repeated_and_equal_the_repeated(name, options):
    mechanism = build_mechanism(name, HEADS, DIM, **options)
    q, k, v = inputs(batch=1)
    cu_seqlens = torch.tensor([0, 37, 38, 101, LENGTH])
    with TensorRecorder() as sizes:
        out = mechanism(q, k, v, cu_seqlens=cu_seqlens)
        out.square().sum().backward()
    assert repeated(sizes, batch=1) == []
    with_copies = mechanism(q, repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS), cu_seqlens=cu_seqlens)
    torch.testing.assert_close(out, with_copies, rtol=1e-5, atol=1e-6)


def test_the_check_sees_a_repeating_instance():
    mechanism = build_mechanism("local", HEADS, DIM, window=5, block_size=4)
    mechanism.capabilities = mechanism.capabilities.narrowed("a test", grouped_kv="repeat")
    with TensorRecorder() as sizes:
        mechanism(*inputs())
    assert repeated(sizes)


def test_global_projections_repeat_grouped_keys():
    mechanism = build_mechanism("longformer", HEADS, DIM, global_projections=True)
    assert mechanism.capabilities.grouped_kv == "repeat"
    assert "global_projections" in mechanism.capabilities.limited_by


@pytest.mark.parametrize("sinks", [0, 2])
def test_local_decoding_state_holds_kv_heads(sinks):
    mechanism = build_mechanism("local", HEADS, DIM, window=5, block_size=4, sink_tokens=sinks).double()
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, HEADS, 9, DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, KV_HEADS, 9, DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    out, state = mechanism.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7])
    assert all(t.shape[1] == KV_HEADS for key, t in state.tensors.items() if key != "positions")
    full = mechanism(q, k, v, causal=True)
    for t in (7, 8):
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t:t + 1], rtol=0, atol=1e-10)

"""The growing KV cache shared by the exact decoders (attnzoo.functional.kv_cache): one implementation of
growth, copy-on-branch and prefill for softmax, forgetting and differential."""

import pytest
import torch

from attnzoo import build_mechanism
from attnzoo.functional.kv_cache import CACHE_BLOCK, cache_append, cache_capacity, kv_cache_layout, prefilled_cache


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _entries(length, seed):
    """Keys and values of 2 heads and a per-position entry of 3 heads in float64, as forgetting keeps."""
    return {"k": randn(2, 2, length, 4, seed=seed, dtype=torch.float32),
            "v": randn(2, 2, length, 4, seed=seed + 1, dtype=torch.float32),
            "log_gate": randn(2, 3, length, seed=seed + 2)}


def _used(cache, length):
    return {name: x[:, :, :length] for name, x in cache.items() if name != "filled"}


def test_capacity_grows_in_blocks_and_at_least_doubles():
    assert cache_capacity(1) == CACHE_BLOCK
    assert cache_capacity(CACHE_BLOCK + 1, CACHE_BLOCK) == 2 * CACHE_BLOCK
    assert cache_capacity(CACHE_BLOCK + 1) == 2 * CACHE_BLOCK
    assert cache_capacity(5 * CACHE_BLOCK + 1, 4 * CACHE_BLOCK) == 8 * CACHE_BLOCK


def test_appending_across_a_block_keeps_every_entry_with_its_heads_and_dtype():
    prompt = _entries(CACHE_BLOCK - 2, seed=0)
    cache = prefilled_cache(prompt)
    assert cache["k"].shape[2] == CACHE_BLOCK and cache["filled"].tolist() == [CACHE_BLOCK - 2] * 2
    written = {name: [x] for name, x in prompt.items()}
    for position in range(CACHE_BLOCK - 2, CACHE_BLOCK + 3):
        step = _entries(1, seed=10 + position)
        cache = cache_append(cache, step, position)
        for name, x in step.items():
            written[name].append(x)
    length = CACHE_BLOCK + 3
    assert cache["k"].shape[2] == 2 * CACHE_BLOCK and cache["log_gate"].shape == (2, 3, 2 * CACHE_BLOCK)
    assert cache["log_gate"].dtype == torch.float64 and cache["filled"].tolist() == [length] * 2
    for name, x in _used(cache, length).items():
        torch.testing.assert_close(x, torch.cat(written[name], dim=2), rtol=0, atol=0)


def test_stepping_twice_from_one_cache_copies_instead_of_overwriting_the_first_branch():
    cache = prefilled_cache(_entries(5, seed=0))
    a, b = _entries(1, seed=20), _entries(1, seed=30)
    branch_a = cache_append(cache, a, 5)
    branch_b = cache_append(cache, b, 5)  # the buffers were written past 5 by branch a: copy first
    assert branch_b["k"].data_ptr() != branch_a["k"].data_ptr()
    for name in a:
        torch.testing.assert_close(branch_a[name][:, :, 5:6], a[name], rtol=0, atol=0)
        torch.testing.assert_close(branch_b[name][:, :, 5:6], b[name], rtol=0, atol=0)


def test_starting_from_nothing_holds_the_first_position():
    first = _entries(1, seed=3)
    cache = cache_append(None, first, 0)
    assert cache["v"].shape[2] == CACHE_BLOCK and cache["filled"].tolist() == [1, 1]
    for name, x in _used(cache, 1).items():
        torch.testing.assert_close(x, first[name], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softmax", "forgetting"])
def test_softmax_and_forgetting_lay_out_and_fill_the_same_kv_cache(name):
    """Both decoders keep their keys and values in this one cache: the same layout, the same buffers."""
    mechanism = build_mechanism(name, 2, 4).double()
    layout = mechanism.state_layout(torch.float64)
    assert {key: layout[key] for key in ("k", "v", "filled")} == kv_cache_layout(2, 4, torch.float64)
    q = randn(1, 2, CACHE_BLOCK + 1, 4)
    _, state = mechanism.prefill(q[:, :, :-1], q[:, :, :-1], q[:, :, :-1])
    _, state = mechanism.step(q[:, :, -1:], q[:, :, -1:], q[:, :, -1:], state)
    assert state.tensors["k"].shape[2] == cache_capacity(CACHE_BLOCK + 1, CACHE_BLOCK)
    torch.testing.assert_close(state.tensors["k"][:, :, : CACHE_BLOCK + 1], q, rtol=0, atol=0)

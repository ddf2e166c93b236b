"""``lolcats`` with LoLA's sparse cache (``sparse_cache``): which keys the cache keeps, the attention they get,
decoding, and what it refuses. The conformance suite runs a ``sparse_cache`` variant as well."""

from __future__ import annotations

import pytest
import torch

from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.sparse_cache import sparse_cache_members_reference, sparse_cache_schedule
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from test_lolcats import _drawn, _inputs


def test_the_pair_the_state_recalls_best_moves_into_it():
    """One-hot features, window 1, a cache of 1: A leaves first and is cached; when B leaves, the state is
    empty, so each recalls nothing and the smaller value (A's) moves into the state; the second A, which the
    state now recalls exactly (error 0), moves straight in; B, recalled by nothing, stays cached to the end."""
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    one_hot = {"A": (torch.tensor([1.0, 0.0]), a), "B": (torch.tensor([0.0, 1.0]), b)}
    sequence = ["A", "B", "A", "A", "B"]
    phi = torch.stack([one_hot[s][0] for s in sequence]).view(1, 1, 5, 2).double()
    v = torch.stack([one_hot[s][1] for s in sequence]).view(1, 1, 5, 2).double()
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    moved, kv, cache, snapshots = sparse_cache_schedule(k, v, phi, window=1, sinks=0, size=1, decay=None,
                                                        key_padding_mask=None, snapshot_at=[0, 1, 3])
    # Position 3 leaves at 4: the state recalls it exactly too. Position 4 never leaves the window.
    assert moved.view(-1).tolist() == [2, 5, 3, 4, 5]
    assert cache["cache_positions"].view(-1).tolist() == [1]
    assert snapshots.view(-1).tolist() == [-1, 0, 1]  # the cache queries 0, 1 and 3 read
    torch.testing.assert_close(kv[0, 0], torch.tensor([[3.0, 0.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    members = sparse_cache_members_reference(k, v, phi, 1, 0, 1, None, None)[0, 0]
    cached_at = {i: members[i].nonzero().view(-1).tolist() for i in range(5)}
    assert cached_at == {0: [], 1: [0], 2: [1], 3: [1], 4: [1]}


@pytest.mark.parametrize("sinks, decay, rotate", [(0, None, True), (3, 0.9, True), (2, 0.8, False)])
def test_forward_equals_the_simulation_and_decoding_across_many_evictions(sinks, decay, rotate):
    """40 positions, window 4, a cache of 3: dozens of decisions, padding on the right of one row. The parallel
    form equals the float64 reference (whose decisions come from a plain simulation forming the state anew at
    every position), and a prefill with its steps, branching included, equals the parallel form."""
    options = dict(window=4, feature_dim=3, sink_tokens=sinks, decay=decay, sparse_cache=3)
    mechanism = _drawn(**options, rotate_features=rotate)
    q, k, v = _inputs(length=40)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 33:] = True
    with torch.no_grad():
        for padding in (None, mask):
            out = mechanism(q, k, v, causal=True, key_padding_mask=padding)
            torch.testing.assert_close(out, mechanism.reference(q, k, v, True, padding), rtol=1e-10, atol=1e-10)
        full = mechanism(q, k, v, causal=True)
        without = build_mechanism("lolcats", 2, 8, **{**options, "sparse_cache": 0}).double()
        without.load_state_dict(mechanism.state_dict())
        assert (without(q, k, v, causal=True) - full).abs().amax() > 1e-3  # the cache changes the answer
        out, state = mechanism.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9])
        outputs = [out]
        for t in range(9, 40):
            if t == 20:
                branch = state
            out_t, state = mechanism.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            outputs.append(out_t)
        torch.testing.assert_close(torch.cat(outputs, 2), full, rtol=1e-10, atol=1e-10)
        again, _ = mechanism.step(q[:, :, 20:21], k[:, :, 20:21], v[:, :, 20:21], branch)
        torch.testing.assert_close(again, full[:, :, 20:21], rtol=1e-10, atol=1e-10)
        assert state.tensors["cache_k"].shape == (2, 2, 3, 8) and state.tensors["cache_phi"].shape == (2, 2, 3, 6)
        assert set(state.tensors["cache_positions"].view(-1).tolist()) <= set(range(sinks, 36))


def test_gradients_match_the_reference():
    """The chosen keys' terms carry gradients (the choice itself is not differentiated): every input's and
    parameter's gradient equals the float64 reference's."""
    mechanism = _drawn(window=3, feature_dim=3, sink_tokens=1, decay=0.85, sparse_cache=2)
    q, k, v = _inputs(length=24, requires_grad=True)
    weights = torch.randn(2, 2, 24, 8, dtype=torch.float64)
    grads = []
    for run in (lambda: mechanism(q, k, v, causal=True), lambda: mechanism.reference(q, k, v, True)):
        mechanism.zero_grad()
        (run() * weights).sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v)] + [p.grad.clone() for p in mechanism.parameters()])
        for x in (q, k, v):
            x.grad = None
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_a_cache_holding_every_key_is_exact_softmax():
    """With room for every key beyond the window, nothing joins the linear state: every term is exact, the
    window factor cancels, and the output is causal softmax attention."""
    mechanism = _drawn(window=3, feature_dim=3, sparse_cache=20)
    q, k, v = _inputs(length=20)
    with torch.no_grad():
        out = mechanism(q, k, v, causal=True)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal=True), rtol=1e-10, atol=1e-10)


def test_non_causal_calls_are_refused_naming_the_option():
    mechanism = _drawn(window=3, feature_dim=3, sparse_cache=2)
    q, k, v = _inputs(length=8)
    with pytest.raises(UnsupportedOptionError, match="sparse_cache.*causal=False"):
        mechanism(q, k, v)
    assert not mechanism.capabilities.non_causal and build_mechanism("lolcats", 2, 8).capabilities.non_causal


@pytest.mark.parametrize("value", [-1, 1.5, "4", True])
def test_bad_sizes_name_the_option(value):
    with pytest.raises((TypeError, ValueError), match="sparse_cache"):
        build_mechanism("lolcats", 2, 8, sparse_cache=value)


def test_blocks_of_many_queries_read_the_cache_their_first_query_reads_and_what_enters():
    """Window 16 (query blocks of 16): each block reads the cache at its first query and the keys leaving the
    window during the block, where a block spans several decisions; equal to the reference, padding included."""
    mechanism = _drawn(window=16, feature_dim=3, sink_tokens=2, decay=0.9, sparse_cache=3)
    q, k, v = _inputs(length=100)
    mask = torch.zeros(2, 100, dtype=torch.bool)
    mask[1, 89:] = True
    with torch.no_grad():
        out = mechanism(q, k, v, causal=True, key_padding_mask=mask)
        expected = mechanism.reference(q, k, v, True, mask)
    torch.testing.assert_close(out[0], expected[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, :, :89], expected[1, :, :89], rtol=1e-10, atol=1e-10)

"""Native sparse attention (functional.nsa, mechanism ``nsa``) beyond the conformance suite: the fast path
against its float64 reference at lengths with many blocks, each branch against an independent definition,
selection that matters, decoding across block completions, no N x N tensor, and the option errors."""

from __future__ import annotations

import math

import pytest
import torch

from attnzoo.functional.blocksparse import LocalPattern, blocksparse_attention_reference, selected
from attnzoo.functional.nsa import NSABlocks, nsa_attention, nsa_attention_reference
from attnzoo.functional.softmax import softmax_attention_reference
from attnzoo.mechanisms import build_mechanism
from tensor_records import TensorRecorder

BLOCKS = NSABlocks(compress_block=8, compress_stride=4, select_block=8, top_k=3, window=6, selection_group=1)


def _inputs(batch=2, heads=4, length=53, dim=8, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))
    gates = torch.rand(batch, heads, length, 3, generator=generator, dtype=dtype)
    weights = [torch.eye(dim, dtype=dtype) + 0.1 * torch.randn(dim, dim, generator=generator, dtype=dtype)
               for _ in range(2)]
    return q, k, v, gates, weights


def _mask(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, :3] = True
    mask[1, 20:29] = True  # a whole compressed block and a whole selectable block
    mask[1, -2:] = True
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("group", [1, 2])
def test_fast_path_matches_reference(causal, padded, group):
    blocks = NSABlocks(8, 4, 8, 3, 6, group)
    q, k, v, gates, (wk, wv) = _inputs()
    mask = _mask(2, q.shape[2]) if padded else None
    options = dict(k_weight=wk, v_weight=wv, causal=causal, key_padding_mask=mask)
    out = nsa_attention(q, k, v, gates, blocks, **options)
    expected = nsa_attention_reference(q, k, v, gates, blocks, **options)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)
    out32 = nsa_attention(*(x.float() for x in (q, k, v, gates)), blocks, k_weight=wk.float(), v_weight=wv.float(),
                          causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out32.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_gathered_path_matches_reference(causal, monkeypatch):
    """The gather of each query's blocks (the path for keys far longer than the chosen blocks) is exact too."""
    monkeypatch.setattr(selected, "DENSE_SHARE", 0)
    blocks = NSABlocks(8, 4, 8, 3, 6, 2)
    q, k, v, gates, (wk, wv) = _inputs()
    mask = _mask(2, q.shape[2])
    options = dict(k_weight=wk, v_weight=wv, causal=causal, key_padding_mask=mask)
    out = nsa_attention(q, k, v, gates, blocks, **options)
    torch.testing.assert_close(out, nsa_attention_reference(q, k, v, gates, blocks, **options), rtol=1e-9,
                               atol=1e-11)


def _branch(index):
    q, k, v, gates, _ = _inputs(length=40)
    one_hot = torch.zeros_like(gates)
    one_hot[..., index] = 1.0
    return q, k, v, one_hot


def test_window_branch_is_local_attention():
    q, k, v, gates = _branch(2)
    for causal in (True, False):
        out = nsa_attention(q, k, v, gates, BLOCKS, causal=causal)
        expected = blocksparse_attention_reference(q, k, v, LocalPattern(6, 4), causal)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)


def test_selecting_every_block_is_softmax():
    q, k, v, gates = _branch(1)
    every = NSABlocks(8, 4, 8, 5, 6)  # 40 positions: 5 blocks
    for causal in (True, False):
        out = nsa_attention(q, k, v, gates, every, causal=causal)
        torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal), rtol=1e-9, atol=1e-11)
    # With fewer blocks the selection matters: the output is no longer softmax attention.
    fewer = nsa_attention(q, k, v, gates, NSABlocks(8, 4, 8, 2, 6), causal=True)
    assert (fewer - softmax_attention_reference(q, k, v, True)).abs().max() > 1e-2


def test_compressed_branch_by_hand():
    """Query 20 sees the compressed blocks ending at or before it: starts 0, 4, 8, 12 (l=8, d=4)."""
    q, k, v, gates = _branch(0)
    out = nsa_attention(q, k, v, gates, BLOCKS, causal=True)
    ck = torch.stack([k[:, :, s:s + 8].mean(2) for s in (0, 4, 8, 12)], dim=2)
    cv = torch.stack([v[:, :, s:s + 8].mean(2) for s in (0, 4, 8, 12)], dim=2)
    weights = torch.softmax(q[:, :, 20:21] @ ck.transpose(-1, -2) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(out[:, :, 20:21], weights @ cv, rtol=1e-9, atol=1e-11)
    assert out[:, :, :7].abs().max() == 0  # no block is complete before position 7


@pytest.mark.parametrize("dense_share", [0, 128])
def test_decoding_crosses_block_completions(dense_share, monkeypatch):
    monkeypatch.setattr(selected, "DENSE_SHARE", dense_share)
    torch.manual_seed(0)
    mechanism = build_mechanism("nsa", 2, 8, compress_block=8, compress_stride=4, select_block=8, top_k=2,
                                window=5).double()
    q, k, v, _, _ = _inputs(batch=2, heads=2, length=37)
    full = mechanism(q, k, v, causal=True)
    out, state = mechanism.prefill(q[:, :, :13], k[:, :, :13], v[:, :, :13])
    torch.testing.assert_close(out, full[:, :, :13], rtol=1e-9, atol=1e-11)
    for t in range(13, 37):
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t:t + 1], rtol=1e-9, atol=1e-11)
    assert state.tensors["ck"].shape[2] == (37 - 8) // 4 + 1


def test_no_quadratic_tensor():
    length = 2048
    mechanism = build_mechanism("nsa", 1, 16, compress_block=32, compress_stride=16, select_block=32, top_k=2,
                                window=64)
    q, k, v = (torch.randn(1, 1, length, 16, requires_grad=True) for _ in range(3))
    with TensorRecorder() as recorder:
        mechanism(q, k, v, causal=True).sum().backward()
    assert recorder.largest <= length * length / 4, recorder.largest


@pytest.mark.parametrize("options, named", [
    ({"compress_block": 6, "compress_stride": 4}, "compress_stride"),
    ({"compress_block": 8, "compress_stride": 4, "select_block": 6}, "select_block"),
    ({"selection_group": 3}, "selection_group"),
    ({"top_k": 0}, "top_k"),
    ({"window": 2.0}, "window"),
])
def test_bad_options_name_the_option(options, named):
    error = TypeError if named == "window" else ValueError
    with pytest.raises(error, match=named):
        build_mechanism("nsa", 4, 8, **options)


def test_top_k_above_the_blocks_is_refused():
    q, k, v, gates, _ = _inputs(length=20)  # 3 blocks of 8
    with pytest.raises(ValueError, match="top_k"):
        nsa_attention(q, k, v, gates, NSABlocks(8, 4, 8, 4, 6))
    with pytest.raises(ValueError, match="gates"):
        nsa_attention(q, k, v, gates[..., :2], BLOCKS)


def test_short_sequences_read_every_block():
    """The mechanism takes sequences of fewer blocks than top_k (decoding starts with one): it reads them all."""
    mechanism = build_mechanism("nsa", 2, 8, compress_block=8, compress_stride=4, select_block=8, top_k=4,
                                window=3).double()
    q, k, v, _, _ = _inputs(heads=2, length=10)
    gates = mechanism.gates(q)
    expected = nsa_attention_reference(q, k, v, gates, mechanism.blocks, k_weight=mechanism.k_compress,
                                       v_weight=mechanism.v_compress, causal=True)
    torch.testing.assert_close(mechanism(q, k, v, causal=True), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("gates, weight, match", [
    ("nan", None, "gates must lie in"),
    ("five", None, "gates must lie in"),
    ("bool", None, "gates must be a floating"),
    (None, "long", "k_weight must be a floating"),
    (None, "nan", "k_weight must be finite"),
    (None, "shape", "k_weight must be a tensor of shape"),
])
def test_nsa_attention_refuses_bad_gates_and_weights_naming_them(gates, weight, match):
    from attnzoo.functional.nsa import NSABlocks, nsa_attention

    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    blocks = NSABlocks(4, 2, 2, 2, 3)
    g = {None: torch.rand(1, 2, 8, 3), "nan": torch.full((1, 2, 8, 3), math.nan), "five": torch.full((1, 2, 8, 3), 5.0),
         "bool": torch.ones(1, 2, 8, 3, dtype=torch.bool)}[gates]
    w = {None: None, "long": torch.ones(4, 4, dtype=torch.long), "nan": torch.full((4, 4), math.nan),
         "shape": torch.eye(3)}[weight]
    with pytest.raises((ValueError, TypeError), match=match):
        nsa_attention(q, k, v, g, blocks, k_weight=w)


def test_nsa_attention_ignores_what_padded_gates_hold():
    from attnzoo.functional.nsa import NSABlocks, nsa_attention

    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    blocks, gates = NSABlocks(4, 2, 2, 2, 3), torch.rand(1, 2, 8, 3, generator=torch.Generator().manual_seed(3))
    padding = torch.zeros(1, 8, dtype=torch.bool)
    padding[:, 6:] = True
    clean = nsa_attention(q, k, v, gates, blocks, key_padding_mask=padding)
    noisy = nsa_attention(q, k, v, gates.masked_fill(padding[:, None, :, None], math.nan), blocks,
                          key_padding_mask=padding)
    torch.testing.assert_close(noisy[:, :, :6], clean[:, :, :6], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sequence_classifies_alike_in_any_padded_batch(causal):
    """A sequence's pooled classifier logits (and its outputs at every position) do not depend on the batch it
    is padded into: alone, padded on the right beside a longer sequence, padded on the left beside another.
    The block grid is the sequence's own, so trailing padding completes no partial block and leading padding
    shifts no boundary; the padded positions' garbage (huge, NaN) reaches nothing. Fast path and reference."""
    torch.manual_seed(0)
    mechanism = build_mechanism("nsa", 2, 8, compress_block=8, compress_stride=4, select_block=8, top_k=3,
                                window=6).double()
    generator = torch.Generator().manual_seed(5)
    draw = lambda length: [torch.randn(1, 2, length, 8, generator=generator, dtype=torch.float64)  # noqa: E731
                           for _ in range(3)]
    head = torch.randn(2 * 8, 3, generator=generator, dtype=torch.float64)  # a classifier over pooled outputs

    def logits(out):
        return out.mean(2).flatten(1) @ head

    sequence = draw(21)  # 2 whole compressed blocks of 8 at stride 4, then a partial one
    alone = mechanism(*sequence, causal=causal)
    for pad, left in ((11, False), (13, True), (3, True)):
        other = draw(21 + pad)
        real = slice(pad, pad + 21) if left else slice(0, 21)
        mask = torch.ones(2, 21 + pad, dtype=torch.bool)
        mask[0, real] = False
        mask[1] = False
        batch = []
        for x, y in zip(sequence, other):
            row = torch.full((1, 2, 21 + pad, 8), 1e6, dtype=torch.float64)
            row[:, :, ::2] = math.nan
            row[:, :, real] = x
            batch.append(torch.cat([row, y]))
        for run in (mechanism, mechanism.reference):
            out = run(*batch, causal=causal, key_padding_mask=mask)
            expected = alone if run is mechanism else mechanism.reference(*sequence, causal=causal)
            torch.testing.assert_close(out[:1, :, real], expected, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(logits(out[:1, :, real]), logits(expected), rtol=1e-10, atol=1e-10)
            assert out[:1, :, mask[0]].abs().max() == 0  # padded positions output zeros
            torch.testing.assert_close(out[1:], run(*(y for y in other), causal=causal), rtol=1e-10, atol=1e-10)

"""Longformer: global positions by count, by index and by a per-call mask per batch element, and separate global
projections. The fast path against the float64 reference, the reference against loops written from the
definition, padding invisibility, no look-ahead and gradients with a per-call ``global_mask`` (which the
conformance suite's generic calls do not pass), memory that never reaches N x N, and the errors."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.functional.blocksparse import LongformerPattern, blocksparse_attention_reference
from attnzoo.functional.longformer import (
    gather_global_positions,
    longformer_attention,
    longformer_attention_reference,
    longformer_dense_mask,
)
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from conformance import checks
from tensor_records import TensorRecorder


def qkv(batch, heads, length, dim, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))


def global_masks(length):
    """(4, length) per-batch global masks that differ between elements: none; the start, the middle and the
    end; one position that :func:`paddings` pads; every third position."""
    mask = torch.zeros(4, length, dtype=torch.bool)
    mask[1, [0, length // 2, length - 1]] = True
    mask[2, length - 2 if length > 1 else 0] = True
    mask[3, ::3] = True
    return mask


def paddings(length):
    """(4, length) key padding: none; the last two positions; the global position of element 2 and the first;
    everything."""
    mask = torch.zeros(4, length, dtype=torch.bool)
    mask[1, -2:] = True
    mask[2, [0, length - 2 if length > 1 else 0]] = True
    mask[3] = True
    return mask


def randomised(mechanism, seed=5):
    """``mechanism`` with its global projections moved away from the identity (seeded), so that a row computed
    with the wrong tensors shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in mechanism.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return mechanism


def build(**options):
    m = build_mechanism("longformer", 2, 4, **options).double()
    return randomised(m) if options.get("global_projections") else m


# -- the reference against loops written from the definition ---------------------------------------------------
def loop_reference(q, k, v, window, global_mask, causal, padding, projections=None):
    """Row by row, key by key: softmax over the keys the definition allows, from the projected tensors on a
    global query's row."""
    batch, heads, length, dim = q.shape
    out = torch.zeros(batch, heads, length, v.shape[3], dtype=torch.float64)
    for b, h, i in itertools.product(range(batch), range(heads), range(length)):
        keys = [j for j in range(length)
                if (abs(i - j) < window or global_mask[b, j] or global_mask[b, i])
                and (j <= i or not causal) and not padding[b, j]]
        if not keys:
            continue
        qi, kk, vv = q[b, h, i], k[b, h], v[b, h]
        if projections is not None and global_mask[b, i]:
            qi, kk, vv = qi @ projections[0][h], kk @ projections[1][h], vv @ projections[2][h]
        logits = torch.stack([qi @ kk[j] / math.sqrt(dim) for j in keys])
        weights = torch.softmax(logits, 0)
        out[b, h, i] = sum(w * vv[j] for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_is_the_definition(causal):
    length, window = 11, 3
    mask, padding = global_masks(length), paddings(length)
    dense = longformer_dense_mask(window, mask, causal, padding)
    for b, i, j in itertools.product(range(4), range(length), range(length)):
        expected = ((abs(i - j) < window or mask[b, j] or mask[b, i]) and (j <= i or not causal)
                    and not padding[b, j])
        assert bool(dense[b, i, j]) == bool(expected), (b, i, j)


@pytest.mark.parametrize("causal, projected", [(False, False), (True, False), (False, True), (True, True)])
def test_reference_matches_loops(causal, projected):
    length = 9
    q, k, v = qkv(4, 2, length, 3, seed=1)
    mask, padding = global_masks(length), paddings(length)
    projections = None
    if projected:
        generator = torch.Generator().manual_seed(2)
        projections = tuple(torch.randn(2, 3, 3, generator=generator, dtype=torch.float64) for _ in range(3))
    got = longformer_attention_reference(q, k, v, 2, mask, causal, padding, global_projections=projections)
    torch.testing.assert_close(got, loop_reference(q, k, v, 2, mask, causal, padding, projections),
                               rtol=1e-12, atol=1e-12)


def test_leading_global_tokens_are_the_block_pattern():
    # With the first g positions global, the reference is the fixed LongformerPattern's dense softmax.
    q, k, v = qkv(2, 2, 13, 4, seed=3)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[:, :3] = True
    for causal in (False, True):
        torch.testing.assert_close(longformer_attention_reference(q, k, v, 4, mask, causal),
                                   blocksparse_attention_reference(q, k, v, LongformerPattern(4, 3, 2), causal))


# -- the fast path against the reference ----------------------------------------------------------------------
OPTIONS = [
    {"window": 1, "global_tokens": 0, "block_size": 1},
    {"window": 3, "global_tokens": 1, "block_size": 2},
    {"window": 2, "global_tokens": 0, "global_indices": (0, 4, -1), "block_size": 3},  # start, middle, end
    {"window": 4, "global_tokens": 2, "global_indices": (-3,), "block_size": 2},
    {"window": 5, "global_tokens": 0, "global_projections": True, "block_size": 4},
    {"window": 2, "global_tokens": 1, "global_indices": (6, -1), "global_projections": True, "block_size": 2},
    {"window": 50, "global_tokens": 0, "global_projections": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_fast_path_matches_reference(options):
    m = build(**options)
    for length, causal, padded, per_call in itertools.product((7, 13, 21), (False, True), (False, True),
                                                              (False, True)):
        q, k, v = qkv(4, 2, length, 4, seed=length)
        padding = paddings(length) if padded else None
        mask = global_masks(length) if per_call else None
        out = m(q, k, v, causal, padding, global_mask=mask)
        expected = m.reference(q, k, v, causal, padding, global_mask=mask)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12, msg=lambda s: (
            f"{options} N={length} causal={causal} padded={padded} global_mask={per_call}: {s}"))
        if padded:
            assert torch.all(out[3] == 0)  # every key padded: rows of zeros


def test_one_position():
    m = build(window=2, global_tokens=0, global_indices=(-1,), global_projections=True)
    q, k, v = qkv(2, 2, 1, 4)
    mask = torch.tensor([[True], [False]])
    for causal in (False, True):
        torch.testing.assert_close(m(q, k, v, causal, global_mask=mask),
                                   m.reference(q, k, v, causal, global_mask=mask), rtol=1e-10, atol=1e-12)


def test_functional_form_matches_reference():
    q, k, v = qkv(4, 2, 15, 4, seed=4)
    mask, padding = global_masks(15), paddings(15)
    generator = torch.Generator().manual_seed(6)
    projections = tuple(torch.randn(2, 4, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out = longformer_attention(q, k, v, 3, mask, causal, padding, global_projections=projections, block_size=2)
        expected = longformer_attention_reference(q, k, v, 3, mask, causal, padding, global_projections=projections)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_block_size_does_not_change_the_output():
    q, k, v = qkv(4, 2, 23, 4)
    mask, padding = global_masks(23), paddings(23)
    outs = [build(window=5, global_indices=(7,), block_size=b)(q, k, v, True, padding, global_mask=mask)
            for b in (1, 2, 5, 64)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-12, atol=1e-12)


def test_float32_close_to_float64():
    m = build_mechanism("longformer", 2, 8, window=5, global_indices=(3, -1), global_projections=True)
    randomised(m)
    q, k, v = qkv(4, 2, 37, 8, dtype=torch.float32)
    mask, padding = global_masks(37), paddings(37)
    out = m(q, k, v, False, padding, global_mask=mask)
    torch.testing.assert_close(out.double(), m.reference(q, k, v, False, padding, global_mask=mask),
                               rtol=1e-4, atol=1e-5)


# -- which positions are global ---------------------------------------------------------------------------------
def test_sources_of_global_positions_combine_by_union():
    q, k, v = qkv(2, 2, 12, 4)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 5] = True
    mask[1, 11] = True
    by_options = build(window=2, global_tokens=1, global_indices=(-1,))
    union = torch.zeros(2, 12, dtype=torch.bool)
    union[:, 0] = union[:, 11] = True
    union[0, 5] = True
    plain = build(window=2, global_tokens=0)
    torch.testing.assert_close(by_options(q, k, v, global_mask=mask), plain(q, k, v, global_mask=union),
                               rtol=1e-12, atol=1e-12)
    assert by_options.global_positions(2, 12, mask).equal(union)


def test_indices_naming_one_position_name_it_once():
    q, k, v = qkv(1, 2, 7, 4)
    torch.testing.assert_close(build(window=2, global_tokens=0, global_indices=(0, -7))(q, k, v),
                               build(window=2, global_tokens=0, global_indices=(0,))(q, k, v))


def test_global_positions_change_the_output():
    # A global position reaches beyond the window, both ways; without one the rows are local attention's.
    q, k, v = qkv(1, 2, 16, 4)
    local = build_mechanism("local", 2, 4, window=2).double()(q, k, v)
    m = build(window=2, global_tokens=0)
    torch.testing.assert_close(m(q, k, v), local)
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[0, 9] = True
    out = m(q, k, v, global_mask=mask)
    changed = (out - local).abs().amax((0, 1, 3)) > 1e-9
    # Row 9 now sees every key, every row farther than the window from 9 sees key 9; rows 8 and 10 saw it.
    assert changed.tolist() == [i not in (8, 10) for i in range(16)]
    assert torch.equal(gather_global_positions(mask).positions, torch.tensor([[9]]))


def test_batch_elements_with_different_global_counts_match_running_alone():
    m = build(window=3, global_tokens=0, global_projections=True)
    q, k, v = qkv(4, 2, 14, 4)
    mask, padding = global_masks(14), paddings(14)
    together = m(q, k, v, True, padding, global_mask=mask)
    for b in range(4):
        alone = m(q[b:b + 1], k[b:b + 1], v[b:b + 1], True, padding[b:b + 1], global_mask=mask[b:b + 1])
        torch.testing.assert_close(together[b:b + 1], alone, rtol=1e-12, atol=1e-12)


# -- separate global projections ------------------------------------------------------------------------------
def test_projections_start_at_the_identity_and_change_only_global_rows():
    q, k, v = qkv(4, 2, 11, 4)
    mask, padding = global_masks(11), paddings(11)
    plain = build_mechanism("longformer", 2, 4, window=2, global_indices=(5,)).double()
    projected = build_mechanism("longformer", 2, 4, window=2, global_indices=(5,), global_projections=True).double()
    assert not list(plain.parameters())
    assert sorted(name for name, _ in projected.named_parameters()) == ["key_global", "query_global", "value_global"]
    assert projected.query_global.shape == (2, 4, 4)
    before = plain(q, k, v, False, padding, global_mask=mask)
    torch.testing.assert_close(projected(q, k, v, False, padding, global_mask=mask), before, rtol=1e-12, atol=1e-12)
    randomised(projected)
    after = projected(q, k, v, False, padding, global_mask=mask)
    rows = projected.global_positions(4, 11, mask)[:, None, :, None].expand_as(after)
    torch.testing.assert_close(after[~rows], before[~rows], rtol=1e-12, atol=1e-12)
    live = rows & ~padding.all(1)[:, None, None, None]  # an element with every key padded stays zeros
    assert ((after - before).abs()[live] > 1e-9).float().mean() > 0.9


def test_projection_parameters_get_the_reference_gradients():
    m = build(window=2, global_tokens=1, global_indices=(-2,), global_projections=True)
    q, k, v = qkv(4, 2, 10, 4)
    mask, padding = global_masks(10), paddings(10)
    weights = torch.randn(4, 2, 10, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    grads = []
    for attend in (m, m.reference):
        m.zero_grad(set_to_none=True)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        (attend(*inputs, True, padding, global_mask=mask) * weights).sum().backward()
        grads.append([t.grad for t in inputs] + [p.grad.clone() for p in m.parameters()])
    for fast, slow in zip(*grads):
        torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-11)
    assert all(p.abs().sum() > 0 for p in grads[0][3:])


# -- global_mask under the suite's properties -------------------------------------------------------------------
class WithGlobalMask(nn.Module):
    """The mechanism called with a fixed ``global_mask``, in the contract's call form the suite's checks use."""

    def __init__(self, mechanism, global_mask):
        super().__init__()
        self.mechanism, self.global_mask = mechanism, global_mask

    def forward(self, q, k, v, causal=False, key_padding_mask=None, *, cross=False):
        return self.mechanism(q, k, v, causal, key_padding_mask, cross=cross, global_mask=self.global_mask)


MASKED = [{"window": 2, "global_tokens": 0}, {"window": 3, "global_tokens": 1, "global_projections": True}]


@pytest.mark.parametrize("options", MASKED, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_global_mask_padding_is_invisible(options, causal):
    # Element 2's global position is padding, element 3 is all padding: NaN and inf there change nothing.
    length = 11
    m = WithGlobalMask(build(**options), global_masks(length))
    checks.padding_invariance(m, qkv(4, 2, length, 4, seed=9), causal, paddings(length),
                              f"longformer {options} with global_mask, causal={causal}")


@pytest.mark.parametrize("options", MASKED, ids=str)
def test_global_mask_has_no_lookahead(options):
    length = 11
    m = build(**options)
    q, k, v = qkv(4, 2, length, 4, seed=10)
    mask, padding = global_masks(length), paddings(length)
    for cut in (0, 4, 9):
        checks.no_lookahead(WithGlobalMask(m, mask), (q, k, v), padding, cut, f"longformer {options} cut={cut}")
        # Marking later positions global (or not) changes no row up to the cut either.
        later = mask.clone()
        later[:, cut + 1:] = ~later[:, cut + 1:]
        torch.testing.assert_close(m(q, k, v, True, padding, global_mask=later)[:, :, :cut + 1],
                                   m(q, k, v, True, padding, global_mask=mask)[:, :, :cut + 1],
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", MASKED, ids=str)
def test_global_mask_gradcheck(options):
    m = build(**options)
    q, k, v = (t.requires_grad_() for t in qkv(3, 2, 6, 4, seed=11))
    mask = torch.tensor([[False] * 6, [True, False, False, True, False, False], [False] * 5 + [True]])
    padding = torch.tensor([[False] * 6, [False, False, False, False, True, True], [True, False, False, False,
                                                                                  False, False]])
    for causal in (False, True):
        # Fast mode compares random projections of the Jacobian, as the conformance suite's gradcheck does.
        assert torch.autograd.gradcheck(lambda q, k, v: m(q, k, v, causal, padding, global_mask=mask), (q, k, v),
                                        eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


# -- memory: nothing N x N ----------------------------------------------------------------------------------------
def test_no_quadratic_tensor_with_a_global_mask():
    length, window, block, count = 2048, 8, 4, 16
    m = build_mechanism("longformer", 1, 4, window=window, global_tokens=1, block_size=block,
                        global_projections=True)
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, length, 4, dtype=torch.float32))
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, torch.randperm(length, generator=torch.Generator().manual_seed(0))[:count]] = True
    with TensorRecorder() as probe:
        m(q, k, v, False, torch.zeros(1, length, dtype=torch.bool), global_mask=mask).sum().backward()
    # Window span of a query block plus the global keys per query, and the (G + 1) x N global rows.
    per_query = (2 * window + block) + count + 1
    assert probe.largest <= 4 * length * per_query < length * length // 8, (probe.largest, length * length)


# -- through MultiHeadAttention -----------------------------------------------------------------------------------
def test_multi_head_attention_passes_global_mask_on():
    torch.manual_seed(0)
    mha = attnzoo.MultiHeadAttention(16, 2, "longformer", window=2, global_tokens=0).double()
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    mask = global_masks(9)[:3]
    q, k, v = (mha._split_heads(proj(x)) for proj in (mha.q_proj, mha.k_proj, mha.v_proj))
    expected = mha.out_proj(mha._merge_heads(mha.mechanism(q, k, v, global_mask=mask)))
    torch.testing.assert_close(mha(x, global_mask=mask), expected)
    assert not torch.allclose(mha(x, global_mask=mask), mha(x))


def test_multi_head_attention_refuses_global_mask_for_other_mechanisms():
    mha = attnzoo.MultiHeadAttention(16, 2, "local", window=2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(UnsupportedOptionError, match=r"global_mask.*'local' does not take global_mask.*longformer"):
        mha(x, global_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_a_mechanism_refuses_a_per_call_input_it_does_not_declare_before_any_work():
    q, k, v = qkv(2, 2, 5, 4)
    local = build_mechanism("local", 2, 4, window=2)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for call in (lambda: local(q, k, v, global_mask=mask), lambda: local.reference(q, k, v, global_mask=mask)):
        with pytest.raises(UnsupportedOptionError, match=r"global_mask=...: mechanism 'local' does not take "
                                                          r"global_mask \(mechanisms that do: longformer\)"):
            call()
    # A name no mechanism takes is a misspelt argument, for MultiHeadAttention too, before anything is projected.
    with pytest.raises(TypeError, match=r"unexpected argument 'key_paddding_mask'"):
        local(q, k, v, key_paddding_mask=mask)
    mha = attnzoo.MultiHeadAttention(8, 2, "longformer", window=2)
    with pytest.raises(TypeError, match=r"unexpected argument 'global_masks'"):
        mha(torch.randn(2, 5, 8), global_masks=mask)


def test_a_global_mask_is_checked_once_by_the_base_class_naming_it():
    m = build(window=2, global_tokens=0)
    q, k, v = qkv(2, 2, 6, 4)
    with pytest.raises(ValueError, match="global_mask"):
        m(q, k, v, global_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="global_mask"):
        m(q, k, v, global_mask=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="global_mask"):
        m.reference(q, k, v, global_mask=torch.zeros(3, 6, dtype=torch.bool))


# -- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, error", [
    ((1, 1), ValueError), ((0, 2, -1, 2), ValueError), ((1.0,), TypeError), ((True,), TypeError), ("12", TypeError),
    (3, TypeError), (torch.tensor([1, 2]), TypeError), ((1, None), TypeError),
])
def test_bad_global_indices_are_named(value, error):
    with pytest.raises(error, match="global_indices"):
        build_mechanism("longformer", 2, 4, global_indices=value)


def test_global_indices_accept_lists_and_keep_a_tuple():
    assert build_mechanism("longformer", 2, 4, global_indices=[3, -1]).global_indices == (3, -1)
    assert build_mechanism("longformer", 2, 4).global_indices == ()


def test_out_of_range_index_is_refused_at_forward():
    m = build(window=2, global_indices=(3, -5, 9))
    q, k, v = qkv(1, 2, 9, 4)
    with pytest.raises(UnsupportedOptionError, match=r"global_indices \[9\] name no position .* length 9"):
        m(q, k, v)
    with pytest.raises(UnsupportedOptionError, match=r"global_indices \[-5, 9\]"):
        m(*(t[:, :, :4] for t in (q, k, v)))
    assert m(*qkv(1, 2, 10, 4)).shape == (1, 2, 10, 4)
    mha = attnzoo.MultiHeadAttention(8, 2, "longformer", global_indices=(9,))
    with pytest.raises(UnsupportedOptionError, match="global_indices"):
        mha(torch.randn(1, 9, 8))


@pytest.mark.parametrize("mask, error", [
    (torch.zeros(2, 6, dtype=torch.bool), ValueError),
    (torch.zeros(3, 5, dtype=torch.bool), ValueError),
    (torch.zeros(2, 5, 1, dtype=torch.bool), ValueError),
    (torch.zeros(2, 5), TypeError),
    (torch.zeros(2, 5, dtype=torch.long), TypeError),
    ([[False] * 5] * 2, TypeError),
])
def test_bad_global_mask_is_named(mask, error):
    m = build(window=2)
    q, k, v = qkv(2, 2, 5, 4)
    with pytest.raises(error, match="global_mask"):
        m(q, k, v, global_mask=mask)
    with pytest.raises(error, match="global_mask"):
        longformer_attention(q, k, v, 2, mask)


def test_global_mask_is_refused_under_tracing():
    m = build(window=2)
    q, k, v = qkv(1, 2, 5, 4)
    with pytest.raises(UnsupportedOptionError, match="global_mask"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values in the input checks
        torch.jit.trace(WithGlobalMask(m, torch.ones(1, 5, dtype=torch.bool)), (q, k, v), check_trace=False)


def test_value_width_must_fit_the_value_projection():
    m = build(window=2, global_projections=True)
    q, k, v = qkv(1, 2, 5, 4)
    with pytest.raises(UnsupportedOptionError, match="global_projections"):
        m(q, k, torch.randn(1, 2, 5, 3, dtype=torch.float64))
    assert build(window=2)(q, k, torch.randn(1, 2, 5, 3, dtype=torch.float64)).shape == (1, 2, 5, 3)


def test_bad_global_projections_option():
    for value in ("True", 1, None):
        with pytest.raises(TypeError, match="global_projections"):
            build_mechanism("longformer", 2, 4, global_projections=value)

"""Sparse Sinkhorn attention: Sinkhorn balancing, the single-block limit, SortCut, causality, padding, options."""

import pytest
import torch

import attnzoo
from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.sinkhorn import (
    sinkhorn_attention,
    sinkhorn_attention_reference,
    sinkhorn_balance,
    sinkhorn_balance_reference,
    sinkhorn_sorting,
)
from attnzoo.mechanisms import UnsupportedOptionError


def qkv(batch=2, heads=2, n=12, dim=8, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, dim, generator=g, dtype=dtype) for _ in range(3))


def build(heads=2, dim=8, **options):
    torch.manual_seed(0)
    return attnzoo.build_mechanism("sinkhorn", heads, dim, **options).double()


# -- Sinkhorn balancing ------------------------------------------------------------------------------------------
def test_sinkhorn_rows_and_columns_sum_to_one_after_enough_iterations():
    logits = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    deviation = {}
    for iterations in (1, 5, 20, 50):
        p = sinkhorn_balance(logits, iterations)
        assert bool((p > 0).all())
        rows, columns = (p.sum(-1) - 1).abs().max().item(), (p.sum(-2) - 1).abs().max().item()
        deviation[iterations] = rows
        assert columns < 1e-12  # the last normalisation of each round is over columns
    # Measured (logits ~ N(0, 4), 8 x 8): row sums off by at most 0.70, 0.066, 1.2e-5, 4.6e-13 after 1, 5, 20, 50
    # rounds (64 x 64 logits ~ N(0, 1/0.75^2): 0.14, 1.1e-4, 8.5e-7 after 1, 5, 8 rounds).
    assert deviation[1] > deviation[5] > deviation[20] > deviation[50]
    assert deviation[20] < 1e-3 and deviation[50] < 1e-9


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 6, 20])  # 20 blocks: causal problems batched in chunks of unequal sizes
def test_log_space_balancing_matches_the_probability_space_reference(causal, n):
    logits = torch.randn(3, n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits.requires_grad_()
    weights = torch.randn(3, n, n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for temperature in (1.0, 0.3):
        fast = sinkhorn_balance(logits, 7, temperature=temperature, causal=causal)
        reference = sinkhorn_balance_reference(logits, 7, temperature=temperature, causal=causal)
        torch.testing.assert_close(fast, reference)
        if causal and n == 1:
            continue  # one block has no past: a constant zero row
        gradients = [torch.autograd.grad((p * weights).sum(), logits)[0] for p in (fast, reference)]
        torch.testing.assert_close(*gradients)


def test_causal_balancing_uses_only_earlier_blocks_and_earlier_rows():
    logits = torch.randn(6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p = sinkhorn_balance(logits, 50, causal=True)
    assert torch.equal(p.triu(), torch.zeros_like(p))  # row i weighs only blocks j < i; row 0 nothing
    torch.testing.assert_close(p[1:].sum(-1), torch.ones(5, dtype=torch.float64))
    # Row i is the last row of the balanced i x i past: rows after it, and columns >= i, change nothing.
    changed = logits.clone()
    changed[4:] = 100.0
    changed[:, 3:] = -100.0
    torch.testing.assert_close(sinkhorn_balance(changed, 50, causal=True)[:4], p[:4])
    # ...and that past matrix is doubly stochastic: its columns sum to 1 too.
    past = sinkhorn_balance(logits[1:5, :4], 50)
    torch.testing.assert_close(p[4, :4], past[-1])
    torch.testing.assert_close(past.sum(-2), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_balancing_in_log_space_stays_finite_for_extreme_logits(dtype):
    # Tempered logits spread over ~1e5: probability-space Sinkhorn would underflow to 0/0; log space does not.
    logits = (torch.randn(2, 12, 12, generator=torch.Generator().manual_seed(4)) * 1000).to(dtype).requires_grad_()
    for causal in (False, True):
        p = sinkhorn_balance(logits, 10, temperature=0.01, causal=causal)
        (gradient,) = torch.autograd.grad((p * torch.linspace(-1, 1, 12, dtype=dtype)).sum(), logits)
        assert bool(torch.isfinite(p).all()) and bool(torch.isfinite(gradient).all())
        assert bool((p >= 0).all()) and bool((p <= 1).all())


def test_functional_arguments_are_named():
    q, k, v = qkv(n=8)
    weight, bias = torch.zeros(2, 8, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64)
    for options, named in (({"iterations": 0}, "iterations"), ({"block_size": 0}, "block_size"),
                           ({"temperature": 0.0}, "temperature"), ({"sortcut": 0}, "sortcut"),
                           ({"causal": 1}, "causal")):
        with pytest.raises((TypeError, ValueError), match=named):
            sinkhorn_attention(q, k, v, weight, bias, **options)
    with pytest.raises(ValueError, match="sort_weight"):
        sinkhorn_attention(q, k, v, weight[:1], bias)
    with pytest.raises(ValueError, match="one length"):
        sinkhorn_attention(q, k[:, :, :5], v[:, :, :5], weight, bias)
    with pytest.raises(ValueError, match="square"):
        sinkhorn_balance(torch.zeros(3, 4), 3)


# -- the single-block limit -----------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [12, 64])
def test_one_block_is_exact_softmax_attention(causal, block_size):
    q, k, v = qkv(n=12)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 3] = mask[1, -2:] = True
    m = build(block_size=block_size, sinkhorn_iterations=3)
    for padding in (None, mask):
        out = m(q, k, v, causal=causal, key_padding_mask=padding)
        exact = softmax_attention_reference(q, k, v, causal, padding)
        torch.testing.assert_close(out, exact, rtol=1e-10, atol=1e-12)


# -- SortCut --------------------------------------------------------------------------------------------------
def _sorted_inputs(order):
    """q, k, v for 3 blocks of 4 positions whose sorting is clear-cut: block i's queries point at the keys of
    block order[i] (unit directions, scaled), so a sharp Sinkhorn permutation sends block order[i] to row i."""
    g = torch.Generator().manual_seed(3)
    dim, size = 8, 4
    directions = torch.eye(dim, dtype=torch.float64)
    k = torch.cat([directions[j].expand(size, dim) * 4 for j in range(3)]) + 0.1 * torch.randn(12, dim, generator=g, dtype=torch.float64)
    q = torch.cat([directions[order[i]].expand(size, dim) * 4 for i in range(3)]) + 0.1 * torch.randn(12, dim, generator=g, dtype=torch.float64)
    v = torch.randn(12, dim, generator=g, dtype=torch.float64)
    return q.view(1, 1, 12, dim), k.view(1, 1, 12, dim), v.view(1, 1, 12, dim)


@pytest.mark.parametrize("sortcut", [1, 2])
def test_sortcut_keeps_only_the_first_sorted_blocks(sortcut):
    order = (2, 0, 1)
    q, k, v = _sorted_inputs(order)
    m = build(heads=1, block_size=4, sinkhorn_iterations=30, temperature=0.05, sortcut=sortcut)
    with torch.no_grad():
        m.sort_weight.copy_(torch.eye(8, dtype=torch.float64)[None])
        m.sort_bias.zero_()
    permutation = sinkhorn_sorting(q, k, m.sort_weight, m.sort_bias, block_size=4, iterations=30, temperature=0.05)
    assert (permutation[0, 0] - torch.eye(3, dtype=torch.float64)[list(order)]).abs().max() < 1e-8
    # Every query attends to exactly the keys of blocks order[0], ..., order[sortcut - 1].
    kept = torch.cat([torch.arange(4 * order[i], 4 * order[i] + 4) for i in range(sortcut)])
    expected = softmax_attention_reference(q, k[:, :, kept], v[:, :, kept])
    torch.testing.assert_close(m(q, k, v), expected, rtol=1e-7, atol=1e-7)
    # Keys and values of the blocks left out change nothing.
    dropped = torch.tensor([p for p in range(12) if p not in kept.tolist()])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, dropped] = k2[:, :, dropped] + 0.01  # small enough to keep the sorting
    v2[:, :, dropped] = 100.0
    torch.testing.assert_close(m(q, k2, v2), m(q, k, v), rtol=1e-6, atol=1e-6)


def test_sortcut_is_non_causal_and_larger_than_the_block_count_keeps_every_block():
    q, k, v = qkv(n=10)
    m = build(block_size=4, sortcut=2)
    with pytest.raises(UnsupportedOptionError, match="sortcut=2"):
        m(q, k, v, causal=True)
    with pytest.raises(ValueError, match="sortcut"):
        sinkhorn_attention(q, k, v, m.sort_weight, m.sort_bias, block_size=4, causal=True, sortcut=2)
    everything = build(block_size=4, sortcut=50)  # 3 blocks
    torch.testing.assert_close(everything(q, k, v), build(block_size=4, sortcut=3)(q, k, v))


# -- causality and padding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [0, 3, 4, 9, 17])
def test_causal_output_ignores_the_future(cut):
    q, k, v = qkv(n=20)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, 2] = mask[1, 13] = True
    m = build(block_size=4, sinkhorn_iterations=4)
    before = m(q, k, v, causal=True, key_padding_mask=mask)
    future = slice(cut + 1, None)
    q2, k2, v2, mask2 = q.clone(), k.clone(), v.clone(), mask.clone()
    for t in (q2, k2, v2):
        t[:, :, future] = torch.randn(t[:, :, future].shape, dtype=torch.float64) * 3 + 1
    mask2[:, future] = ~mask2[:, future]
    after = m(q2, k2, v2, causal=True, key_padding_mask=mask2)
    torch.testing.assert_close(after[:, :, : cut + 1], before[:, :, : cut + 1], rtol=0, atol=1e-12)


def test_causal_first_block_attends_to_itself_only():
    q, k, v = qkv(n=12)
    out = build(block_size=4)(q, k, v, causal=True)
    local = softmax_attention_reference(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True)
    torch.testing.assert_close(out[:, :, :4], local)


@pytest.mark.parametrize("causal", [False, True])
def test_internal_padding_equals_padding_keys_at_the_end(causal):
    # Length 10 in blocks of 4 is padded inside to 12; a length-12 input whose last 2 keys are padding must
    # give the same first 10 rows, whatever the padding holds.
    q, k, v = qkv(n=12)
    m = build(block_size=4, sinkhorn_iterations=4)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 10:] = True
    k[:, :, 10:], v[:, :, 10:] = float("nan"), float("inf")
    padded = m(q, k, v, causal=causal, key_padding_mask=mask)
    short = m(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=causal)
    torch.testing.assert_close(padded[:, :, :10], short, rtol=1e-12, atol=1e-12)


def test_functional_matches_reference_and_sorting_is_learned():
    q, k, v = (t.float().requires_grad_() for t in qkv(n=13))
    m = build(block_size=4).float()
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, 5] = True
    out = sinkhorn_attention(q, k, v, m.sort_weight, m.sort_bias, block_size=4, key_padding_mask=mask)
    ref = sinkhorn_attention_reference(q, k, v, m.sort_weight, m.sort_bias, block_size=4, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    assert m.sort_weight.grad is not None and m.sort_weight.grad.abs().sum() > 0  # gradients reach the sorter
    assert m.sort_bias.grad is not None and m.sort_bias.grad.abs().sum() > 0


def test_non_contiguous_inputs():
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(n=10))
    assert not q.is_contiguous()
    m = build(block_size=4)
    for causal in (False, True):
        torch.testing.assert_close(m(q, k, v, causal=causal), m.reference(q, k, v, causal))


def test_fully_padded_element_gives_zeros():
    q, k, v = qkv(n=9)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1] = True
    for causal in (False, True):
        out = build(block_size=4)(q, k, v, causal=causal, key_padding_mask=mask)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


# -- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, named",
    [
        ({"block_size": 0}, "block_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"sinkhorn_iterations": 0}, "sinkhorn_iterations"),
        ({"sortcut": 0}, "sortcut"),
    ],
)
def test_bad_options_are_named(options, named):
    with pytest.raises(ValueError, match=named):
        attnzoo.build_mechanism("sinkhorn", 2, 8, **options)


def test_cross_attention_is_refused():
    q, k, v = qkv(n=6)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        build()(q, k, v, cross=True)


def test_repr_names_the_options():
    assert "block_size=64, sinkhorn_iterations=8, temperature=0.75, sortcut=None" in repr(build())

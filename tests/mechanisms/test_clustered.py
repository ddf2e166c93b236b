"""Clustered attention: exact with one cluster per query (and improved with every key in its top-k), error
falling with more clusters on clustered queries, the Hamming k-means, gradients through the centroids,
padding, determinism and options.

The conformance suite (tests/conformance) holds the mechanism to the common contract, its fast path to its own
float64 reference() included; these tests hold it to softmax attention and to the paper's maths."""

import pytest
import torch

import attnzoo
from attnzoo.functional import softmax_attention_reference
from attnzoo.functional.clustered import (
    cluster_queries,
    clustered_attention,
    clustered_attention_reference,
)
from attnzoo.mechanisms import UnsupportedOptionError


def qkv(batch=2, heads=2, q_len=48, k_len=None, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    k_len = q_len if k_len is None else k_len
    return tuple(torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64).to(dtype)
                 for n in (q_len, k_len, k_len))


def grouped_queries(batch=2, heads=2, length=256, dim=16, groups=16, spread=0.3, seed=0):
    """Queries drawn around ``groups`` random centres (what clustering is for), standard normal k and v."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, heads, groups, dim, generator=g, dtype=torch.float64) * 1.5
    which = torch.randint(0, groups, (batch, heads, length), generator=g)
    q = centres.gather(2, which[..., None].expand(batch, heads, length, dim))
    q = q + spread * torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def build(heads=2, dim=8, **options):
    options.setdefault("seed", 0)
    return attnzoo.build_mechanism("clustered", heads, dim, **options).double()


def relative_error(out, exact):
    return float((out.double() - exact).norm() / exact.norm())


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -5:] = True
    mask[-1, :3] = True
    return mask


def assert_close_unpadded(out, expected, mask, atol):
    """Equal at the unpadded positions (in self-attention a padded query is zeroed, its own row is free)."""
    kept = ~mask[:, None, :, None]
    torch.testing.assert_close(out * kept, expected * kept, rtol=0, atol=atol)


# -- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("improved", [False, True])
def test_one_cluster_per_query_is_exact_softmax(improved):
    """clusters >= queries: every query is its own centroid, so each attends exactly (improved too, with any
    top-k: the top keys get the query's own mass on them, the rest its own weights)."""
    q, k, v = qkv()
    mask = padding(2, 48)
    for clusters in (48, 100):
        m = build(clusters=clusters, improved=improved, topk=5)
        torch.testing.assert_close(m(q, k, v), softmax_attention_reference(q, k, v), rtol=0, atol=1e-12)
        assert_close_unpadded(m(q, k, v, key_padding_mask=mask),
                              softmax_attention_reference(q, k, v, key_padding_mask=mask), mask, atol=1e-12)
    # Cross-attention: as many clusters as queries, any number of keys.
    q, k, v = qkv(q_len=12, k_len=30, seed=1)
    m = build(clusters=12, improved=improved, topk=7)
    torch.testing.assert_close(m(q, k, v, cross=True), softmax_attention_reference(q, k, v), rtol=0, atol=1e-12)


def test_improved_with_every_key_in_its_topk_is_exact_softmax_whatever_the_clusters():
    """topk = N: each query recomputes softmax over every key and the centroid's mass on them is 1."""
    q, k, v = qkv()
    mask = padding(2, 48)
    for clusters in (1, 4, 48):
        m = build(clusters=clusters, improved=True, topk=48)
        torch.testing.assert_close(m(q, k, v), softmax_attention_reference(q, k, v), rtol=0, atol=1e-12)
        assert_close_unpadded(m(q, k, v, key_padding_mask=mask),
                              softmax_attention_reference(q, k, v, key_padding_mask=mask), mask, atol=1e-12)


def test_float32_one_cluster_per_query_is_softmax_within_rounding():
    q, k, v = qkv(dtype=torch.float32)
    out = build(clusters=48).float()(q, k, v)
    torch.testing.assert_close(out.double(), softmax_attention_reference(q, k, v), rtol=1e-4, atol=1e-5)


# -- accuracy -------------------------------------------------------------------------------------------------
def test_error_against_softmax_falls_with_more_clusters():
    """Queries around 16 centres, N=256, head_dim 16, 32 hash bits, seed 0. Relative (Frobenius) error against
    softmax_attention_reference (uniform attention, the mean of v, scores 0.97):

        clusters           4      16     64     256 (one per query)
        clustered        0.88   0.50   0.24   0
        improved, k=16   0.74   0.34   0.10   0
    """
    q, k, v = grouped_queries()
    exact = softmax_attention_reference(q, k, v)
    for improved, bounds in ((False, (0.95, 0.6, 0.3, 1e-12)), (True, (0.8, 0.4, 0.15, 1e-12))):
        errors = [relative_error(build(heads=2, dim=16, clusters=c, improved=improved, topk=16)(q, k, v), exact)
                  for c in (4, 16, 64, 256)]
        assert all(a > b for a, b in zip(errors, errors[1:])), f"improved={improved}: errors {errors} do not fall"
        assert all(e < bound for e, bound in zip(errors, bounds)), f"improved={improved}: errors {errors}"


def test_improved_beats_plain_at_equal_clusters():
    q, k, v = grouped_queries(seed=1)
    exact = softmax_attention_reference(q, k, v)
    for clusters in (8, 32):
        plain = relative_error(build(heads=2, dim=16, clusters=clusters)(q, k, v), exact)
        improved = relative_error(build(heads=2, dim=16, clusters=clusters, improved=True, topk=16)(q, k, v), exact)
        assert improved < plain, f"{clusters} clusters: improved {improved:.3g} >= plain {plain:.3g}"


@pytest.mark.parametrize("improved", [False, True])
def test_weights_sum_to_one(improved):
    """Every query's weights (the centroid's, or the paper's A^t) sum to one: constant values come out."""
    q, k, _ = qkv(seed=2)
    ones = torch.ones_like(k)
    mask = padding(2, 48)
    out = build(clusters=5, improved=improved, topk=6)(q, k, ones, key_padding_mask=mask)
    torch.testing.assert_close(out, torch.ones_like(out), rtol=0, atol=1e-12)


# -- clustering -----------------------------------------------------------------------------------------------
def test_clustering_groups_equal_codes_and_stays_in_range():
    q, _, _ = qkv(batch=2, heads=3, q_len=40, seed=3)
    planes = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assignment = cluster_queries(q, planes, 7, 3)
    assert assignment.shape == (2, 3, 40) and assignment.dtype == torch.long
    assert int(assignment.min()) >= 0 and int(assignment.max()) < 7
    codes = q @ planes > 0
    same_code = (codes[..., :, None, :] == codes[..., None, :, :]).all(-1)
    same_cluster = assignment[..., :, None] == assignment[..., None, :]
    assert bool((same_cluster | ~same_code).all()), "queries with equal codes landed in different clusters"
    # Fewer queries than clusters: one each, in order.
    assert torch.equal(cluster_queries(q[:, :, :5], planes, 7, 3), torch.arange(5).expand(2, 3, 5))


def _lloyd_by_the_definition(q, planes, clusters, iterations):
    """The module docstring's Hamming k-means written out per (batch, head), every iteration run: codes by the
    hyperplane signs, centres started at the codes of queries floor(c N / C), assignment to the first nearest
    centre by counting differing bits, centres moved to their members' bitwise majority (a tie gives 0, a
    cluster with no member keeps its code)."""
    batch, heads, length, _ = q.shape
    out = torch.empty(batch, heads, length, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            codes = [tuple(bool(bit) for bit in row) for row in (q[b, h] @ planes > 0)]
            centres = [codes[c * length // clusters] for c in range(clusters)]

            def assign():
                return [min(range(clusters), key=lambda c: (sum(x != y for x, y in zip(code, centres[c])), c))
                        for code in codes]

            for _ in range(iterations):
                assignment = assign()
                for c in range(clusters):
                    members = [codes[i] for i in range(length) if assignment[i] == c]
                    if members:
                        centres[c] = tuple(2 * sum(column) > len(members) for column in zip(*members))
            out[b, h] = torch.tensor(assign())
    return out


@pytest.mark.parametrize("iterations", [1, 2, 4, 25])
def test_clustering_equals_every_lloyd_iteration_run_by_the_definition(iterations):
    """The batched k-means (which stops once the centres stop moving) equals the definition run for every
    iteration; with 25 the centres have long settled, so this also checks the early stop changes nothing."""
    q, _, _ = qkv(batch=2, heads=2, q_len=40, dim=6, seed=11)
    planes = torch.randn(6, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.equal(cluster_queries(q, planes, 6, iterations), _lloyd_by_the_definition(q, planes, 6, iterations))


def test_clustering_separates_well_separated_groups():
    """Four far-apart groups, laid out contiguously so that the evenly spaced starts hit each: k-means puts
    every group in a cluster of its own."""
    g = torch.Generator().manual_seed(4)
    centres = torch.randn(4, 16, generator=g, dtype=torch.float64) * 5
    q = (centres.repeat_interleave(10, 0) + 0.05 * torch.randn(40, 16, generator=g, dtype=torch.float64))[None, None]
    planes = torch.randn(16, 32, generator=g, dtype=torch.float64)
    assignment = cluster_queries(q, planes, 4, 5)[0, 0]
    assert torch.equal(assignment, torch.arange(4).repeat_interleave(10))


def test_padded_queries_are_left_out_of_the_clustering():
    """A padded query joins no centroid: whatever it holds leaves the other queries' clusters and outputs
    unchanged."""
    q, k, v = qkv(seed=5)
    mask = padding(2, 48)
    m = build(clusters=5, improved=True, topk=6)
    planes = m.planes
    before = cluster_queries(q, planes, 5, 10, mask)
    q2 = q.masked_fill(mask[:, None, :, None], float("nan"))
    assert torch.equal(cluster_queries(q2, planes, 5, 10, mask), before)
    kept = ~mask[:, None, :, None]
    out, out2 = m(q, k, v, key_padding_mask=mask), m(q2, k, v, key_padding_mask=mask)
    assert bool(torch.isfinite(out2).all())
    torch.testing.assert_close(out2 * kept, out * kept, rtol=0, atol=0)


# -- gradients ------------------------------------------------------------------------------------------------
def test_gradients_reach_queries_through_the_centroids():
    """Plain clustered attention: a query's output is its centroid's, the mean of its members, so each member
    of a cluster gets the same gradient (the centroid's over the cluster size), and a padded query none."""
    q, k, v = qkv(seed=6)
    mask = padding(2, 48)
    m = build(clusters=5)
    q.requires_grad_()
    out = m(q, k, v, key_padding_mask=mask)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)).sum().backward()
    assignment = cluster_queries(q.detach(), m.planes, 5, m.iterations, mask)
    grad = q.grad
    assert bool((grad[mask[:, None, :].expand(2, 2, 48)] == 0).all())
    for b in range(2):
        for h in range(2):
            for c in range(5):
                members = ((assignment[b, h] == c) & ~mask[b]).nonzero().flatten()
                if len(members) > 1:
                    torch.testing.assert_close(grad[b, h, members], grad[b, h, members[:1]].expand(len(members), -1))
    assert float(grad.abs().sum()) > 0


# -- functional API, determinism, options, capabilities ------------------------------------------------------
def test_functional_matches_its_reference_and_validates():
    q, k, v = qkv(q_len=20, k_len=25, seed=7)
    planes = torch.randn(8, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = padding(2, 25)
    for topk in (None, 6):
        fast = clustered_attention(q, k, v, mask, planes=planes, clusters=4, iterations=3, topk=topk)
        slow = clustered_attention_reference(q, k, v, mask, planes=planes, clusters=4, iterations=3, topk=topk)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    # Unbalanced clusters (most queries nearly equal, so one cluster holds most of them): the improved form
    # spreads a large cluster over several chunks of queries.
    lopsided = q.clone()
    lopsided[:, :, 3:] = q[:, :, :1] + 1e-3 * q[:, :, 3:]
    for clusters in (2, 4, 7):
        fast = clustered_attention(lopsided, k, v, mask, planes=planes, clusters=clusters, iterations=2, topk=5)
        slow = clustered_attention_reference(lopsided, k, v, mask, planes=planes, clusters=clusters, iterations=2,
                                             topk=5)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="planes"):
        clustered_attention(q, k, v, planes=planes[:4])
    with pytest.raises(ValueError, match="topk"):
        clustered_attention(q, k, v, planes=planes, topk=0)
    with pytest.raises(ValueError, match="query_padding_mask"):
        clustered_attention(q, k, v, planes=planes, query_padding_mask=mask)


def test_deterministic_from_the_seed():
    q, k, v = qkv(seed=8)
    a, b = build(clusters=6, seed=3), build(clusters=6, seed=3)
    assert torch.equal(a.planes, b.planes)
    assert torch.equal(a(q, k, v), b(q, k, v))
    assert torch.equal(a(q, k, v), a(q, k, v))
    assert not torch.equal(build(clusters=6, seed=4).planes, a.planes)
    # Without a seed the hyperplanes come from the global RNG, reproducibly.
    torch.manual_seed(11)
    first = attnzoo.build_mechanism("clustered", 2, 8).planes
    torch.manual_seed(11)
    assert torch.equal(attnzoo.build_mechanism("clustered", 2, 8).planes, first)


@pytest.mark.parametrize("option", ["clusters", "hash_bits", "iterations", "topk"])
def test_bad_options_are_named(option):
    for bad in (0, -1):
        with pytest.raises(ValueError, match=option):
            attnzoo.build_mechanism("clustered", 2, 8, **{option: bad})
    with pytest.raises(TypeError, match=option):
        attnzoo.build_mechanism("clustered", 2, 8, **{option: 2.5})
    with pytest.raises(ValueError, match="seed"):
        attnzoo.build_mechanism("clustered", 2, 8, seed=-1)


def test_capabilities_and_refusals():
    caps = attnzoo.capabilities("clustered")
    assert (caps.causal, caps.cross, caps.key_padding, caps.recurrent_step, caps.kind) == (
        False, True, True, False, "approximate")
    m = build()
    q, k, v = qkv(q_len=6)
    with pytest.raises(UnsupportedOptionError, match="causal"):
        m(q, k, v, causal=True)
    assert "clusters=100" in repr(attnzoo.build_mechanism("clustered", 2, 8))


def test_half_precision_runs_and_stays_close():
    q, k, v = grouped_queries(length=64)
    for improved in (False, True):
        m = build(heads=2, dim=16, clusters=8, improved=improved, topk=8)
        expected = m(q, k, v)
        for dtype in (torch.float16, torch.bfloat16):
            out = m.to(dtype)(*(t.to(dtype) for t in (q, k, v)))
            m.double()
            assert out.dtype == dtype and bool(torch.isfinite(out).all())
            assert relative_error(out, expected) < 0.05, f"{dtype} improved={improved}"

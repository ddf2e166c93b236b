"""Reformer LSH attention: the one-bucket limit, hashing, rotations kept in a buffer, causality, padding,
options."""

import math

import pytest
import torch

import attnzoo
from attnzoo.functional.lsh import (
    SELF_LOGIT,
    lsh_attention,
    lsh_attention_reference,
    lsh_bucket_count,
    lsh_buckets,
    lsh_hash_key,
    lsh_rotations,
)
from attnzoo.mechanisms import UnsupportedOptionError


def qkv(batch=2, heads=2, n=12, dim=8, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, dim, generator=g, dtype=dtype) for _ in range(3))


def build(heads=2, dim=8, **options):
    return attnzoo.build_mechanism("reformer", heads, dim, **options).double()


def shared_qk_attention(q, v, causal=False, padding=None):
    """Dense shared-QK attention, written out: unit keys, 1/sqrt(d), self attended only when nothing else is."""
    n, d = q.shape[2], q.shape[3]
    keys = q / q.norm(dim=-1, keepdim=True)
    logits = q @ keys.transpose(-1, -2) / math.sqrt(d)
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    visible = visible & ~torch.eye(n, dtype=torch.bool)
    visible = visible.expand(q.shape[0], 1, n, n)
    if padding is not None:
        visible = visible & ~padding[:, None, None, :]
    alone = ~visible.any(-1, keepdim=True)
    visible = visible | (alone & torch.eye(n, dtype=torch.bool))
    weights = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
    return weights @ v


# -- the one-bucket limit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_bucket_is_exact_shared_qk_attention_with_self_masked(causal, n_hashes):
    q, k, v = qkv(n=10)
    m = build(bucket_size=10, n_hashes=n_hashes, seed=3)
    assert m.n_buckets(10) == 1
    expected = shared_qk_attention(q, v, causal)
    torch.testing.assert_close(m(q, k, v, causal=causal), expected)
    # Rounds over one bucket are identical: combining them changes nothing.
    if causal:  # position 0 sees only itself
        torch.testing.assert_close(m(q, k, v, causal=True)[:, :, 0], v[:, :, 0])


def test_one_bucket_with_padding_matches_dense_attention_over_the_unpadded_keys():
    q, k, v = qkv(n=9)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, [0, 4, 8]] = True
    m = build(bucket_size=16, n_hashes=2, seed=0)
    for causal in (False, True):
        out = m(q, k, v, causal=causal, key_padding_mask=padding)
        expected = shared_qk_attention(q, v, causal, padding)
        kept = ~padding[:, None, :, None]
        torch.testing.assert_close(out * kept, expected * kept)
        assert torch.equal(out[0, :, [0, 4, 8]], torch.zeros_like(out[0, :, [0, 4, 8]]))  # padded rows: zeros


# -- fast path against the reference, at several chunks and rounds --------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, bucket_size", [(37, 4), (10, 16)])  # many chunks; one bucket (one round computed)
def test_fast_path_and_gradients_match_the_reference_over_many_chunks(causal, n, bucket_size):
    q, k, v = qkv(n=n, seed=4)
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, :3] = True
    padding[1, 6:8] = True
    key = torch.tensor(lsh_hash_key(5))
    weights = torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    results = []
    for attend in (lsh_attention, lsh_attention_reference):
        leaves = [q.clone().requires_grad_(), v.clone().requires_grad_()]
        out = attend(*leaves, key, bucket_size=bucket_size, n_hashes=3, causal=causal, key_padding_mask=padding)
        (out * weights).sum().backward()
        results.append((out.detach(), leaves[0].grad, leaves[1].grad))
    for fast, slow in zip(*results):
        torch.testing.assert_close(fast, slow)
    # float32 buckets agree with float64 ones here, so the float32 result is the float64 one within rounding.
    out32 = lsh_attention(q.float(), v.float(), key, bucket_size=bucket_size, n_hashes=3, causal=causal,
                          key_padding_mask=padding)
    torch.testing.assert_close(out32.double(), results[1][0], rtol=1e-4, atol=1e-5)


def test_several_buckets_differ_from_full_attention_and_rounds_matter():
    q, k, v = qkv(n=48, seed=7)
    full = shared_qk_attention(q, v)
    one = build(bucket_size=4, n_hashes=1, seed=1)(q, k, v)
    four = build(bucket_size=4, n_hashes=4, seed=1)(q, k, v)
    assert (one - full).abs().max() > 1e-2
    # More rounds see more of each query's keys: closer to full attention on average.
    assert (four - full).norm() < (one - full).norm()


# -- hashing and rotations -----------------------------------------------------------------------------------
def test_bucket_count_follows_the_length():
    assert lsh_bucket_count(8192, 64) == 128
    assert lsh_bucket_count(64, 64) == 1
    assert lsh_bucket_count(65, 64) == 2
    assert lsh_bucket_count(300, 64) == 6  # ~ 300 / 64, rounded up to an even number
    assert all(lsh_bucket_count(n, 5) % 2 == 0 for n in range(6, 60))


def test_rotations_are_standard_normal_deterministic_and_extend_without_changing():
    key = torch.tensor(lsh_hash_key(11))
    small = lsh_rotations(key, 2, 8, 3)
    large = lsh_rotations(key, 2, 8, 4000)
    assert small.shape == (2, 8, 3) and small.dtype == torch.float64
    assert torch.equal(large[..., :3], small)
    assert torch.equal(lsh_rotations(key, 2, 8, 4000), large)
    assert abs(large.mean().item()) < 0.02 and abs(large.std().item() - 1) < 0.02
    assert abs(torch.corrcoef(large.reshape(16, -1)).fill_diagonal_(0).abs().max().item()) < 0.06
    other = lsh_rotations(torch.tensor(lsh_hash_key(12)), 2, 8, 3)
    assert not torch.allclose(other, small)


def test_hashing_is_locality_sensitive():
    key = torch.tensor(lsh_hash_key(0))
    x = torch.randn(1, 1, 400, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    near = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    far = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    buckets = lsh_buckets(torch.cat([x, near, far], dim=0), key, n_hashes=2, n_buckets=16)
    assert buckets.shape == (3, 1, 2, 400) and int(buckets.min()) >= 0 and int(buckets.max()) < 16
    # The scale of a vector does not change its bucket; a nearby direction mostly keeps it; a random one not.
    assert torch.equal(lsh_buckets(3.0 * x, key, 2, 16), buckets[:1])
    assert (buckets[1] == buckets[0]).double().mean() > 0.8
    assert (buckets[2] == buckets[0]).double().mean() < 0.2


def test_rotations_live_in_state_dict_and_reload_identically():
    q, k, v = qkv(n=30, seed=8)
    torch.manual_seed(123)
    m = build(bucket_size=4, n_hashes=2)  # seed None: drawn from the global generator
    assert "hash_key" in m.state_dict()
    first = m(q, k, v)
    assert torch.equal(m(q, k, v), first)  # no randomness at call time
    torch.manual_seed(456)
    fresh = build(bucket_size=4, n_hashes=2)
    assert not torch.equal(fresh(q, k, v), first)  # another draw hashes differently
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(q, k, v), first)
    assert torch.equal(fresh.rotations(30), m.rotations(30))
    # An explicit seed gives the same rotations whatever the global generator.
    torch.manual_seed(1)
    a = build(bucket_size=4, n_hashes=2, seed=42)
    torch.manual_seed(2)
    b = build(bucket_size=4, n_hashes=2, seed=42)
    assert torch.equal(a(q, k, v), b(q, k, v))
    assert a.rotations(30).shape == (2, 8, lsh_bucket_count(30, 4) // 2)
    assert a.rotations(3).shape == (2, 8, 0)


def test_any_length_runs_and_moves_devices_and_dtypes_with_the_module():
    m = build(bucket_size=4, n_hashes=2, seed=0)
    for n in (1, 2, 5, 8, 13, 301):
        q, k, v = qkv(n=n, seed=n)
        out = m(q, k, v, causal=n % 2 == 1)
        assert out.shape == (2, 2, n, 8) and bool(torch.isfinite(out).all())
    half = build(bucket_size=4, n_hashes=2, seed=0).to(torch.float16)
    q, k, v = qkv(n=20, dtype=torch.float16)
    assert half(q, k, v).dtype == torch.float16


# -- shared QK: k is not read --------------------------------------------------------------------------------
def test_k_is_ignored_and_gets_a_zero_gradient():
    q, k, v = qkv(n=20, seed=9)
    m = build(bucket_size=4, n_hashes=2, seed=0)
    k = k.clone().requires_grad_()
    out = m(q, k, v)
    torch.testing.assert_close(m(q, torch.full_like(k, math.nan), v), out)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


# -- causality and padding -----------------------------------------------------------------------------------
def test_causal_rows_ignore_the_future_with_many_buckets():
    q, k, v = qkv(n=60, seed=10)
    padding = torch.zeros(2, 60, dtype=torch.bool)
    padding[1, 10:14] = True
    m = build(bucket_size=4, n_hashes=3, seed=2)
    assert m.n_buckets(60) == 16
    out = m(q, k, v, causal=True, key_padding_mask=padding)
    for cut in (0, 17, 41):
        later = (slice(None), slice(None), slice(cut + 1, None))
        q2, v2 = q.clone(), v.clone()
        q2[later] = torch.randn(q2[later].shape, generator=torch.Generator().manual_seed(cut), dtype=torch.float64)
        v2[later] = 5.0
        padding2 = padding.clone()
        padding2[:, cut + 1 :] = ~padding2[:, cut + 1 :]
        out2 = m(q2, k, v2, causal=True, key_padding_mask=padding2)
        torch.testing.assert_close(out2[:, :, : cut + 1], out[:, :, : cut + 1], rtol=1e-12, atol=1e-12)


def test_a_causal_query_alone_in_its_bucket_returns_its_own_value():
    q, k, v = qkv(batch=1, heads=1, n=40, seed=11)
    m = build(heads=1, bucket_size=4, n_hashes=1, seed=3)
    out = m(q, k, v, causal=True)
    buckets = lsh_buckets(q, m.hash_key, 1, m.n_buckets(40))[0, 0, 0]
    firsts = [i for i in range(40) if int(buckets[i]) not in buckets[:i].tolist()]
    assert len(firsts) > 1
    for i in firsts:  # the first position of each bucket sees no earlier key of its bucket
        torch.testing.assert_close(out[0, 0, i], v[0, 0, i])


@pytest.mark.parametrize("causal", [False, True])
def test_padding_at_the_end_is_as_if_the_sequence_were_shorter(causal):
    # 40 and 36 positions with bucket_size 8 both hash into 6 buckets: the unpadded positions sort, chunk and
    # attend exactly as in the shorter sequence, whatever the padding holds.
    q, k, v = qkv(n=40, seed=12)
    m = build(bucket_size=8, n_hashes=2, seed=4)
    assert m.n_buckets(40) == m.n_buckets(36)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[:, 36:] = True
    q[:, :, 36:], v[:, :, 36:] = math.nan, math.inf
    out = m(q, k, v, causal=causal, key_padding_mask=padding)
    short = m(q[:, :, :36], k[:, :, :36], v[:, :, :36], causal=causal)
    torch.testing.assert_close(out[:, :, :36], short, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:, :, 36:], torch.zeros_like(out[:, :, 36:]))


def test_a_fully_padded_element_gives_zeros_and_finite_gradients():
    q, k, v = (t.clone().requires_grad_() for t in qkv(n=13, seed=13))
    padding = torch.zeros(2, 13, dtype=torch.bool)
    padding[1] = True
    out = build(bucket_size=4, n_hashes=2, seed=0)(q, k, v, causal=True, key_padding_mask=padding)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_self_logit_is_far_below_real_logits():
    # Unit keys: a real logit is at most |q| / sqrt(d); the self stand-in must stay below any plausible one.
    assert SELF_LOGIT <= -1e4


# -- options and capabilities ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, name",
    [
        ({"bucket_size": 0}, "bucket_size"),
        ({"bucket_size": -4}, "bucket_size"),
        ({"bucket_size": 2.0}, "bucket_size"),
        ({"n_hashes": 0}, "n_hashes"),
        ({"n_hashes": True}, "n_hashes"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_options_are_refused_naming_them(options, name):
    with pytest.raises((TypeError, ValueError), match=name):
        attnzoo.build_mechanism("reformer", 2, 8, **options)


def test_functional_refuses_bad_arguments():
    q, _, v = qkv(n=6)
    key = torch.tensor(lsh_hash_key(0))
    with pytest.raises(ValueError, match="bucket_size"):
        lsh_attention(q, v, key, bucket_size=0)
    with pytest.raises(ValueError, match="n_hashes"):
        lsh_attention(q, v, key, n_hashes=0)
    with pytest.raises(TypeError, match="hash_key"):
        lsh_attention(q, v, 3)
    with pytest.raises(ValueError, match="n_buckets"):
        lsh_buckets(q, key, 1, 3)


def test_cross_attention_and_decoding_are_refused():
    q, k, v = qkv(n=6)
    m = build(bucket_size=4)
    with pytest.raises(UnsupportedOptionError, match="cross"):
        m(q, k, v, cross=True)
    with pytest.raises(UnsupportedOptionError, match="step"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    caps = attnzoo.capabilities("reformer")
    assert caps.kind == "own" and caps.causal and caps.key_padding and not caps.cross
    assert "bucket_size=4" in repr(m) and "n_hashes=4" in repr(m)

"""The linear attention core: chunked causal vs float64 quadratic references, decays, recurrent steps,
padding, half precision and bad input."""

import math

import pytest
import torch

from attnzoo.feature_maps import FavorPositiveFeatures
from attnzoo.functional import (
    kernel_attention,
    kernel_attention_prefill,
    kernel_attention_reference,
    kernel_attention_step,
    linear_attention,
    linear_attention_reference,
)
import attnzoo.functional.linear.causal_chunks as causal_chunks_module
from attnzoo.functional.linear.causal_chunks import _CausalChunks
from attnzoo.functional.linear.normalize import normalize_output


def tensors(*shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


def qkv(q_len, k_len, batch=2, heads=3, dim=8, seed=0):
    return tensors((batch, heads, q_len, dim), (batch, heads, k_len, dim), (batch, heads, k_len, dim), seed=seed)


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -2:] = True  # right padding
    mask[-1, 0] = True  # and a padded key at the start
    return mask


FEATURE_MAPS = {
    "elu": lambda: "elu",
    "relu": lambda: "relu",
    "favor": lambda: FavorPositiveFeatures(8, 16, generator=torch.Generator().manual_seed(0)).double(),
}


@pytest.mark.parametrize("feature_map", list(FEATURE_MAPS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 7, 33])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_quadratic_reference(feature_map, causal, length, chunk_size, padded):
    q, k, v = qkv(length, length)
    mask = padding(2, length) if padded and length > 2 else None
    fm = FEATURE_MAPS[feature_map]()
    out = linear_attention(q, k, v, fm, causal, mask, chunk_size=chunk_size)
    torch.testing.assert_close(out, linear_attention_reference(q, k, v, fm, causal, mask), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("lengths", [(3, 10), (10, 3), (1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_lengths_bottom_right_aligned(lengths, causal):
    q, k, v = qkv(*lengths)
    mask = padding(2, lengths[1])
    out = linear_attention(q, k, v, "elu", causal, mask, chunk_size=4)
    torch.testing.assert_close(out, linear_attention_reference(q, k, v, "elu", causal, mask), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalizer", ["sum", "max_abs", "none"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_decayed_matches_reference(causal, normalizer, chunk_size, padded):
    q, k, v, raw = tensors((2, 3, 23, 8), (2, 3, 23, 8), (2, 3, 23, 6), (2, 3, 23), seed=1)
    log_decay = -torch.rand_like(raw) - raw.abs()  # gates from strong (e^-3) to none
    # "sum" needs positive features; the others run on raw dot products as retention does.
    phi_q, phi_k = (q.exp(), k.exp()) if normalizer == "sum" else (q, k)
    mask = padding(2, 23) if padded else None
    kwargs = dict(log_decay=log_decay, normalizer=normalizer)
    out = kernel_attention(phi_q, phi_k, v, causal, mask, chunk_size=chunk_size, **kwargs)
    ref = kernel_attention_reference(phi_q, phi_k, v, causal, mask, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_constant_decay_reference_is_gamma_to_the_distance():
    # Pins the reference itself to the textbook formula sum_j gamma^|i-j| (q_i . k_j) v_j.
    q, k, v = qkv(5, 5, batch=1, heads=1, dim=3)
    gamma = 0.8
    log_decay = torch.full((1, 1, 5), math.log(gamma), dtype=torch.float64)
    i = torch.arange(5)
    weights = (q @ k.transpose(-1, -2)) * gamma ** (i.view(-1, 1) - i.view(1, -1)).abs()
    ref = kernel_attention_reference(q, k, v, False, log_decay=log_decay, normalizer="none")
    torch.testing.assert_close(ref, weights @ v)
    causal = kernel_attention_reference(q, k, v, True, log_decay=log_decay, normalizer="none")
    torch.testing.assert_close(causal, weights.tril() @ v)


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_step_equals_parallel(decayed, scaled):
    q, k, v, raw, scale = tensors((2, 3, 19, 8), (2, 3, 19, 8), (2, 3, 19, 5), (2, 3, 19), (2, 3, 19), seed=2)
    phi_q, phi_k = q.exp(), k.exp()
    log_decay = -raw.abs() if decayed else None
    full = kernel_attention(phi_q, phi_k, v, True, log_decay=log_decay, chunk_size=4)
    # Keys given as features times exp(per-token scale), merged by the step's running scale.
    token_scale = 5.0 * scale.view(2, 3, 19, 1, 1)
    prompt = 7
    out, state = kernel_attention_prefill(
        phi_q[:, :, :prompt], phi_k[:, :, :prompt], v[:, :, :prompt],
        log_decay=None if log_decay is None else log_decay[:, :, :prompt], chunk_size=3,
    )
    outputs = [out]
    for t in range(prompt, 19):
        key = phi_k[:, :, t : t + 1]
        key_log_scale = None
        if scaled:
            key_log_scale = token_scale[:, :, t]
            key = key * torch.exp(-key_log_scale)
        out_t, state = kernel_attention_step(
            phi_q[:, :, t : t + 1], key, v[:, :, t : t + 1], state, key_log_scale=key_log_scale,
            log_decay_t=None if log_decay is None else log_decay[:, :, t : t + 1],
        )
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=2), full, atol=1e-12, rtol=1e-10)
    assert state["kv"].shape == (2, 3, 8, 6)  # constant size: (features, value dim + normaliser)


def test_padded_keys_leave_numerator_and_normaliser():
    q, k, v = qkv(6, 9, seed=3)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 6:] = True
    out = linear_attention(q, k, v, "elu", key_padding_mask=mask)
    # Same as attending over the unpadded keys only ...
    torch.testing.assert_close(out, linear_attention(q, k[:, :, :6], v[:, :, :6], "elu"), atol=1e-12, rtol=0)
    # ... whatever the padded positions hold, even inf and NaN.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] = math.inf
    v2[:, :, 6:] = math.nan
    torch.testing.assert_close(linear_attention(q, k2, v2, "elu", key_padding_mask=mask), out)


def test_fully_padded_row_outputs_zeros_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(4, 4))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True
    for causal in (False, True):
        out = linear_attention(q, k, v, "elu", causal, mask)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_large_norms_stay_finite(dtype, causal):
    # elu(x)+1 of entries ~100 summed over 4096 keys reaches ~1e8 per feature, beyond float16's 65504: the
    # float32 accumulation must absorb it. The output is a convex combination of v, so it fits.
    q, k, v = (100 * t for t in qkv(4096, 4096, batch=1, heads=2, dim=16, seed=4))
    out = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), "elu", causal)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = linear_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), "elu", causal)
    # float16 has a 2^-11 relative precision on inputs and output: compare against the scale of v.
    assert (out.double() - ref).abs().max() < 0.02 * v.abs().max()


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_sum_normaliser_without_gradient_equals_its_function(eps):
    """``normalize_output(.., "sum")`` without a gradient skips its autograd Function: the same outputs bit for
    bit, the guards included (a zero normaliser gives zeros; ``denominator_eps`` keeps magnitudes >= eps)."""
    num_den = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    num_den[0, 0, 0] = 0.0
    num_den[0, 0, 1, -1] = 0.1
    with_function = normalize_output(num_den.clone().requires_grad_(True), "sum", eps)
    assert with_function.grad_fn is not None
    with torch.no_grad():
        plain = normalize_output(num_den, "sum", eps)
    assert torch.equal(plain, with_function.detach()) and bool((plain[0, 0, 0] == 0).all())


def test_gradients_of_the_hand_written_paths():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        chunked = lambda a, b, c: linear_attention(a, b, c, "elu", causal, chunk_size=3)  # noqa: E731
        assert torch.autograd.gradcheck(chunked, (q, k, v))


@pytest.mark.parametrize("batch_heads, length, chunk, group_rows, n_groups", [
    ((2, 2), 11, 3, 6, 8),  # spans of two chunks per head, the last one ragged
    ((1, 2), 12, 3, 3, 8),  # one chunk per group
    ((1, 3), 12, 4, 12, 3),  # one whole sequence per group
    ((2, 3), 5, 2, 12, 3),  # two whole, ragged sequences per group
    ((2, 2), 5, 5, 1024, 1),  # everything in one group: nothing recomputed
])
@pytest.mark.parametrize("used", ["both", "outputs", "state"])
def test_chunked_backward_recomputes_exactly(monkeypatch, batch_heads, length, chunk, group_rows, n_groups, used):
    # The backward recomputes each group's chunk scores and states (but the last group's, which the forward
    # keeps) from q, k, v and the state saved at the group's start, and carries the later chunks' gradient
    # across groups: several groups, several chunks per group, ragged last chunks, an initial state, and the
    # gradient of the outputs, of the final state, or of both (the unused one arrives as None).
    monkeypatch.setattr(causal_chunks_module, "GROUP_ROWS", group_rows)
    assert len(causal_chunks_module._groups(batch_heads[0] * batch_heads[1], length, chunk)) == n_groups
    shapes = [(*batch_heads, length, 5), (*batch_heads, length, 5), (*batch_heads, length, 4), (*batch_heads, 5, 5)]
    q, k, v, initial = (t.requires_grad_() for t in tensors(*shapes, seed=6))

    def chunked(*args):
        out, final = _CausalChunks.apply(*args, chunk)
        return {"both": (out, final), "outputs": out, "state": final}[used]

    assert torch.autograd.gradcheck(chunked, (q, k, v, initial))
    # And the forward itself: outputs and final state against the quadratic form and a plain sum.
    with torch.no_grad():
        out, final = _CausalChunks.apply(q, k, v, initial, chunk)
        values = torch.cat([v, torch.ones(*batch_heads, length, 1, dtype=torch.float64)], dim=-1)
        expected = (q @ k.transpose(-1, -2)).tril() @ values + q @ initial
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(final, initial + k.transpose(-1, -2) @ values, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("group_rows", [8, 16, 4096])
def test_causal_groups_on_strided_inputs(monkeypatch, group_rows):
    # (batch, seq, heads, dim) inputs seen as (batch, heads, seq, dim): no group slice is a view, and groups
    # of one head's span, of whole sequences, or of everything must agree with the reference, gradients too.
    monkeypatch.setattr(causal_chunks_module, "GROUP_ROWS", group_rows)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 13, 2, 3, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = linear_attention(*leaves, "elu", True, chunk_size=4)
    torch.testing.assert_close(out, linear_attention_reference(q, k, v, "elu", True), atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, c: linear_attention(a, b, c, "elu", True, chunk_size=4), leaves)


@pytest.mark.parametrize("group_rows", [16, 1024])
def test_float32_chunk_states_keep_a_tiny_prefix_beside_a_large_own_term(monkeypatch, group_rows):
    # Keys of 1e-12 everywhere but one of 1 at position 23, the last of chunk 5: rows 20..22 see only tiny
    # keys, so their outputs rest on the state before chunk 5. Taken as "inclusive sum - own term" that state
    # is (tiny + 1) - 1, rounding noise of 1e-7, and those outputs were off by up to 1.4; an exclusive sum
    # proper keeps float32 within rounding of float64, forward and backward, whether the chunk states are
    # carried within one group or across groups of four chunks.
    monkeypatch.setattr(causal_chunks_module, "GROUP_ROWS", group_rows)
    g = torch.Generator().manual_seed(8)
    phi_q = torch.rand(1, 2, 64, 4, generator=g) + 0.5
    phi_k = 1e-12 * (torch.rand(1, 2, 64, 4, generator=g) + 0.5)
    phi_k[:, :, 23] = 1.0
    v, weights = torch.randn(1, 2, 64, 5, generator=g), torch.randn(1, 2, 64, 5, generator=g)

    def run(fn, dtype):
        inputs = [t.to(dtype).detach().requires_grad_() for t in (phi_q, phi_k, v)]
        out = fn(*inputs)
        (out * weights.to(dtype)).sum().backward()
        return [out.detach()] + [t.grad for t in inputs]

    got = run(lambda a, b, c: kernel_attention(a, b, c, True, chunk_size=4), torch.float32)
    expected = run(lambda a, b, c: kernel_attention_reference(a, b, c, True), torch.float64)
    for x, y in zip(got, expected):
        assert (x.double() - y).abs().max() < 1e-4 * y.abs().max()


def causal_with_poison(where, value, decayed, chunk_size=64, column=None):
    """Causal outputs over 200 positions with ``value`` written at position 150 of q, k, v or the log decay
    (in one column of v when ``column`` is given), and the outputs over the first 150 positions alone."""
    q, k, v, raw = tensors((1, 2, 200, 8), (1, 2, 200, 8), (1, 2, 200, 5), (1, 2, 200), seed=7)
    inputs = {"q": q.exp(), "k": k.exp(), "v": v, "log_decay": -raw.abs() if decayed else None}
    prefix = {name: None if x is None else x[:, :, :150] for name, x in inputs.items()}
    poisoned = inputs[where].clone()
    poisoned[:, :, 150, ...] = value
    if column is not None:
        poisoned[:, :, 150] = torch.where(torch.arange(5) == column, poisoned[:, :, 150], inputs[where][:, :, 150])
    inputs[where] = poisoned
    run = lambda x: kernel_attention(  # noqa: E731
        x["q"], x["k"], x["v"], True, log_decay=x["log_decay"], chunk_size=chunk_size
    )
    return run(inputs), run(prefix)


@pytest.mark.parametrize(
    "decayed, where, value",
    [(decayed, where, value) for decayed in (False, True) for where in ("q", "k") for value in (math.nan, math.inf)]
    + [(True, "log_decay", math.nan)],  # log decays are <= 0: only a NaN one is out of range
)
def test_non_finite_query_key_or_decay_reaches_no_earlier_output(decayed, where, value):
    # Position 150 shares its chunk (128..191) with the earlier positions 128..149. With a decay, a future
    # key's weight used to be exp(-inf) = 0 times q.k = NaN (or inf): a NaN in every earlier row of the chunk.
    # Now the outputs before 150 are those of the first 150 positions alone, as incremental decoding gives.
    out, prefix = causal_with_poison(where, value, decayed)
    assert torch.isfinite(out[:, :, :150]).all()
    torch.testing.assert_close(out[:, :, :150], prefix, atol=1e-12, rtol=1e-12)
    assert not torch.isfinite(out[:, :, 150]).all()


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_value_reaches_earlier_outputs_of_its_chunk_only(decayed, value):
    # The remaining, documented leak: the intra-chunk product multiplies the zero weight of a future value by
    # that value, and 0 * NaN = 0 * inf = NaN. A non-finite entry of v at position 150 (column 2 here) makes
    # column 2 of the outputs 128..149 (the earlier positions of its chunk) NaN; earlier chunks, the other
    # columns and the normaliser are untouched. (SDPA's exact softmax leaks such a value into every earlier
    # position.)
    out, prefix = causal_with_poison("v", value, decayed, column=2)
    torch.testing.assert_close(out[:, :, :128], prefix[:, :, :128], atol=1e-12, rtol=1e-12)
    assert torch.isnan(out[:, :, 128:150, 2]).all()
    others = [0, 1, 3, 4]
    torch.testing.assert_close(out[:, :, :150, others], prefix[..., others], atol=1e-12, rtol=1e-12)
    # One-position chunks have no future position inside a chunk: no leak at all, at the cost of speed.
    out, prefix = causal_with_poison("v", value, decayed, chunk_size=1, column=2)
    torch.testing.assert_close(out[:, :, :150], prefix, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(normalizer="softmax"), "normalizer"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(log_decay=torch.zeros(2, 3, 4, dtype=torch.float64)), "log_decay must have shape"),
        (dict(denominator_eps=-1.0), "denominator_eps"),
    ],
)
def test_bad_input_names_the_option(kwargs, match):
    q, k, v = qkv(5, 5)
    with pytest.raises(ValueError, match=match):
        kernel_attention(q.exp(), k.exp(), v, True, **kwargs)


def test_decay_needs_one_sequence():
    q, k, v = qkv(3, 5)
    with pytest.raises(ValueError, match="log_decay"):
        kernel_attention(q, k, v, True, log_decay=torch.zeros(2, 3, 5, dtype=torch.float64))


def test_bad_feature_map_and_shapes():
    q, k, v = qkv(3, 5)
    with pytest.raises(ValueError, match="feature_map"):
        linear_attention(q, k, v, "softmax")
    with pytest.raises(ValueError, match="key_padding_mask"):
        linear_attention(q, k, v, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="head_dim"):
        linear_attention(q, k[..., :4], v)


@pytest.mark.parametrize("decayed", [False, True])
def test_references_keep_what_padded_keys_hold_out_of_real_rows(decayed):
    """The quadratic references zero the padded keys' features and values before weighting them: a zero
    weight times a padded NaN would otherwise still be NaN in every row (kernel and shrunk references)."""
    from attnzoo.functional import shrunk_kernel_attention_reference

    phi_q, phi_k, v = (x.abs() for x in qkv(6, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, -1] = True
    nan_k = phi_k.masked_fill(mask[:, None, :, None], math.nan)
    nan_v = v.masked_fill(mask[:, None, :, None], math.nan)
    log_decay = torch.full((2, 3, 6), -0.3, dtype=torch.float64) if decayed else None
    clean = kernel_attention_reference(phi_q, phi_k, v, True, mask, log_decay=log_decay)
    dirty = kernel_attention_reference(phi_q, nan_k, nan_v, True, mask, log_decay=log_decay)
    torch.testing.assert_close(dirty[0, :, 2:], clean[0, :, 2:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dirty[1], clean[1], rtol=1e-12, atol=1e-12)
    second_half = torch.arange(8) >= 4
    clean = shrunk_kernel_attention_reference(phi_q, phi_k, v, second_half, mask)
    dirty = shrunk_kernel_attention_reference(phi_q, nan_k, nan_v, second_half, mask)
    torch.testing.assert_close(dirty, clean, rtol=1e-12, atol=1e-12)

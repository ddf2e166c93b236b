"""Exact softmax attention: fast path against the float64 reference, masking rules, quiet softmax."""

import pytest
import torch

from attnzoo.functional import causal_allowed, softmax_attention, softmax_attention_reference


def qkv(batch=2, heads=3, q_len=5, k_len=7, dim=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(batch, heads, n, dim, generator=g, dtype=dtype) for n in (q_len, k_len, k_len))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize("lengths", [(6, 6), (1, 9), (4, 9), (9, 4)])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_path_matches_reference(causal, quiet, lengths, padded):
    q, k, v = qkv(q_len=lengths[0], k_len=lengths[1])
    mask = None
    if padded:
        mask = torch.zeros(2, lengths[1], dtype=torch.bool)
        mask[0, -2:] = True
        mask[1, 0] = True
    out = softmax_attention(q, k, v, causal, mask, quiet=quiet)
    ref = softmax_attention_reference(q, k, v, causal, mask, quiet=quiet)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_causal_alignment_is_bottom_right():
    allowed = causal_allowed(2, 5)
    assert allowed.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # Decoding case: the last query sees every key, and equals full attention for that row.
    q, k, v = qkv(q_len=3, k_len=6)
    out = softmax_attention(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, -1:], softmax_attention(q[:, :, -1:], k, v))


def test_fully_padded_row_gives_zeros_and_finite_gradients():
    q, k, v = (t.float().requires_grad_() for t in qkv(q_len=4, k_len=4))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True  # every key of batch 1 is padding
    out = softmax_attention(q, k, v, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_causal_with_more_queries_than_keys_zeroes_rows_that_see_nothing():
    q, k, v = qkv(q_len=5, k_len=3)
    out = softmax_attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))


def test_quiet_softmax_can_attend_to_nothing():
    q, k, v = qkv(q_len=1, k_len=4)
    # Keys pointing away from the query give very negative logits: quiet softmax outputs ~0, plain does not.
    k = -q.expand(-1, -1, 4, -1) * 50
    plain = softmax_attention(q, k, v)
    quiet = softmax_attention(q, k, v, quiet=True)
    assert quiet.abs().max() < 1e-6
    assert plain.abs().max() > 1e-2
    # With large positive logits the two agree.
    k = q.expand(-1, -1, 4, -1) * 50
    torch.testing.assert_close(softmax_attention(q, k, v, quiet=True), softmax_attention(q, k, v))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=torch.randn(2, 5, 8)), "q must have shape"),
        (dict(k=torch.randn(2, 4, 7, 8)), "number of heads"),
        (dict(k=torch.randn(2, 3, 7, 6)), "head_dim"),
        (dict(v=torch.randn(2, 3, 6, 8)), "sequence length"),
        (dict(key_padding_mask=torch.zeros(2, 6, dtype=torch.bool)), "key_padding_mask must have shape"),
        (dict(key_padding_mask=torch.zeros(2, 7)), "bool"),
        (dict(v=torch.randn(2, 3, 7, 8, dtype=torch.float64)), "dtype"),
    ],
)
def test_bad_input_names_the_argument(bad, match):
    args = dict(q=torch.randn(2, 3, 5, 8), k=torch.randn(2, 3, 7, 8), v=torch.randn(2, 3, 7, 8), key_padding_mask=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        softmax_attention(**args)

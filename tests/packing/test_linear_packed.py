"""The causal kernelized path over a packed row (``cu_seqlens``): the undecayed hand-written form and the plain
autograd form (used with a decay and under ``torch.compile``) give each document what it gets alone, forward
and gradients, across chunk and group boundaries; float32 keeps each document's accuracy at a long row; a
non-finite input stays in its document."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo.functional.linear.causal_chunks as causal_chunks_module
from attnzoo.functional.linear.chunk import _chunked_causal, kernel_attention_unchecked
from attnzoo.functional.linear.packed import (
    _packed_autograd,
    packed_causal_kernel_attention_unchecked,
    packed_causal_unnormalised,
    packed_masks,
)
from attnzoo.functional.linear.packed_chunks import scan_steps

# Rows with documents of one position, documents crossing several chunks, starting on a chunk boundary and
# ending the row mid-chunk.
ROWS = [
    (300, [(0, 5), (5, 70), (70, 200), (200, 201), (201, 300)], 16),
    (128, [(0, 64), (64, 128)], 64),
    (10, [(0, 10)], 64),
    (257, [(0, 1), (1, 257)], 8),
    (48, [(i, i + 1) for i in range(48)], 8),
    (100, [(0, 3), (3, 100)], 1),
]


def inputs(n, seed=0, log_decay=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64).abs().requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64, requires_grad=True)
    decay = -torch.rand(2, 3, n, generator=g, dtype=torch.float64) if log_decay else None
    return q, k, v, decay, torch.randn(2, 3, n, 6, generator=g, dtype=torch.float64)


def alone(q, k, v, log_decay, spans, chunk):
    """Each document through the unpacked chunked path, concatenated."""
    return torch.cat([
        _chunked_causal(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None if log_decay is None else log_decay[:, :, s:e],
                        chunk, None)[0]
        for s, e in spans
    ], dim=2)


def assert_same_with_gradients(out, expected, grad, tensors):
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    for got, want in zip(torch.autograd.grad((out * grad).sum(), tensors),
                         torch.autograd.grad((expected * grad).sum(), tensors)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("group_rows", [64, 8192])
@pytest.mark.parametrize("n, spans, chunk", ROWS)
def test_undecayed_packed_path_equals_documents_alone(monkeypatch, group_rows, n, spans, chunk):
    # 64 rows: a head's row split over several groups, documents crossing groups.
    monkeypatch.setattr(causal_chunks_module, "GROUP_ROWS", group_rows)
    q, k, v, _, grad = inputs(n)
    out = packed_causal_unnormalised(q, k, v, None, spans, chunk)
    assert_same_with_gradients(out, alone(q, k, v, None, spans, chunk), grad, (q, k, v))


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("n, spans, chunk", ROWS)
def test_autograd_packed_path_equals_documents_alone(decayed, n, spans, chunk):
    q, k, v, log_decay, grad = inputs(n, log_decay=decayed)
    size = min(chunk, n)
    masks = packed_masks(spans, math.ceil(n / size), size, q.device)
    out = _packed_autograd(q, k, v, log_decay, masks, scan_steps(spans, size))
    assert_same_with_gradients(out, alone(q, k, v, log_decay, spans, chunk), grad, (q, k, v))


def test_float32_keeps_each_documents_accuracy_at_a_long_row():
    # Short documents after long ones: a prefix of the row minus the prefix at the document start would lose
    # them to rounding (their sums are small beside the prefix). Each document's float32 error is the one it
    # has alone.
    n = 16384
    spans = [(0, 8000), (8000, 16000), (16000, 16003), (16003, 16100), (16100, n)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1

    def packed(a, b, c):
        return packed_causal_kernel_attention_unchecked(a, b, c, spans, None, "sum", 64, 0.0)

    def documents_alone(a, b, c):
        return torch.cat([kernel_attention_unchecked(a[:, :, s:e], b[:, :, s:e], c[:, :, s:e], True, None, None,
                                                     "sum", 64, 0.0) for s, e in spans], dim=2)

    exact = packed(phi_q, phi_k, v)
    rounded = packed(phi_q.float(), phi_k.float(), v.float()).double()
    rounded_alone = documents_alone(phi_q.float(), phi_k.float(), v.float()).double()
    for s, e in spans:
        error = (rounded - exact)[:, :, s:e].abs().amax()
        error_alone = (rounded_alone - exact)[:, :, s:e].abs().amax()
        assert error <= 2 * error_alone + 1e-7, (s, e, error, error_alone)


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_features_stay_in_their_document(decayed, bad):
    # Features only: a non-finite value reaches the earlier rows of its chunk, as in the unpacked path
    # (functional.linear.chunk, "Non-finite inputs"), and here those may be a later document's.
    n, chunk, spans = 40, 8, [(0, 13), (13, 27), (27, 40)]
    q, k, v, log_decay, _ = inputs(n, log_decay=decayed)
    q, k, v = (x.detach().clone() for x in (q, k, v))
    q[:, :, 12], k[:, :, 12] = bad, bad  # the last position of the first document, mid-chunk
    size = min(chunk, n)
    masks = packed_masks(spans, math.ceil(n / size), size, q.device)
    outputs = [_packed_autograd(q, k, v, log_decay, masks, scan_steps(spans, size))]
    if not decayed:
        outputs.append(packed_causal_unnormalised(q, k, v, None, spans, chunk))
    for out in outputs:
        assert torch.isfinite(out[:, :, 13:]).all()
        torch.testing.assert_close(out[:, :, 13:], alone(q, k, v, log_decay, spans[1:], chunk), rtol=0,
                                   atol=1e-10)

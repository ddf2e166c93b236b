"""Packed rows (cu_seqlens) on the fixed sparse patterns: every pattern's packed plan gives each document the
dense reference of that document alone, whatever the lengths against the blocks; longformer's global positions
per document; bigbird's max_length per document; nothing N x N."""

from __future__ import annotations

import pytest
import torch

from attnzoo.functional.blocksparse import (
    BigBirdPattern,
    DilatedPattern,
    FixedPattern,
    LocalPattern,
    LongformerPattern,
    SinkLocalPattern,
    StridedPattern,
    blocksparse_attention_reference,
    packed_blocksparse_attention_unchecked,
    packed_blocksparse_plan,
)
from attnzoo.mechanisms import UnsupportedOptionError, build_mechanism
from tensor_records import TensorRecorder

# Block size 3: lengths 1..7 start and end at every offset within a block, and repeat (batched by length); the
# long ones run blockwise even where short documents run densely (dense_when_cheaper).
LENGTHS = (1, 2, 3, 4, 5, 40, 6, 7, 5, 1, 8, 3, 41)
PATTERNS = [
    LocalPattern(4, 3),
    SinkLocalPattern(4, 3, 3),
    DilatedPattern(3, 3),  # its blocks shrink on short documents
    StridedPattern(3, 3),  # two parts, merged
    FixedPattern(4, 2, 3),
    LongformerPattern(3, 2, 3),  # dense global rows per document
    BigBirdPattern(3, 1, 1, torch.randint(0, 1 << 30, (14, 2), generator=torch.Generator().manual_seed(0))),
]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def spans(lengths):
    ends = offsets(lengths).tolist()
    return list(zip(ends, ends[1:]))


def row(length, heads=2, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, length, dim, generator=generator, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dense_when_cheaper", [False, True])
def test_each_document_gets_its_reference_alone(pattern, causal, dense_when_cheaper):
    q, k, v = row(sum(LENGTHS))
    plan = packed_blocksparse_plan(pattern, spans(LENGTHS), causal, q.device, dense_when_cheaper=dense_when_cheaper)
    assert (plan.dense != ()) == dense_when_cheaper
    if type(pattern) is LocalPattern:  # short documents dense, long ones blockwise, in one row
        assert plan.blocks is not None and plan.blockwise is not None or not dense_when_cheaper
    out = packed_blocksparse_attention_unchecked(q, k, v, plan, None)
    for start, end in spans(LENGTHS):
        alone = blocksparse_attention_reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], pattern,
                                                causal)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=0, atol=1e-10)


def test_a_pattern_that_ignored_documents_would_fail():
    # The same row as one sequence: documents see each other, and the check above tells.
    q, k, v = row(sum(LENGTHS))
    whole = blocksparse_attention_reference(q, k, v, LocalPattern(4, 3))
    start, end = spans(LENGTHS)[4]
    alone = blocksparse_attention_reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                            LocalPattern(4, 3))
    assert (whole[:, :, start:end] - alone).abs().max() > 1e-3


# -- the mechanisms ---------------------------------------------------------------------------------------------
def packed_and_alone(mechanism, lengths, causal, **call):
    q, k, v = row(sum(lengths), mechanism.heads, mechanism.head_dim, seed=2)
    mask = call.pop("global_mask", None)
    packed = mechanism(q, k, v, causal, cu_seqlens=offsets(lengths), **({} if mask is None else {"global_mask": mask}))
    for start, end in spans(lengths):
        extra = {} if mask is None else {"global_mask": mask[:, start:end]}
        alone = mechanism(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal, **extra)
        torch.testing.assert_close(packed[:, :, start:end], alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("projections", [False, True])
def test_longformer_global_positions_are_each_documents_own(causal, projections):
    mechanism = build_mechanism("longformer", 2, 4, window=2, global_tokens=2, global_indices=(-1,),
                                global_projections=projections, block_size=3).double()
    if projections:
        with torch.no_grad():
            for weight in mechanism.projections():
                weight.add_(0.3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5),
                                              dtype=torch.float64))
    lengths = (4, 9, 2, 7, 9)
    mask = torch.zeros(1, sum(lengths), dtype=torch.bool)
    mask[0, [6, 9, 25]] = True  # a call's own global positions, in the second and last documents
    packed_and_alone(mechanism, lengths, causal)
    packed_and_alone(mechanism, lengths, causal, global_mask=mask)


def test_longformer_refuses_a_document_its_global_indices_miss():
    mechanism = build_mechanism("longformer", 2, 4, window=2, global_indices=(3,)).double()
    q, k, v = row(9)
    with pytest.raises(UnsupportedOptionError, match=r"global_indices \[3\].*document \[6, 9\)"):
        mechanism(q, k, v, cu_seqlens=offsets((6, 3)))


def test_bigbird_max_length_binds_each_document_not_the_row():
    mechanism = build_mechanism("bigbird", 2, 4, block_size=2, random_blocks=2, max_seq_len=8).double()
    packed_and_alone(mechanism, (8, 5, 8, 3), False)  # a row of 24 positions, each document within 8
    q, k, v = row(12)
    with pytest.raises(UnsupportedOptionError, match="max_length=8"):
        mechanism(q, k, v, cu_seqlens=offsets((3, 9)))


@pytest.mark.parametrize("name", ["local", "strided", "longformer", "bigbird"])
def test_refusals_name_the_argument(name):
    mechanism = build_mechanism(name, 2, 4).double()
    q, k, v = row(6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mechanism(q, k, v, cu_seqlens=torch.tensor([0, 4, 3, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        mechanism(q, k, v, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mechanism(q, k, v, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool), cu_seqlens=offsets((2, 4)))


# -- memory: nothing N x N ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options", [
    ("local", {"window": 16, "block_size": 8}),
    ("strided", {"pattern": "strided", "stride": 32, "block_size": 8}),
    ("longformer", {"window": 16, "global_tokens": 2, "block_size": 8}),
    ("bigbird", {"block_size": 8, "random_blocks": 2}),
])
def test_packed_rows_make_nothing_n_by_n(name, options):
    lengths = (700, 1, 333, 1000, 13, 1001)  # 3048 positions
    n = sum(lengths)
    mechanism = build_mechanism(name, 1, 4, **options)
    q, k, v = (t.float().requires_grad_() for t in row(n, 1, 4))
    with TensorRecorder() as probe:
        mechanism(q, k, v, name != "bigbird", cu_seqlens=offsets(lengths)).sum().backward()
    assert probe.largest < n * n // 16, (probe.largest, n * n)

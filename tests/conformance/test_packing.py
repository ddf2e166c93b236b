"""Packed batches (``cu_seqlens``) against the contract, for every registered mechanism.

A mechanism declaring ``capabilities.packing`` gives, for each document of a packed row, exactly what it
gives that document alone (float64, 1e-10), forward and gradients, causal and not as declared; one that does
not declare it refuses ``cu_seqlens`` naming it. Toys broken in the ways packing goes wrong show the check can
fail.
"""

import inspect
from typing import List, Tuple

import pytest
import torch
from torch import Tensor

import attnzoo
from attnzoo import MultiHeadAttention
from attnzoo.mechanisms import Mechanism, SoftmaxAttention, UnsupportedOptionError, mechanism_class
from attnzoo.mechanisms.base import shapes_only

from . import checks

# Lengths 1, 5, 3, 8 in a row of 17 (offsets 0, 1, 6, 9, 17): a document of one position, and documents that
# start inside a chunk or block of 2, 4 or 8 (every chunk size the test options use) and end inside another.
DOCUMENT_LENGTHS = (1, 5, 3, 8)
# Repeated lengths, which a split mechanism runs as one batch per length: documents must not see each other there.
REPEATED_LENGTHS = (2, 3, 2, 3, 2)
EXACT = {"rtol": 0.0, "atol": 1e-10}

MECHANISMS = attnzoo.available()
CASES = [(name, options) for name in MECHANISMS
         for options in (mechanism_class(name).test_options, *mechanism_class(name).test_variants)]
IDS = [f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in CASES]


def offsets(lengths: Tuple[int, ...]) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def spans(lengths: Tuple[int, ...]) -> List[Tuple[int, int]]:
    ends = offsets(lengths).tolist()
    return list(zip(ends, ends[1:]))


def _forward_and_grads(mechanism: Mechanism, qkv, causal: bool, weights: Tensor, **packed) -> Tuple[Tensor, ...]:
    leaves = [x.detach().clone().requires_grad_(True) for x in qkv]
    out = mechanism(*leaves, causal, **packed)
    (out * weights).sum().backward()
    return (out.detach(), *(x.grad for x in leaves))


def check_packing(mechanism: Mechanism, lengths: Tuple[int, ...] = DOCUMENT_LENGTHS) -> None:
    """Each document of a packed row gets what it gets alone, forward and gradients; or, undeclared, refused.
    Length limits bind each document, not the row: the row may be longer than ``max_length``."""
    caps = mechanism.capabilities
    if not caps.packed:
        expect_refused(mechanism)
        return
    refused_alone = [length for length in lengths if mechanism.unsupported_reasons(
        *shapes_only(1, mechanism.heads, length, length, mechanism.head_dim))]
    if refused_alone:  # a row holding a document refused alone is refused; the others are checked
        qkv = checks.random_qkv(mechanism, 1, sum(lengths), sum(lengths), torch.float64, seed=3)
        checks.expect_error(lambda: mechanism(*qkv, cu_seqlens=offsets(lengths)), UnsupportedOptionError, r".",
                            f"{type(mechanism).__name__}: a packed document of a length refused alone")
        lengths = tuple(length for length in lengths if length not in refused_alone)
        if not lengths:
            return
    n = sum(lengths)
    qkv = checks.random_qkv(mechanism, 1, n, n, torch.float64, seed=3)
    weights = torch.randn(1, mechanism.heads, n, mechanism.head_dim, generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)
    for causal in checks.causal_settings(mechanism):
        packed = _forward_and_grads(mechanism, qkv, causal, weights, cu_seqlens=offsets(lengths))
        for start, end in spans(lengths):
            piece = [x[:, :, start:end] for x in qkv]
            alone = _forward_and_grads(mechanism, piece, causal, weights[:, :, start:end])
            for what, got, want in zip(("output", "dq", "dk", "dv"), packed, alone):
                checks.assert_close(got[:, :, start:end], want, f"{type(mechanism).__name__} causal={causal}: "
                                    f"{what} of document [{start}, {end}) packed vs alone", **EXACT)
        reference = mechanism.reference_packed(*qkv, causal, cu_seqlens=offsets(lengths))
        checks.assert_close(packed[0], reference, f"{type(mechanism).__name__} causal={causal}: packed vs "
                            f"reference_packed", **checks.TIGHT)


def expect_refused(mechanism: Mechanism) -> None:
    """Undeclared packing is refused naming cu_seqlens, by the mechanism and by MultiHeadAttention."""
    n = checks.fit(mechanism, sum(DOCUMENT_LENGTHS))  # lengths it takes unpacked: refused for packing alone
    cu = offsets((n // 2, n - n // 2) if n > 1 else (n,))
    qkv = checks.random_qkv(mechanism, 1, n, n, torch.float64, seed=3)
    where = f"{type(mechanism).__name__} (packing={mechanism.capabilities.packing!r})"
    if "cu_seqlens" in inspect.signature(mechanism.forward).parameters:
        checks.expect_error(lambda: mechanism(*qkv, cu_seqlens=cu), UnsupportedOptionError, r"cu_seqlens",
                            f"{where}: forward(cu_seqlens=...)")
    layer = MultiHeadAttention(8, mechanism.heads, head_dim=mechanism.head_dim).double()
    layer.mechanism = mechanism  # this instance, options and all
    x = torch.randn(1, n, layer.dim, dtype=torch.float64)
    checks.expect_error(lambda: layer(x, cu_seqlens=cu), UnsupportedOptionError, r"cu_seqlens",
                        f"{where}: MultiHeadAttention(cu_seqlens=...)")


@pytest.mark.parametrize("name, options", CASES, ids=IDS)
def test_packed_documents_equal_documents_alone(name, options):
    check_packing(checks.build(name, options=options))


@pytest.mark.parametrize("name, options", [case for case in CASES if attnzoo.capabilities(case[0]).packed],
                         ids=[i for i, case in zip(IDS, CASES) if attnzoo.capabilities(case[0]).packed])
def test_documents_of_equal_length_stay_apart(name, options):
    check_packing(checks.build(name, options=options), REPEATED_LENGTHS)


def refused_short_lengths(mechanism: Mechanism, longest: int = 8) -> List[int]:
    """The lengths up to ``longest`` this instance refuses alone (a rule a short document breaks)."""
    causal = checks.causal_settings(mechanism)[0]
    return [length for length in range(1, longest + 1) if mechanism.unsupported_reasons(
        *shapes_only(1, mechanism.heads, length, length, mechanism.head_dim), causal)]


def check_short_document_refused_as_alone(mechanism: Mechanism) -> None:
    """A packed row whose one short document is refused alone is refused with that document's own error
    (type and message), naming the document of ``cu_seqlens``, whichever document is the longest."""
    refused = refused_short_lengths(mechanism)
    accepted = max(length for length in range(1, 9) if length not in refused)
    for short in refused:
        qkv = checks.random_qkv(mechanism, 1, accepted + short, accepted + short, torch.float64, seed=3)
        causal = checks.causal_settings(mechanism)[0]
        with pytest.raises(ValueError) as alone:
            mechanism(*(x[:, :, accepted:] for x in qkv), causal=causal)
        with pytest.raises(ValueError) as packed:
            mechanism(*qkv, causal=causal, cu_seqlens=offsets((accepted, short)))
        where = f"{type(mechanism).__name__}: documents ({accepted}, {short}) packed"
        assert type(packed.value) is type(alone.value), f"{where}: {type(packed.value)} vs {type(alone.value)} alone"
        assert str(alone.value) in str(packed.value), f"{where}: {packed.value!r} lacks what alone says, {alone.value!r}"
        assert f"document [{accepted}, {accepted + short}) of cu_seqlens" in str(packed.value), \
            f"{where}: {packed.value!r} does not name the document"


SHORT_REFUSED = [(name, options) for name, options in CASES if attnzoo.capabilities(name).packed
                 and refused_short_lengths(checks.build(name, options=options))]


def test_some_mechanism_refuses_a_short_document():
    """What the next test checks exists (longformer's global_indices name positions a short document lacks)."""
    assert SHORT_REFUSED


@pytest.mark.parametrize("name, options", SHORT_REFUSED, ids=[IDS[CASES.index(case)] for case in SHORT_REFUSED])
def test_a_short_document_is_refused_as_it_is_alone(name, options):
    check_short_document_refused_as_alone(checks.build(name, options=options))


@pytest.mark.parametrize("name", ["softmax", "linear", "rfa", "retention", "gla", "local", "strided", "longformer",
                                  "bigbird"])
def test_packs_natively(name):
    assert attnzoo.capabilities(name).packing == "native"


# -- the check can fail ----------------------------------------------------------------------------------
class Toy(SoftmaxAttention):
    name = "packing-toy"


class AttendsAcrossDocuments(Toy):
    """Ignores the documents: the whole row attends to itself."""

    def attend_packed(self, q, k, v, causal, spans):
        return self.attend(q, k, v, causal, None, False)


class LeaksOneKey(Toy):
    """Each document also sees the row's first key (a state not reset at document starts)."""

    def attend_packed(self, q, k, v, causal, spans):
        pieces = []
        for start, end in spans:
            keys = torch.cat([k[:, :, :1], k[:, :, start:end]], dim=2) if start else k[:, :, start:end]
            values = torch.cat([v[:, :, :1], v[:, :, start:end]], dim=2) if start else v[:, :, start:end]
            pieces.append(self.attend(q[:, :, start:end], keys, values, False, None, True))
        return torch.cat(pieces, dim=2)


class UndeclaredButAccepts(Toy):
    """Declares no packing, yet runs packed rows (as if it were split)."""

    capabilities = SoftmaxAttention.capabilities.__class__(
        **{**SoftmaxAttention.capabilities.as_dict(), "packing": "none"})

    def check_packing(self, q, key_padding_mask, cross, cu_seqlens):
        return spans(DOCUMENT_LENGTHS)


class MixesBatchRows(Toy):
    """Split, but each row's values leak into the other rows of its batch (documents of one length batched)."""

    capabilities = SoftmaxAttention.capabilities.__class__(
        **{**SoftmaxAttention.capabilities.as_dict(), "packing": "split"})
    attend_packed = Mechanism.attend_packed

    def attend(self, q, k, v, causal, key_padding_mask, cross):
        out = super().attend(q, k, v, causal, key_padding_mask, cross)
        return out + v.mean(0, keepdim=True) - v  # nothing added to a batch of one


def test_good_toy_passes():
    check_packing(Toy(checks.HEADS, checks.HEAD_DIM).double())


@pytest.mark.parametrize("toy", [AttendsAcrossDocuments, LeaksOneKey, UndeclaredButAccepts])
def test_broken_toys_fail(toy):
    with pytest.raises(AssertionError):
        check_packing(toy(checks.HEADS, checks.HEAD_DIM).double())


def test_batching_toy_fails_only_with_equal_lengths():
    toy = MixesBatchRows(checks.HEADS, checks.HEAD_DIM).double()
    check_packing(toy)  # distinct lengths: every batch holds one document
    with pytest.raises(AssertionError):
        check_packing(toy, REPEATED_LENGTHS)

"""Packed batches (``cu_seqlens``): malformed offsets and unsupported combinations are refused, naming
``cu_seqlens``, before any computation; the functional and layer forms agree with documents run alone."""

import dataclasses

import pytest
import torch

import attnzoo
from attnzoo import MultiHeadAttention, UnsupportedOptionError
from attnzoo.functional.packing import check_cu_seqlens
from attnzoo.functional.softmax import packed_softmax_attention, softmax_attention

HEADS, HEAD_DIM, LENGTH = 2, 4, 9


def qkv(batch=1, length=LENGTH, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator, dtype=dtype) for _ in range(3))


def offsets(*values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize(
    "cu_seqlens, error, message",
    [
        (offsets(1, 4, LENGTH), ValueError, r"cu_seqlens must start at 0, got 1"),
        (offsets(0, 5, 3, LENGTH), ValueError, r"cu_seqlens must be strictly increasing.*5 then 3"),
        (offsets(0, 4, 4, LENGTH), ValueError, r"cu_seqlens must be strictly increasing.*4 then 4"),
        (offsets(0, 4, LENGTH - 1), ValueError, rf"cu_seqlens must end at the row length {LENGTH}, got {LENGTH - 1}"),
        (offsets(0, 4, LENGTH + 1), ValueError, rf"cu_seqlens must end at the row length {LENGTH}"),
        (torch.tensor([0.0, 4.0, LENGTH]), TypeError, r"cu_seqlens must be int64.*float32"),
        (torch.tensor([0, 4, LENGTH], dtype=torch.int32), TypeError, r"cu_seqlens must be int64.*int32"),
        (offsets(0, 4, LENGTH).view(1, 3), ValueError, r"cu_seqlens must be 1-D.*\(1, 3\)"),
        (offsets(0), ValueError, r"cu_seqlens must be 1-D with at least two offsets"),
        ([0, 4, LENGTH], TypeError, r"cu_seqlens must be an int64 tensor.*list"),
    ],
)
@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_malformed_offsets_are_refused_naming_cu_seqlens(name, cu_seqlens, error, message):
    mechanism = attnzoo.build_mechanism(name, HEADS, HEAD_DIM).double()
    with pytest.raises(error, match=message):
        mechanism(*qkv(), cu_seqlens=cu_seqlens)
    with pytest.raises(error, match=message):
        packed_softmax_attention(*qkv(), cu_seqlens)


def test_batch_over_one_is_refused_naming_cu_seqlens():
    mechanism = attnzoo.build_mechanism("softmax", HEADS, HEAD_DIM).double()
    with pytest.raises(ValueError, match=r"cu_seqlens .* one packed row: the batch must be 1, got batch 2"):
        mechanism(*qkv(batch=2), cu_seqlens=offsets(0, 4, LENGTH))


def test_offsets_on_another_device_are_refused():
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta, the inputs on cpu"):
        check_cu_seqlens(offsets(0, LENGTH).to("meta"), 1, LENGTH, torch.device("cpu"))


def test_cross_attention_and_padding_are_refused_with_cu_seqlens():
    mechanism = attnzoo.build_mechanism("softmax", HEADS, HEAD_DIM).double()
    with pytest.raises(UnsupportedOptionError, match=r"cu_seqlens .* cross=True"):
        mechanism(*qkv(), cross=True, cu_seqlens=offsets(0, 4, LENGTH))
    mask = torch.zeros(1, LENGTH, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"cu_seqlens and key_padding_mask"):
        mechanism(*qkv(), key_padding_mask=mask, cu_seqlens=offsets(0, 4, LENGTH))


def test_undeclared_packing_is_refused_before_projecting():
    layer = MultiHeadAttention(8, 2, "linformer", max_seq_len=LENGTH, rank=4).double()
    x = torch.randn(1, LENGTH, 8, dtype=torch.float64)
    with pytest.raises(UnsupportedOptionError, match=r"linformer does not take cu_seqlens"):
        layer(x, cu_seqlens=offsets(0, 4, LENGTH))
    with pytest.raises(UnsupportedOptionError, match=r"cu_seqlens .* context"):
        MultiHeadAttention(8, 2).double()(x, x, cu_seqlens=offsets(0, 4, LENGTH))


def test_capabilities_refuse_an_unknown_packing():
    with pytest.raises(ValueError, match=r"packing must be one of native, split, none, got 'sometimes'"):
        caps = attnzoo.capabilities("softmax")
        type(caps)(**{**caps.as_dict(), "packing": "sometimes"})


@pytest.mark.parametrize("causal", [False, True])
def test_packed_softmax_equals_each_document_alone(causal):
    q, k, v = qkv()
    cu = offsets(0, 2, 3, 7, LENGTH)  # lengths 2, 1, 4, 2: two documents of one length share one call
    out = packed_softmax_attention(q, k, v, cu, causal)
    ends = cu.tolist()
    for start, end in zip(ends, ends[1:]):
        alone = softmax_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_layer_with_rotary_gives_each_document_what_it_gets_alone(name):
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, name, rotary=True).double()
    x = torch.randn(1, LENGTH, 8, dtype=torch.float64)
    out = layer(x, causal=True, cu_seqlens=offsets(0, 4, LENGTH))
    torch.testing.assert_close(out[:, :4], layer(x[:, :4], causal=True), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 4:], layer(x[:, 4:], causal=True), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64])
@pytest.mark.parametrize("gated", [False, True])
def test_kernelized_state_resets_at_document_starts_for_any_chunk_size(chunk_size, gated):
    mechanism = attnzoo.build_mechanism("rfa", HEADS, HEAD_DIM, nb_features=16, seed=0, gated=gated,
                                        chunk_size=chunk_size).double()
    q, k, v = qkv()
    cu = offsets(0, 1, 6, 7, LENGTH)
    out = mechanism(q, k, v, True, cu_seqlens=cu)
    ends = cu.tolist()
    for start, end in zip(ends, ends[1:]):
        alone = mechanism(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], True)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "linear", "rfa", "local"])
def test_prefill_of_a_packed_row_returns_one_state_per_document(name):
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, name, rotary=True).double()
    x = torch.randn(1, LENGTH + 1, 8, dtype=torch.float64)
    out, states = layer.prefill_packed(x[:, :LENGTH], offsets(0, 4, LENGTH))
    assert [state.position for state in states] == [4, LENGTH - 4]
    for (start, end), state in zip([(0, 4), (4, LENGTH)], states):
        alone, alone_state = layer.prefill(x[:, start:end])
        torch.testing.assert_close(out[:, start:end], alone, rtol=0, atol=1e-12)
        # The next token continues each document as it continues the document alone.
        torch.testing.assert_close(layer.step(x[:, LENGTH:], state)[0], layer.step(x[:, LENGTH:], alone_state)[0],
                                   rtol=0, atol=1e-12)


def test_prefill_of_a_packed_row_is_refused_without_packing():
    mechanism = attnzoo.build_mechanism("local", HEADS, HEAD_DIM, window=4).double()
    # Every built-in mechanism with a recurrent step packs: an instance declaring none stands for one that doesn't.
    mechanism.capabilities = dataclasses.replace(mechanism.capabilities, packing="none")
    with pytest.raises(UnsupportedOptionError, match=r"cu_seqlens"):
        mechanism.prefill_packed(*qkv(), cu_seqlens=offsets(0, 4, LENGTH))


def test_tracing_a_packed_call_is_refused():
    mechanism = attnzoo.build_mechanism("softmax", HEADS, HEAD_DIM).double()
    cu = offsets(0, 4, LENGTH)
    with pytest.raises(UnsupportedOptionError, match=r"cu_seqlens cannot be traced"):
        torch.jit.trace(lambda q, k, v: mechanism(q, k, v, cu_seqlens=cu), qkv())


# Mechanisms whose max_length is 6 here (a learned table over positions, or bigbird's random table): a packed
# row of documents of at most 6 positions may be longer than 6, and a document of 7 is refused.
LIMITED = [
    ("aft", {"variant": "full", "max_seq_len": 6}),
    ("aft", {"variant": "local", "max_seq_len": 6, "window": 2}),
    ("synthesizer", {"max_seq_len": 6}),
    ("bigbird", {"block_size": 2, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1, "max_seq_len": 6}),
]


@pytest.mark.parametrize("name, options", LIMITED, ids=[f"{n}-{o.get('variant', '')}" for n, o in LIMITED])
def test_max_length_binds_each_document_not_the_row(name, options):
    mechanism = attnzoo.build_mechanism(name, HEADS, HEAD_DIM, **options).double()
    assert mechanism.max_length == 6
    q, k, v = qkv(length=14)
    cu = offsets(0, 6, 8, 14)  # a row of 14 positions, no document longer than 6
    causal = mechanism.capabilities.causal
    out = mechanism(q, k, v, causal, cu_seqlens=cu)
    for start, end in [(0, 6), (6, 8), (8, 14)]:
        alone = mechanism(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=0, atol=1e-12)
    with pytest.raises(UnsupportedOptionError, match=r"sequence length 7 exceeds max_length=6"):
        mechanism(q, k, v, causal, cu_seqlens=offsets(0, 7, 14))
    if mechanism.capabilities.recurrent_step:
        _, states = mechanism.prefill_packed(q, k, v, cu_seqlens=cu)
        assert [state.length for state in states] == [6, 2, 6]
        with pytest.raises(UnsupportedOptionError, match=r"max_length=6"):
            mechanism.prefill_packed(q, k, v, cu_seqlens=offsets(0, 7, 14))


def test_prefill_of_a_packed_row_repeats_grouped_keys_for_a_repeating_mechanism():
    mechanism = attnzoo.build_mechanism("gla", 4, HEAD_DIM, chunk_size=2).double()
    assert mechanism.capabilities.grouped_kv == "repeat"
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, LENGTH, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 2, LENGTH, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    cu = offsets(0, 4, LENGTH)
    out, states = mechanism.prefill_packed(q, k, v, cu_seqlens=cu)
    repeated = [x.repeat_interleave(2, dim=1) for x in (k, v)]
    out_r, states_r = mechanism.prefill_packed(q, *repeated, cu_seqlens=cu)
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-12)
    for state, state_r in zip(states, states_r):
        torch.testing.assert_close(state.tensors["kv"], state_r.tensors["kv"], rtol=0, atol=1e-12)


def test_length_multiple_binds_every_document():
    mechanism = attnzoo.build_mechanism("linear", HEADS, HEAD_DIM).double()
    # No built-in packing mechanism declares a length_multiple: an instance declaring one stands for one that does.
    mechanism.capabilities = dataclasses.replace(mechanism.capabilities, length_multiple=2)
    q, k, v = qkv(length=10)
    out = mechanism(q, k, v, True, cu_seqlens=offsets(0, 4, 6, 10))
    torch.testing.assert_close(out[:, :, 4:6], mechanism(q[:, :, 4:6], k[:, :, 4:6], v[:, :, 4:6], True),
                               rtol=0, atol=1e-12)
    with pytest.raises(UnsupportedOptionError, match=r"query length 3 is not a multiple of length_multiple=2"):
        mechanism(q, k, v, True, cu_seqlens=offsets(0, 4, 7, 10))


class NeedsThreePositions(attnzoo.mechanisms.SoftmaxAttention):
    """Stands for a mechanism with a minimum length: a rule only a short document breaks (not registered)."""

    name = "needs-three-positions"

    def unsupported_reasons(self, q, k, v, causal=False, key_padding_mask=None, *, cross=False):
        reasons = super().unsupported_reasons(q, k, v, causal, key_padding_mask, cross=cross)
        if q.shape[2] < 3:
            reasons.append(f"{self.name}: sequence length {q.shape[2]} is under 3")
        return reasons


@pytest.mark.parametrize("prefill", [False, True])
def test_a_short_document_is_refused_as_it_is_alone_naming_it(prefill):
    """Every document's length is checked, not only the longest's: a row with one document too short is
    refused with that document's own reason, naming the document and cu_seqlens."""
    mechanism = NeedsThreePositions(HEADS, HEAD_DIM).double()
    q, k, v = qkv(length=LENGTH)
    with pytest.raises(UnsupportedOptionError) as alone:
        mechanism(q[:, :, 6:8], k[:, :, 6:8], v[:, :, 6:8], True)
    cu = offsets(0, 3, 6, 8, LENGTH)  # lengths 3, 3, 2, 1: the longest refused, [6, 8), is named
    with pytest.raises(UnsupportedOptionError) as packed:
        if prefill:
            mechanism.prefill_packed(q, k, v, cu_seqlens=cu)
        else:
            mechanism(q, k, v, True, cu_seqlens=cu)
    message = str(packed.value)
    assert str(alone.value) in message and "document [6, 8) of cu_seqlens" in message
    out = mechanism(q, k, v, True, cu_seqlens=offsets(0, 3, 6, LENGTH))  # every document long enough runs
    torch.testing.assert_close(out[:, :, 3:6], mechanism(q[:, :, 3:6], k[:, :, 3:6], v[:, :, 3:6], True),
                               rtol=0, atol=1e-12)


def test_a_refusal_that_does_not_depend_on_the_length_names_no_document():
    """v of another width is refused by aft whatever the lengths: the packed error is the unpacked one, with
    no document named; a length rule's refusal still names its document (the test above)."""
    mechanism = attnzoo.build_mechanism("aft", HEADS, HEAD_DIM).double()
    q, k, v = qkv(length=LENGTH)
    wide = torch.randn(1, HEADS, LENGTH, HEAD_DIM + 1, dtype=torch.float64)
    with pytest.raises(UnsupportedOptionError) as alone:
        mechanism(q[:, :, :3], k[:, :, :3], wide[:, :, :3], True)
    with pytest.raises(UnsupportedOptionError) as packed:
        mechanism(q, k, wide, True, cu_seqlens=offsets(0, 3, 6, LENGTH))
    assert str(packed.value) == str(alone.value) and "any_value_width" in str(packed.value)

"""Reversible stacks and the chunked feed-forward network (Kitaev et al. 2020).

The memory-saving backward pass (layer inputs rebuilt from outputs, branches recomputed with the saved random
state) gives the outputs and every gradient of the same coupling run with ordinary autograd, dropout included;
what the stack keeps for the backward pass does not grow with depth; the coupling is the documented formula;
the token models train and decode with reversible stacks; the feed-forward network run in slices of the
sequence equals one pass; bad options are refused by name."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo import (
    FeedForward,
    LanguageModel,
    ReversibleDecoder,
    ReversibleEncoder,
    Seq2SeqTransformer,
    SequenceClassifier,
)
from attnzoo.models import BlockConfig, Decoder, Encoder
from decoding_helpers import incremental_logits

VOCAB = 13


def tokens(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def outputs_and_gradients(stack, memory_saving, inputs, seed=7, **kwargs):
    """Output of ``stack`` and the gradients of a fixed loss w.r.t. its inputs and every parameter, with the
    random stream seeded the same way before the run."""
    stack.memory_saving = memory_saving
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    torch.manual_seed(seed)
    out = stack(*leaves, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    loss = (out.sin() * weights).sum()
    parameters = [p for p in stack.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, leaves + parameters, allow_unused=True)
    return out.detach(), grads


def assert_same_run(stack, inputs, **kwargs):
    naive_out, naive_grads = outputs_and_gradients(stack, False, inputs, **kwargs)
    out, grads = outputs_and_gradients(stack, True, inputs, **kwargs)
    torch.testing.assert_close(out, naive_out, atol=1e-10, rtol=1e-10)
    assert len(grads) == len(naive_grads)
    for grad, naive in zip(grads, naive_grads):
        assert (grad is None) == (naive is None)
        if grad is not None:
            torch.testing.assert_close(grad, naive, atol=1e-10, rtol=1e-10)
    return out, grads


# -- the memory-saving backward equals ordinary autograd -----------------------------------------------------
@pytest.mark.parametrize("ff_chunks", [1, 3])
@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
def test_encoder_memory_saving_equals_ordinary_autograd_with_dropout_and_padding(mechanism, ff_chunks):
    torch.manual_seed(0)
    stack = ReversibleEncoder(16, 2, 3, dropout=0.2, activation="swiglu", ff_chunks=ff_chunks,
                              self_attention=mechanism).double().train()
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[1, 6:] = True
    out, grads = assert_same_run(stack, [randn(2, 10, 16)], key_padding_mask=mask)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    # Dropout is on: another random stream gives another output.
    other, _ = outputs_and_gradients(stack, True, [randn(2, 10, 16)], seed=8, key_padding_mask=mask)
    assert not torch.allclose(out, other)


@pytest.mark.parametrize("cross", [True, False])
def test_decoder_memory_saving_equals_ordinary_autograd_including_the_memory(cross):
    torch.manual_seed(0)
    stack = ReversibleDecoder(16, 2, 2, dropout=0.1, ff_chunks=2, rotary=True, memory_dim=6 if cross else None,
                              cross_attention="softmax" if cross else None).double().train()
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, :2] = True
    inputs = [randn(2, 9, 16)]
    kwargs = dict(padding_mask=padding)
    if cross:
        inputs.append(randn(2, 5, 6, seed=1))
        memory_padding = torch.zeros(2, 5, dtype=torch.bool)
        memory_padding[1, 3:] = True
        kwargs["memory_padding_mask"] = memory_padding
    _, grads = assert_same_run(stack, inputs, **kwargs)
    if cross:
        assert grads[1].abs().sum() > 0  # the gradient reaches the memory
        assert grads[1][1, 3:].abs().max() == 0  # and not its padded positions


def test_frozen_parameters_get_no_gradient_and_the_rest_match():
    torch.manual_seed(0)
    stack = ReversibleEncoder(8, 2, 2, dropout=0.1).double().train()
    for p in stack.layers[0].self_attention.parameters():
        p.requires_grad_(False)
    assert_same_run(stack, [randn(1, 6, 8)])
    stack.memory_saving = True
    torch.manual_seed(0)
    stack(randn(1, 6, 8).requires_grad_()).sum().backward()
    assert all(p.grad is None for p in stack.layers[0].self_attention.parameters())
    assert all(p.grad is not None for p in stack.layers[1].parameters())


def test_backward_leaves_the_random_stream_where_the_forward_left_it():
    torch.manual_seed(0)
    stack = ReversibleEncoder(8, 2, 2, dropout=0.3).double().train()
    out = stack(randn(1, 6, 8).requires_grad_())
    after_forward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_kept_activations_do_not_grow_with_depth():
    """What the autograd graph keeps for the backward pass, counted by saved-tensor hooks: constant in the
    depth with the memory-saving pass, growing with ordinary autograd."""

    def saved_elements(depth, memory_saving):
        torch.manual_seed(0)
        stack = ReversibleEncoder(8, 2, depth, dropout=0.1).double().train()
        stack.memory_saving = memory_saving
        count = [0]

        def pack(t):
            count[0] += t.numel() if not isinstance(t, torch.nn.Parameter) else 0
            return t

        x = randn(2, 16, 8).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stack(x)
        return count[0]

    assert saved_elements(1, True) == saved_elements(6, True)
    assert saved_elements(6, False) > 4 * saved_elements(1, True)


def test_the_coupling_is_the_documented_formula():
    """y1 = x1 + attention(x2), y2 = x2 + feed-forward(y1) per layer from (x, x); output norm((y1 + y2) / 2)."""
    torch.manual_seed(0)
    stack = ReversibleEncoder(8, 2, 2, ff_chunks=2).double().eval()
    x = randn(2, 5, 8)
    x1, x2 = x, x
    for layer in stack.layers:
        x1 = x1 + layer.self_attention(layer.attention_block.norm(x2))
        x2 = x2 + layer.feed_forward(layer.feed_forward_block.norm(x1))
    expected = stack.norm((x1 + x2) / 2)
    torch.testing.assert_close(stack(x), expected, atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # no recording: run directly, same values
        torch.testing.assert_close(stack(x), expected, atol=1e-12, rtol=1e-12)


def test_decoder_is_causal_and_shares_the_layers_and_names_of_the_plain_one():
    torch.manual_seed(0)
    stack = ReversibleDecoder(8, 2, 2, cross_attention=None).double().eval()
    torch.manual_seed(0)
    plain = Decoder(8, 2, 2, cross_attention=None).double()
    assert isinstance(stack, Decoder)
    assert list(stack.state_dict()) == list(plain.state_dict())
    x = randn(1, 7, 8)
    later = x.clone()
    later[:, 4:] += 1.0
    torch.testing.assert_close(stack(later)[:, :4], stack(x)[:, :4], atol=1e-12, rtol=0)


# -- models --------------------------------------------------------------------------------------------------
def test_reversible_language_model_trains():
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 2, reversible=True, self_attention="linear", dropout=0.1, ff_chunks=2)
    assert isinstance(model.decoder, ReversibleDecoder)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sequence = tokens(4, 12)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(sequence[:, :-1]).transpose(1, 2), sequence[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
def test_reversible_language_model_decodes_like_its_forward(mechanism):
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 2, reversible=True, self_attention=mechanism, positional="rotary",
                          ff_chunks=3).double().eval()
    sequence = tokens(2, 9)
    full = model(sequence)
    for prompt_len in (1, 4):
        torch.testing.assert_close(incremental_logits(model, prompt_len, sequence), full, atol=1e-10, rtol=1e-10)


def test_reversible_seq2seq_decodes_like_its_forward():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(VOCAB, VOCAB + 2, 16, 2, reversible=True, max_length=16).double().eval()
    assert isinstance(model.encoder, ReversibleEncoder) and isinstance(model.decoder, ReversibleDecoder)
    src, tgt = tokens(2, 6, seed=1), tokens(2, 7, seed=2)
    src_mask = torch.zeros(2, 6, dtype=torch.bool)
    src_mask[0, 4:] = True
    full = model(src, tgt, src_padding_mask=src_mask)
    logits, state = model.prefill(src, tgt[:, :3], src_padding_mask=src_mask)
    rows = [logits]
    for t in range(3, 7):
        logits_t, state = model.step(tgt[:, t], state)
        rows.append(logits_t[:, None])
    torch.testing.assert_close(torch.cat(rows, dim=1), full, atol=1e-10, rtol=1e-10)


def test_reversible_classifier_ignores_padding_and_gets_gradients():
    torch.manual_seed(0)
    model = SequenceClassifier(VOCAB, 3, 16, 2, 2, reversible=True, pooling="cls").double()
    sequence = tokens(2, 8, seed=5)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True
    logits = model(sequence, padding_mask=mask)
    F.cross_entropy(logits, torch.tensor([0, 2])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    other = sequence.clone()
    other[1, 5:] = (other[1, 5:] + 1) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(other, padding_mask=mask), logits.detach(), atol=1e-10, rtol=0)


def test_reversible_and_plain_models_share_checkpoints():
    plain = LanguageModel(VOCAB, 16, 2, 2)
    reversible = LanguageModel(VOCAB, 16, 2, 2, reversible=True)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {
        k: v.shape for k, v in reversible.state_dict().items()
    }
    reversible.load_state_dict(plain.state_dict())


# -- chunked feed-forward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [2, 3, 7, 20])
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_chunked_feed_forward_equals_one_pass(activation, chunks):
    torch.manual_seed(0)
    whole = FeedForward(8, 24, activation).double()
    sliced = FeedForward(8, 24, activation, chunks=chunks).double()
    sliced.load_state_dict(whole.state_dict())
    widest = []
    sliced.in_proj.register_forward_hook(lambda module, args, out: widest.append(out.shape[1]))
    x = randn(2, 7, 8)
    out_whole, grads_whole = outputs_and_gradients(whole, True, [x])
    out_sliced, grads_sliced = outputs_and_gradients(sliced, True, [x])
    torch.testing.assert_close(out_sliced, out_whole, atol=1e-12, rtol=1e-12)
    for grad, expected in zip(grads_sliced, grads_whole):
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-12)
    assert max(widest) == math.ceil(7 / chunks)  # the hidden activation never spans the whole sequence


def test_ff_chunks_reaches_every_layer_and_changes_no_output():
    torch.manual_seed(0)
    whole = LanguageModel(VOCAB, 16, 2, 2).double()
    sliced = LanguageModel(VOCAB, 16, 2, 2, ff_chunks=4).double()
    sliced.load_state_dict(whole.state_dict())
    assert all(layer.feed_forward.chunks == 4 for layer in sliced.decoder.layers)
    sequence = tokens(2, 9)
    torch.testing.assert_close(sliced(sequence), whole(sequence), atol=1e-12, rtol=1e-12)
    assert Encoder(16, 2, 1, ff_chunks=3).layers[0].feed_forward.chunks == 3


# -- bad options ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: BlockConfig(16, 2, ff_chunks=0), ValueError, "ff_chunks"),
        (lambda: BlockConfig(16, 2, ff_chunks=2.0), TypeError, "ff_chunks"),
        (lambda: BlockConfig(16, 2, ff_chunks=True), TypeError, "ff_chunks"),
        (lambda: FeedForward(16, 32, chunks=0), ValueError, "chunks"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, ff_chunks=-1), ValueError, "ff_chunks"),
        (lambda: Encoder(16, 2, 1, ff_chunks="2"), TypeError, "ff_chunks"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, reversible="yes"), TypeError, "reversible must be True or False"),
        (lambda: SequenceClassifier(VOCAB, 3, 16, 2, 1, reversible=1), TypeError, "reversible must be True or False"),
        (lambda: Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, reversible=None), TypeError,
         "reversible must be True or False"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, reversible=True, norm_first=False), ValueError,
         "reversible=True needs norm_first=True"),
        (lambda: ReversibleEncoder(16, 2, 1, norm_first=False), ValueError, "needs norm_first=True"),
        (lambda: ReversibleDecoder.from_config(BlockConfig(16, 2, norm_first=False), 1), ValueError,
         "needs norm_first=True"),
        (lambda: ReversibleEncoder(16, 2, 0), ValueError, "depth"),
    ],
)
def test_bad_options_are_refused_by_name(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_decoder_memory_is_checked():
    stack = ReversibleDecoder(8, 2, 1)
    with pytest.raises(ValueError, match="memory .* is required"):
        stack(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="memory given"):
        ReversibleDecoder(8, 2, 1, cross_attention=None)(torch.randn(1, 3, 8), torch.randn(1, 2, 8))


def test_recomputation_runs_under_the_forwards_autocast():
    torch.manual_seed(0)
    stack = ReversibleEncoder(8, 2, 2).train()
    seen = []
    stack.layers[0].feed_forward.in_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack(torch.randn(1, 6, 8, requires_grad=True))
    out.float().sum().backward()
    assert seen == [torch.bfloat16, torch.bfloat16]  # the forward, then the recomputation
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in stack.parameters())

"""Transformer layers and models: incremental decoding equals the full forward pass, padding, per-slot
mechanism options, pooling, and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo import (
    Decoder,
    Encoder,
    FeedForward,
    LanguageModel,
    Seq2SeqTransformer,
    SequenceClassifier,
)
from attnzoo.state import select_batch

VOCAB = 13


def tokens(batch, seq, vocab=VOCAB, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def language_model(**options):
    settings = dict(dim=16, heads=2, depth=2, max_length=32)
    settings.update(options)
    return LanguageModel(VOCAB, **settings).double().eval()


def seq2seq(**options):
    settings = dict(dim=16, heads=2, encoder_depth=2, decoder_depth=2, max_length=32)
    settings.update(options)
    return Seq2SeqTransformer(VOCAB, VOCAB + 4, **settings).double().eval()


def incremental_logits(model, prompt_len, sequence, **prefill_args):
    """Logits of every position computed by prefill over a prefix and then one step per token."""
    if isinstance(model, Seq2SeqTransformer):
        logits, state = model.prefill(prefill_args["src"], sequence[:, :prompt_len],
                                      src_padding_mask=prefill_args.get("src_padding_mask"))
    else:
        logits, state = model.prefill(sequence[:, :prompt_len])
    rows = [logits]
    for t in range(prompt_len, sequence.shape[1]):
        logits_t, state = model.step(sequence[:, t], state)
        rows.append(logits_t[:, None])
    return torch.cat(rows, dim=1)


# -- incremental decoding == full forward --------------------------------------------------------------------
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rotary", "none"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_language_model_incremental_matches_forward(positional, norm_first):
    model = language_model(positional=positional, norm_first=norm_first, activation="swiglu")
    sequence = tokens(3, 9)
    full = model(sequence)
    for prompt_len in (1, 4):
        torch.testing.assert_close(incremental_logits(model, prompt_len, sequence), full, atol=1e-10, rtol=1e-10)


DECODING_MECHANISMS = [
    name for name in attnzoo.available()
    if attnzoo.capabilities(name).causal and attnzoo.capabilities(name).recurrent_step
]


@pytest.mark.parametrize("mechanism", DECODING_MECHANISMS)
def test_every_decoding_mechanism_decodes_incrementally_like_forward(mechanism):
    model = language_model(self_attention=mechanism, positional="sinusoidal")
    sequence = tokens(2, 7)
    torch.testing.assert_close(incremental_logits(model, 3, sequence), model(sequence), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_seq2seq_incremental_matches_forward(positional):
    model = seq2seq(positional=positional, norm_first=False, activation="relu")
    src, tgt = tokens(2, 7, seed=1), tokens(2, 6, vocab=VOCAB + 4, seed=2)
    src_mask = torch.zeros(2, 7, dtype=torch.bool)
    src_mask[1, 4:] = True
    full = model(src, tgt, src_padding_mask=src_mask)
    for prompt_len in (1, 3):
        got = incremental_logits(model, prompt_len, tgt, src=src, src_padding_mask=src_mask)
        torch.testing.assert_close(got, full, atol=1e-10, rtol=1e-10)


def test_seq2seq_state_reorders_with_select_batch():
    model = seq2seq()
    src, tgt = tokens(2, 5, seed=3), tokens(2, 4, vocab=VOCAB + 4, seed=4)
    src_mask = torch.tensor([[False] * 5, [False, False, True, True, True]])
    _, state = model.prefill(src, tgt[:, :2], src_padding_mask=src_mask)
    order = torch.tensor([1, 0, 1])
    state = select_batch(state, order)
    logits_t, _ = model.step(tgt[order, 2], state)
    full = model(src[order], tgt[order, :3], src_padding_mask=src_mask[order])
    torch.testing.assert_close(logits_t, full[:, -1], atol=1e-10, rtol=1e-10)


def test_seq2seq_projects_memory_once():
    model = seq2seq()
    src, tgt = tokens(1, 5, seed=5), tokens(1, 4, vocab=VOCAB + 4, seed=6)
    calls = []
    for layer in model.decoder.layers:
        layer.cross_attention.k_proj.register_forward_hook(lambda *args: calls.append(1))
    _, state = model.prefill(src, tgt[:, :1])
    for t in range(1, 4):
        _, state = model.step(tgt[:, t], state)
    assert len(calls) == len(model.decoder.layers)


# -- padding -------------------------------------------------------------------------------------------------
def test_language_model_ignores_left_padding():
    model = language_model(positional="rotary")
    sequence = tokens(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :3] = True
    changed = sequence.clone()
    changed[0, :3] = (changed[0, :3] + 5) % VOCAB
    a, b = model(sequence, padding_mask=mask), model(changed, padding_mask=mask)
    torch.testing.assert_close(a[~mask], b[~mask], atol=1e-12, rtol=0)
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rotary"])
def test_classifier_pooling_ignores_padding(pooling, positional):
    model = SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=2, pooling=pooling, positional=positional,
                               max_length=8).double().eval()
    sequence = tokens(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 5:] = True
    padded = model(sequence, padding_mask=mask)
    changed = sequence.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % VOCAB
    torch.testing.assert_close(model(changed, padding_mask=mask), padded, atol=1e-12, rtol=0)
    # The padded row equals the same tokens without padding; the unpadded row is untouched by the mask.
    torch.testing.assert_close(padded[0], model(sequence[:1, :5])[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(padded[1], model(sequence[1:])[0], atol=1e-10, rtol=1e-10)


def test_classifier_mean_pooling_is_the_mean_of_the_encoder_output():
    model = SequenceClassifier(VOCAB, 4, dim=16, heads=2, depth=1, pooling="mean").double().eval()
    sequence = tokens(1, 6)
    hidden = model.encoder(model.embedding(sequence))
    torch.testing.assert_close(model(sequence), model.head(hidden.mean(dim=1)))


# -- layers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_feed_forward_matches_its_formula(activation):
    ff = FeedForward(6, 10, activation).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    hidden = x @ ff.in_proj.weight.T + ff.in_proj.bias
    if activation == "swiglu":
        gate, value = hidden[..., :10], hidden[..., 10:]
        hidden = gate * torch.sigmoid(gate) * value
    elif activation == "gelu":
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / 2**0.5))
    else:
        hidden = hidden.clamp(min=0)
    torch.testing.assert_close(ff(x), hidden @ ff.out_proj.weight.T + ff.out_proj.bias)


def test_post_norm_output_is_normalized_and_pre_norm_closes_with_a_norm():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    post = Encoder(16, 2, 2, norm_first=False).double()
    out = post(x)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5, dtype=torch.float64), atol=1e-10, rtol=0)
    pre = Encoder(16, 2, 2, norm_first=True).double()
    assert isinstance(pre.norm, torch.nn.LayerNorm) and isinstance(post.norm, torch.nn.Identity)


def test_dropout_is_active_in_training_only():
    model = LanguageModel(VOCAB, 16, 2, 1, dropout=0.5)
    sequence = tokens(2, 6)
    model.train()
    assert not torch.equal(model(sequence), model(sequence))
    model.eval()
    assert torch.equal(model(sequence), model(sequence))


def test_decoder_is_causal():
    decoder = Decoder(16, 2, 2).double()
    x, memory = torch.randn(1, 6, 16, dtype=torch.float64), torch.randn(1, 4, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 4:] += 1.0
    torch.testing.assert_close(decoder(x, memory)[:, :4], decoder(changed, memory)[:, :4], atol=1e-12, rtol=0)


def test_each_attention_slot_gets_its_own_mechanism():
    others = [name for name in attnzoo.available() if name != "softmax" and attnzoo.capabilities(name).key_padding]
    if not others:
        pytest.skip("only softmax is registered")
    model = Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, encoder_self_attention=others[0]).double().eval()
    assert {layer.self_attention.mechanism_name for layer in model.encoder.layers} == {others[0]}
    assert {layer.cross_attention.mechanism_name for layer in model.decoder.layers} == {"softmax"}
    src, tgt = tokens(2, 6), tokens(2, 4)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    full = model(src, tgt, src_padding_mask=mask)
    torch.testing.assert_close(incremental_logits(model, 1, tgt, src=src, src_padding_mask=mask), full,
                               atol=1e-10, rtol=1e-10)


def test_each_attention_slot_gets_its_own_options():
    model = Seq2SeqTransformer(
        VOCAB, VOCAB, 16, 2,
        encoder_self_attention_options={"quiet": True},
        cross_attention_options={"scale": 0.5},
    )
    assert model.encoder.layers[0].self_attention.mechanism.quiet
    assert not model.decoder.layers[0].self_attention.mechanism.quiet
    assert model.decoder.layers[0].cross_attention.mechanism.scale == 0.5
    assert model.decoder.layers[0].self_attention.mechanism.scale is None


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: LanguageModel(VOCAB, 16, 2, 1, positional="alibi"), "positional"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, activation="tanh"), "activation"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, positional="learned"), "max_length"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, dropout=1.5), "dropout"),
        (lambda: LanguageModel(VOCAB, 16, 2, 0), "depth"),
        (lambda: LanguageModel(0, 16, 2, 1), "vocab_size"),
        (lambda: SequenceClassifier(VOCAB, 3, 16, 2, 1, pooling="max"), "pooling"),
        (lambda: LanguageModel(VOCAB, 16, 2, 1, self_attention="nonesuch"), "softmax"),
        (lambda: Encoder(16, 2, 1, self_attention_options=["quiet"]), "self_attention_options"),
    ],
)
def test_bad_configuration_raises(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_unknown_mechanism_option_lists_valid_ones():
    with pytest.raises(TypeError, match="valid options: quiet, scale"):
        Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, cross_attention_options={"quite": True})


def test_bad_model_input_raises():
    model = language_model()
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"tokens must have shape \(batch, seq\)"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.full((1, 3), VOCAB))
    with pytest.raises(ValueError, match="tokens is empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="padding_mask must have shape"):
        model(tokens(2, 4), padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        model(tokens(2, 4), padding_mask=torch.zeros(2, 4))
    _, state = model.prefill(tokens(2, 4))
    with pytest.raises(ValueError, match=r"token_t must have shape \(batch,\)"):
        model.step(tokens(2, 1), state)
    with pytest.raises(TypeError, match="state must be the DecoderState"):
        model.step(tokens(2, 1)[:, 0], None)


def test_learned_positions_refuse_to_decode_past_max_length():
    model = LanguageModel(VOCAB, 16, 2, 1, positional="learned", max_length=4).eval()
    _, state = model.prefill(tokens(1, 4))
    with pytest.raises(ValueError, match="max_length=4"):
        model.step(tokens(1, 1)[:, 0], state)


def test_seq2seq_mismatched_batches_raise():
    model = seq2seq()
    with pytest.raises(ValueError, match="tgt batch 1 does not match src batch 2"):
        model(tokens(2, 4), tokens(1, 3))
    with pytest.raises(ValueError, match="src_padding_mask must have shape"):
        model(tokens(2, 4), tokens(2, 3), src_padding_mask=torch.zeros(2, 3, dtype=torch.bool))


def test_language_model_trains_one_step_with_finite_gradients():
    model = LanguageModel(VOCAB, 16, 2, 2, positional="rotary", activation="swiglu", dropout=0.1)
    sequence = tokens(2, 8)
    loss = F.cross_entropy(model(sequence[:, :-1]).transpose(1, 2), sequence[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

"""Transformer layers and models: incremental decoding equals the full forward pass, padding, per-slot
mechanism options, pooling, clear errors for bad input, and one checked BlockConfig behind every constructor."""

import ast
import math
from dataclasses import replace
from pathlib import Path

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
    SequenceTagger,
)
from attnzoo.models import AttentionSpec, BlockConfig, DecoderLayer, EncoderLayer, ModelConfig, ReversibleDecoder
from attnzoo.models.gau import UNIT_MECHANISMS
from attnzoo.state import select_batch
from decoding_helpers import incremental_logits

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


def test_tagger_gives_a_label_per_position_and_ignores_padding():
    model = SequenceTagger(VOCAB, 5, dim=16, heads=2, depth=2).double().eval()
    sequence = tokens(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 6:] = True
    logits = model(sequence, padding_mask=mask)
    assert logits.shape == (2, 8, 5)
    changed = sequence.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % VOCAB
    torch.testing.assert_close(model(changed, padding_mask=mask)[~mask], logits[~mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(logits[0, :6], model(sequence[:1, :6])[0], atol=1e-10, rtol=1e-10)
    # Bidirectional: the first position's label depends on the last token.
    later = sequence.clone()
    later[1, -1] = (later[1, -1] + 1) % VOCAB
    assert not torch.allclose(model(later)[1, 0], model(sequence)[1, 0])


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


# -- one BlockConfig behind every constructor ----------------------------------------------------------------
BOOL_OPTION_BUILDS = {
    "LanguageModel norm_first": lambda bad: LanguageModel(VOCAB, 16, 2, 1, norm_first=bad),
    "SequenceClassifier norm_first": lambda bad: SequenceClassifier(VOCAB, 3, 16, 2, 1, norm_first=bad),
    "Seq2SeqTransformer norm_first": lambda bad: Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, norm_first=bad),
    "Encoder norm_first": lambda bad: Encoder(16, 2, 1, norm_first=bad),
    "Decoder norm_first": lambda bad: Decoder(16, 2, 1, norm_first=bad),
    "Encoder rotary": lambda bad: Encoder(16, 2, 1, rotary=bad),
    "Decoder rotary": lambda bad: Decoder(16, 2, 1, rotary=bad),
    "BlockConfig rotary": lambda bad: BlockConfig(16, 2, rotary=bad),
}


@pytest.mark.parametrize("truthy", ["False", "True", 1, None])
@pytest.mark.parametrize("where", list(BOOL_OPTION_BUILDS))
def test_yes_no_options_refuse_truthy_stand_ins(where, truthy):
    option = where.split()[-1]
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        BOOL_OPTION_BUILDS[where](truthy)


@pytest.mark.parametrize(
    "option, bad, error",
    [
        ("layer_norm_eps", math.nan, ValueError),
        ("layer_norm_eps", math.inf, ValueError),
        ("layer_norm_eps", 0.0, ValueError),
        ("layer_norm_eps", -1e-5, ValueError),
        ("layer_norm_eps", "1e-5", TypeError),
        ("dropout", math.nan, ValueError),
        ("dropout", -0.1, ValueError),
        ("dropout", 1.0, ValueError),
        ("dropout", True, TypeError),
        ("ff_dim", 0, ValueError),
        ("ff_dim", 32.0, TypeError),
        ("activation", "tanh", ValueError),
    ],
)
@pytest.mark.parametrize("model", ["LanguageModel", "Seq2SeqTransformer", "SequenceClassifier", "Encoder"])
def test_bad_numbers_and_choices_raise_naming_the_option(model, option, bad, error):
    build = {
        "LanguageModel": lambda: LanguageModel(VOCAB, 16, 2, 1, **{option: bad}),
        "Seq2SeqTransformer": lambda: Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, **{option: bad}),
        "SequenceClassifier": lambda: SequenceClassifier(VOCAB, 3, 16, 2, 1, **{option: bad}),
        "Encoder": lambda: Encoder(16, 2, 1, **{option: bad}),
    }[model]
    with pytest.raises(error, match=option):
        build()


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: BlockConfig(16, 3), ValueError, "dim=16 is not divisible by heads=3"),
        (lambda: BlockConfig(16, 0), ValueError, "heads"),
        (lambda: BlockConfig(16.0, 2), TypeError, "dim"),
        (lambda: BlockConfig(16, 2, self_attention="softmax"), TypeError, "self_attention must be an AttentionSpec"),
        (lambda: BlockConfig(16, 2, self_attention=AttentionSpec("nonesuch")), ValueError, "self_attention.*softmax"),
        (lambda: BlockConfig(16, 2, cross_attention=AttentionSpec("softmax", ["scale"])), TypeError,
         "cross_attention_options"),
        (lambda: BlockConfig(16, 2, memory_dim=8), ValueError, "memory_dim given but cross_attention=None"),
        (lambda: Decoder(16, 2, 1, memory_dim=0), ValueError, "memory_dim"),
        (lambda: Decoder(16, 2, 1, cross_attention=None, cross_attention_options={"scale": 0.5}), ValueError,
         "cross_attention_options given but cross_attention=None"),
        (lambda: EncoderLayer(BlockConfig(16, 2, cross_attention=AttentionSpec())), ValueError, "cross_attention=None"),
        (lambda: DecoderLayer({"dim": 16, "heads": 2}), TypeError, "config must be a BlockConfig"),
    ],
)
def test_block_config_checks_every_option(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_block_config_is_frozen_and_works_out_the_feed_forward_width():
    config = BlockConfig(16, 2)
    with pytest.raises(AttributeError):
        config.dim = 32
    assert config.feed_forward_dim == 64
    assert replace(config, dim=32).feed_forward_dim == 128
    assert BlockConfig(16, 2, ff_dim=24).feed_forward_dim == 24


def test_stacks_built_from_a_config_equal_those_built_from_keywords():
    options = dict(ff_dim=24, activation="swiglu", norm_first=False, dropout=0.1, layer_norm_eps=1e-6)
    config = BlockConfig(16, 2, **options, cross_attention=AttentionSpec("softmax", {"scale": 0.5}), memory_dim=10)
    torch.manual_seed(0)
    from_keywords = Decoder(16, 2, 2, **options, cross_attention_options={"scale": 0.5}, memory_dim=10)
    torch.manual_seed(0)
    from_config = Decoder.from_config(config, 2)
    assert isinstance(from_config, Decoder)
    assert from_keywords.config == from_config.config == config
    assert all(layer.config is config for layer in from_config.layers)
    ours, theirs = from_config.state_dict(), from_keywords.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert from_config.layers[0].cross_attention.mechanism.scale == 0.5


def test_seq2seq_encoder_config_differs_in_its_self_attention_only():
    model = Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, positional="rotary", norm_first=False,
                               encoder_self_attention="linear", cross_attention_options={"scale": 0.5})
    encoder, decoder = model.encoder.config, model.decoder.config
    assert encoder.self_attention == AttentionSpec("linear") and encoder.cross_attention is None
    assert decoder.self_attention == AttentionSpec("softmax")
    assert decoder.cross_attention == AttentionSpec("softmax", {"scale": 0.5})
    assert encoder.rotary and decoder.rotary and not encoder.norm_first and not decoder.norm_first


# state_dict keys and shapes of three models, recorded before the constructors shared one BlockConfig: a
# checkpoint saved then loads now, and the parameters come in the same order (optimizer states follow it).
RECORDED_STATE_DICTS = {
    "decoder": (lambda: Decoder(16, 2, 1, activation="swiglu", memory_dim=10), """
    layers.0.self_attention.q_proj.weight (16, 16)
    layers.0.self_attention.q_proj.bias (16,)
    layers.0.self_attention.k_proj.weight (16, 16)
    layers.0.self_attention.k_proj.bias (16,)
    layers.0.self_attention.v_proj.weight (16, 16)
    layers.0.self_attention.v_proj.bias (16,)
    layers.0.self_attention.out_proj.weight (16, 16)
    layers.0.self_attention.out_proj.bias (16,)
    layers.0.attention_block.norm.weight (16,)
    layers.0.attention_block.norm.bias (16,)
    layers.0.cross_attention.q_proj.weight (16, 16)
    layers.0.cross_attention.q_proj.bias (16,)
    layers.0.cross_attention.k_proj.weight (16, 10)
    layers.0.cross_attention.k_proj.bias (16,)
    layers.0.cross_attention.v_proj.weight (16, 10)
    layers.0.cross_attention.v_proj.bias (16,)
    layers.0.cross_attention.out_proj.weight (16, 16)
    layers.0.cross_attention.out_proj.bias (16,)
    layers.0.cross_attention_block.norm.weight (16,)
    layers.0.cross_attention_block.norm.bias (16,)
    layers.0.feed_forward.in_proj.weight (128, 16)
    layers.0.feed_forward.in_proj.bias (128,)
    layers.0.feed_forward.out_proj.weight (16, 64)
    layers.0.feed_forward.out_proj.bias (16,)
    layers.0.feed_forward_block.norm.weight (16,)
    layers.0.feed_forward_block.norm.bias (16,)
    norm.weight (16,)
    norm.bias (16,)
    """),
    "language_model": (
        lambda: LanguageModel(VOCAB, 16, 2, 1, positional="learned", max_length=32, norm_first=False, ff_dim=40), """
    embedding.embedding.weight (13, 16)
    embedding.position.embedding.weight (32, 16)
    decoder.layers.0.self_attention.q_proj.weight (16, 16)
    decoder.layers.0.self_attention.q_proj.bias (16,)
    decoder.layers.0.self_attention.k_proj.weight (16, 16)
    decoder.layers.0.self_attention.k_proj.bias (16,)
    decoder.layers.0.self_attention.v_proj.weight (16, 16)
    decoder.layers.0.self_attention.v_proj.bias (16,)
    decoder.layers.0.self_attention.out_proj.weight (16, 16)
    decoder.layers.0.self_attention.out_proj.bias (16,)
    decoder.layers.0.attention_block.norm.weight (16,)
    decoder.layers.0.attention_block.norm.bias (16,)
    decoder.layers.0.feed_forward.in_proj.weight (40, 16)
    decoder.layers.0.feed_forward.in_proj.bias (40,)
    decoder.layers.0.feed_forward.out_proj.weight (16, 40)
    decoder.layers.0.feed_forward.out_proj.bias (16,)
    decoder.layers.0.feed_forward_block.norm.weight (16,)
    decoder.layers.0.feed_forward_block.norm.bias (16,)
    head.weight (13, 16)
    """),
    "seq2seq": (
        lambda: Seq2SeqTransformer(
            VOCAB, VOCAB + 4, 16, 2, encoder_depth=1, decoder_depth=1, encoder_self_attention="performer",
            encoder_self_attention_options={"nb_features": 8}, decoder_self_attention="linear",
        ), """
    src_embedding.embedding.weight (13, 16)
    tgt_embedding.embedding.weight (17, 16)
    encoder.layers.0.self_attention.q_proj.weight (16, 16)
    encoder.layers.0.self_attention.q_proj.bias (16,)
    encoder.layers.0.self_attention.k_proj.weight (16, 16)
    encoder.layers.0.self_attention.k_proj.bias (16,)
    encoder.layers.0.self_attention.v_proj.weight (16, 16)
    encoder.layers.0.self_attention.v_proj.bias (16,)
    encoder.layers.0.self_attention.out_proj.weight (16, 16)
    encoder.layers.0.self_attention.out_proj.bias (16,)
    encoder.layers.0.self_attention.mechanism.feature_map.projection (4, 8)
    encoder.layers.0.self_attention.mechanism.feature_map.calls_since_redraw ()
    encoder.layers.0.feed_forward.in_proj.weight (64, 16)
    encoder.layers.0.feed_forward.in_proj.bias (64,)
    encoder.layers.0.feed_forward.out_proj.weight (16, 64)
    encoder.layers.0.feed_forward.out_proj.bias (16,)
    encoder.layers.0.attention_block.norm.weight (16,)
    encoder.layers.0.attention_block.norm.bias (16,)
    encoder.layers.0.feed_forward_block.norm.weight (16,)
    encoder.layers.0.feed_forward_block.norm.bias (16,)
    encoder.norm.weight (16,)
    encoder.norm.bias (16,)
    decoder.layers.0.self_attention.q_proj.weight (16, 16)
    decoder.layers.0.self_attention.q_proj.bias (16,)
    decoder.layers.0.self_attention.k_proj.weight (16, 16)
    decoder.layers.0.self_attention.k_proj.bias (16,)
    decoder.layers.0.self_attention.v_proj.weight (16, 16)
    decoder.layers.0.self_attention.v_proj.bias (16,)
    decoder.layers.0.self_attention.out_proj.weight (16, 16)
    decoder.layers.0.self_attention.out_proj.bias (16,)
    decoder.layers.0.attention_block.norm.weight (16,)
    decoder.layers.0.attention_block.norm.bias (16,)
    decoder.layers.0.cross_attention.q_proj.weight (16, 16)
    decoder.layers.0.cross_attention.q_proj.bias (16,)
    decoder.layers.0.cross_attention.k_proj.weight (16, 16)
    decoder.layers.0.cross_attention.k_proj.bias (16,)
    decoder.layers.0.cross_attention.v_proj.weight (16, 16)
    decoder.layers.0.cross_attention.v_proj.bias (16,)
    decoder.layers.0.cross_attention.out_proj.weight (16, 16)
    decoder.layers.0.cross_attention.out_proj.bias (16,)
    decoder.layers.0.cross_attention_block.norm.weight (16,)
    decoder.layers.0.cross_attention_block.norm.bias (16,)
    decoder.layers.0.feed_forward.in_proj.weight (64, 16)
    decoder.layers.0.feed_forward.in_proj.bias (64,)
    decoder.layers.0.feed_forward.out_proj.weight (16, 64)
    decoder.layers.0.feed_forward.out_proj.bias (16,)
    decoder.layers.0.feed_forward_block.norm.weight (16,)
    decoder.layers.0.feed_forward_block.norm.bias (16,)
    decoder.norm.weight (16,)
    decoder.norm.bias (16,)
    head.weight (17, 16)
    """),
}


@pytest.mark.parametrize("name", list(RECORDED_STATE_DICTS))
def test_models_have_the_recorded_state_dict_keys_and_shapes(name):
    build, recorded = RECORDED_STATE_DICTS[name]
    expected = []
    for line in recorded.strip().splitlines():
        key, shape = line.split(maxsplit=1)
        expected.append((key, ast.literal_eval(shape)))
    assert [(key, tuple(value.shape)) for key, value in build().state_dict().items()] == expected


def _declared_options(name):
    """The mechanism's small conformance settings (learned position tables sized for short sequences)."""
    return dict(attnzoo.mechanisms.mechanism_class(name).test_options)


@pytest.mark.parametrize("name", attnzoo.available())
def test_every_mechanism_trains_in_a_classifier_with_padding(name):
    """Any registered mechanism drops into a model by its name: one training step of a padded classifier gives
    a finite loss and finite gradients that reach the embeddings, and padded tokens change nothing."""
    torch.manual_seed(0)
    model = SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=1, self_attention=name,
                               self_attention_options=_declared_options(name)).double()
    sequence = tokens(2, 8, seed=5)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True
    logits = model(sequence, padding_mask=mask)
    loss = F.cross_entropy(logits, torch.tensor([0, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads), name
    assert model.embedding.embedding.weight.grad.abs().sum() > 0
    other = sequence.clone()
    other[1, 5:] = (other[1, 5:] + 1) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(other, padding_mask=mask), logits.detach(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", [n for n in attnzoo.available() if attnzoo.capabilities(n).causal])
def test_every_causal_mechanism_trains_a_language_model(name):
    """A causal mechanism drops into a language model: finite loss and gradients, and no logit depends on a
    later token."""
    torch.manual_seed(0)
    model = language_model(self_attention=name, self_attention_options=_declared_options(name))
    sequence = tokens(2, 8, seed=6)
    logits = model(sequence)
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), sequence[:, 1:].reshape(-1)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    later = sequence.clone()
    later[:, 5:] = (later[:, 5:] + 1) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(later)[:, :5], logits.detach()[:, :5], atol=1e-10, rtol=0)


def test_a_source_longer_than_max_length_is_refused_whatever_the_positions():
    for positional in ("sinusoidal", "rotary", "learned"):
        model = Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, positional=positional, max_length=6)
        model(tokens(1, 6), tokens(1, 3))  # up to max_length: fine
        with pytest.raises(ValueError, match="src has 7 positions, more than this model's max_length 6"):
            model(tokens(1, 7), tokens(1, 3))
        with pytest.raises(ValueError, match="max_length"):
            model.prefill(tokens(1, 7), tokens(1, 1))


# -- one ModelConfig behind the token models -----------------------------------------------------------------
MODEL_OPTIONS = dict(dim=16, heads=2, depth=2, ff_dim=24, activation="swiglu", dropout=0.1, positional="learned",
                     max_length=12, self_attention="linear", layer_norm_eps=1e-6, ff_chunks=2, token_shift=True)


def _same_parameters(ours, theirs):
    ours, theirs = ours.state_dict(), theirs.state_dict()
    return list(ours) == list(theirs) and all(torch.equal(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize("model", ["LanguageModel", "SequenceClassifier", "SequenceTagger"])
def test_token_models_built_from_a_model_config_equal_those_built_from_keywords(model):
    config = ModelConfig(VOCAB, **MODEL_OPTIONS)
    build_from_keywords = {
        "LanguageModel": lambda: LanguageModel(VOCAB, **MODEL_OPTIONS),
        "SequenceClassifier": lambda: SequenceClassifier(VOCAB, 3, **MODEL_OPTIONS, pooling="cls"),
        "SequenceTagger": lambda: SequenceTagger(VOCAB, 3, **MODEL_OPTIONS),
    }[model]
    build_from_config = {
        "LanguageModel": lambda: LanguageModel.from_config(config),
        "SequenceClassifier": lambda: SequenceClassifier.from_config(config, 3, pooling="cls"),
        "SequenceTagger": lambda: SequenceTagger.from_config(config, 3),
    }[model]
    torch.manual_seed(0)
    from_keywords = build_from_keywords()
    torch.manual_seed(0)
    from_config = build_from_config()
    assert type(from_config).__name__ == model
    assert from_keywords.config == from_config.config == config
    assert _same_parameters(from_config, from_keywords)
    assert from_config.config.block_config == BlockConfig(
        16, 2, ff_dim=24, activation="swiglu", dropout=0.1, layer_norm_eps=1e-6, ff_chunks=2,
        self_attention=AttentionSpec("linear"))
    sequence = tokens(2, 6)
    from_config.eval(), from_keywords.eval()
    torch.testing.assert_close(from_config(sequence), from_keywords(sequence), atol=0, rtol=0)


def test_model_config_makes_rotary_layers_and_reversible_stacks():
    config = ModelConfig(VOCAB, dim=16, heads=2, positional="rotary", reversible=True)
    assert config.block_config.rotary
    assert isinstance(LanguageModel.from_config(config).decoder, ReversibleDecoder)
    assert replace(config, positional="none").block_config.rotary is False


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: ModelConfig(0), ValueError, "vocab_size"),
        (lambda: ModelConfig(VOCAB, dim=16, heads=3), ValueError, "dim=16 is not divisible by heads=3"),
        (lambda: ModelConfig(VOCAB, depth=0), ValueError, "depth"),
        (lambda: ModelConfig(VOCAB, positional="alibi"), ValueError, "positional"),
        (lambda: ModelConfig(VOCAB, positional="learned"), ValueError, "max_length"),
        (lambda: ModelConfig(VOCAB, max_length=0), ValueError, "max_length"),
        (lambda: ModelConfig(VOCAB, self_attention="nonesuch"), ValueError, "self_attention"),
        (lambda: ModelConfig(VOCAB, self_attention_options=["scale"]), TypeError, "self_attention_options"),
        (lambda: ModelConfig(VOCAB, token_shift="yes"), TypeError, "token_shift"),
        (lambda: ModelConfig(VOCAB, reversible=1), TypeError, "reversible"),
        (lambda: ModelConfig(VOCAB, reversible=True, norm_first=False), ValueError, "norm_first=True"),
        (lambda: ModelConfig(VOCAB, dim=16, heads=2, reversible=True, block="gau"), ValueError,
         "reversible=True needs block='attention'"),
        (lambda: LanguageModel.from_config(BlockConfig(16, 2)), TypeError, "config must be a ModelConfig"),
        (lambda: SequenceTagger.from_config(ModelConfig(VOCAB), 0), ValueError, "num_classes"),
        (lambda: SequenceClassifier.from_config(ModelConfig(VOCAB), 3, pooling="max"), ValueError, "pooling"),
    ],
)
def test_model_config_checks_every_option_naming_it(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_model_config_is_frozen():
    config = ModelConfig(VOCAB)
    with pytest.raises(AttributeError):
        config.dim = 32


# -- the gated block "flash" is now "flash_gau" --------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda: BlockConfig(16, 2, block="flash"),
    lambda: ModelConfig(VOCAB, dim=16, heads=2, block="flash"),
    lambda: LanguageModel(VOCAB, 16, 2, 1, block="flash", block_options={"chunk_size": 4}),
    lambda: Encoder(16, 2, 1, block="flash"),
])
def test_the_old_block_name_flash_is_refused_naming_the_new_one(build):
    with pytest.raises(ValueError, match="block 'flash' was renamed 'flash_gau'"):
        build()


def test_flash_gau_blocks_build_their_own_mechanism():
    model = LanguageModel(VOCAB, 16, 2, 1, block="flash_gau", block_options={"chunk_size": 4})
    assert model.decoder.layers[0].attention.name == UNIT_MECHANISMS["flash_gau"]
    assert set(UNIT_MECHANISMS) == set(attnzoo.models.config.BLOCKS) - {"attention", "mamba2", "mla"}
    assert set(UNIT_MECHANISMS.values()) <= set(attnzoo.available())


# -- the modules of attnzoo.models ---------------------------------------------------------------------------
MODELS_PACKAGE = Path(attnzoo.models.__file__).resolve().parent


def _model_imports(sources):
    """{module: set of the modules of the same package it imports}, parsed from {module name: source}; a
    relative import ("from .x import y", "from . import x") or an absolute one ("attnzoo.models.x"), at module
    level or inside a function. "from . import name" of a name that is no module is an import of __init__."""
    graph = {}
    for module, source in sources.items():
        imported = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                imported.update(name.split(".")[0] if name.split(".")[0] in sources else "__init__" for name in names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnzoo.models."):
                imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                imported.update(a.name.split(".")[2] for a in node.names if a.name.startswith("attnzoo.models."))
        graph[module] = imported - {module}
    return graph


def _import_cycles(graph):
    """Every cycle of the import graph, each as a list of modules from one back to itself (depth-first)."""
    cycles, finished = [], set()

    def visit(module, path):
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in finished:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        finished.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_no_two_model_modules_import_each_other():
    sources = {path.stem: path.read_text() for path in MODELS_PACKAGE.glob("*.py")}
    graph = _model_imports(sources)
    assert graph["reversible"] >= {"stacks"} and graph["language"] >= {"reversible", "stacks"}
    assert _import_cycles(graph) == []


def test_the_import_cycle_check_can_fail():
    pair = {"a": "from .b import B", "b": "def f():\n    from .a import A", "c": "from attnzoo.models.d import D",
            "d": "import attnzoo.models.c", "e": "from . import a"}
    graph = _model_imports(pair)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}
    assert sorted(map(tuple, _import_cycles(graph))) == [("a", "b", "a"), ("c", "d", "c")]
    assert _import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z", "x"]]


def test_the_old_module_paths_and_exports_keep_working():
    """Split by role, the models are still importable by the names and paths they had."""
    from attnzoo.models import transformer

    before = {"AttentionFusion", "AttentionSpec", "BlockConfig", "CopyDecoderState", "CopyMemory", "DecoderLayer",
              "EncoderLayer", "FeedForward", "GatedAttentionUnit", "GatedDecoderLayer", "GatedEncoderLayer",
              "LayerState", "Decoder", "DecoderState", "Encoder", "LanguageModel", "PointerGenerator",
              "ReversibleDecoder", "ReversibleEncoder", "Seq2SeqTransformer", "SequenceClassifier", "SequenceTagger",
              "TokenEmbedding"}
    assert before <= set(attnzoo.models.__all__)
    for name in ("CopyDecoderState", "Decoder", "DecoderState", "Encoder", "LanguageModel", "Seq2SeqTransformer",
                 "SequenceClassifier", "SequenceTagger", "TokenEmbedding"):
        assert getattr(transformer, name) is getattr(attnzoo.models, name), name
    assert callable(transformer.check_tokens) and callable(transformer.check_padding_mask)


@pytest.mark.parametrize("model_class, own", [(LanguageModel, set()), (SequenceClassifier, {"num_classes", "pooling"}),
                                              (SequenceTagger, {"num_classes", "causal"})])
def test_keyword_constructors_take_exactly_the_config_fields_with_its_defaults(model_class, own):
    """The keyword constructors are thin wrappers that make a ModelConfig: a field added to the config and
    forgotten in a wrapper (or a default that drifts) fails here."""
    import dataclasses
    import inspect

    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.init}
    parameters = dict(inspect.signature(model_class.__init__).parameters)
    parameters.pop("self")
    assert set(parameters) - own == set(fields)
    for name, default in fields.items():
        expected = inspect.Parameter.empty if default is dataclasses.MISSING else default
        assert parameters[name].default == expected, name

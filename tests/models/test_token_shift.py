"""Token shift: half of each position's embedding features come from the token before it.

Checked against the formula written out by hand, for causality, padding, incremental decoding and beam
reordering, bad input, and end to end: it is what lets a small model learn associative recall quickly."""

import pytest
import torch

from attnzoo import LanguageModel, SequenceClassifier, SequenceTagger
from attnzoo.models import TokenEmbedding
from attnzoo.state import select_batch
from attnzoo.tasks import load
from attnzoo.training import TrainConfig, build_model
from decoding_helpers import incremental_logits

VOCAB = 11


def tokens(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [2, 7, 16])
def test_shifted_features_are_the_previous_tokens_embedding(dim):
    embedding = TokenEmbedding(VOCAB, dim, "none", None, 0.0, token_shift=True).double()
    ids = tokens(3, 6)
    table = embedding.embedding.weight
    out = embedding(ids)
    kept = dim - dim // 2
    for b in range(3):
        for t in range(6):
            own = table[ids[b, t]]
            torch.testing.assert_close(out[b, t, :kept], own[:kept])
            before = table[ids[b, t - 1]][kept:] if t > 0 else torch.zeros(dim // 2, dtype=table.dtype)
            torch.testing.assert_close(out[b, t, kept:], before)
    # Without the shift the embedding is the plain lookup.
    plain = TokenEmbedding(VOCAB, dim, "none", None, 0.0)
    plain.load_state_dict(embedding.state_dict())
    torch.testing.assert_close(plain.double()(ids), table[ids])


def test_a_padded_token_never_reaches_the_position_after_it():
    embedding = TokenEmbedding(VOCAB, 8, "none", None, 0.0, token_shift=True)
    ids = tokens(1, 5)
    mask = torch.tensor([[True, True, False, False, False]])
    changed = ids.clone()
    changed[0, :2] = (changed[0, :2] + 3) % VOCAB
    a, b = embedding(ids, padding_mask=mask), embedding(changed, padding_mask=mask)
    torch.testing.assert_close(a[0, 2:], b[0, 2:], rtol=0, atol=0)
    assert (a[0, 2, 4:] == 0).all()  # the first real token has nothing before it


def test_language_model_with_token_shift_stays_causal():
    model = LanguageModel(VOCAB, dim=16, heads=2, depth=2, token_shift=True).double().eval()
    sequence = tokens(2, 9)
    later = sequence.clone()
    later[:, 5:] = (later[:, 5:] + 1) % VOCAB
    torch.testing.assert_close(model(sequence)[:, :5], model(later)[:, :5], rtol=0, atol=0)
    # ... and the shift is used: the token before a position changes that position's logits.
    earlier = sequence.clone()
    earlier[:, 3] = (earlier[:, 3] + 1) % VOCAB
    assert not torch.allclose(model(sequence)[:, 4], model(earlier)[:, 4])


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_language_model_with_token_shift_decodes_incrementally_like_forward(positional):
    model = LanguageModel(VOCAB, dim=16, heads=2, depth=2, positional=positional, token_shift=True).double().eval()
    sequence = tokens(3, 9)
    full = model(sequence)
    for prompt_len in (1, 4):
        torch.testing.assert_close(incremental_logits(model, prompt_len, sequence), full, atol=1e-10, rtol=1e-10)


def test_beam_reordering_carries_the_last_token():
    model = LanguageModel(VOCAB, dim=16, heads=2, depth=1, token_shift=True).double().eval()
    sequence = tokens(3, 6)
    _, state = model.prefill(sequence[:, :4])
    order = torch.tensor([2, 0, 0])
    logits_t, _ = model.step(sequence[order, 4], select_batch(state, order))
    torch.testing.assert_close(logits_t, model(sequence[order, :5])[:, -1], atol=1e-10, rtol=1e-10)


def test_a_state_without_the_last_token_is_refused():
    model = LanguageModel(VOCAB, dim=16, heads=2, depth=1, token_shift=True).eval()
    plain = LanguageModel(VOCAB, dim=16, heads=2, depth=1).eval()
    _, state = plain.prefill(tokens(2, 3))
    with pytest.raises(ValueError, match="last token .* token_shift"):
        model.step(tokens(2, 1)[:, 0], state)
    _, state = model.prefill(tokens(2, 3))
    with pytest.raises(ValueError, match="last token .* token_shift"):
        model.step(tokens(3, 1)[:, 0], state)


@pytest.mark.parametrize("build", [
    lambda shift: SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=1, token_shift=shift),
    lambda shift: SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=1, token_shift=shift),
    lambda shift: LanguageModel(VOCAB, dim=16, heads=2, depth=1, token_shift=shift),
])
@pytest.mark.parametrize("truthy", ["True", 1, None])
def test_token_shift_refuses_truthy_stand_ins(build, truthy):
    with pytest.raises(TypeError, match="token_shift must be True or False"):
        build(truthy)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_and_tagger_with_token_shift_ignore_padding(pooling):
    classifier = SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=2, pooling=pooling,
                                    token_shift=True).double().eval()
    tagger = SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=2, token_shift=True).double().eval()
    sequence = tokens(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 5:] = True   # right padding
    mask[1, :2] = True   # left padding: the first real token must not see the padded one before it
    changed = sequence.clone()
    changed[mask] = (changed[mask] + 1) % VOCAB
    torch.testing.assert_close(classifier(changed, padding_mask=mask), classifier(sequence, padding_mask=mask),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(tagger(changed, padding_mask=mask)[~mask], tagger(sequence, padding_mask=mask)[~mask],
                               rtol=0, atol=1e-12)


def test_train_config_builds_token_shift_models_and_refuses_seq2seq():
    task = load("recall", num_pairs=4, train_size=8, validation_size=4, test_size=4)
    model = build_model(TrainConfig(task="recall", token_shift=True), task)
    assert model.embedding.token_shift
    assert not build_model(TrainConfig(task="recall"), task).embedding.token_shift
    with pytest.raises(TypeError, match="token_shift must be True or False"):
        TrainConfig(task="recall", token_shift="yes")
    reverse = load("reverse", train_size=8, validation_size=4, test_size=4)
    with pytest.raises(ValueError, match="token_shift"):
        build_model(TrainConfig(task="reverse", token_shift=True), reverse)


@pytest.mark.slow
def test_token_shift_lets_a_small_model_learn_associative_recall(tmp_path, one_thread):
    """The same model and budget with and without the shift: only the shifted one gets past guessing
    among the stored values (about 1 / num_pairs)."""
    from attnzoo.training import train

    results = {}
    for shift in (False, True):
        config = TrainConfig(task="recall", task_options=dict(num_pairs=8), token_shift=shift,
                             positional="rotary", steps=200, lr=6e-3, eval_interval=200, batch_size=32)
        results[shift] = train(config, output=tmp_path / str(shift), progress=False).test["accuracy"]
    assert results[True] > 0.9, results
    assert results[False] < 0.5, results

"""The copy mechanism (pointer-generator, See et al. 2017): the mixed distribution sums to one and reaches
source-only tokens through extended ids, the fast path equals its float64 reference and passes gradcheck,
incremental decoding scores like a full forward pass, bad input is named, and a few steps of
`attnzoo train copy-names --copy-mechanism` then `attnzoo eval` (resuming such a run: in
test_training_seq2seq.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnzoo import Seq2SeqTransformer, beam_search, greedy_decode
from attnzoo.cli import main
from attnzoo.functional import (
    copy_weights,
    pointer_generator_log_probs,
    pointer_generator_log_probs_reference,
    scatter_copy,
)
from attnzoo.mechanisms import UnsupportedOptionError
from attnzoo.models import CopyDecoderState
from attnzoo.tasks import IGNORE_INDEX, load
from attnzoo.training import TrainConfig, build_model, find_checkpoint, train
from attnzoo.training.loop import loss_and_tally
from attnzoo.training.seq2seq import decoded_metrics, rare_token_recall

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, EXTENDED = 6, 9  # target ids 0..5; 6, 7, 8 exist only in the source


def mixing_inputs(seed=0, dtype=torch.float64, batch=3, seq_tgt=4, seq_src=5):
    generator = torch.Generator().manual_seed(seed)
    vocab_logits = torch.randn(batch, seq_tgt, VOCAB, generator=generator, dtype=dtype)
    copy_scores = torch.randn(batch, seq_tgt, seq_src, generator=generator, dtype=dtype)
    gate_logits = torch.randn(batch, seq_tgt, generator=generator, dtype=dtype)
    source_ids = torch.tensor([[3, 6, 6, -1, 8],    # a repeated source-only token, one blocked position
                               [-1, -1, -1, -1, -1],  # nothing to copy: the vocabulary distribution alone
                               [0, 7, 1, 1, -1]])[:batch]
    return vocab_logits, copy_scores, gate_logits, source_ids


# -- the maths -----------------------------------------------------------------------------------------------
def test_the_mixture_sums_to_one_and_puts_copy_mass_on_source_only_ids():
    vocab_logits, copy_scores, gate_logits, source_ids = mixing_inputs()
    log_probs = pointer_generator_log_probs(vocab_logits, copy_scores, gate_logits, source_ids, EXTENDED)
    assert log_probs.shape == (3, 4, EXTENDED)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 4, dtype=torch.float64))
    weights = copy_weights(copy_scores, source_ids)
    not_gen = torch.sigmoid(-gate_logits)
    # Row 0: ids 6 and 8 are outside the target vocabulary, reached by copying alone (6 from two positions).
    torch.testing.assert_close(log_probs[0, :, 6].exp(), not_gen[0] * (weights[0, :, 1] + weights[0, :, 2]))
    torch.testing.assert_close(log_probs[0, :, 8].exp(), not_gen[0] * weights[0, :, 4])
    assert (log_probs[0, :, 7] == float("-inf")).all()  # not in this source: probability 0
    assert (weights[0, :, 3] == 0).all() and (weights[2, :, 4] == 0).all()  # blocked positions
    # Row 1 cannot copy: p_gen is 1 there.
    torch.testing.assert_close(log_probs[1, :, :VOCAB], vocab_logits[1].log_softmax(-1))
    assert (log_probs[1, :, VOCAB:] == float("-inf")).all()


def test_scatter_copy_sums_the_weights_of_each_id():
    weights = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    ids = torch.tensor([[2, 0, 2, -1]])
    torch.testing.assert_close(scatter_copy(weights, ids, 4), torch.tensor([[[0.2, 0.0, 0.4, 0.0]]]))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fast_path_equals_the_float64_reference(dtype, tolerance):
    inputs = mixing_inputs(seed=3, dtype=dtype)
    fast = pointer_generator_log_probs(*inputs, EXTENDED).double()
    reference = pointer_generator_log_probs_reference(*inputs, EXTENDED)
    assert torch.equal(fast.isinf(), reference.isinf())
    finite = reference.isfinite()
    torch.testing.assert_close(fast[finite], reference[finite], atol=tolerance, rtol=tolerance)


def test_gradcheck_of_the_mixing_in_float64():
    vocab_logits, copy_scores, gate_logits, source_ids = mixing_inputs(seed=5)

    def finite_part(v, c, g):
        out = pointer_generator_log_probs(v, c, g, source_ids, EXTENDED)
        return torch.where(out.isfinite(), out, torch.zeros_like(out))

    inputs = tuple(x.clone().requires_grad_() for x in (vocab_logits, copy_scores, gate_logits))
    assert torch.autograd.gradcheck(finite_part, inputs)


def test_gradients_stay_finite_beside_probability_zero_outputs():
    """Label-smoothing-like losses reach every output; the -inf ones must not turn gradients into NaN."""
    inputs = tuple(x.clone().requires_grad_() for x in mixing_inputs(seed=6)[:3])
    out = pointer_generator_log_probs(*inputs, mixing_inputs()[3], EXTENDED)
    torch.where(out.isfinite(), out, torch.zeros_like(out)).sum().backward()
    assert all(x.grad.isfinite().all() for x in inputs)


@pytest.mark.parametrize("change, error, message", [
    (lambda v, c, g, s: (v, c, g, s + 10), ValueError, "source_ids holds ids in"),
    (lambda v, c, g, s: (v, c, g, s.clamp(max=0) - 2), ValueError, "source_ids holds ids in"),
    (lambda v, c, g, s: (v, c, g, s.double()), TypeError, "source_ids must be an int64 tensor"),
    (lambda v, c, g, s: (v, c[:, :, :3], g, s), ValueError, "copy_scores must have shape"),
    (lambda v, c, g, s: (v, c, g[:, :2], s), ValueError, "gate_logits must have shape"),
    (lambda v, c, g, s: (v[0], c, g, s), ValueError, "vocab_logits must have shape"),
    (lambda v, c, g, s: (v, c, g.long(), s), TypeError, "gate_logits must be a floating tensor"),
])
def test_bad_mixing_input_is_named(change, error, message):
    with pytest.raises(error, match=message):
        pointer_generator_log_probs(*change(*mixing_inputs()), EXTENDED)
    with pytest.raises(ValueError, match="extended_vocab_size must be an int >= the vocabulary"):
        pointer_generator_log_probs(*mixing_inputs(), VOCAB - 1)


# -- the model -----------------------------------------------------------------------------------------------
SOURCE_VOCAB = 9
COPY_MAP = torch.tensor([-1, -1, -1, 3, 4, 5, 6, 7, 8])  # specials never copied; 6..8 become extended ids 6..8


def copy_model(seed=0, copy_map=COPY_MAP, gate_bias=-1.0):
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(SOURCE_VOCAB, VOCAB, 16, 2, encoder_depth=1, decoder_depth=2,
                               copy_mechanism=True, copy_map=copy_map).double().eval()
    with torch.no_grad():  # sharper distributions than at initialization, and copying favoured
        model.head.weight.mul_(4.0)
        model.pointer.query.weight.mul_(4.0)
        model.pointer.gate.bias.fill_(gate_bias)
    return model


def sources(seed=2):
    source = torch.randint(3, SOURCE_VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    return source.masked_fill(mask, 0), mask


def test_model_outputs_are_a_distribution_over_the_extended_vocabulary():
    model = copy_model()
    source, mask = sources()
    assert model.output_vocab_size == EXTENDED
    tgt = torch.tensor([[1, 7, 3, 8], [1, 4, 6, 2]])  # extended ids read back as decoder inputs
    log_probs = model(source, tgt, src_padding_mask=mask)
    assert log_probs.shape == (2, 4, EXTENDED)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 4, dtype=torch.float64))
    for b in range(2):
        held = set(source[b][~mask[b]].tolist())
        for token in range(VOCAB, EXTENDED):  # a source-only token is possible exactly when the source holds it
            assert bool((log_probs[b, :, token] > float("-inf")).all()) == (token in held)


def test_without_the_copy_mechanism_nothing_changes():
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(SOURCE_VOCAB, VOCAB, 16, 2, encoder_depth=1, decoder_depth=1)
    torch.manual_seed(0)
    again = Seq2SeqTransformer(SOURCE_VOCAB, VOCAB, 16, 2, encoder_depth=1, decoder_depth=1, copy_mechanism=False)
    assert plain.pointer is None and plain.output_vocab_size == VOCAB
    source, mask = sources()
    tgt = torch.tensor([[1, 3], [1, 4]])
    assert torch.equal(plain(source, tgt, src_padding_mask=mask), again(source, tgt, src_padding_mask=mask))


def naive_greedy(model, prompt, steps, source, mask):
    """Greedy decoding by a full forward pass per token: no state."""
    sequence = prompt
    for _ in range(steps):
        log_probs = model(source, sequence, src_padding_mask=mask)
        sequence = torch.cat([sequence, log_probs[:, -1].argmax(-1, keepdim=True)], dim=1)
    return sequence


def full_scores(model, sequence, source, mask):
    """(batch, seq - 1) log-probabilities of sequence[:, 1:] from one full forward pass."""
    return model(source, sequence, src_padding_mask=mask)[:, :-1].gather(-1, sequence[:, 1:, None])[..., 0]


def test_greedy_decoding_with_copying_equals_full_forward_recomputation():
    model = copy_model()
    source, mask = sources()
    prompt = torch.full((2, 1), 1)
    got = greedy_decode(model, prompt, 6, source=source, source_padding_mask=mask)
    torch.testing.assert_close(got, naive_greedy(model, prompt, 6, source, mask), atol=0, rtol=0)
    assert (got >= VOCAB).any()  # the decode copied source-only tokens and read them back
    # The scores themselves, step by step against one full pass.
    log_probs, state = model.prefill(source, prompt, src_padding_mask=mask)
    scores = [log_probs[:, -1].gather(-1, got[:, 1:2])[:, 0]]
    for t in range(2, got.shape[1]):
        log_probs, state = model.step(got[:, t - 1], state)
        scores.append(log_probs.gather(-1, got[:, t:t + 1])[:, 0])
    torch.testing.assert_close(torch.stack(scores, 1), full_scores(model, got, source, mask))


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_scores_with_copying_are_the_full_forward_scores_of_their_sequences(length_penalty):
    model = copy_model(seed=3)
    source, mask = sources(seed=4)
    prompt = torch.full((2, 1), 1)
    result = beam_search(model, prompt, 5, beam_size=3, length_penalty=length_penalty, eos_id=2, source=source,
                         source_padding_mask=mask)
    assert (result.sequences >= VOCAB).any()
    for b in range(2):
        for j in range(3):
            length = int(result.lengths[b, j])
            sequence = result.sequences[b, j, :length][None]
            raw = full_scores(model, sequence, source[b:b + 1], mask[b:b + 1]).sum().item()
            assert math.isclose(result.scores[b, j].item(), raw / (length - 1) ** length_penalty, rel_tol=1e-9)


def test_the_state_carries_the_copy_memory():
    model = copy_model()
    source, mask = sources()
    _, state = model.prefill(source, torch.full((2, 1), 1), src_padding_mask=mask)
    assert isinstance(state, CopyDecoderState) and state.position == 1
    assert torch.equal(state.copy.source_ids[1, 3:], torch.full((3,), -1))  # padding is never copied
    plain = Seq2SeqTransformer(SOURCE_VOCAB, VOCAB, 16, 2, encoder_depth=1, decoder_depth=1)
    _, plain_state = plain.prefill(source, torch.full((2, 1), 1), src_padding_mask=mask)
    with pytest.raises(TypeError, match="state must be the CopyDecoderState"):
        model.step(torch.tensor([3, 4]), plain_state)
    with pytest.raises(TypeError, match="state must be the DecoderState"):
        plain.step(torch.tensor([3, 4]), state)


@pytest.mark.parametrize("options, error, message", [
    (dict(copy_mechanism=True), ValueError, "copy_mechanism=True needs copy_map"),
    (dict(copy_map=COPY_MAP), ValueError, "copy_map is only used with copy_mechanism=True"),
    (dict(copy_mechanism=1, copy_map=COPY_MAP), TypeError, "copy_mechanism must be True or False"),
    (dict(copy_mechanism=True, copy_map=COPY_MAP[:5]), ValueError, "copy_map must give one target id per source"),
    (dict(copy_mechanism=True, copy_map=COPY_MAP.int()), TypeError, "copy_map must be a 1-D int64 tensor"),
    (dict(copy_mechanism=True, copy_map=COPY_MAP.tolist()), TypeError, "copy_map must be a 1-D int64 tensor"),
    (dict(copy_mechanism=True, copy_map=torch.full((9,), -1)), ValueError, "maps no source token"),
    (dict(copy_mechanism=True, copy_map=COPY_MAP.clamp(min=-2) - 3 * (COPY_MAP < 0)), ValueError,
     "copy_map holds -4"),
    (dict(copy_mechanism=True, copy_map=torch.tensor([-1, -1, -1, 3, 4, 5, 6, 8, 8])), ValueError,
     "without gaps"),
])
def test_bad_copy_settings_are_named(options, error, message):
    with pytest.raises(error, match=message):
        Seq2SeqTransformer(SOURCE_VOCAB, VOCAB, 16, 2, **options)


def test_target_ids_past_the_extended_vocabulary_are_refused():
    model = copy_model()
    source, mask = sources()
    with pytest.raises(ValueError, match=r"tgt holds ids in \[1, 9\], outside the vocabulary \[0, 9\)"):
        model(source, torch.tensor([[1, 9], [1, 3]]), src_padding_mask=mask)
    with pytest.raises(ValueError, match="token_t holds ids"):
        _, state = model.prefill(source, torch.full((2, 1), 1), src_padding_mask=mask)
        model.step(torch.tensor([EXTENDED, 3]), state)


# -- tasks and training --------------------------------------------------------------------------------------
NAMES = dict(train_size=48, validation_size=16, test_size=16, num_names=20, num_numbers=20)
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=4, eval_interval=2)


def test_task_copy_maps_pair_tokens_by_name():
    names = load("copy-names", **NAMES)
    copy_map = names.copy_map()
    assert copy_map[:3].tolist() == [-1, -1, -1]  # PAD, BOS, EOS
    assert torch.equal(copy_map[3:], torch.arange(3, names.vocab_size))  # one shared vocabulary
    assert names.name_ids | names.number_ids == names.rare_ids and not names.name_ids & names.number_ids
    assert {names.target_tokens[i] for i in names.number_ids} == {str(n) for n in range(20)}
    g2p = load("g2p", train_size=8, validation_size=4, test_size=4)
    assert (g2p.copy_map() == -1).all()  # letters and phonemes share nothing


def test_copy_names_without_a_shared_vocabulary_holds_held_out_names_as_extended_ids():
    task = load("copy-names", **NAMES, shared_vocabulary=False)
    held_out = task.extended_tokens
    assert len(held_out) == 10 and not set(held_out) & set(task.target_tokens)
    assert task.num_classes == task.vocab_size - len(held_out)
    copy_map = task.copy_map()
    extended = {task.source_tokens.index(name): task.num_classes + k for k, name in enumerate(held_out)}
    assert all(copy_map[source_id] == target_id for source_id, target_id in extended.items())
    assert int(task.split("train").targets.max()) < task.num_classes  # training answers never need them
    test = task.split("test")
    for row in range(len(test)):
        source_names = {extended[t] for t in test.inputs[row].tolist() if t in extended}
        answer_names = {t for t in test.targets[row].tolist() if t >= task.num_classes}
        assert answer_names == source_names and len(answer_names) == 1  # each answer repeats its source's name
    assert {task.num_classes + k for k in range(len(held_out))} <= task.name_ids
    with pytest.raises(ValueError, match="copy_mechanism is needed: copy-names's answers"):
        build_model(TrainConfig("copy-names", task_options={**NAMES, "shared_vocabulary": False}, **SMALL), task)
    with pytest.raises(TypeError, match="shared_vocabulary must be True or False"):
        load("copy-names", **NAMES, shared_vocabulary="no")


def test_rare_token_recall_counts_each_rare_token_of_the_reference():
    rare = {10, 11, 12}
    predictions = [[10, 5, 11], [12, 12], [5], []]
    references = [[11, 5, 10], [12, 12, 12], [5, 6], [10]]
    # 2 of 2, 2 of 3, nothing to find, 0 of 1.
    assert rare_token_recall(predictions, references, rare) == pytest.approx(4 / 6)
    assert decoded_metrics(predictions, references, rare)["rare_token_recall"] == pytest.approx(4 / 6)
    assert "rare_token_recall" not in decoded_metrics(predictions, references)
    assert rare_token_recall([[1]], [[1]], rare) == 1.0


def test_the_training_loss_is_the_nll_of_the_mixture():
    task = load("copy-names", **NAMES)
    torch.manual_seed(0)
    model = build_model(TrainConfig("copy-names", task_options=NAMES, copy_mechanism=True, **SMALL), task)
    split = task.split("train")
    index = torch.arange(8)
    log_probs = model(split.inputs[index], split.decoder_inputs[index],
                      src_padding_mask=split.padding_mask[index])
    targets = split.targets[index]
    loss, tally = loss_and_tally("seq2seq", log_probs, targets)
    scored = targets != IGNORE_INDEX
    expected = -log_probs[scored].gather(-1, targets[scored][:, None]).mean()
    torch.testing.assert_close(loss, expected.float())


def test_copy_settings_are_checked_by_the_config_and_the_task():
    with pytest.raises(TypeError, match="copy_mechanism must be True or False"):
        TrainConfig("copy-names", copy_mechanism="yes")
    with pytest.raises(ValueError, match="label_smoothing 0.1 cannot be combined with copy_mechanism"):
        TrainConfig("copy-names", copy_mechanism=True, label_smoothing=0.1)
    recall = TrainConfig("recall", task_options=dict(train_size=8, validation_size=4, test_size=4, num_pairs=2,
                                                     num_keys=4, num_values=4), copy_mechanism=True, **SMALL)
    with pytest.raises(ValueError, match="copy_mechanism needs a seq2seq task"):
        train(recall, None, progress=False)
    g2p = TrainConfig("g2p", task_options=dict(train_size=8, validation_size=4, test_size=4),
                      copy_mechanism=True, **SMALL)
    with pytest.raises(UnsupportedOptionError, match="g2p's vocabularies share none"):
        train(g2p, None, progress=False)


@pytest.mark.parametrize("argv, message", [
    (["train", "g2p", "--copy-mechanism"], "--copy-mechanism needs a task whose source and target share tokens"),
    (["train", "recall", "--copy-mechanism"], "--copy-mechanism needs a seq2seq task"),
    (["train", "copy-names", "--copy-mechanism", "--label-smoothing", "0.1"],
     "--label-smoothing 0.1 cannot be combined with copy_mechanism"),
    (["train", "copy-names", "--task-options", "shared_vocabulary=false"], "--copy-mechanism is needed"),
])
def test_bad_copy_options_are_one_line_usage_errors(capsys, argv, message):
    assert main([*argv, "--task-options", "train_size=8,validation_size=4,test_size=4", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("shared_vocabulary", [True, False])
def test_a_few_steps_of_attnzoo_train_copy_names_with_the_copy_mechanism_then_eval(capsys, tmp_path,
                                                                                 shared_vocabulary):
    options = json.dumps({**NAMES, "shared_vocabulary": shared_vocabulary})
    argv = ["train", "copy-names", "--copy-mechanism", "--task-options", options, "--dim", "16",
            "--depth", "1", "--heads", "2", "--batch-size", "8", "--steps", "3", "--eval-interval", "3",
            "--scheduled-sampling", "two-pass", "--output", str(tmp_path), "--quiet", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["copy_mechanism"] is True
    for split in ("validation", "test"):
        assert 0 <= result[split]["rare_token_recall"] <= 1 and math.isfinite(result[split]["loss"])
    saved = json.loads((find_checkpoint(tmp_path) / "config.json").read_text())
    assert saved["train"]["copy_mechanism"] is True
    assert main(["eval", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exact_match" in out and "rare_token_recall" in out



def test_monotonic_inference_is_refused_with_the_copy_mechanism():
    # The window would hold the cross-attention but not the copy attention, which reads every source position.
    from attnzoo.models.monotonic import MonotonicInference

    model, (source, mask) = copy_model(), sources()
    prompt = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(UnsupportedOptionError, match="monotonic"):
        greedy_decode(model, prompt, 3, source=source, source_padding_mask=mask, monotonic=MonotonicInference(ahead=2))
    with pytest.raises(UnsupportedOptionError, match="cross_attention_mask"):
        model.prefill(source, prompt, src_padding_mask=mask, cross_attention_mask=torch.zeros_like(mask))

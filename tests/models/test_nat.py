"""Non-autoregressive decoding: the decoder's self-attention is bidirectional and reads no target token, the
length head pools only real source positions and learns lengths, nat_decode equals a row-by-row reference,
bad arguments are named, a model that learned `copy` reproduces its input, and `attnzoo train` and `eval` run in
this mode (resuming: test_training_seq2seq.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from attnzoo import Seq2SeqTransformer, nat_decode
from attnzoo.cli import main
from attnzoo.models.nat import LengthHead, length_loss, mean_over_positions, predicted_lengths
from attnzoo.tasks import Seq2SeqSplit, load
from attnzoo.training import TrainConfig, build_model, train
from attnzoo.training.loop import load_trained, model_logits
from attnzoo.training.nat import nat_logits, target_lengths

VOCAB, EOS = 11, 2
NAT = dict(decoding="non-autoregressive", max_target_length=8)
COPY = dict(train_size=64, validation_size=16, test_size=16, length=6, num_symbols=6)
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=4, eval_interval=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def nat_model(seed: int = 0, **changes) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, **{**NAT, **changes}).double().eval()


def source(batch: int = 3, length: int = 7, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, 5:] = True
    return tokens.masked_fill(mask, 0), mask


# -- the parallel pass ---------------------------------------------------------------------------------------
def test_every_position_sees_the_later_placeholders():
    """Hiding the last positions (as padding keys) changes position 0's output: the self-attention looks ahead.
    The same decoder run causally is blind to them, which shows the check can fail."""
    model = nat_model()
    src, mask = source()
    memory = model.encode(src, src_padding_mask=mask)
    full = model.decode_nat(memory, memory_padding_mask=mask, target_lengths=torch.tensor([8, 8, 8]))
    short = model.decode_nat(memory, memory_padding_mask=mask, target_lengths=torch.tensor([8, 3, 8]))
    assert not torch.allclose(full[1, 0], short[1, 0])
    torch.testing.assert_close(full[[0, 2]], short[[0, 2]])  # the other rows are untouched
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    y = x.clone()
    y[:, 5] = torch.randn(3, 16, dtype=torch.float64)  # a later position, changed (not by a constant: norms undo that)
    for causal, changes in ((False, True), (True, False)):
        a = model.decoder(x, memory, memory_padding_mask=mask, causal=causal)
        b = model.decoder(y, memory, memory_padding_mask=mask, causal=causal)
        assert (not torch.allclose(a[:, 0], b[:, 0])) == changes


def test_the_pass_reads_no_target_token():
    """Training logits are the same whatever the split's decoder inputs hold; the teacher-forced entry points
    refuse a non-autoregressive model instead of reading them."""
    task = load("copy", **COPY)
    cfg = TrainConfig("copy", task_options=COPY, decoding="non-autoregressive", **SMALL)
    torch.manual_seed(0)
    model = build_model(cfg, task).eval()
    split = task.split("train")
    index = torch.arange(8)
    scrambled = Seq2SeqSplit(split.inputs, split.targets, split.padding_mask,
                             torch.randint(0, task.num_classes, split.decoder_inputs.shape))
    args = (index, split.inputs[index], split.padding_mask[index])
    a, length_a = model_logits(model, task, split, *args)
    b, length_b = model_logits(model, task, scrambled, *args)
    assert torch.equal(a, b) and torch.equal(length_a, length_b)
    src, tgt = split.inputs[:2], split.decoder_inputs[:2]
    for call in (lambda: model(src, tgt), lambda: model.prefill(src, tgt[:, :1])):
        with pytest.raises(ValueError, match="decoding='non-autoregressive' does not read"):
            call()


def test_padded_target_positions_change_nothing_before_them():
    """Positions past a row's length are padding keys: their count (the width) does not change the rest."""
    model = nat_model()
    src, mask = source()
    lengths = torch.tensor([3, 5, 2])
    narrow, _ = model.forward_nat(src, src_padding_mask=mask, target_lengths=lengths, width=5)
    wide, _ = model.forward_nat(src, src_padding_mask=mask, target_lengths=lengths, width=8)
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(narrow[row, :length], wide[row, :length])


def _reference_decode(logits, lengths, eos_id):
    """Row by row: the argmax, END from position length - 1 on (when lengths are given) and after the first END."""
    rows = []
    for row, scores in enumerate(logits.tolist()):
        tokens = [max(range(len(s)), key=s.__getitem__) for s in scores]
        if lengths is not None:
            tokens = tokens[: int(lengths[row]) - 1] + [eos_id] * (len(tokens) - int(lengths[row]) + 1)
        if eos_id in tokens:
            first = tokens.index(eos_id)
            tokens = tokens[:first] + [eos_id] * (len(tokens) - first)
        rows.append(tokens)
    return torch.tensor(rows)


@pytest.mark.parametrize("length", ["predicted", "max"])
def test_nat_decode_equals_its_row_by_row_reference(length):
    model = nat_model(seed=3, length=length)
    src, mask = source(batch=5, seed=4)
    logits, length_logits = model.forward_nat(src, src_padding_mask=mask)
    lengths = None
    if length == "predicted":
        lengths = predicted_lengths(length_logits)
        logits, _ = model.forward_nat(src, src_padding_mask=mask, target_lengths=lengths)
    else:
        assert length_logits is None
    decoded = nat_decode(model, src, eos_id=EOS, source_padding_mask=mask)
    assert torch.equal(decoded, _reference_decode(logits, lengths, EOS))
    given = torch.tensor([2, 8, 1, 4, 6])
    decoded = nat_decode(model, src, eos_id=EOS, source_padding_mask=mask, target_lengths=given)
    if length == "predicted":  # given lengths take the prediction's place
        logits, _ = model.forward_nat(src, src_padding_mask=mask, target_lengths=given)
    assert torch.equal(decoded, _reference_decode(logits, given, EOS))
    assert (decoded[:, -1] == EOS).all() and (decoded[2] == EOS).all()  # length 1: END only


def test_a_sentence_decoded_alone_equals_it_decoded_in_a_batch():
    """Alone, a sentence needs no padding on either side (and its decoder runs without a mask)."""
    model = nat_model(seed=3)
    src, mask = source(batch=5, seed=4)
    batch = nat_decode(model, src, eos_id=EOS, source_padding_mask=mask)
    for row in range(5):
        alone = nat_decode(model, src[row : row + 1, ~mask[row]], eos_id=EOS)[0]
        assert torch.equal(alone, batch[row, : len(alone)]) and (batch[row, len(alone) :] == EOS).all()


# -- the length head -----------------------------------------------------------------------------------------
def test_mean_over_positions_and_the_length_loss_equal_their_formulas():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[False] * 5, [False, False, True, True, True], [True] * 5])
    pooled = mean_over_positions(hidden, mask)
    for row in range(3):
        kept = [hidden[row, i] for i in range(5) if not mask[row, i]]
        expected = sum(kept) / len(kept) if kept else torch.zeros(4, dtype=torch.float64)
        torch.testing.assert_close(pooled[row], expected)
    logits = torch.randn(4, 6, generator=generator)
    lengths = torch.tensor([1, 6, 3, 3])
    expected = -sum(math.log(F.softmax(logits[i].double(), 0)[lengths[i] - 1]) for i in range(4)) / 4
    assert float(length_loss(logits, lengths)) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(predicted_lengths(logits), logits.argmax(dim=1) + 1)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 6\]"):
        length_loss(logits, torch.tensor([0, 1, 2, 3]))


def test_the_length_head_ignores_padded_source_positions():
    model = nat_model()
    src, mask = source()
    _, a = model.forward_nat(src, src_padding_mask=mask)
    _, b = model.forward_nat(src.masked_fill(mask, 7), src_padding_mask=mask)
    torch.testing.assert_close(a, b)
    head = LengthHead(16, 8).double()  # pooled without the mask, the padded positions would count
    memory = model.encode(src, src_padding_mask=mask)
    assert not torch.allclose(head(memory, mask)[1], head(memory, None)[1])


def test_the_length_head_learns_lengths():
    """160 steps on the length loss alone teach the head to tell the length (source length + END)."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, encoder_depth=1, decoder_depth=1, **NAT)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(5)

    def batch(n):
        lengths = torch.randint(1, 8, (n,), generator=generator)
        mask = torch.arange(7)[None, :] >= lengths[:, None]
        return torch.randint(3, VOCAB, (n, 7), generator=generator).masked_fill(mask, 0), mask, lengths + 1

    def length_logits(src, mask):
        return model.nat.length_head(model.encode(src, src_padding_mask=mask), mask)

    src, mask, lengths = batch(64)
    with torch.no_grad():
        before = float(length_loss(length_logits(src, mask), lengths))
    for _ in range(160):
        s, m, n = batch(32)
        loss = length_loss(length_logits(s, m), n)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = length_logits(src, mask)
    assert float(length_loss(after, lengths)) < 0.25 * before
    assert (predicted_lengths(after) == lengths).float().mean() > 0.9


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, error, message", [
    (dict(length="predicted"), ValueError, "length='predicted' is an option of decoding='non-autoregressive'"),
    (dict(max_target_length=8), ValueError, "max_target_length=8 is an option of decoding='non-autoregressive'"),
    (dict(decoding="parallel"), ValueError, "decoding must be one of"),
    (dict(decoding="non-autoregressive"), ValueError, "needs max_target_length"),
    (dict(**NAT, length="guessed"), ValueError, "length must be one of 'predicted', 'max'"),
    (dict(**NAT, positional="none"), ValueError, "positional='none'"),
    (dict(**NAT, reversible=True), ValueError, "reversible=True"),
    (dict(decoding="non-autoregressive", max_target_length=0), ValueError, "max_target_length must be"),
    (dict(decoding="non-autoregressive", max_target_length=8.0), TypeError, "max_target_length must be"),
])
def test_bad_model_arguments_are_named(options, error, message):
    with pytest.raises(error, match=re.escape(message) if "(" not in message else message):
        Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, **options)


def test_bad_decoding_arguments_are_named():
    model = nat_model()
    src, mask = source()
    with pytest.raises(TypeError, match="target_lengths must be an integer tensor"):
        model.forward_nat(src, target_lengths=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"target_lengths must have shape \(batch,\) = \(3,\)"):
        model.forward_nat(src, target_lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"target_lengths must be in \[1, 8\]"):
        model.forward_nat(src, target_lengths=torch.tensor([1, 9, 2]))
    with pytest.raises(ValueError, match=r"target_lengths must be in \[1, 4\]"):
        model.forward_nat(src, target_lengths=torch.tensor([1, 5, 2]), width=4)
    with pytest.raises(ValueError, match="width must be an integer >= 1 and <= 8"):
        model.forward_nat(src, width=9)
    with pytest.raises(ValueError, match="eos_id .*required"):
        nat_decode(model, src, eos_id=None)
    with pytest.raises(ValueError, match="eos_id must be"):
        nat_decode(model, src, eos_id=VOCAB)
    autoregressive = Seq2SeqTransformer(VOCAB, VOCAB, 16, 2)
    with pytest.raises(TypeError, match="decoding='non-autoregressive', got 'autoregressive'"):
        nat_decode(autoregressive, src, eos_id=EOS)
    with pytest.raises(ValueError, match="forward_nat and decode_nat need a model built with"):
        autoregressive.forward_nat(src)
    with pytest.raises(TypeError, match="causal must be True or False"):
        model.decoder(torch.zeros(1, 2, 16, dtype=torch.float64), model.encode(src[:1]), causal="no")


@pytest.mark.parametrize("changes, message", [
    (dict(length_mode="max"), "length_mode 'max' is a setting of decoding 'non-autoregressive'"),
    (dict(length_loss=0.5), "length_loss 0.5 is a setting of decoding 'non-autoregressive'"),
    (dict(decoding="non-autoregressive", scheduled_sampling="token"), "scheduled_sampling 'token' feeds"),
    (dict(decoding="non-autoregressive", guide_loss=1.0), "guide_loss 1.0 is measured on a teacher-forced"),
    (dict(decoding="non-autoregressive", length_mode="max", length_loss=0.5), "length_loss 0.5 weighs"),
    (dict(decoding="non-autoregressive", length_loss=-1.0), "length_loss must be a number >= 0"),
    (dict(decoding="non-autoregressive", length_mode="fixed"), "length_mode must be one of"),
    (dict(decoding="non-autoregressive", copy_mechanism=True), "copy_mechanism is built for autoregressive"),
])
def test_settings_that_do_not_fit_the_decoding_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig("copy", task_options=COPY, **{**SMALL, **changes})


@pytest.mark.parametrize("argv, message", [
    (["train", "copy", "--decoding", "non-autoregressive", "--scheduled-sampling", "two-pass"],
     "--scheduled-sampling 'two-pass' feeds the decoder its own tokens"),
    (["train", "copy", "--length-mode", "max"], "--length-mode 'max' is a setting of decoding"),
    (["train", "recall", "--decoding", "non-autoregressive"], "--decoding 'non-autoregressive' needs a seq2seq task"),
    (["train", "copy", "--decoding", "non-autoregressive", "--beam-size", "2"], "decodes in one parallel pass"),
    (["train", "copy-names", "--copy-mechanism", "--monotonic-inference"], "leave it off with --copy-mechanism"),
])
def test_bad_options_are_one_line_usage_errors_naming_them(capsys, argv, message):
    assert main([*argv, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


# -- end to end ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length_mode", ["predicted", "max"])
def test_a_few_steps_of_attnzoo_train_and_eval_in_nat_mode(capsys, tmp_path, length_mode):
    argv = ["train", "copy", "--decoding", "non-autoregressive", "--length-mode", length_mode,
            "--task-options", json.dumps(COPY), "--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "8",
            "--steps", "3", "--eval-interval", "3", "--output", str(tmp_path), "--quiet", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["decoding"] == "non-autoregressive" and result["config"]["length_mode"] == length_mode
    for split in ("validation", "test"):
        metrics = result[split]
        assert {"loss", "exact_match", "token_error_rate", "ms_per_sentence"} <= set(metrics)
        assert "guide_loss" not in metrics and ("length_loss" in metrics) == (length_mode == "predicted")
        assert math.isfinite(metrics["loss"]) and metrics["ms_per_sentence"] > 0
    assert main(["eval", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["decoding"] == "non-autoregressive" and "ms_per_sentence" in report["metrics"]


def test_autoregressive_evaluation_reports_its_decoding_time_too(tmp_path):
    result = train(TrainConfig("copy", task_options=COPY, **SMALL), tmp_path, progress=False)
    assert result.test["ms_per_sentence"] > 0 and "length_loss" not in result.test
    assert "ms_per_sentence" in (tmp_path / "metrics.csv").read_text().splitlines()[0]


@pytest.mark.slow
def test_nat_with_the_true_length_reproduces_the_input_once_it_learned_copy(tmp_path):
    """150 steps on `copy` (strings of 4..6 of 6 symbols); then one pass with each test target's true length
    gives back the source, where the untrained model does not."""
    options = dict(train_size=2000, validation_size=16, test_size=64, length=6, num_symbols=6)
    cfg = TrainConfig("copy", task_options=options, dim=32, depth=1, heads=2, batch_size=32, steps=150,
                      eval_interval=150, eval_batches=1, lr=3e-3, decoding="non-autoregressive")
    task = load("copy", **options)
    split = task.split("test")
    lengths = target_lengths(split.targets)

    def reproduced(model):
        decoded = nat_decode(model.eval(), split.inputs, eos_id=task.eos_id, source_padding_mask=split.padding_mask,
                             target_lengths=lengths)
        return sum(torch.equal(decoded[i, : n - 1], split.inputs[i, : n - 1]) for i, n in enumerate(lengths.tolist()))

    torch.manual_seed(0)
    assert reproduced(build_model(cfg, task)) < 8
    train(cfg, tmp_path, progress=False)
    model, _, _ = load_trained(tmp_path)
    assert reproduced(model) >= 0.95 * len(lengths)
    assert nat_logits(model, split, torch.arange(4), split.inputs[:4], split.padding_mask[:4])[0].shape[1] == 7


def test_a_copy_mechanism_model_cannot_be_non_autoregressive():
    from attnzoo.mechanisms import UnsupportedOptionError

    with pytest.raises(UnsupportedOptionError, match="copy_mechanism=True: the copy mechanism is built for"):
        Seq2SeqTransformer(VOCAB, VOCAB, 16, 2, copy_mechanism=True, copy_map=torch.arange(VOCAB), **NAT)


def test_evaluation_of_a_nat_model_refuses_another_decoder():
    from attnzoo.mechanisms import UnsupportedOptionError
    from attnzoo.training.decoders import DecoderSettings
    from attnzoo.training.loop import evaluate

    cfg = TrainConfig("copy", task_options=COPY, decoding="non-autoregressive", **SMALL)
    task = load("copy", **COPY)
    model = build_model(cfg, task)
    with pytest.raises(UnsupportedOptionError, match="non-autoregressive model decodes in one parallel pass"):
        evaluate(model, task, "test", decoding=DecoderSettings(decoder="beam", beam_size=2))

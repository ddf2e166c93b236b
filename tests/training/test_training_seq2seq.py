"""Seq2seq training: the teacher-probability schedules and label smoothing equal their formulas, scheduled
sampling with teacher probability 1 is teacher forcing exactly (and with 0 is the model's own decoding),
decoded metrics, bad settings named, and a few steps of `attnzoo train` on each seq2seq task."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.cli import main
from attnzoo.decoding import greedy_decode
from attnzoo.tasks import IGNORE_INDEX, load
from attnzoo.training import TrainConfig, build_model, find_checkpoint, train
from attnzoo.training.loop import loss_and_tally, model_logits
from attnzoo.training.seq2seq import (
    CrossAttentionRecorder,
    decoded_metrics,
    default_sampling_k,
    edit_distance,
    guide_loss,
    guide_penalties,
    smoothed_cross_entropy,
    teacher_probability,
)

REVERSE = dict(train_size=64, validation_size=16, test_size=16, length=7, num_symbols=6)
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=6, eval_interval=3)


def config(**changes) -> TrainConfig:
    return TrainConfig("reverse", **{**SMALL, "task_options": REVERSE, **changes})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reverse():
    return load("reverse", **REVERSE)


# -- schedules -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, 1, 7, 50, 99, 100, 250, 10_000])
def test_teacher_probability_equals_bengios_formulas(step):
    assert teacher_probability("linear", step, 100.0) == pytest.approx(max(0.0, 1 - step * 0.01), abs=1e-15)
    assert teacher_probability("linear", step, 100.0, 0.25) == pytest.approx(max(0.25, 1 - step * 0.01))
    assert teacher_probability("exponential", step, 0.97) == pytest.approx(math.pow(0.97, step), rel=1e-12)
    expected = 20.0 / (20.0 + math.exp(step / 20.0))
    assert teacher_probability("inverse-sigmoid", step, 20.0) == pytest.approx(expected, rel=1e-12)
    assert teacher_probability("exponential", step, 0.97, 0.1) == max(0.1, 0.97**step)


def test_default_constants_span_the_run():
    steps = 400
    assert teacher_probability("linear", steps, default_sampling_k("linear", steps)) == pytest.approx(0.0)
    assert teacher_probability("exponential", steps, default_sampling_k("exponential", steps)) == pytest.approx(0.01)
    k = default_sampling_k("inverse-sigmoid", steps)
    assert teacher_probability("inverse-sigmoid", steps // 2, k) == pytest.approx(0.5, abs=1e-6)
    # Each schedule decreases from (nearly) 1.
    for decay in ("linear", "exponential", "inverse-sigmoid"):
        values = [config(scheduled_sampling="two-pass", sampling_decay=decay, steps=steps).teacher_probability(i)
                  for i in range(0, steps + 1, 20)]
        assert values[0] > 0.98 and all(a >= b for a, b in zip(values, values[1:])) and values[-1] < 0.05
    assert config().teacher_probability(300) == 1.0  # no scheduled sampling: always the gold token


# -- label smoothing -----------------------------------------------------------------------------------------
def test_label_smoothing_equals_its_formula():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 7, generator=generator)
    targets = torch.randint(0, 7, (10,), generator=generator)
    targets[[2, 5]] = IGNORE_INDEX
    eps = 0.1
    expected = 0.0
    for row in range(10):  # -sum_c q_c log p_c with q = (1 - eps) one-hot + eps / classes, in float64
        if targets[row] == IGNORE_INDEX:
            continue
        p = torch.softmax(logits[row].double(), dim=0)
        q = torch.full((7,), eps / 7, dtype=torch.float64)
        q[targets[row]] += 1 - eps
        expected += float(-(q * p.log()).sum())
    assert float(smoothed_cross_entropy(logits, targets, eps)) == pytest.approx(expected, rel=1e-5)
    reference = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, label_smoothing=eps, reduction="sum")
    torch.testing.assert_close(smoothed_cross_entropy(logits, targets, eps), reference)
    # Through the loss the loop uses: the mean over scored targets; 0 is plain cross-entropy.
    loss, tally = loss_and_tally("seq2seq", logits[None], targets[None], label_smoothing=eps)
    assert float(loss) == pytest.approx(expected / 8, rel=1e-5) and tally.scored == 8
    plain, _ = loss_and_tally("seq2seq", logits[None], targets[None])
    torch.testing.assert_close(plain, F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX))


# -- scheduled sampling --------------------------------------------------------------------------------------
def _logits(model, task, cfg, step=3, seed=5):
    split = task.split("train")
    index = torch.arange(8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_logits(model, task, split, index, split.inputs[index], split.padding_mask[index],
                            config=cfg, step=step)[0]


@pytest.mark.parametrize("mode", ["token", "two-pass"])
def test_scheduled_sampling_with_teacher_probability_1_is_teacher_forcing_exactly(reverse, mode):
    teacher = config(dropout=0.2)  # dropout on: the mixing must not disturb its random stream either
    sampled = config(dropout=0.2, scheduled_sampling=mode, sampling_min_teacher=1.0)
    assert sampled.teacher_probability(3) == 1.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(teacher, reverse).train()
    assert torch.equal(_logits(model, reverse, sampled), _logits(model, reverse, teacher))
    assert not torch.equal(_logits(model, reverse, teacher, seed=6), _logits(model, reverse, teacher))  # dropout on


def test_with_teacher_probability_0_the_decoder_reads_its_own_predictions(reverse, monkeypatch):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(config(), reverse).train()
    split = reverse.split("train")
    index = torch.arange(8)
    source, mask = split.inputs[index], split.padding_mask[index]
    scored = split.targets[index] != IGNORE_INDEX
    seen = []
    real_forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, src, tgt, **kw: seen.append(tgt) or real_forward(
        self, src, tgt, **kw))
    # Per token, never the gold token: the inputs are the model's greedy decode (where the target is scored).
    _logits(model, reverse, config(scheduled_sampling="token", sampling_k=0.5, sampling_decay="exponential"), step=200)
    model.eval()
    greedy = greedy_decode(model, split.decoder_inputs[index][:, :1], reverse.target_len - 1, source=source,
                           source_padding_mask=mask)
    model.train()
    assert torch.equal(seen[-1][scored], greedy[scored])
    # Two passes: every input after BOS is the teacher-forced pass's argmax of the position before.
    seen.clear()
    _logits(model, reverse, config(scheduled_sampling="two-pass", sampling_k=0.5, sampling_decay="exponential"),
            step=200)
    model.eval()
    first = real_forward(model, source, split.decoder_inputs[index], src_padding_mask=mask).argmax(dim=-1)
    expected = torch.cat([split.decoder_inputs[index][:, :1], first[:, :-1]], dim=1)
    assert torch.equal(seen[-1][scored], expected[scored])


def test_the_mixture_follows_the_teacher_probability_and_depends_on_seed_and_step_only(reverse):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(config(), reverse)
    task = load("reverse", **{**REVERSE, "train_size": 400})
    split = task.split("train")
    index = torch.arange(400)
    cfg = config(scheduled_sampling="two-pass", sampling_decay="linear", sampling_k=100.0)  # p = 0.5 at step 50
    from attnzoo.training.seq2seq import decoder_inputs

    def mixed(step, seed=0):
        torch.manual_seed(seed + 1000)  # the global generator must not matter
        return decoder_inputs(model, split, index, split.inputs[index], split.padding_mask[index], mode="two-pass",
                              teacher=cfg.teacher_probability(step), seed=cfg.seed, step=step)

    scored = (split.targets[index] != IGNORE_INDEX)[:, 1:]  # decoder inputs 1.. that are not padding
    gold = split.decoder_inputs[index][:, 1:]
    first = mixed(50)
    assert torch.equal(first, mixed(50, seed=1))
    assert not torch.equal(first, mixed(51))
    # Where the model's prediction differs from the gold token, the share fed gold is about 1/2.
    predicted = torch.cat([split.decoder_inputs[index][:, :1],
                           model.eval()(split.inputs[index], split.decoder_inputs[index],
                                        src_padding_mask=split.padding_mask[index]).argmax(-1)[:, :-1]], 1)[:, 1:]
    differs = scored & (predicted != gold)
    share = float((first[:, 1:][differs] == gold[differs]).double().mean())
    assert 0.45 < share < 0.55, share


# -- decoded metrics -----------------------------------------------------------------------------------------
def test_edit_distance_and_decoded_metrics():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], [1, 2]) == 2 and edit_distance([1, 2], []) == 2 and edit_distance([4], [4]) == 0
    assert edit_distance(list("flaw"), list("lawn")) == 2
    metrics = decoded_metrics([[1, 2, 3], [4, 5], []], [[1, 2, 3], [4, 6], [7]])
    assert metrics == pytest.approx({"exact_match": 1 / 3, "token_error_rate": 2 / 6})


# -- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, error, message", [
    ("scheduled_sampling", "per-token", ValueError, "scheduled_sampling must be one of 'none', 'token', 'two-pass'"),
    ("sampling_decay", "cosine", ValueError, "sampling_decay must be one of 'linear', 'exponential'"),
    ("label_smoothing", 1.0, ValueError, "label_smoothing must be"),
    ("label_smoothing", -0.1, ValueError, "label_smoothing must be"),
    ("sampling_min_teacher", 1.5, ValueError, "sampling_min_teacher must be"),
    ("sampling_k", "5", TypeError, "sampling_k must be"),
])
def test_bad_settings_are_named(field, value, error, message):
    with pytest.raises(error, match=message):
        config(**{field: value})


@pytest.mark.parametrize("decay, k", [("linear", 0.0), ("exponential", 1.0), ("exponential", 0.0),
                                      ("inverse-sigmoid", 0.5)])
def test_sampling_k_out_of_its_decays_range_is_named(decay, k):
    with pytest.raises(ValueError, match=f"sampling_k must be .* for the {decay} decay"):
        config(scheduled_sampling="token", sampling_decay=decay, sampling_k=k)


def test_scheduled_sampling_needs_a_seq2seq_task():
    cfg = TrainConfig("recall", task_options=dict(train_size=8, validation_size=4, test_size=4, num_pairs=2,
                                                  num_keys=4, num_values=4), scheduled_sampling="two-pass", **SMALL)
    with pytest.raises(ValueError, match="scheduled_sampling 'two-pass' needs a seq2seq task; recall is 'tag'"):
        train(cfg, None, progress=False)


# -- end to end ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes", [dict(scheduled_sampling="token", label_smoothing=0.1),
                                     dict(scheduled_sampling="token", copy_mechanism=True),
                                     dict(decoding="non-autoregressive", length_loss=0.5)])
def test_a_seq2seq_run_resumes_to_bit_identical_parameters(tmp_path, changes):
    from safetensors.torch import load_file

    cfg = config(**changes, dropout=0.1, steps=3)
    train(cfg, tmp_path / "whole", progress=False)

    def stop(step, metrics):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "cut", progress=False, on_step=stop)
    train(None, tmp_path / "cut", resume=True, progress=False)
    a, b = (load_file(str(find_checkpoint(tmp_path / run) / "model.safetensors")) for run in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("task, options, extra", [
    ("copy", dict(train_size=32, validation_size=8, test_size=8, length=6), []),
    ("sort", dict(train_size=32, validation_size=8, test_size=8, length=6), ["--scheduled-sampling", "two-pass"]),
    ("copy-names", dict(train_size=32, validation_size=8, test_size=8, num_names=20, num_numbers=20),
     ["--label-smoothing", "0.1"]),
    ("g2p", dict(train_size=32, validation_size=8, test_size=8),
     ["--scheduled-sampling", "token", "--sampling-decay", "inverse-sigmoid"]),
])
def test_a_few_steps_of_attnzoo_train_on_each_seq2seq_task(capsys, tmp_path, task, options, extra):
    argv = ["train", task, "--task-options", json.dumps(options), "--dim", "16", "--depth", "1", "--heads", "2",
            "--batch-size", "8", "--steps", "3", "--eval-interval", "3", "--output", str(tmp_path), "--quiet",
            "--json", *extra]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for split in ("validation", "test"):
        assert {"loss", "accuracy", "exact_match", "token_error_rate"} <= set(result[split])
        assert math.isfinite(result[split]["loss"]) and 0 <= result[split]["exact_match"] <= 1
    assert main(["eval", str(tmp_path), "--json"]) == 0
    assert "exact_match" in json.loads(capsys.readouterr().out)["metrics"]


def test_a_bad_choice_on_the_command_line_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        main(["train", "reverse", "--scheduled-sampling", "sometimes"])
    assert "choose from 'none', 'token', 'two-pass'" in capsys.readouterr().err
    assert main(["train", "recall", "--scheduled-sampling", "token", "--steps", "1"]) == 2
    assert "--scheduled-sampling 'token' needs a seq2seq task" in capsys.readouterr().err


# -- guided attention ----------------------------------------------------------------------------------------
def test_guide_penalties_equal_tachibanas_formula():
    T, N, g = 4, 6, 0.3
    W = guide_penalties(T, N, g, torch.float64)
    for t in range(T):
        for n in range(N):
            assert float(W[t, n]) == pytest.approx(1 - math.exp(-((n / N - t / T) ** 2) / (2 * g * g)), rel=1e-12)
    assert float(W[0, 0]) == 0.0 and float(W[T - 1, 0]) > 0.5


def test_guide_loss_equals_its_formula_inside_each_examples_lengths():
    generator = torch.Generator().manual_seed(1)
    layers = [torch.rand(2, 3, 5, 7, generator=generator, dtype=torch.float64) for _ in range(2)]
    source_lengths, target_lengths = torch.tensor([7, 4]), torch.tensor([3, 5])
    total, count = 0.0, 0
    for weights in layers:  # a plain loop: per scored target position, head and layer, sum_n A W
        for b in range(2):
            T, N = int(target_lengths[b]), int(source_lengths[b])
            for h in range(3):
                for t in range(T):
                    count += 1
                    for n in range(N):
                        total += float(weights[b, h, t, n]) * (1 - math.exp(-((n / N - t / T) ** 2) / (2 * 0.2**2)))
    assert float(guide_loss(layers, source_lengths, target_lengths, 0.2)) == pytest.approx(total / count, rel=1e-12)
    # Diagonal attention (within the lengths) pays less than attention to the first source position.
    diagonal = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    diagonal[0, 0, range(4), range(4)] = 1
    first = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    first[..., 0] = 1
    lengths = torch.tensor([4])
    assert float(guide_loss([diagonal], lengths, lengths, 0.2)) == 0.0
    assert float(guide_loss([first], lengths, lengths, 0.2)) > 0.5


def test_recorded_cross_attention_is_a_distribution_over_the_unpadded_source(reverse):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(config(depth=2), reverse)
    split = reverse.split("train")
    index = torch.arange(8)
    with CrossAttentionRecorder(model) as recorder:
        logits = model(split.inputs[index], split.decoder_inputs[index], src_padding_mask=split.padding_mask[index])
    assert len(recorder.weights) == 2
    for weights in recorder.weights:
        assert weights.shape == (8, 2, reverse.target_len, reverse.seq_len)
        torch.testing.assert_close(weights.sum(-1), torch.ones(8, 2, reverse.target_len))
        assert (weights.masked_select(split.padding_mask[index][:, None, None, :]) == 0).all()
    # The recording changes nothing; outside the context nothing is recorded.
    again = model(split.inputs[index], split.decoder_inputs[index], src_padding_mask=split.padding_mask[index])
    assert torch.equal(logits, again) and len(recorder.weights) == 2


def test_the_guide_loss_makes_cross_attention_diagonal():
    """Sixty steps on `copy` with a strong guide loss bring the attention near the diagonal."""
    task_options = dict(train_size=64, validation_size=8, test_size=8, length=7, num_symbols=6)
    plain = TrainConfig("copy", **{**SMALL, "task_options": task_options, "steps": 60, "lr": 1e-2})
    guided = TrainConfig("copy", **{**SMALL, "task_options": task_options, "steps": 60, "lr": 1e-2,
                                    "guide_loss": 5.0})
    scores = []
    for cfg in (plain, guided):
        result = train(cfg, None, progress=False)
        assert "guide_loss" in result.test
        scores.append(result.test["guide_loss"])
    assert scores[1] < 0.5 * scores[0], scores


def test_guide_loss_settings_are_checked():
    with pytest.raises(ValueError, match="guide_loss must be a number >= 0"):
        config(guide_loss=-1.0)
    with pytest.raises(ValueError, match="guide_width must be"):
        config(guide_width=0.0)


@pytest.mark.parametrize("argv, message", [
    (["train", "reverse", "--guide-loss", "-1"], "--guide-loss must be a number >= 0"),
    (["train", "recall", "--guide-loss", "1"], "--guide-loss 1.0 needs a seq2seq task"),
    (["train", "reverse", "--label-smoothing", "1"], "--label-smoothing must be"),
    (["train", "reverse", "--scheduled-sampling", "token", "--sampling-decay", "exponential", "--sampling-k", "2"],
     "--sampling-k must be in \\(0, 1\\) for the exponential decay"),
])
def test_bad_seq2seq_options_are_one_line_usage_errors_naming_them(capsys, argv, message):
    import re

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err

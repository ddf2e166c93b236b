"""Evaluation of seq2seq models by a chosen decoder: corpus BLEU against its formula, decoder settings checked,
the decoders' outputs as attnzoo.decoding gives them, and `attnzoo train` / `attnzoo eval` choosing them."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import sacrebleu
import torch

from attnzoo import beam_search, greedy_decode, sample_decode
from attnzoo.cli import main
from attnzoo.models.monotonic import MonotonicInference
from attnzoo.tasks import load
from attnzoo.training import DecoderSettings, TrainConfig, build_model, evaluate
from attnzoo.training.decoders import corpus_bleu, timed_outputs

REVERSE = dict(train_size=64, validation_size=12, test_size=12, length=7, num_symbols=6)
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=4, eval_interval=4)


@pytest.fixture(scope="module", autouse=True)
def reverse():
    """The task; torch on one thread for the module's tests (tiny models run fastest so beside other work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load("reverse", **REVERSE)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(reverse):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_model(TrainConfig("reverse", task_options=REVERSE, **SMALL), reverse).eval()


# -- BLEU ----------------------------------------------------------------------------------------------------
def reference_bleu(hypotheses, references, max_order=4):
    """Papineni et al. 2002, written out: corpus-level clipped n-gram precisions, their geometric mean and the
    brevity penalty; 0 when some order has no match (sacrebleu's default, unsmoothed)."""
    matches, totals = [0] * max_order, [0] * max_order
    hyp_length = ref_length = 0
    for hyp, ref in zip(hypotheses, references):
        hyp_length, ref_length = hyp_length + len(hyp), ref_length + len(ref)
        for n in range(1, max_order + 1):
            hyp_grams = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
            ref_grams = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(count, ref_grams[gram]) for gram, count in hyp_grams.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_order
    brevity = 1.0 if hyp_length > ref_length else math.exp(1 - ref_length / hyp_length)
    return 100 * brevity * math.exp(log_precision)


NAMES = ["<pad>", "<bos>", "<eos>", "AH", "B", "K", "T", "S", "IY", "ER"]
HAND_MADE = (
    [[4, 3, 5, 6, 7], [5, 8, 6, 3], [9, 4, 3, 5, 6, 7, 8]],        # predictions
    [[4, 3, 5, 6, 7, 8], [5, 8, 6, 3], [9, 4, 5, 6, 7, 8]],        # references
)


def test_bleu_equals_the_formula_and_sacrebleu_on_a_hand_made_case():
    predictions, references = HAND_MADE
    words = lambda rows: [[NAMES[i] for i in row] for row in rows]  # noqa: E731
    expected = reference_bleu(words(predictions), words(references))
    assert 20 < expected < 100  # the case has matches of every order, and errors
    assert corpus_bleu(predictions, references, NAMES) == pytest.approx(expected, rel=1e-9)
    direct = sacrebleu.corpus_bleu([" ".join(w) for w in words(predictions)],
                                   [[" ".join(w) for w in words(references)]], tokenize="none").score
    assert corpus_bleu(predictions, references, NAMES) == pytest.approx(direct, rel=1e-12)


def test_bleu_is_100_for_exact_outputs_and_0_without_any_match():
    _, references = HAND_MADE
    assert corpus_bleu(references, references, NAMES) == pytest.approx(100.0)
    assert corpus_bleu([[3], [3], [3]], [[4, 5], [6, 7], [8, 9]], NAMES) == 0.0
    with pytest.raises(ValueError, match="predictions"):
        corpus_bleu([[3]], [[3], [4]], NAMES)


# -- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,error,match", [
    (dict(decoder="viterbi"), ValueError, "decoder"),
    (dict(beam_size=4), ValueError, "beam_size is an option of decoder 'beam'"),
    (dict(decoder="sample", length_penalty=0.5), ValueError, "length_penalty"),
    (dict(decoder="beam", top_p=0.9), ValueError, "top_p is an option of decoder 'sample'"),
    (dict(decoder="beam", beam_size=0), ValueError, "beam_size"),
    (dict(decoder="beam", beam_size=2.0), TypeError, "beam_size"),
    (dict(decoder="beam", length_penalty=float("nan")), ValueError, "length_penalty"),
    (dict(decoder="sample", temperature=0.0), ValueError, "temperature"),
    (dict(decoder="sample", top_k=0), ValueError, "top_k"),
    (dict(decoder="sample", top_p=1.5), ValueError, "top_p"),
    (dict(decoder="sample", seed=-1), ValueError, "seed"),
    (dict(decoder="sample", seed=True), TypeError, "seed"),
    (dict(monotonic={"ahead": 2}), TypeError, "monotonic"),
])
def test_bad_decoder_settings_raise_naming_them(options, error, match):
    with pytest.raises(error, match=match):
        DecoderSettings(**options)


def test_each_setting_decodes_as_its_decoder_does(model, reverse):
    split = reverse.split("test")
    source, mask = split.inputs[:6], split.padding_mask[:6]
    prompt = torch.full((6, 1), reverse.bos_id)
    common = dict(eos_id=reverse.eos_id, source=source, source_padding_mask=mask)
    window = MonotonicInference(ahead=2)
    cases = [
        (DecoderSettings(), greedy_decode(model, prompt, reverse.target_len, **common)),
        (DecoderSettings(monotonic=window),
         greedy_decode(model, prompt, reverse.target_len, monotonic=window, **common)),
        (DecoderSettings("beam", beam_size=3, length_penalty=0.5),
         beam_search(model, prompt, reverse.target_len, beam_size=3, length_penalty=0.5, **common).best),
        (DecoderSettings("sample", temperature=0.7, top_k=4, seed=5),
         sample_decode(model, prompt, reverse.target_len, temperature=0.7, top_k=4,
                       generator=torch.Generator().manual_seed(5), **common)),
    ]
    for settings, decoded in cases:
        outputs, seconds = timed_outputs(model, source, mask, bos_id=reverse.bos_id, eos_id=reverse.eos_id,
                                         max_new_tokens=reverse.target_len, settings=settings,
                                         generator=settings.generator())
        expected = [[t for t in row[1:].tolist()] for row in decoded]
        expected = [row[:row.index(reverse.eos_id)] if reverse.eos_id in row else row for row in expected]
        assert outputs == expected, settings
        assert seconds > 0


def test_evaluate_reports_bleu_and_decoding_time_and_sampling_is_seeded(model, reverse):
    greedy = evaluate(model, reverse, "test")
    assert 0 <= greedy["bleu"] <= 100 and greedy["ms_per_sentence"] > 0
    sampled = [evaluate(model, reverse, "test", decoding=DecoderSettings("sample", seed=seed)) for seed in (1, 1, 2)]
    assert sampled[0]["token_error_rate"] == sampled[1]["token_error_rate"]
    assert sampled[0]["bleu"] == sampled[1]["bleu"]
    # A sample of an untrained model differs from its argmax, and from another seed's sample.
    assert sampled[0]["token_error_rate"] != greedy["token_error_rate"]
    assert (sampled[0]["bleu"], sampled[0]["token_error_rate"]) != (sampled[2]["bleu"], sampled[2]["token_error_rate"])


# -- the command line ----------------------------------------------------------------------------------------
TRAIN_ARGV = ["train", "reverse", "--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "8", "--steps", "4",
              "--eval-interval", "4", "--task-options", json.dumps(REVERSE), "--quiet", "--threads", "1"]


@pytest.mark.slow
def test_train_and_eval_print_the_decoded_metrics_of_the_chosen_decoder(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TRAIN_ARGV, "--output", str(run), "--monotonic-inference", "--monotonic-ahead", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"test: .*bleu [\d.]+, ms_per_sentence [\d.]+", out), out
    assert "decoder:    greedy, monotonic (ahead 2, behind 0)" in out

    assert main(["eval", str(run), "--beam-size", "4", "--length-penalty", "0.5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"exact_match [\d.]+, token_error_rate [\d.]+, .*bleu [\d.]+, ms_per_sentence", out), out
    assert "decoder:  beam (size 4, length penalty 0.5)" in out

    assert main(["eval", str(run), "--json", "--sampling-temperature", "0.5", "--top-p", "0.9"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decoder"].startswith("sampling (temperature 0.5") and "bleu" in report["metrics"]


@pytest.mark.parametrize("options, message", [
    (["--beam-size", "0"], "--beam-size must be an integer >= 1"),
    (["--beam-size", "2", "--top-k", "3"], "choose different decoders"),
    (["--top-p", "2"], "--top-p must be a number > 0 and <= 1"),
    (["--sampling-temperature", "-1"], "--sampling-temperature must be a number > 0"),
    (["--monotonic-ahead", "2"], "--monotonic-ahead / --monotonic-behind set the window of --monotonic-inference"),
    (["--monotonic-inference", "--monotonic-ahead", "0"], "--monotonic-ahead must be an integer >= 1"),
    (["--monotonic-inference", "--monotonic-behind", "-1"], "--monotonic-behind must be an integer >= 0"),
])
def test_bad_decoder_options_are_one_line_usage_errors_naming_them(tmp_path, capsys, options, message):
    assert main([*TRAIN_ARGV, "--output", str(tmp_path / "run"), *options]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # refused before any training


def test_decoder_options_need_a_seq2seq_task(capsys):
    assert main(["train", "recall", "--beam-size", "4", "--steps", "1"]) == 2
    assert "decoding options apply to seq2seq tasks only" in capsys.readouterr().err

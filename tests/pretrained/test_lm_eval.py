"""attnzoo lm-eval and its measurements (attnzoo.pretrained.evaluation, attnzoo.pretrained.passkey,
attnzoo.experiments.lm_eval): on tiny GGUF models written by test_pretrained.write_tiny_gguf, with stand-in
tokenizers; one end-to-end run of the command on SmolLM2, marked slow."""

from __future__ import annotations

import csv
import json
import zlib

import pytest
import torch
from test_corpus import CharTokenizer
from test_pretrained import write_tiny_gguf

import attnzoo
from attnzoo import pretrained
from attnzoo.cli import main
from attnzoo.experiments.lm_eval import LmEvalConfig, Variant, plan_text, prepare, run_lm_eval
from attnzoo.pretrained import CausalLM, evaluation
from attnzoo.pretrained.passkey import (
    ANSWER_TOKENS,
    INTRO,
    KEY_SENTENCE,
    QUESTION,
    passkey,
    passkey_answer,
    passkey_correct,
    passkey_prompt,
)


class WordTokenizer:
    """One token per word (a CRC of it, ids 1-95), 0 is EOS: prompts short enough for the tiny models' context."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [1 + zlib.crc32(word.encode()) % 95 for word in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    model, _ = pretrained.load(path, tokenizer=False)
    return path, model


# -- perplexity ------------------------------------------------------------------------------------------------
def test_perplexity_is_exp_of_the_mean_token_nll(tiny, monkeypatch):
    _, model = tiny
    windows = torch.randint(0, 96, (3, 21))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(windows).double(), dim=-1)  # the full forward, every logit at once
    nll = -log_probs[:, :-1].gather(-1, windows[:, 1:, None]).squeeze(-1)
    expected = torch.exp(nll.mean()).item()
    monkeypatch.setattr(evaluation, "HEAD_CHUNK", 6)  # the head in chunks, with a short last one
    result = evaluation.perplexity(model, windows)
    assert result.tokens == 3 * 20 and result.windows == 3
    # The same float32 logits, computed in other batches and chunks: equal to float32 rounding.
    assert result.perplexity == pytest.approx(expected, rel=1e-6)
    assert result.mean_nll == pytest.approx(nll.mean().item(), rel=1e-6)
    assert torch.allclose(evaluation.token_nll(model, windows[:1]), nll[:1], rtol=0, atol=1e-5)


def test_perplexity_refuses_bad_windows(tiny):
    _, model = tiny
    for bad in (torch.randint(0, 96, (8,)), torch.randint(0, 96, (2, 1)), torch.full((1, 4), 96),
                torch.rand(1, 4)):
        with pytest.raises(ValueError, match="windows"):
            evaluation.perplexity(model, bad)


# -- passkey ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_passkey_prompt_puts_the_key_at_the_asked_depth(depth):
    tokenizer = CharTokenizer()
    prompt = passkey_prompt(tokenizer, 2048, depth, "40913")
    ids = prompt.tokens.tolist()
    assert len(ids) <= 2048 - ANSWER_TOKENS
    assert tokenizer.decode(ids[prompt.key_start:prompt.key_end]) == " " + KEY_SENTENCE.format(key="40913")
    assert tokenizer.decode(ids).count("40913") == 2  # only in the key sentence
    assert tokenizer.decode(ids[:prompt.filler_start]) == INTRO
    assert tokenizer.decode(ids[prompt.filler_end:]) == " " + QUESTION
    # The share of filler before the key is the asked depth, to one repetition of the filler.
    filler = (prompt.filler_end - prompt.filler_start) - (prompt.key_end - prompt.key_start)
    share = (prompt.key_start - prompt.filler_start) / filler
    assert abs(share - depth) <= 0.5 / prompt.repetitions + 1e-9
    assert prompt.depth_reached == pytest.approx(share)
    if depth == 0.0:
        assert prompt.key_start == prompt.filler_start
    if depth == 1.0:
        assert prompt.key_end == prompt.filler_end


def test_the_passkey_prompt_refuses_a_length_too_short():
    with pytest.raises(ValueError, match="length=100 is too short"):
        passkey_prompt(CharTokenizer(), 100, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(CharTokenizer(), 2048, 1.5, "12345")


def test_passkeys_are_seeded_five_digit_numbers():
    keys = {passkey(0, 1024, depth, trial) for depth in (0, 0.5, 1) for trial in range(4)}
    assert all(len(key) == 5 and key.isdigit() for key in keys) and len(keys) > 8
    assert passkey(0, 1024, 0.5, 1) == passkey(0, 1024, 0.5, 1) != passkey(1, 1024, 0.5, 1)


@pytest.mark.parametrize("text, right", [
    (" 40913.", True), ("40913", True), (" The pass key is 40913", True), (" 40913 40913", True),
    (" 4091", False), (" 409130", False), (" 12345 and 40913", False), (" none", False), ("", False),
])
def test_the_passkey_scorer(text, right):
    assert passkey_correct(text, "40913") is right
    assert passkey_answer(text) == ("40913" if right else passkey_answer(text))


# -- decoding --------------------------------------------------------------------------------------------------
def test_greedy_continuation_matches_greedy_decode(tiny):
    _, model = tiny
    prompt = torch.randint(0, 96, (1, 12))
    continuation = evaluation.greedy_continue(model, prompt, 5)
    assert continuation.tokens == attnzoo.greedy_decode(model, prompt, 5)[0, 12:].tolist()
    assert continuation.steps == 4 and continuation.context == 12 and continuation.tokens_per_second > 0


def test_a_batch_decodes_each_prompt_as_alone_and_counts_every_sequence(tiny):
    _, model = tiny
    prompts = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    together = evaluation.greedy_continue(model, prompts, 5)
    alone = [evaluation.greedy_continue(model, prompt, 5) for prompt in prompts]
    assert together.sequences == [one.tokens for one in alone] and together.batch == 3
    assert together.state_bytes == sum(one.state_bytes for one in alone)
    assert together.tokens_per_second == pytest.approx(3 * 4 / together.step_seconds)
    assert together.state_bytes_per_token == pytest.approx(alone[0].state_bytes_per_token)
    with pytest.raises(ValueError, match="batch of 3: read sequences"):
        together.tokens


def test_decoding_state_is_flat_for_a_constant_state_mechanism_and_grows_for_softmax(tiny):
    _, model = tiny
    linear, _ = evaluation.swapped(model, "linear")
    short, long = torch.randint(0, 96, (1, 16)), torch.randint(0, 96, (1, 1200))
    softmax_sizes = [evaluation.greedy_continue(model, p, 2).state_bytes for p in (short, long)]
    linear_sizes = [evaluation.greedy_continue(linear, p, 2).state_bytes for p in (short, long)]
    assert linear_sizes[0] == linear_sizes[1] > 0
    # A KV cache: 2 layers x (k + v) x 2 kv heads x 16 channels x 4 bytes per position, allocated in blocks of 256.
    per_position = 2 * 2 * 2 * 16 * 4
    assert softmax_sizes[1] > 4 * softmax_sizes[0]
    assert 1201 * per_position <= softmax_sizes[1] <= 1536 * per_position + 64


def test_a_mechanism_without_incremental_decoding_is_said_so(tiny):
    _, model = tiny
    strided, _ = evaluation.swapped(model, "longformer")
    assert "recurrent_step" in evaluation.decodes(strided)
    with pytest.raises(ValueError, match="recurrent_step"):
        evaluation.greedy_continue(strided, torch.randint(0, 96, (1, 8)), 2)


# -- which mechanisms can take the attention's place -----------------------------------------------------------
def test_swap_candidates_follow_the_declared_capabilities(tiny):
    _, model = tiny
    grouped = evaluation.swap_candidates(model.config, 64)
    assert grouped["softmax"] is None and grouped["linear"] is None
    assert "causal" in grouped["bigbird"]
    assert "grouped key/value heads" in grouped["synthesizer"]
    for name, reason in grouped.items():
        caps = attnzoo.mechanisms.capabilities(name)
        assert (reason is None) == (caps.causal and caps.grouped_kv != attnzoo.mechanisms.NO_GROUPED_KV)
    ungrouped = evaluation.swap_candidates(type(model.config)(**{**model.config.__dict__, "kv_heads": 4}), 64)
    assert ungrouped["synthesizer"] is None and "causal" in ungrouped["bigbird"]


def test_a_raw_swap_keeps_every_pretrained_weight(tiny):
    _, model = tiny
    other, own = evaluation.swapped(model, "local", {"window": 4})
    assert isinstance(other, CausalLM) and other.mechanism_name == "local" and own == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor)
    _, own = evaluation.swapped(model, "gla")
    assert own > 0  # its gates: parameters the pretrained model does not have


# -- the command ---------------------------------------------------------------------------------------------
def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnzoo lm-eval: error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("arguments, named", [
    (["--lengths", "64,256"], "--lengths: 256 tokens is past the model's context of 128"),
    (["--passkey-lengths", "1024"], "--passkey-lengths"),
    (["--decode-lengths", "129"], "--decode-lengths"),
    (["--swap-length", "512"], "--swap-length"),
    (["--windows", "0"], "--windows"),
    (["--decode-batch", "0"], "--decode-batch"),
    (["--passkey-depths", "0,1.5"], "--passkey-depths"),
    (["--parts", "perplexity,speed"], "--parts"),
    (["--sources", "poetry"], "--sources"),
    (["--variant", "no-such-mechanism"], "--variant no-such-mechanism"),
    (["--variant", "local:windw=4"], "windw"),
    (["--variant", "bigbird"], "causal"),
    (["--swap-mechanisms", "softmax,nope"], "--swap-mechanisms"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(tiny, tmp_path, capsys, arguments, named):
    path, _ = tiny
    output = tmp_path / "out"
    within = ["--lengths", "32", "--passkey-lengths", "100", "--decode-lengths", "32", "--swap-length", "64"]
    assert main(["lm-eval", "--gguf", str(path), "--output", str(output), *within, *arguments]) == 2
    assert named in _error_line(capsys)
    assert not output.exists()


def test_a_missing_model_file_is_one_line(tmp_path, capsys):
    assert main(["lm-eval", "--gguf", str(tmp_path / "none.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert "--model" in _error_line(capsys)


def test_a_model_file_without_a_tokenizer_is_one_line(tiny, tmp_path, capsys):
    path, _ = tiny
    assert main(["lm-eval", "--gguf", str(path), "--output", str(tmp_path / "out"), "--lengths", "32",
                 "--passkey-lengths", "100", "--decode-lengths", "32", "--swap-length", "64"]) == 2
    assert "--model: tiny.gguf holds no tokenizer" in _error_line(capsys)


def test_a_split_too_short_for_the_windows_is_named(tiny, tmp_path):
    path, _ = tiny
    config = LmEvalConfig(gguf=str(path), parts=["perplexity"], sources=["code"], lengths=[100], windows=10**6)
    with pytest.raises(ValueError, match="--windows"):
        run_lm_eval(config, tmp_path, ["test"], tokenizer=WordTokenizer())
    batch = LmEvalConfig(gguf=str(path), parts=["decode"], decode_lengths=[100], decode_batch=10**6)
    with pytest.raises(ValueError, match="--decode-batch"):
        run_lm_eval(batch, tmp_path, ["test"], tokenizer=WordTokenizer())
    assert not (tmp_path / "lm-eval.json").exists()


def test_a_run_writes_every_table_and_figure(tiny, tmp_path):
    path, _ = tiny
    config = LmEvalConfig(gguf=str(path), variants=[Variant("local", {"window": 8, "sink_tokens": 2})],
                          sources=["code"], lengths=[32, 64], passkey_lengths=[100], depths=[0.0, 1.0],
                          decode_lengths=[32, 100], decode_tokens=3, decode_batch=2, swap_length=64,
                          swap_mechanisms=["softmax", "linear", "bigbird"])
    seen = []  # each measurement's label, with the tables and figures already written when it started

    def progress(label):
        seen.append((label, (tmp_path / "lm-eval.json").exists(), any(tmp_path.glob("*.png"))))

    data = run_lm_eval(config, tmp_path, ["attnzoo", "lm-eval", "..."], progress=progress,
                       prepared=prepare(config, needs_tokenizer=False), tokenizer=WordTokenizer())
    assert len(seen) == 2 * (2 + 2 + 2) + 3
    # The tables after the first variant (an interrupted run keeps them), the figures once, at the end.
    assert [tables for _, tables, _ in seen] == [False] * 6 + [True] * 9
    assert not any(figures for _, _, figures in seen)
    assert [v["label"] for v in data["variants"]] == ["softmax", "local window=8 sink_tokens=2"]
    assert all(row["status"] == "ok" for part in ("perplexity", "passkey", "decode") for row in data[part])
    assert {row["mechanism"]: row["status"] for row in data["swap"]} == \
        {"softmax": "ok", "linear": "ok", "bigbird": "unusable"}
    softmax_swap = next(row for row in data["swap"] if row["mechanism"] == "softmax")
    softmax_row = next(r for r in data["perplexity"] if r["variant"] == "softmax" and r["length"] == 64)
    assert softmax_swap["code_perplexity"] == pytest.approx(softmax_row["perplexity"])
    local = [r for r in data["decode"] if r["variant"].startswith("local")]
    assert local[0]["state_bytes"] == local[1]["state_bytes"]  # a window and sinks: a bounded cache
    assert all(row["batch"] == 2 for row in data["decode"])
    written = json.loads((tmp_path / "lm-eval.json").read_text())
    assert written["command"] == ["attnzoo", "lm-eval", "..."] and written["schema"] == "attnzoo.lm-eval/1"
    with (tmp_path / "lm-eval.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["part"] for row in rows} == {"perplexity", "passkey", "decode", "swap"}
    markdown = (tmp_path / "lm-eval.md").read_text()
    assert "## Perplexity" in markdown and "## Raw swap" in markdown and "bigbird" in markdown
    for part in ("perplexity", "passkey", "decode", "swap"):
        assert (tmp_path / f"lm-eval-{part}.png").stat().st_size > 1000


def _converted(path, folder, target_options):
    """A conversion of the tiny model in ``path`` (a few steps; what it learns does not matter here)."""
    from attnzoo import conversion

    teacher, _ = pretrained.load(path, tokenizer=False)
    settings = conversion.ConversionConfig(target="lolcats", target_options=target_options, seq_len=12,
                                           transfer_steps=2, finetune_steps=2, checkpoint_every=2)
    windows = torch.randint(0, teacher.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    conversion.convert(teacher, windows, windows[:1], folder, settings, source=conversion.gguf_source(path),
                       progress=False)
    return conversion.load_converted(folder, tokenizer=False, merged=True).model


def test_a_converted_model_is_measured_like_a_variant(tiny, tmp_path):
    """--converted: the model attnzoo convert saved, rebuilt on the weights already loaded, gives the perplexity
    the model load_converted returns gives, and decodes from its constant-size state."""
    path, _ = tiny
    options = {"window": 4, "feature_dim": 4, "chunk_size": 4, "sink_tokens": 2}
    model = _converted(path, tmp_path / "run", options)
    config = LmEvalConfig(gguf=str(path), converted=[str(tmp_path / "run")], parts=["perplexity", "decode"],
                          sources=["code"], lengths=[64], decode_lengths=[32, 100], decode_tokens=3)
    data = run_lm_eval(config, tmp_path / "out", ["test"], prepared=prepare(config, needs_tokenizer=False),
                       tokenizer=WordTokenizer())
    label = f"converted {tmp_path / 'run'}"
    assert [v["label"] for v in data["variants"]] == ["softmax", label]
    record = data["variants"][1]
    assert record["mechanism"] == "lolcats" and record["options"] == options
    assert record["converted"]["layer_mechanisms"] == ["lolcats"] * model.config.depth
    row = next(r for r in data["perplexity"] if r["variant"] == label)
    text = plan_text(config, WordTokenizer())[("code", 64)]
    assert row["status"] == "ok" and row["own_parameters"] > 0
    assert row["perplexity"] == pytest.approx(evaluation.perplexity(model, text.tokens).perplexity, rel=1e-6)
    decode = [r for r in data["decode"] if r["variant"] == label]
    assert [r["status"] for r in decode] == ["ok", "ok"] and decode[0]["state_bytes"] == decode[1]["state_bytes"]


def test_a_converted_model_with_options_set_at_inference(tiny, tmp_path):
    """--converted DIR:sparse_cache=4: the same trained tensors with LoLA's cache on every converted layer,
    measured beside the model as saved; its perplexity is the model load_converted(options=...) gives, and an
    option the saved tensors do not fit (or an unknown one) is refused before any measurement, naming it."""
    from attnzoo import conversion

    path, _ = tiny
    _converted(path, tmp_path / "run", {"window": 4, "feature_dim": 4, "chunk_size": 4, "sink_tokens": 2})
    run = str(tmp_path / "run")
    config = LmEvalConfig(gguf=str(path), converted=[run, (run, {"sparse_cache": 4})], parts=["perplexity"],
                          sources=["code"], lengths=[64])
    data = run_lm_eval(config, tmp_path / "out", ["test"], prepared=prepare(config, needs_tokenizer=False),
                       tokenizer=WordTokenizer())
    labels = [v["label"] for v in data["variants"]]
    assert labels == ["softmax", f"converted {run}", f"converted {run}:sparse_cache=4"]
    assert data["variants"][2]["options"]["sparse_cache"] == 4
    assert data["variants"][2]["converted"]["options"] == {"sparse_cache": 4}
    scores = {r["variant"]: r["perplexity"] for r in data["perplexity"]}
    text = plan_text(config, WordTokenizer())[("code", 64)]
    cached = conversion.load_converted(run, tokenizer=False, merged=True, options={"sparse_cache": 4}).model
    assert cached.layers[0].attention.mechanism.sparse_cache == 4
    assert scores[labels[2]] == pytest.approx(evaluation.perplexity(cached, text.tokens).perplexity, rel=1e-6)
    assert scores[labels[2]] != pytest.approx(scores[labels[1]], rel=1e-6)  # the cache changes what it reads
    for given, named in (({"decay": 0.9}, "do not fit"), ({"sparse_cach": 4}, "sparse_cach")):
        bad = LmEvalConfig(gguf=str(path), converted=[(run, given)], parts=["perplexity"], lengths=[32])
        with pytest.raises(ValueError, match=f"--converted {run}: .*{named}"):
            prepare(bad, needs_tokenizer=False)
        with pytest.raises((TypeError, ValueError), match=named):
            conversion.load_converted(run, tokenizer=False, options=given)


def test_a_converted_model_of_another_file_or_none_is_refused(tiny, tmp_path, capsys):
    path, _ = tiny
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, tied=True)  # another file whatever the random state: no output.weight tensor
    _converted(other, tmp_path / "run", {"window": 4, "feature_dim": 4, "chunk_size": 4})
    for folder, named in ((tmp_path / "run", "not the model the conversion read"),
                          (tmp_path, "holds no converted model")):
        arguments = ["lm-eval", "--gguf", str(path), "--converted", str(folder), "--lengths", "32",
                     "--parts", "perplexity", "--output", str(tmp_path / "out")]
        assert main(arguments) == 2
        line = _error_line(capsys)
        assert f"--converted {folder}" in line and named in line


@pytest.mark.slow
def test_the_command_on_smollm2(tmp_path, capsys):
    try:
        pretrained.smollm2_path()
        pretrained.corpus.prose_path()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    output = tmp_path / "out"
    code = main(["lm-eval", "--lengths", "128", "--windows", "1", "--passkey-lengths", "400",
                 "--passkey-depths", "0.5", "--decode-lengths", "128", "--decode-tokens", "2",
                 "--swap-length", "128", "--swap-mechanisms", "softmax,bigbird",
                 "--variant", "local:window=32,sink_tokens=4", "--output", str(output), "--quiet"])
    assert code == 0
    data = json.loads((output / "lm-eval.json").read_text())
    softmax = {r["source"]: r["perplexity"] for r in data["perplexity"] if r["variant"] == "softmax"}
    assert 1 < softmax["prose"] < 100 and 1 < softmax["code"] < 100
    assert data["passkey"][0]["status"] == "ok" and len(data["passkey"][0]["key"]) == 5
    print(f"\nSmolLM2, 128 tokens: perplexity {softmax}; passkey at 400 tokens: "
          f"{[(r['variant'], r['answer'], r['key']) for r in data['passkey']]}")


def test_converted_folders_take_options_after_their_last_colon():
    from attnzoo.cli.lm_eval import converted_spec

    assert converted_spec("runs/lolcats") == "runs/lolcats"
    assert converted_spec("runs/a:b") == "runs/a:b"  # a colon in the path, no options after it
    assert converted_spec("runs/lolcats:sparse_cache=64,sink_tokens=8") == (
        "runs/lolcats", {"sparse_cache": 64, "sink_tokens": 8})
    with pytest.raises(Exception, match="DIR"):
        converted_spec(":sparse_cache=64")

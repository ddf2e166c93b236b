"""Pretrained models from Hugging Face model directories (config.json and safetensors, as save_pretrained writes
them): equal logits to transformers' own model, decoding, sharded and tied checkpoints, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import pretrained
from attnzoo.pretrained import CausalLM, HFDirectoryError

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def save_tiny(directory: Path, kind: str = "llama", *, tied: bool = False, dtype: torch.dtype = torch.float32,
              shard: bool = False, **settings) -> torch.nn.Module:
    """A random tiny transformers model of ``kind`` saved to ``directory``; returns it in float32, eval mode,
    holding the values saved (rounded to ``dtype``)."""
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[kind])
    extra = {"sliding_window": None} if kind == "mistral" else {}
    config = config_class(**{**TINY, "tie_word_embeddings": tied, **extra, **settings})
    torch.manual_seed(0)
    model = model_class(config).to(dtype)
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    model = model.float().eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("kind, tied", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False)])
def test_a_directory_gives_transformers_logits(tmp_path, kind, tied):
    reference = save_tiny(tmp_path, kind, tied=tied)
    model, tokenizer = pretrained.load(tmp_path, tokenizer=False)
    assert tokenizer is None and isinstance(model, CausalLM) and not model.training
    assert model.config.tied_embeddings == tied and model.config.attention_bias == (kind == "qwen2")
    assert (model.config.rope_base, model.config.kv_heads, model.config.context_length) == (50000.0, 2, 128)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    decoded = attnzoo.greedy_decode(model, tokens[:, :5], 6)
    theirs = reference.generate(tokens[:, :5], attention_mask=torch.ones_like(tokens[:, :5]), max_new_tokens=6,
                                min_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(decoded, theirs)


def test_sharded_and_half_precision_checkpoints_load(tmp_path):
    reference = save_tiny(tmp_path, "qwen2", dtype=torch.bfloat16, shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = pretrained.load(tmp_path, tokenizer=False)
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # float32 rounding apart (1e-5 here, against logits of about 0.2), the same model
        assert (model(tokens) - reference(tokens).logits).abs().max().item() <= 1e-4


def test_another_mechanism_runs_the_same_weights(tmp_path):
    save_tiny(tmp_path)
    model, _ = pretrained.load(tmp_path, mechanism="local", mechanism_options={"window": 4, "sink_tokens": 1},
                               tokenizer=False)
    assert model.layer_mechanism_names == ["local"] * 2
    assert attnzoo.greedy_decode(model, torch.zeros(1, 3, dtype=torch.long), 4).shape == (1, 7)


def test_the_saved_tokenizer_is_loaded(tmp_path):
    save_tiny(tmp_path)
    words = ["<unk>", "the", "cat", "sat"]
    backend = __import__("tokenizers")
    vocabulary = {word: index for index, word in enumerate(words)}
    tokenizer = backend.Tokenizer(backend.models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = backend.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(tmp_path)
    _, loaded = pretrained.load(tmp_path)
    assert loaded("the cat sat").input_ids == [1, 2, 3]


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _rewrite(directory: Path, **changes) -> None:
    config = _config(directory)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"'GPT2LMHeadModel' model .*supported: LlamaForCausalLM"),
    ({"architectures": None}, r"None model .*architectures"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type 'llama3'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"hidden_size": "64"}, "hidden_size must be a JSON int, got '64'"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a JSON int, got True"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be a JSON bool, got 'false'"),
    ({"rms_norm_eps": [1e-5]}, r"rms_norm_eps must be a JSON float, got \[1e-05\]"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
])
def test_a_model_it_would_run_wrongly_is_refused_naming_why(tmp_path, changes, message):
    save_tiny(tmp_path)
    _rewrite(tmp_path, **changes)
    with pytest.raises(HFDirectoryError, match=message) as error:
        pretrained.load(tmp_path, tokenizer=False)
    assert "\n" not in str(error.value)


def test_mistrals_sliding_window_is_the_models_own(tmp_path):
    """Mistral's sliding window (5 keys here, on 24 tokens) runs as the model's: transformers' logits and
    greedy tokens, decoding past the window; a mechanism that cannot attend within a window is refused naming
    it; Qwen2's window on some layers only is refused."""
    reference = save_tiny(tmp_path / "mistral", "mistral", sliding_window=5)
    model, _ = pretrained.load(tmp_path / "mistral", tokenizer=False)
    assert model.config.sliding_window == 5
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5
    decoded = attnzoo.greedy_decode(model, tokens[:, :3], 12)
    theirs = reference.generate(tokens[:, :3], attention_mask=torch.ones_like(tokens[:, :3]), max_new_tokens=12,
                                min_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(decoded, theirs)
    windowed, _ = pretrained.load(tmp_path / "mistral", mechanism="local", tokenizer=False)
    with torch.no_grad():  # local's own window defaults to the model's
        assert (windowed(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5
    with pytest.raises(attnzoo.UnsupportedOptionError, match="sliding window of 5 keys .*linear cannot"):
        pretrained.load(tmp_path / "mistral", mechanism="linear", tokenizer=False)
    from attnzoo.conversion import ConversionConfig
    from attnzoo.pretrained.evaluation import swap_candidates

    candidates = swap_candidates(model.config, 24)
    assert candidates["softmax"] is None and candidates["local"] is None
    assert "sliding window of 5" in candidates["linear"]

    with pytest.raises(ValueError, match="target 'lolcats' cannot replace .* sliding window of 5 keys"):
        ConversionConfig(target="lolcats", seq_len=16).check_fits(model.config)
    ConversionConfig(target="local", target_options={"window": 4}, seq_len=16).check_fits(model.config)
    save_tiny(tmp_path / "qwen2", "qwen2")
    _rewrite(tmp_path / "qwen2", use_sliding_window=True, sliding_window=16)
    with pytest.raises(HFDirectoryError, match="use_sliding_window"):
        pretrained.load(tmp_path / "qwen2", tokenizer=False)


@pytest.mark.parametrize("damage, message", [
    ("no weights", "no model.safetensors"),
    ("pickle only", "pytorch_model.bin: save it with safe_serialization=True"),
    ("bad json", "cannot be read as JSON"),
    ("extra tensor", "unexpected tensors extra.weight"),
    ("missing tensor", "missing tensors model.norm.weight"),
    ("no tokenizer", "holds no tokenizer"),
])
def test_a_damaged_directory_is_refused_in_one_line(tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage in ("no weights", "pickle only"):
        weights.unlink()
        if damage == "pickle only":
            (tmp_path / "pytorch_model.bin").write_bytes(b"")
    elif damage == "bad json":
        (tmp_path / "config.json").write_text("{")
    elif damage in ("extra tensor", "missing tensor"):
        tensors = load_file(str(weights))
        if damage == "extra tensor":
            tensors["extra.weight"] = torch.zeros(2)
        else:
            del tensors["model.norm.weight"]
        save_file(tensors, str(weights))
    with pytest.raises((HFDirectoryError, FileNotFoundError), match=message) as error:
        pretrained.load(tmp_path, tokenizer=damage == "no tokenizer")
    assert "\n" not in str(error.value)


def test_lm_eval_reads_a_directory(tmp_path):
    """`attnzoo lm-eval --model DIR`'s run: the directory's weights, its perplexity that of transformers' model."""
    from test_lm_eval import WordTokenizer

    from attnzoo.experiments.lm_eval import LmEvalConfig, prepare, run_lm_eval

    reference = save_tiny(tmp_path / "model", "qwen2")
    config = LmEvalConfig(gguf=str(tmp_path / "model"), parts=["perplexity"], sources=["code"], lengths=[32])
    data = run_lm_eval(config, tmp_path / "out", ["test"], prepared=prepare(config, needs_tokenizer=False),
                       tokenizer=WordTokenizer())
    assert data["model"]["file"] == "model" and data["model"]["architecture"] == "qwen2"
    row = data["perplexity"][0]
    assert row["status"] == "ok"
    with pytest.raises(ValueError, match="--model: model holds no tokenizer"):
        prepare(config)


def test_a_conversion_of_a_directory_loads_to_what_it_measured(tmp_path):
    """A teacher read from a directory: the conversion records it by the digest of its files, load_converted
    reads it back from there (the perplexity it measured, again), and a changed weight file is refused."""
    from attnzoo import conversion
    from attnzoo.pretrained.evaluation import perplexity

    save_tiny(tmp_path / "teacher")
    teacher, _ = pretrained.load(tmp_path / "teacher", tokenizer=False)
    source = conversion.teacher_source(pretrained.open_model(tmp_path / "teacher"))
    assert source["directory"] == str((tmp_path / "teacher").resolve())
    settings = conversion.ConversionConfig(target="lolcats", target_options={"window": 4, "feature_dim": 4,
                                           "chunk_size": 4}, keep_softmax=0, seq_len=12, transfer_steps=2,
                                           finetune_steps=2, checkpoint_every=1)
    windows = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(0))
    held_out = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    result = conversion.convert(teacher, windows, windows[:1], tmp_path / "run", settings, source=source,
                                evaluation_windows={"text": held_out}, progress=False)
    model, _ = conversion.load_converted(tmp_path / "run", tokenizer=False)
    assert model.layer_mechanism_names == ["lolcats"] * 2
    assert perplexity(model, held_out).perplexity == pytest.approx(result.perplexity["converted"]["text"], rel=1e-6)
    weights = tmp_path / "teacher" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    with pytest.raises(ValueError, match="not the model the conversion read"):
        conversion.load_converted(tmp_path / "run", tokenizer=False)


def test_the_commands_take_a_directory_and_refuse_a_bad_one_in_one_line(tmp_path, capsys):
    from attnzoo.cli import main

    save_tiny(tmp_path / "model")
    assert main(["lm-eval", "--model", str(tmp_path / "model"), "--parts", "perplexity", "--lengths", "32",
                 "--output", str(tmp_path / "out")]) == 2
    assert "--model: model holds no tokenizer" in capsys.readouterr().err
    _rewrite(tmp_path / "model", architectures=["PhiForCausalLM"])
    assert main(["convert", str(tmp_path / "run"), "--model", str(tmp_path / "model")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnzoo convert: error")]
    assert len(lines) == 1 and "'PhiForCausalLM' model" in lines[0] and not (tmp_path / "run").exists()

"""attnzoo.conversion: a pretrained softmax model converted to another attention (attention transfer, then
low-rank adapters), on tiny models: the losses compare what they say, the hybrid keeps the worst-transferred
layers, a killed conversion resumes to the same result, the saved model loads to the same outputs, and bad
settings are refused before any work. SmolLM2 itself is converted by ``attnzoo convert`` (docs/pretrained.md)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from attnzoo import conversion, pretrained
from attnzoo.conversion import ConversionConfig, LoRALinear, build_student, layer_plan, transfer_losses
from attnzoo.conversion.student import mechanism_state, trainable_only
from attnzoo.pretrained import CausalLM, CausalLMConfig

TARGET = "lolcats"
TARGET_OPTIONS = {"window": 4, "feature_dim": 4, "chunk_size": 4}
CONFIG = CausalLMConfig(vocab_size=64, dim=32, depth=3, heads=4, kv_heads=2, head_dim=8, ff_dim=64)


def teacher_model():
    torch.manual_seed(0)
    return CausalLM(CONFIG).eval()


@pytest.fixture
def teacher():
    return teacher_model()


def _settings(**changes):
    settings = dict(target=TARGET, target_options=TARGET_OPTIONS, seq_len=16, transfer_steps=6, finetune_steps=4,
                    checkpoint_every=2, keep_softmax=1, transfer_lr=1e-2, finetune_lr=1e-2)
    return ConversionConfig(**{**settings, **changes})


def _windows(count, length=16, seed=1):
    return torch.randint(0, CONFIG.vocab_size, (count, length), generator=torch.Generator().manual_seed(seed))


def _run(teacher, output, config, **kwargs):
    return conversion.convert(teacher, _windows(8), _windows(2, seed=2), output, config, source={"model": "tiny"},
                              evaluation_windows={"text": _windows(2, 24, seed=3)}, progress=False, **kwargs)


# -- the pieces ------------------------------------------------------------------------------------------------
def test_adapters_start_as_the_base_layer_and_merge_to_the_same_map():
    base = torch.nn.Linear(12, 7)
    adapted = LoRALinear(base, rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 12)
    assert torch.equal(adapted(x), base(x))
    assert not base.weight.requires_grad and adapted.lora_a.requires_grad
    with torch.no_grad():
        adapted.lora_b.normal_()
    expected = base(x) + 2.0 * x @ adapted.lora_a.t() @ adapted.lora_b.t()
    torch.testing.assert_close(adapted(x), expected)
    torch.testing.assert_close(adapted.merged()(x), adapted(x), rtol=1e-5, atol=1e-5)


def test_transfer_error_is_zero_for_softmax_and_positive_for_another_attention(teacher):
    tokens = _windows(1)
    same = build_student(teacher, layer_plan(3, range(3), "softmax", {}), seed=0)
    assert transfer_losses(teacher, same, tokens, [0, 1, 2], backward=False) == [0.0, 0.0, 0.0]
    windowed = build_student(teacher, layer_plan(3, [1], "local", {"window": 2}), seed=0)
    losses = transfer_losses(teacher, windowed, tokens, [0, 1, 2], backward=False)
    assert losses[0] == 0.0 and losses[2] == 0.0 and losses[1] > 1e-4


def test_the_student_shares_every_teacher_weight_and_draws_its_mechanisms_from_the_seed(teacher):
    one = build_student(teacher, layer_plan(3, range(3), TARGET, TARGET_OPTIONS), seed=5)
    two = build_student(teacher, layer_plan(3, range(3), TARGET, TARGET_OPTIONS), seed=5)
    other = build_student(teacher, layer_plan(3, range(3), TARGET, TARGET_OPTIONS), seed=6)
    for name, value in teacher.state_dict().items():
        assert torch.equal(one.state_dict()[name], value), name
    state_one, state_two, state_other = mechanism_state(one), mechanism_state(two), mechanism_state(other)
    assert state_one and all(torch.equal(state_one[n], state_two[n]) for n in state_one)
    assert not all(torch.equal(state_one[n], state_other[n]) for n in state_one)


def test_attention_transfer_lowers_the_held_out_error(teacher):
    student = build_student(teacher, layer_plan(3, range(3), TARGET, TARGET_OPTIONS), seed=0)
    held_out = _windows(2, seed=9)
    before = conversion.held_out_errors(teacher, student, held_out, [0, 1, 2])
    parameters = trainable_only(student, list(mechanism_state(student)))
    optimizer = torch.optim.Adam(parameters, lr=2e-2)
    for step in range(30):
        optimizer.zero_grad()
        transfer_losses(teacher, student, _windows(1, seed=step), [0, 1, 2], backward=True)
        optimizer.step()
    after = conversion.held_out_errors(teacher, student, held_out, [0, 1, 2])
    assert sum(after) < 0.8 * sum(before), (before, after)


def test_adapters_trained_on_the_layer_wise_loss_lower_it():
    """What ``transfer_lora`` trains in stage 1: the adapters of a target with no parameters (liger), on one window's
    layer-wise losses, bring them down."""
    teacher = teacher_model()
    student = build_student(teacher, layer_plan(3, range(3), "liger", LIGER_OPTIONS), seed=0)
    names = conversion.add_lora(student, conversion.lora.attention_projection_names(range(3)), 8, 16.0, 0)
    window = _windows(1, seed=5)
    parameters = trainable_only(student, names)
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        losses.append(sum(transfer_losses(teacher, student, window, [0, 1, 2], backward=True)))
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_hybrid_keeps_the_layers_with_the_largest_error():
    assert conversion.layers_to_keep([0.1, 0.5, 0.2, 0.5], [0, 1, 2, 3], 2) == [1, 3]
    assert conversion.layers_to_keep([0.1, 0.5, 0.2], [0, 1, 2], 0) == []


# -- the whole conversion ----------------------------------------------------------------------------------------
def test_a_conversion_reports_and_keeps_the_worst_layer(teacher, tmp_path):
    result = _run(teacher, tmp_path / "run", _settings())
    assert result.kept_softmax == [max(range(3), key=lambda i: result.layer_errors[i])]
    assert set(result.perplexity) == {"teacher", "raw_swap", "transferred", "converted"}
    assert [row["stage"] for row in result.history] == ["transfer"] * 6 + ["finetune"] * 4
    for name in ("conversion.json", "checkpoint.pt", "results.json", "history.csv", "loss.png", "model/model.json"):
        assert (tmp_path / "run" / name).exists(), name
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["kept_softmax"] == result.kept_softmax


class _Killed(Exception):
    pass


@pytest.mark.parametrize("stage, step", [("transfer", 3), ("finetune", 1)])
def test_a_killed_conversion_resumes_to_the_same_result(teacher, tmp_path, stage, step):
    whole = _run(teacher, tmp_path / "whole", _settings())

    def kill(at_stage, at_step):
        if (at_stage, at_step) == (stage, step):
            raise _Killed

    with pytest.raises(_Killed):
        _run(teacher, tmp_path / "killed", _settings(), on_step=kill)
    resumed = _run(teacher, tmp_path / "killed", _settings())
    assert [row["loss"] for row in resumed.history] == [row["loss"] for row in whole.history]
    assert resumed.perplexity == whole.perplexity
    mine = (tmp_path / "killed" / "model" / "weights.safetensors").read_bytes()
    assert mine == (tmp_path / "whole" / "model" / "weights.safetensors").read_bytes()


LIGER_OPTIONS = {"window": 4, "chunk_size": 4, "normalize": True, "sink_tokens": 1}


def test_stage_1_trains_the_adapters_of_a_target_without_parameters_and_stage_2_goes_on(teacher, tmp_path):
    """liger has no parameters: with transfer_lora, stage 1 trains the adapters (of every layer; the kept one's are
    dropped), stage 2 starts from them, and a run killed in stage 1 resumes to the same bytes."""
    settings = _settings(target="liger", target_options=LIGER_OPTIONS, transfer_lora=True, transfer_lr=3e-3,
                         keep_softmax=1)
    whole = _run(teacher, tmp_path / "whole", settings)
    assert [row["stage"] for row in whole.history] == ["transfer"] * 6 + ["finetune"] * 4
    assert whole.perplexity["transferred"] != whole.perplexity["raw_swap"]  # stage 2 starts from stage 1's adapters
    stopped_at = []

    def kill(stage, step):
        if (stage, step) == ("transfer", 3):
            stopped_at.append(step)
            raise _Killed

    with pytest.raises(_Killed):
        _run(teacher, tmp_path / "killed", settings, on_step=kill)
    resumed = _run(teacher, tmp_path / "killed", settings)
    assert stopped_at == [3] and [row["loss"] for row in resumed.history] == [row["loss"] for row in whole.history]
    mine = (tmp_path / "killed" / "model" / "weights.safetensors").read_bytes()
    assert mine == (tmp_path / "whole" / "model" / "weights.safetensors").read_bytes()
    # A finished conversion no longer holds stage 1's adapters apart: --transfer-from is refused, naming why.
    with pytest.raises(ValueError, match="transfer_lora"):
        _run(teacher, tmp_path / "again", settings, transfer_from=tmp_path / "whole")


def test_a_hybrid_from_another_conversions_stage_1_is_the_hybrid_converted_whole(teacher, tmp_path):
    """--transfer-from: stage 1 taken from a conversion of every layer, the worst layer then kept in softmax,
    gives the same model, bytes and all, as the hybrid converted from the start (stage 1 trains every layer
    either way); and killed before its first checkpoint it starts from there again."""
    every = _run(teacher, tmp_path / "every", _settings(keep_softmax=0))
    whole = _run(teacher, tmp_path / "whole", _settings(keep_softmax=1))
    reused = _run(teacher, tmp_path / "reused", _settings(keep_softmax=1), transfer_from=tmp_path / "every")
    assert reused.transfer_from == str(tmp_path / "every") and every.kept_softmax == []
    assert reused.kept_softmax == whole.kept_softmax and reused.layer_errors == every.layer_errors
    assert [row["loss"] for row in reused.history] == [row["loss"] for row in whole.history]
    assert (tmp_path / "reused" / "model" / "weights.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "weights.safetensors").read_bytes()
    assert reused.perplexity["converted"] == whole.perplexity["converted"] and "raw_swap" not in reused.perplexity
    assert json.loads((tmp_path / "reused" / "conversion.json").read_text())["transfer_from"] == \
        str(tmp_path / "every")

    def kill(stage, step):
        raise _Killed

    with pytest.raises(_Killed):
        _run(teacher, tmp_path / "killed", _settings(keep_softmax=1, checkpoint_every=3),
             transfer_from=tmp_path / "every", on_step=kill)
    again = _run(teacher, tmp_path / "killed", _settings(keep_softmax=1, checkpoint_every=3))
    assert again.transfer_from == str(tmp_path / "every")
    assert (tmp_path / "killed" / "model" / "weights.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "weights.safetensors").read_bytes()


def test_a_stage_1_that_does_not_fit_is_refused_naming_why(teacher, tmp_path):
    _run(teacher, tmp_path / "hybrid", _settings(keep_softmax=1))
    _run(teacher, tmp_path / "every", _settings(keep_softmax=0))
    for folder, settings, message in [
        (tmp_path / "every", _settings(transfer_steps=5), "transfer_steps 6, this conversion asks for 5"),
        (tmp_path / "hybrid", _settings(keep_softmax=2), "kept layers"),
        (tmp_path / "none", _settings(), "holds no conversion"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            _run(teacher, tmp_path / "out", settings, transfer_from=folder)
    with pytest.raises(ValueError, match="another model file"):
        conversion.convert(teacher, _windows(8), _windows(2, seed=2), tmp_path / "out2", _settings(),
                           source={"model": "other"}, progress=False, transfer_from=tmp_path / "every")


def test_stage_2_trains_on_its_own_longer_windows_after_another_conversions_stage_1(teacher, tmp_path):
    """finetune_seq_len: stage 2 on windows longer than stage 1's (a length curriculum), from a stage 1 run
    once; its tokens counted at its own length, and killed, it resumes to the same model."""
    every = _run(teacher, tmp_path / "every", _settings(keep_softmax=0))
    settings = _settings(keep_softmax=0, finetune_seq_len=32)
    with pytest.raises(ValueError, match="finetune_windows must be a .n, finetune_seq_len=32"):
        _run(teacher, tmp_path / "none", settings, transfer_from=tmp_path / "every")
    longer = _windows(4, length=32, seed=4)
    whole = _run(teacher, tmp_path / "long", settings, transfer_from=tmp_path / "every", finetune_windows=longer)
    stage_2 = [row for row in whole.history if row["stage"] == "finetune"]
    assert [row["tokens"] for row in stage_2] == [32 * step for step in range(1, 5)]
    assert [row["loss"] for row in stage_2] != [row["loss"] for row in every.history if row["stage"] == "finetune"]

    def kill(stage, step):
        if (stage, step) == ("finetune", 3):
            raise _Killed

    with pytest.raises(_Killed):
        _run(teacher, tmp_path / "killed", settings, transfer_from=tmp_path / "every", finetune_windows=longer,
             on_step=kill)
    again = _run(teacher, tmp_path / "killed", settings, finetune_windows=longer)
    assert [row["loss"] for row in again.history] == [row["loss"] for row in whole.history]
    assert (tmp_path / "killed" / "model" / "weights.safetensors").read_bytes() == \
        (tmp_path / "long" / "model" / "weights.safetensors").read_bytes()


def test_stage_2_trains_the_converted_layers_mechanisms_only_when_asked(teacher, tmp_path):
    """finetune_mechanism: stage 2 trains the converted layers' feature maps with the adapters (from another
    conversion's stage 1, whose maps it leaves as they were); without it they stay stage 1's; killed in stage 2, it
    resumes to the same bytes."""
    from safetensors.torch import load_file

    every = _run(teacher, tmp_path / "every", _settings(keep_softmax=0))
    _run(teacher, tmp_path / "stage-1", _settings(keep_softmax=0, finetune_steps=0), transfer_from=tmp_path / "every")
    stage_1 = load_file(str(tmp_path / "stage-1" / "model" / "weights.safetensors"))
    frozen = load_file(str(tmp_path / "every" / "model" / "weights.safetensors"))
    settings = _settings(keep_softmax=0, finetune_mechanism=True)
    both = _run(teacher, tmp_path / "both", settings, transfer_from=tmp_path / "every")
    trained = load_file(str(tmp_path / "both" / "model" / "weights.safetensors"))
    maps = [name for name in frozen if ".attention.mechanism." in name]
    assert maps and set(trained) == set(frozen)
    assert all(not torch.equal(trained[name], frozen[name]) for name in maps)
    assert [row["loss"] for row in both.history] != [row["loss"] for row in every.history]
    before = every.history[:6]
    assert [row["loss"] for row in both.history[:6]] == [row["loss"] for row in before]
    # Without the setting the maps stay those stage 1 ended with (a stage 2 of no steps saves them).
    assert all(torch.equal(frozen[name], stage_1[name]) for name in maps)

    def kill(stage, step):
        if (stage, step) == ("finetune", 3):
            raise _Killed

    with pytest.raises(_Killed):
        _run(teacher, tmp_path / "killed", settings, transfer_from=tmp_path / "every", on_step=kill)
    again = _run(teacher, tmp_path / "killed", settings)
    assert [row["loss"] for row in again.history] == [row["loss"] for row in both.history]
    assert (tmp_path / "killed" / "model" / "weights.safetensors").read_bytes() == \
        (tmp_path / "both" / "model" / "weights.safetensors").read_bytes()


def test_the_teacher_fine_tuned_alike_is_a_conversion_to_softmax_without_stage_1(teacher, tmp_path):
    """The fair reference for a conversion's perplexity ratios: the teacher given the same adapters and the same
    stage 2 tokens (``target="softmax"``, no stage 1): nothing to transfer, every layer's error 0, and before
    stage 2 it is the teacher."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = _run(teacher, tmp_path / "reference", _settings(target="softmax", target_options={},
                                                                    keep_softmax=0, transfer_steps=0))
    assert not [w for w in caught if "log-scaled" in str(w.message)]  # loss.png: no log axis of zeros
    assert reference.layer_errors == [0.0, 0.0, 0.0]
    assert [row["stage"] for row in reference.history] == ["finetune"] * 4
    assert reference.perplexity["transferred"]["text"] == pytest.approx(reference.perplexity["teacher"]["text"],
                                                                       rel=1e-5)
    assert reference.perplexity["converted"]["text"] != reference.perplexity["teacher"]["text"]


def test_a_conversion_written_before_a_setting_existed_still_resumes(teacher, tmp_path):
    _run(teacher, tmp_path / "run", _settings(finetune_steps=0))
    written = json.loads((tmp_path / "run" / "conversion.json").read_text())
    del written["config"]["finetune_seq_len"]  # as a conversion from before the setting wrote it
    (tmp_path / "run" / "conversion.json").write_text(json.dumps(written))
    assert conversion.run.check_output(tmp_path / "run", _settings(finetune_steps=0), {"model": "tiny"})


def test_a_folder_of_another_conversion_is_refused(teacher, tmp_path):
    _run(teacher, tmp_path / "run", _settings(finetune_steps=0))
    with pytest.raises(ValueError, match="other settings"):
        _run(teacher, tmp_path / "run", _settings(finetune_steps=1))


def test_a_converted_gguf_model_loads_to_the_same_outputs(tmp_path):
    gguf = pytest.importorskip("gguf")  # noqa: F841
    from test_pretrained import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    teacher, _ = pretrained.load(path, tokenizer=False)
    settings = _settings(keep_softmax=0, seq_len=12, transfer_steps=2, finetune_steps=2)
    windows = torch.randint(0, teacher.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    conversion.convert(teacher, windows, windows[:1], tmp_path / "run", settings,
                       source=conversion.gguf_source(path), progress=False)
    model, tokenizer = conversion.load_converted(tmp_path / "run", tokenizer=False)
    assert tokenizer is None and model.layer_mechanism_names == [TARGET] * teacher.config.depth
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 4 * teacher.config.depth
    tokens = windows[:2]
    reference = json.loads((tmp_path / "run" / "model" / "model.json").read_text())
    assert reference["source"]["sha256"] == conversion.gguf_source(path)["sha256"]
    # The same model rebuilt by hand from the checkpoint's tensors gives the same logits, bit for bit.
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    rebuilt = build_student(teacher, layer_plan(teacher.config.depth, range(teacher.config.depth), TARGET,
                                                TARGET_OPTIONS), seed=0)
    conversion.add_lora(rebuilt, conversion.lora.attention_projection_names(range(teacher.config.depth)), 8, 16.0, 0)
    conversion.student.load_tensors(rebuilt, state["tensors"])
    with torch.no_grad():
        assert torch.equal(model(tokens), rebuilt(tokens))
    # Merged for decoding: plain projections, the same logits up to float32 rounding.
    merged, _ = conversion.load_converted(tmp_path / "run", tokenizer=False, merged=True)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    with torch.no_grad():
        assert torch.allclose(merged(tokens), model(tokens), atol=1e-4, rtol=1e-5)
        assert not torch.equal(merged.layers[0].attention.q_proj.weight, teacher.layers[0].attention.q_proj.weight)
    with pytest.raises(TypeError, match="merged must be True or False"):
        conversion.load_converted(tmp_path / "run", tokenizer=False, merged="yes")
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other)
    with pytest.raises(ValueError, match="not the model the conversion read"):
        conversion.load_converted(tmp_path / "run", gguf=other, tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no converted model"):
        conversion.load_converted(tmp_path, tokenizer=False)


# -- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"target": "nope"}, "target must be one of"),
    ({"seq_len": 0}, "seq_len"),
    ({"transfer_lr": 0.0}, "transfer_lr"),
    ({"finetune_loss": "mse"}, "finetune_loss"),
    ({"target_options": "window=4"}, "target_options"),
    ({"transfer_lora": "yes"}, "transfer_lora"),
    ({"transfer_lora": True, "transfer_steps": 0}, "transfer_lora=True"),
])
def test_bad_settings_are_refused_naming_them(changes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        _settings(**changes)


@pytest.mark.parametrize("changes, message", [
    ({"keep_softmax": 3}, "keep_softmax=3 keeps every one"),
    ({"target": "linformer", "target_options": {}}, "cannot replace this model's causal self-attention"),
    ({"target": "local", "target_options": {"windw": 3}}, "target_options: .*windw"),
])
def test_a_target_that_cannot_take_the_models_place_is_refused_before_any_work(teacher, tmp_path, changes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        _run(teacher, tmp_path / "run", _settings(**changes))
    assert not (tmp_path / "run").exists()


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    from attnzoo.cli import main

    gguf = pytest.importorskip("gguf")  # noqa: F841
    from test_pretrained import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    for flags, message in [
        (["--target", "linformer", "--target-options", ""], "cannot replace this model's causal self-attention"),
        (["--keep-softmax", "2"], "keeps every one"),
        (["--eval-length", "4096"], "--eval-length 4096 is past the model's context (128 tokens)"),
        (["--seq-len", "0"], "--seq-len"),
        (["--finetune-seq-len", "256"], "--finetune-seq-len 256 is past the model's context (128 tokens)"),
        (["--gguf", str(tmp_path / "missing.gguf")], "does not exist"),
        (["--transfer-from", str(tmp_path)], "--transfer-from"),
    ]:
        argv = ["--gguf", str(path), "--seq-len", "16", "--eval-length", "16", "--target", TARGET,
                "--target-options", ",".join(f"{k}={v}" for k, v in TARGET_OPTIONS.items()), *flags]
        # In this process: a subprocess per case cost 3 s of imports each; the exit code and stderr are the same.
        code = main(["convert", str(tmp_path / "out"), *argv])
        stderr = capsys.readouterr().err
        assert code == 2, (flags, stderr)
        lines = [line for line in stderr.splitlines() if line.startswith("attnzoo convert: error")]
        assert len(lines) == 1 and message in lines[0], (flags, stderr)
        assert not (tmp_path / "out").exists()  # refused before anything was written


def _state_bytes(state) -> int:
    from attnzoo.state import map_tensors

    sizes = []
    map_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


def test_a_converted_model_decodes_from_a_constant_size_state_equal_to_its_forward(teacher, tmp_path):
    _run(teacher, tmp_path / "run", _settings(keep_softmax=0))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    model = build_student(teacher, layer_plan(3, range(3), TARGET, TARGET_OPTIONS), seed=0)
    conversion.add_lora(model, conversion.lora.attention_projection_names(range(3)), 8, 16.0, 0)
    conversion.student.load_tensors(model, state["tensors"])
    tokens = _windows(2, 20, seed=4)
    with torch.no_grad():
        full = model(tokens)
        logits, decoding = model.prefill(tokens[:, :6])
        steps, sizes = [logits[:, -1]], []
        for position in range(6, 20):
            logits_t, decoding = model.step(tokens[:, position], decoding)
            steps.append(logits_t)
            sizes.append(_state_bytes(decoding.layers))
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, 5:19], rtol=1e-4, atol=1e-4)
    assert len(set(sizes)) == 1, sizes  # the window is full after 4 tokens; from then on nothing grows

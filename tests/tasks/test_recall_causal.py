"""The causal variant of associative recall: ``recall`` with ``causal=True`` trains a causal
:class:`SequenceTagger` (each position sees only itself and earlier ones), end to end from the command line."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch

from attnzoo import SequenceTagger, UnsupportedOptionError
from attnzoo.cli import main
from attnzoo.models import Decoder, Encoder, ModelConfig, ReversibleDecoder
from attnzoo.tasks import Split, Task, load
from attnzoo.training import TrainConfig, build_model, load_trained, unsupported_reasons

VOCAB = 11
RECALL = dict(train_size=32, validation_size=8, test_size=8, num_pairs=4, num_keys=8, num_values=4)


def _tagger(mechanism: str, causal: bool, **options) -> SequenceTagger:
    torch.manual_seed(0)
    model = SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=2, self_attention=mechanism, causal=causal, **options)
    return model.double().eval()


def _changed_after(tokens: torch.Tensor, t: int) -> torch.Tensor:
    """``tokens`` (batch, seq) with every token after position ``t`` replaced by another id."""
    changed = tokens.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(changed.shape[1] - t - 1)) % VOCAB
    assert not torch.equal(changed[:, t + 1:], tokens[:, t + 1:])
    return changed


# -- the causal tagger ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mechanism, options", [
    ("softmax", {}),
    ("linear", {"token_shift": True, "positional": "rotary"}),  # token shift reads backwards: causal-safe
    ("delta", {"token_shift": True}),
    ("softmax", {"reversible": True}),
    ("softmax", {"block": "gau"}),
])
def test_a_causal_taggers_output_at_t_ignores_later_tokens_and_a_bidirectional_ones_does_not(mechanism, options):
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    t = 4
    changed = _changed_after(tokens, t)
    causal = _tagger(mechanism, True, **options)
    with torch.no_grad():
        before, after = causal(tokens), causal(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-12, rtol=0)
    assert not torch.allclose(after[:, t + 1:], before[:, t + 1:])  # later positions do see the change
    bidirectional = _tagger(mechanism, False, **options)
    with torch.no_grad():
        assert not torch.allclose(bidirectional(changed)[:, : t + 1], bidirectional(tokens)[:, : t + 1])


def test_the_causal_tagger_is_a_decoder_only_stack_and_from_config_builds_the_same():
    config = ModelConfig(VOCAB, dim=16, heads=2, depth=1)
    assert type(SequenceTagger.from_config(config, 3).encoder) is Encoder
    torch.manual_seed(0)
    causal = SequenceTagger.from_config(config, 3, causal=True)
    torch.manual_seed(0)
    from_keywords = SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=1, causal=True)
    assert type(causal.encoder) is Decoder and causal.causal and "causal=True" in repr(causal)
    assert causal.encoder.config.cross_attention is None
    ours, theirs = causal.state_dict(), from_keywords.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[key], theirs[key]) for key in ours)
    # The same parameter names as the bidirectional tagger: the layers are alike, only the mask differs.
    assert set(ours) == set(SequenceTagger.from_config(config, 3).state_dict())
    reversible = SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=1, reversible=True, causal=True)
    assert type(reversible.encoder) is ReversibleDecoder


@pytest.mark.parametrize("build", [
    lambda: SequenceTagger(VOCAB, 3, dim=16, heads=2, causal="yes"),
    lambda: SequenceTagger.from_config(ModelConfig(VOCAB, dim=16, heads=2), 3, causal=1),
])
def test_the_taggers_causal_must_be_a_bool(build):
    with pytest.raises(TypeError, match="causal must be True or False"):
        build()


def test_a_causal_tagger_masks_padding_that_comes_before_the_tokens():
    """Left padding, which causality alone would not hide: the tokens' logits ignore what the padding holds."""
    model = _tagger("linear", True)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1, :3] = True
    other = tokens.clone()
    other[1, :3] = (other[1, :3] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens, padding_mask=padding), model(other, padding_mask=padding)
    torch.testing.assert_close(a[1, 3:], b[1, 3:], atol=1e-12, rtol=0)


# -- the task option -----------------------------------------------------------------------------------------
def test_recall_causal_is_validated_recorded_and_leaves_the_data_alone():
    plain, causal = load("recall", **RECALL), load("recall", **RECALL, causal=True)
    assert (plain.causal, plain.needs_causal_model) == (False, False)
    assert (causal.causal, causal.needs_causal_model) == (True, True)
    assert not causal.needs_causal  # the kind (tag) does not demand it; the option does
    assert causal.options()["causal"] is True and load("recall", **causal.options()).causal
    assert "causal True" in causal.describe() and "causal False" in plain.describe()
    for split in ("train", "validation", "test"):
        a, b = plain.split(split), causal.split(split)
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="causal must be True or False"):
            load("recall", **RECALL, causal=bad)


def _toy_task(kind: str, needs_causal: bool, causal_model: Optional[bool]) -> type:
    """An unregistered task of ``kind`` whose model must be causal as said (None: what its kind says)."""

    class Toy(Task):
        name, metric, summary = "toy", "accuracy", "x"

        def __init__(self, *, seed: int = 0) -> None:
            self.seed, self.vocab_size, self.seq_len, self.num_classes, self.pad_id = seed, 4, 3, 4, None
            inputs = torch.zeros(2, 3, dtype=torch.int64)
            targets = torch.zeros(2, dtype=torch.int64) if kind == "classify" else inputs
            self._set_splits({name: Split(inputs, targets, None) for name in ("train", "validation", "test")})

        if causal_model is not None:
            needs_causal_model = property(lambda self: causal_model)

    Toy.kind, Toy.needs_causal = kind, needs_causal
    return Toy


def test_only_a_tag_or_lm_task_has_a_causal_model_and_an_lm_tasks_always_is():
    assert _toy_task("tag", False, True)().needs_causal_model
    assert _toy_task("lm", True, None)().needs_causal_model
    with pytest.raises(ValueError, match="only lm and tag tasks have causal models"):
        _toy_task("classify", False, True)()
    with pytest.raises(ValueError, match="must be causal"):
        _toy_task("lm", True, False)()


# -- training, eval and resume -------------------------------------------------------------------------------
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=4, eval_interval=2)


def test_the_training_builder_makes_the_tagger_the_task_asks_for():
    for causal in (False, True):
        task = load("recall", **RECALL, causal=causal)
        model = build_model(TrainConfig("recall", task_options=task.options(), **SMALL), task)
        assert model.causal is causal


def test_a_causal_recall_refuses_a_mechanism_without_causal_support_in_one_line(capsys, tmp_path):
    task = load("recall", **RECALL, causal=True)
    config = TrainConfig("recall", mechanism="linformer", mechanism_options={"rank": 4}, task_options=RECALL,
                         **SMALL)
    assert unsupported_reasons(TrainConfig("recall", mechanism="linformer", mechanism_options={"rank": 4},
                                           task_options=RECALL, **SMALL), load("recall", **RECALL)) == []
    reasons = unsupported_reasons(config, task)
    assert reasons == ["recall asks for a causal model (each position sees only itself and earlier ones), which "
                       "needs causal attention: linformer does not support causal=True (non-causal only)"]
    with pytest.raises(UnsupportedOptionError, match="linformer cannot train on recall: recall asks for a causal"):
        build_model(config, task)
    code = main(["train", "recall", "--task-options", "num_pairs=4,causal=true", "--mechanism", "fnet",
                 "--output", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
    assert "fnet cannot train on recall" in err and "needs causal attention" in err


def test_a_language_model_still_refuses_a_non_causal_mechanism_as_before():
    data = {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32}
    config = TrainConfig("bytes", mechanism="linformer", mechanism_options={"rank": 4}, task_options=data, **SMALL)
    assert unsupported_reasons(config, load("bytes", **data)) == [
        "bytes is next-token prediction, which needs causal attention: linformer does not support causal=True "
        "(non-causal only)"]


def test_train_causal_recall_then_eval_and_resume_from_the_command_line(capsys, tmp_path):
    out = tmp_path / "run"
    options = ",".join(f"{k}={v}" for k, v in {**RECALL, "causal": "true"}.items())
    argv = ["train", "recall", "--task-options", options, "--mechanism", "delta", "--token-shift",
            "--positional", "rotary", "--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "8",
            "--steps", "5", "--eval-interval", "5", "--threads", "1", "--output", str(out), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["task_options"]["causal"] is True
    model, task, _ = load_trained(out)
    assert task.causal and model.causal and type(model.encoder) is Decoder
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["accuracy"] == results["test"]["accuracy"]
    assert report["metrics"]["loss"] == pytest.approx(results["test"]["loss"], rel=1e-6)
    # Resuming the finished run says it is complete and keeps its results.
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    assert "is complete" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["test"]["accuracy"] == results["test"]["accuracy"]

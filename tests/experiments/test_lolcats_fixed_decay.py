"""scripts/lolcats_fixed_decay.py: the copy's options and tensors are those of lolcats with that decay, everything
else as it was; the refusals."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnzoo.mechanisms import build_mechanism

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lolcats_fixed_decay", ROOT / "scripts" / "lolcats_fixed_decay.py")
fixed_decay = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fixed_decay
_spec.loader.exec_module(fixed_decay)


def _converted(folder: Path, layers=(("lolcats", {"sink_tokens": 4}), ("lolcats", {"sink_tokens": 4}))) -> Path:
    model = folder / "model"
    model.mkdir(parents=True)
    (model / "model.json").write_text(json.dumps({"format": 1, "layer_mechanisms": [list(layer) for layer in layers],
                                                  "source": {"sha256": "0"}}))
    mechanism = build_mechanism("lolcats", 3, 8, sink_tokens=4)
    tensors = {f"layers.{i}.attention.mechanism.{name}": p.detach().clone()
               for i in range(len(layers)) for name, p in mechanism.named_parameters()}
    tensors["layers.0.attention.q_proj.lora_a"] = torch.ones(2, 2)
    save_file(tensors, str(model / "weights.safetensors"))
    return folder


def test_the_copy_is_lolcats_with_that_decay(tmp_path):
    source = _converted(tmp_path / "source")
    assert fixed_decay.main([str(source), str(tmp_path / "out"), "--decay", "0.97"]) == 0
    description = json.loads((tmp_path / "out" / "model" / "model.json").read_text())
    assert description["layer_mechanisms"] == [["lolcats", {"sink_tokens": 4, "decay": 0.97}]] * 2
    before, after = load_file(str(source / "model" / "weights.safetensors")), \
        load_file(str(tmp_path / "out" / "model" / "weights.safetensors"))
    assert all(torch.equal(after[name], value) for name, value in before.items())
    added = sorted(set(after) - set(before))
    assert added == [f"layers.{i}.attention.mechanism.decay_logit" for i in range(2)]
    # The names and shapes a lolcats layer with a decay has, and lambda = 0.97 for every head.
    expected = dict(build_mechanism("lolcats", 3, 8, sink_tokens=4, decay=0.5).named_parameters())["decay_logit"]
    for name in added:
        assert after[name].shape == expected.shape
        torch.testing.assert_close(torch.sigmoid(after[name]), torch.full((3,), 0.97))


@pytest.mark.parametrize("layers, decay, match", [
    ((("lolcats", {}), ("softmax", {})), 0.9, "layer 1 is 'softmax'"),
    ((("lolcats", {"decay": 0.9}),), 0.9, "layer 0"),
    ((("lolcats", {}),), 1.0, "decay"),
])
def test_refusals(tmp_path, capsys, layers, decay, match):
    source = _converted(tmp_path / "source", layers)
    assert fixed_decay.main([str(source), str(tmp_path / "out"), "--decay", str(decay)]) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "exists").mkdir()
    assert fixed_decay.main([str(source), str(tmp_path / "exists"), "--decay", "0.5"]) == 2

"""scripts/cuda_check.py, the check of the CUDA paths, run CPU against CPU: its checks pass on agreeing devices
and fail on a mechanism whose output depends on the device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_of_a_mechanism_is_checked_and_passes_on_agreeing_devices(tmp_path):
    out = tmp_path / "check.json"
    assert _load().main(["--device", "cpu", "--mechanisms", "linear,delta", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    settings = {(row["mechanism"], row["setting"]) for row in report["mechanisms"]}
    assert {("linear", s) for s in ("plain", "causal", "padded", "cross", "grouped", "packed", "step")} <= settings
    assert ("delta", "step") in settings and ("delta", "cross") not in settings  # delta declares no cross
    assert all(row["ok"] for row in report["mechanisms"] + report["models"] + report["training"])
    assert {row["training"] for row in report["training"]} == {"train on the device = on the CPU",
                                                                "resume on the device",
                                                                "resume data-parallel on the device"}


def test_a_device_dependent_output_fails_the_check(monkeypatch):
    script = _load()
    from attnzoo.mechanisms.registry import mechanism_class

    cls = mechanism_class("linear")
    original = cls.attend
    calls = []

    def drifting(self, *args):  # every other call (the "GPU" copy) is off by 1e-2
        calls.append(1)
        out = original(self, *args)
        return out + (1e-2 if len(calls) % 2 == 0 else 0.0)

    monkeypatch.setattr(cls, "attend", drifting)
    script.DEVICE = "cpu"
    rows = script.check_mechanism("linear")
    assert not rows[0]["ok"] and rows[0]["failures"][0].startswith("output: CUDA differs")

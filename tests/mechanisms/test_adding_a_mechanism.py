"""Adding a mechanism takes one class and nothing else: ``tests/mechanisms/toy_new_mechanism.py`` (under 40 lines) shows up
in ``attnzoo list``, runs in ``attnzoo compare`` with the error sweep its class declares, and passes the whole
conformance suite, without a line changed anywhere in the library. ``tests/mechanisms/toy_trained_mechanism.py``, a mechanism
with an auxiliary loss and an update after every optimiser step, trains with ``attnzoo.training.train`` and under
DDP through the training hooks alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.mechanisms import registry
from attnzoo.training import TrainConfig, load_trained, train

from conformance import checks

TOY = Path(__file__).with_name("toy_new_mechanism.py")
TRAINED_TOY = Path(__file__).with_name("toy_trained_mechanism.py")


@pytest.fixture(scope="module")
def toy_class():
    """The toy, registered for this module's tests only (the rest of the suite never sees it)."""
    sys.path.insert(0, str(TOY.parent))
    try:
        import toy_new_mechanism

        yield toy_new_mechanism.QuantizedQueries
    finally:
        registry._REGISTRY.pop("toy-quantized", None)
        sys.modules.pop("toy_new_mechanism", None)
        sys.path.remove(str(TOY.parent))


def test_the_toy_is_one_short_class():
    source = TOY.read_text()
    assert source.count("\nclass ") == 1
    class_lines = source[source.index("@register"):].strip().splitlines()
    assert len(class_lines) < 40, len(class_lines)


def test_held_to_the_whole_conformance_suite(toy_class):
    checks.check_declaration(toy_class)
    mechanism = checks.build("toy-quantized")
    for check in checks.INSTANCE_CHECKS:
        check(mechanism)


def test_listed(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(TOY.parent)!r}); import toy_new_mechanism; "
            "from attnzoo.cli import main; sys.exit(main(['list', '--wide']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("toy-quantized"))
    assert "approximate" in line and "O(N^2)" in line


@pytest.mark.slow
def test_compared_with_its_declared_sweep(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "attnzoo.cli", "compare", "--import", str(TOY), "--mechanisms", "toy-quantized",
         "--lengths", "16,32", "--heads", "2", "--head-dim", "8", "--repeats", "2", "--threads", "1",
         "--quiet", "--output", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    rows = [row for row in data["rows"] if row["mechanism"] == "toy-quantized"]
    assert [row["status"] for row in rows] == ["ok", "ok"] and all(row["kind"] == "approximate" for row in rows)
    sweep = next(item for item in data["sweeps"] if item["mechanism"] == "toy-quantized")
    assert sweep["option"] == "levels"
    errors = [point["error"] for point in sweep["points"]]
    assert errors[0] > errors[-1]  # finer rounding, smaller error


# -- a mechanism with training hooks -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tempered_class():
    """The trained toy, registered for this module's tests only."""
    sys.path.insert(0, str(TRAINED_TOY.parent))
    try:
        import toy_trained_mechanism

        yield toy_trained_mechanism.TemperedAttention
    finally:
        registry._REGISTRY.pop("toy-tempered", None)
        sys.modules.pop("toy_trained_mechanism", None)
        sys.path.remove(str(TRAINED_TOY.parent))


LISTOPS = {"train_size": 64, "validation_size": 16, "test_size": 16, "min_length": 8, "max_length": 24}
TRAINED = TrainConfig("listops", task_options=LISTOPS, mechanism="toy-tempered", dim=16, depth=2, heads=2,
                      batch_size=8, steps=4, eval_interval=2)


def tempered_states(model, cls):
    return [(int(m.updates), int(m.last_step), m.temperature_ema.clone()) for m in model.modules() if isinstance(m, cls)]


def test_the_trained_toy_is_one_class_held_to_the_whole_conformance_suite(tempered_class):
    assert TRAINED_TOY.read_text().count("\nclass ") == 1
    checks.check_declaration(tempered_class)
    mechanism = checks.build("toy-tempered")
    for check in checks.INSTANCE_CHECKS:
        check(mechanism)


def test_trains_with_its_auxiliary_loss_and_updates_after_every_step(tempered_class, monkeypatch, tmp_path):
    reached = []  # the gradient of the step's loss with respect to each auxiliary term the toy handed over
    handed = tempered_class.auxiliary_loss

    def watched(self):
        loss = handed(self)
        if loss is not None:
            loss.register_hook(lambda gradient: reached.append(float(gradient)))
        return loss

    monkeypatch.setattr(tempered_class, "auxiliary_loss", watched)
    train(TRAINED, tmp_path / "run", progress=False)
    assert reached == [1.0] * (TRAINED.steps * TRAINED.depth)  # every layer's term, in every step's loss
    model, _, _ = load_trained(tmp_path / "run")
    states = tempered_states(model, tempered_class)
    assert len(states) == TRAINED.depth
    for updates, last_step, ema in states:
        assert (updates, last_step) == (TRAINED.steps, TRAINED.steps - 1)
        assert not torch.equal(ema, torch.ones_like(ema))


@pytest.mark.slow  # two processes
def test_trains_data_parallel_with_its_hooks_alike_on_every_rank(tempered_class, tmp_path):
    from data_parallel_runs import job, run_ranks, weights

    train(TRAINED, tmp_path / "one", progress=False)
    (ranks,) = run_ranks(tmp_path, [job(TRAINED, tmp_path / "two", imports=[str(TRAINED_TOY)])])
    for name in ("updates", "last_step", "temperature_ema"):
        buffers = [key for key in ranks[0]["state"] if key.endswith(name)]
        assert len(buffers) == TRAINED.depth
        for key in buffers:  # the worker has also checked that every parameter and buffer agrees across ranks
            assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
    assert all(int(ranks[1]["state"][key]) == TRAINED.steps for key in ranks[1]["state"] if key.endswith("updates"))
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    # The key bias of softmax-like attention has a zero gradient in exact arithmetic: AdamW turns its rounding
    # noise into steps of size lr (see tests/training/test_data_parallel.py), so it says nothing and is left out.
    compared = [key for key in one if not key.endswith("k_proj.bias")]
    assert one.keys() == two.keys() and len(compared) > len(one) - 4
    for key in compared:
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=0, msg=key)

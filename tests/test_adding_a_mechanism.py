"""Adding a mechanism takes one class and nothing else: ``tests/toy_new_mechanism.py`` (under 40 lines) shows up
in ``attnzoo list``, runs in ``attnzoo compare`` with the error sweep its class declares, and passes the whole
conformance suite, without a line changed anywhere in the library."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo.mechanisms import base

from conformance import checks

TOY = Path(__file__).with_name("toy_new_mechanism.py")


@pytest.fixture(scope="module")
def toy_class():
    """The toy, registered for this module's tests only (the rest of the suite never sees it)."""
    sys.path.insert(0, str(TOY.parent))
    try:
        import toy_new_mechanism

        yield toy_new_mechanism.QuantizedQueries
    finally:
        base._REGISTRY.pop("toy-quantized", None)
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
            "from attnzoo.cli import main; sys.exit(main(['list']))")
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

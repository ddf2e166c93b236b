"""scripts/bench_decode_flatness.py: the decoding state's size against the context, and its usage errors.

Tiny layers (dim 32, 2 heads) and two contexts; no timing is checked, only what the figures are made of: a
constant-memory mechanism's state has the same bytes at both contexts, a KV cache's grows.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode_flatness.py"
_spec = importlib.util.spec_from_file_location("bench_decode_flatness", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclass looks its module up there
_spec.loader.exec_module(bench)

DIM, HEADS, STATE_DIM = 32, 2, 8
SHORT, LONG = 16, 300  # LONG is past softmax's first cache block (256 positions) and based's window (64)
CONSTANT = ["linear", "delta", "gated_delta", "ssd", "based", "block=mamba2"]
GROWING = ["softmax", "forgetting", "differential", "nsa"]


def _state_bytes(row: str) -> dict:
    layer = bench.build_layer(row, DIM, HEADS, STATE_DIM)
    return {n: m.state_bytes for n, m in bench.measure(layer, [SHORT, LONG], steps=2, warmup=1, dim=DIM).items()}


@pytest.mark.parametrize("row", CONSTANT)
def test_constant_memory_states_do_not_grow(row):
    sizes = _state_bytes(row)
    assert sizes[SHORT] > 0
    assert sizes[LONG] == sizes[SHORT]


@pytest.mark.parametrize("row", GROWING)
def test_kv_cache_states_grow(row):
    sizes = _state_bytes(row)
    assert sizes[LONG] > sizes[SHORT]


def test_state_bytes_sums_every_tensor_in_the_tree():
    state = {"a": torch.zeros(2, 3), "b": (torch.zeros(4, dtype=torch.float64), 7, None), "c": [torch.zeros(5, 1)]}
    assert bench.state_bytes(state) == 2 * 3 * 4 + 4 * 8 + 5 * 4


def test_measure_gives_a_positive_time():
    layer = bench.build_layer("linear", DIM, HEADS, STATE_DIM)
    figures = bench.measure(layer, [8, 24], steps=3, warmup=1, dim=DIM)
    assert list(figures) == [8, 24]
    assert all(m.ms_per_token > 0 and m.prefill_s > 0 for m in figures.values())


def test_run_writes_json_table_and_plot(tmp_path, capsys):
    output = tmp_path / "decode.json"
    assert bench.main(["--mechanisms", "linear,softmax", "--blocks", "mamba2", "--contexts", f"{SHORT},{LONG}",
                       "--steps", "3", "--warmup", "1", "--dim", str(DIM), "--heads", str(HEADS),
                       "--state-dim", str(STATE_DIM), "--output", str(output)]) == 0
    data = json.loads(output.read_text())
    assert data["command"].startswith("python scripts/bench_decode_flatness.py --mechanisms linear,softmax")
    assert set(data["ms_per_token"]) == {"linear", "softmax", "block=mamba2"}
    assert list(data["state_bytes"]["softmax"]) == [str(SHORT), str(LONG)]
    assert len(data["load_average"]["before"]) == 3
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[2:]] == ["linear", "softmax", "block=mamba2"]


@pytest.mark.parametrize("argv, named", [
    (["--mechanisms", "no_such_mechanism"], "unknown mechanism 'no_such_mechanism'"),
    (["--mechanisms", "bigbird"], "'bigbird' has no recurrent step"),
    (["--blocks", "transformer"], "unknown block 'transformer'"),
    (["--contexts", "1024,0"], "--contexts: 0 is not a context length > 0"),
    (["--contexts", "-8"], "--contexts: -8 is not a context length > 0"),
    (["--contexts", "1k"], "--contexts: '1k' is not an integer"),
    (["--steps", "5", "--warmup", "5"], "--warmup must be in [0, --steps)"),
    (["--mechanisms", "", "--blocks", ""], "nothing to measure"),
    (["--dim", "30", "--heads", "4"], "dim=30 is not divisible by heads=4"),
])
def test_bad_arguments_are_one_line_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and named in error, error

"""Tests of the comparison machinery behind ``attnzoo compare``: measurement, isolation, results, peers."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnzoo import available
from attnzoo.bench.compare import CompareConfig, ConfigError, cores_busy_elsewhere, sweep_plan
from attnzoo.bench.launch import Launcher
from attnzoo.bench.measure import (
    PeakMemory,
    calibrate,
    fix_malloc_threshold,
    make_inputs,
    reference_output,
    relative_error,
    scaled_logits,
    uniform_attention,
)
from attnzoo.bench.peers import PEERS, build_peer, peer_installed
from attnzoo.bench.results import (
    CSV_COLUMNS,
    SCHEMA,
    STATUSES,
    add_ratios,
    busy_warning,
    crossover_length,
    describe_crossover,
    load_accuracy,
    prepare_output,
    speed_ratio,
    summarize,
    write_results,
)
from attnzoo.bench.table import counterpart_note, results_table
from attnzoo.bench.targets import build_target, classify_failure, mechanism_entry
from attnzoo.functional.softmax import softmax_attention_reference

TOYS = str(Path(__file__).with_name("compare_toys.py"))
OUTPUT_FILES = ["results.json", "results.csv", "time.png", "memory.png", "error.png", "bubble.png", "report.md"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A configuration small enough that a whole run takes seconds: the pipeline, not the numbers, is under test.
TINY = ["--lengths", "16,32", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "2",
        "--time-budget", "5", "--threads", "1"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``attnzoo compare`` in its own interpreter, so the toys it imports never register in this process."""
    return subprocess.run([sys.executable, "-m", "attnzoo.cli", "compare", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180)


# -- derived numbers -----------------------------------------------------------------------------------------
def test_crossover_is_interpolated_in_log_log_between_the_last_slower_and_first_faster_length():
    # Ratios 4 at N=256 and 1/4 at N=1024: log-linear in log N, the crossing is the geometric midpoint 512.
    points = [(256, 4.0, 1.0), (1024, 1.0, 4.0)]
    assert crossover_length(points) == {"kind": "interpolated", "length": 512, "measured": [256, 1024]}
    assert describe_crossover(crossover_length(points)) == "~512"


def test_crossover_requires_staying_faster_at_every_longer_length():
    # Faster at 256, slower at 1024, faster again at 4096: the crossover lies after 1024.
    points = [(256, 1.0, 2.0), (1024, 3.0, 2.0), (4096, 1.0, 3.0)]
    result = crossover_length(points)
    assert result["kind"] == "interpolated" and 1024 < result["length"] < 4096


@pytest.mark.parametrize("points, kind", [
    ([(256, 1.0, 2.0), (1024, 1.0, 4.0)], "below_range"),
    ([(256, 2.0, 1.0), (1024, 2.0, 1.9), (4096, None, 5.0)], "not_reached"),  # measured up to 1024 only
    ([(256, None, 1.0)], "unknown"),
    ([], "unknown"),
])
def test_crossover_outside_the_measured_range(points, kind):
    result = crossover_length(points)
    assert result["kind"] == kind
    assert describe_crossover(result) == {"below_range": "<= 256", "not_reached": "> 1024", "unknown": "-"}[kind]


def test_speed_ratio_pairs_the_samples_of_each_round():
    # The machine slowed down for rounds 2 and 3, for both: pairing rounds keeps the mechanism at 2x faster,
    # while a ratio of the two medians would call them even.
    softmax = {"forward_ms": 2.0, "forward_ms_samples": [1.0, 2.0, 100.0]}
    mechanism = {"forward_ms": 2.0, "forward_ms_samples": [2.0, 1.0, 50.0]}
    assert speed_ratio(softmax, mechanism, "forward_ms") == 2.0
    without_samples = {"forward_ms": 4.0}
    assert speed_ratio(softmax, without_samples, "forward_ms") == 0.5  # falls back to the medians


def test_relative_error_of_exact_attention_is_rounding_and_uniform_attention_is_far():
    inputs = make_inputs(2, 3, 40, 8, torch.float32, "cpu", seed=1)
    for causal in (False, True):
        reference = reference_output(inputs, causal)
        expected = softmax_attention_reference(inputs.q, inputs.k, inputs.v, causal)
        assert relative_error(expected, reference) < 1e-12
        assert relative_error(uniform_attention(inputs.v.double(), causal), reference) > 0.1


@pytest.mark.parametrize("logit_std", [1.0, 0.5, 0.25])
def test_scaled_logits_give_the_logits_that_spread_and_keep_v(logit_std):
    inputs = make_inputs(1, 4, 512, 64, torch.float64, "cpu", seed=2)
    scaled = scaled_logits(inputs, logit_std)
    logits = scaled.q @ scaled.k.transpose(-1, -2) / 64 ** 0.5
    assert float(logits.std()) == pytest.approx(logit_std, rel=0.05)
    assert scaled.v is inputs.v and scaled.grad_out is inputs.grad_out


def test_memory_jobs_run_on_every_launcher_at_once_and_land_in_their_rows():
    import threading

    from attnzoo.bench.compare import _Measured, _measure_memory

    spans, job_threads = {}, set()

    class Launcher:  # answers with the length of the job's mechanism name, after a pause
        def __init__(self):
            self.threads = set()

        def run(self, job, timeout_s):
            self.threads.add(threading.get_ident())
            start = time.perf_counter()
            time.sleep(0.05)
            spans[job["entry"]["name"]] = (start, time.perf_counter())
            job_threads.add(job["threads"])
            size = len(job["entry"]["name"])
            return {"status": "ok", "peak_bytes": size * 2**20, "forward_peak_bytes": size * 2**19}

    launchers = [Launcher(), Launcher()]
    names = ["softmax", "linear", "performer", "local", "nystrom"]
    rows = [{"mechanism": name, "length": 16, "status": "ok" if name != "local" else "failed", "reason": None}
            for name in names]
    pending = [({"name": name}, row) for name, row in zip(names, rows)]
    measured, labels = _Measured(current=rows), []
    _measure_memory(launchers, CompareConfig(), {"threads": 2}, pending, labels.append, measured)
    assert job_threads == {1}  # two jobs at once on two threads: one thread each
    (first_start, first_end), (second_start, second_end) = spans["softmax"], spans["linear"]
    assert first_start < second_end and second_start < first_end  # the first two ran at the same time
    assert labels == [f"memory {name} N=16" for name in names]  # a progress line for every row, in order
    for name, row in zip(names, rows):
        expected = None if name == "local" else len(name)  # the row not timed gets no memory job
        assert row.get("peak_memory_mib") == expected, name
        assert id(row) in measured.finished_ids
    assert all(launcher.threads for launcher in launchers)


def test_an_interrupt_during_the_memory_jobs_starts_no_more_of_them():
    import os
    import signal

    from attnzoo.bench.compare import _Measured, _measure_memory

    ran = []

    class Launcher:  # the third job is interrupted by Ctrl-C (SIGINT to this process, as a terminal sends it)
        def run(self, job, timeout_s):
            ran.append(job["entry"]["name"])
            if len(ran) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            return {"status": "ok", "peak_bytes": 2**20, "forward_peak_bytes": 2**20}

    names = [f"m{index}" for index in range(8)]
    rows = [{"mechanism": name, "length": 16, "status": "ok", "reason": None} for name in names]
    measured = _Measured(current=rows)
    # Python's own Ctrl-C handler for the test's length: a test runner's worker may hold another one.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _measure_memory([Launcher(), Launcher()], CompareConfig(), {"threads": 2},
                            [({"name": name}, row) for name, row in zip(names, rows)], lambda label: None, measured)
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.5)
    assert len(ran) <= 4, ran  # the jobs running or about to start when it came, none after


def test_calibration_costs_a_call_by_its_second_run_not_its_lazy_first():
    inputs = make_inputs(1, 1, 4, 2, torch.float32, "cpu")
    calls = []

    def fn(q, k, v, causal):  # the first call pays 0.3 s of set-up, every later one 0.01 s
        calls.append(None)
        time.sleep(0.3 if len(calls) == 1 else 0.01)
        return v * 1.0

    # (A process's first backward also pays for lazy imports: the first call can take 0.7 s.)
    inner, one = calibrate(fn, inputs, False, "cpu", min_sample_s=1.0)
    assert len(calls) == 2 and one < 0.2 and inner >= 10  # priced at 0.01 s: several calls per sample
    calls.clear()
    inner, one = calibrate(fn, inputs, False, "cpu", min_sample_s=0.05, budget_s=0.1)
    assert len(calls) == 1 and (inner, one >= 0.3) == (1, True)  # over the budget at once: no second call
    calls.clear()
    inner, one = calibrate(fn, inputs, False, "cpu", min_sample_s=0.05, budget_s=1.2)
    assert len(calls) == 2 and one < 0.2  # within the budget, but priced by its first call it would not be
    calls.clear()
    inner, one = calibrate(fn, inputs, False, "cpu", min_sample_s=0.05, budget_s=2.0)
    # A sample is one call anyway, and 3 repeats of 1.5 first calls fit the budget: no second call.
    assert len(calls) == 1 and (inner, one >= 0.3) == (1, True)


def test_calibration_hands_the_first_output_to_check_untimed():
    inputs = make_inputs(1, 1, 4, 2, torch.float32, "cpu")
    seen = []

    def check(out):
        time.sleep(0.2)
        seen.append(out.clone())

    inner, one = calibrate(lambda q, k, v, causal: v * 2.0, inputs, False, "cpu", min_sample_s=0.01,
                           check=check)
    assert len(seen) == 1 and torch.equal(seen[0], inputs.v * 2.0) and not seen[0].requires_grad
    assert one < 0.1  # the check's 0.2 s is not in the price


def test_uniform_attention_averages_the_visible_values():
    v = torch.arange(12, dtype=torch.float64).view(1, 1, 4, 3)
    assert torch.equal(uniform_attention(v, False)[0, 0, 0], v[0, 0].mean(0))
    causal = uniform_attention(v, True)
    for t in range(4):
        assert torch.allclose(causal[0, 0, t], v[0, 0, : t + 1].mean(0))


def test_relative_error_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        relative_error(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))


@pytest.mark.skipif(not PeakMemory.cpu_supported(), reason="needs Linux /proc clear_refs")
def test_peak_memory_sees_a_temporary_allocation_and_not_earlier_ones():
    # As the memory worker does before measuring: a test that ran attnzoo train in this process may have told
    # glibc to keep freed memory, which would hide the allocation inside the heap's freed pages.
    fix_malloc_threshold()
    earlier = torch.ones(64 * 2**20 // 4)  # 64 MiB allocated and freed before the measured block
    del earlier
    with PeakMemory("cpu") as peak:
        scratch = torch.ones(32 * 2**20 // 4)  # 32 MiB, touched so it is resident
        del scratch
    assert 30 * 2**20 <= peak.peak_bytes < 48 * 2**20


def test_classify_failure_tells_oom_from_bugs():
    message = "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 536870912 bytes."
    assert classify_failure(RuntimeError(message)) == ("oom", "out of memory: could not allocate 512 MiB")
    assert classify_failure(MemoryError())[0] == "oom"
    status, reason = classify_failure(ValueError("bad thing\nsecond line"))
    assert status == "failed" and reason == "ValueError: bad thing"


def test_build_target_reports_why_a_configuration_does_not_apply():
    fn = build_target(mechanism_entry("softmax"), 2, 8, 16, True, "cpu", torch.float32)
    assert callable(fn)
    assert build_target({"key": "peer:x", "kind": "peer", "name": "linformer", "options": {}}, 2, 8, 16, True,
                        "cpu", torch.float32).startswith(("unsupported", "not installed"))


def test_accuracy_files_in_several_shapes(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"softmax": 0.6, "performer": 0.55}))
    assert load_accuracy(flat) == {"softmax": 0.6, "performer": 0.55}
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": [{"mechanism": "softmax", "accuracy": 0.5},
                                         {"mechanism": "softmax", "accuracy": 0.7},
                                         {"mechanism": "linear", "test_accuracy": 0.4}]}))
    assert load_accuracy(rows) == pytest.approx({"softmax": 0.6, "linear": 0.4})
    for bad in ("not json", json.dumps({"rows": [{"name": "x"}]}), json.dumps([1, 2])):
        path = tmp_path / "bad.json"
        path.write_text(bad)
        with pytest.raises(ValueError, match="--accuracy"):
            load_accuracy(path)


def test_config_validation_names_the_setting():
    with pytest.raises(ValueError, match="lengths"):
        CompareConfig.from_preset("quick", lengths=[0]).validate()
    with pytest.raises(ValueError, match="heads"):
        CompareConfig.from_preset("quick", heads=0).validate()
    with pytest.raises(ValueError, match="unknown mechanism"):
        CompareConfig.from_preset("quick", mechanisms=["no_such_mechanism"]).validate()
    with pytest.raises(ValueError, match="preset"):
        CompareConfig.from_preset("huge")


@pytest.mark.parametrize("setting, value", [
    ("budget_s", math.nan), ("budget_s", math.inf), ("budget_s", 0), ("budget_s", -1.0), ("budget_s", "10"),
    ("threads", -1), ("threads", 1.5), ("repeats", 0), ("batch", 0), ("heads", True), ("head_dim", 0),
    ("head_dim", 8.0), ("lengths", [16, -1]), ("lengths", []), ("lengths", [16.5]), ("sweep_values", [0]),
    ("sweep_length", 0), ("sweep_logit_stds", [0.0]), ("sweep_logit_stds", [math.inf]),
    ("sweep_logit_stds", ["1"]), ("min_sample_s", math.nan), ("memory_fraction", 0), ("memory_fraction", 1.5),
    ("seed", 0.5), ("device", "cuda:x"), ("device", "meta"), ("launch", "thread"), ("dtype", "int8"),
])
def test_config_validation_checks_type_finiteness_and_range_of_every_setting(setting, value):
    with pytest.raises(ConfigError) as error:
        CompareConfig(**{setting: value}).validate()
    assert error.value.setting == setting
    assert str(error.value).startswith(f"{setting} ") and "\n" not in str(error.value)


def test_config_validation_accepts_the_documented_edge_values():
    # threads=0 is documented as "every core"; a budget may be an int; any large length is the user's call.
    config = CompareConfig(threads=0, budget_s=1, lengths=[10**6], memory_fraction=1.0, min_sample_s=0)
    config.validate()
    assert config.resolved_threads() == (os.cpu_count() or 1)


def test_prepare_output_creates_the_directory_and_refuses_what_cannot_hold_results(tmp_path, monkeypatch):
    nested = tmp_path / "a" / "b"
    prepare_output(nested)
    assert nested.is_dir() and list(nested.iterdir()) == []  # the probe file is gone again
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        prepare_output(a_file)
    with pytest.raises(ValueError, match="cannot create the directory"):
        prepare_output(a_file / "results")
    # Permissions do not stop root, and read-only file systems are not at hand: the probe write decides.
    import attnzoo.bench.results as results

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(results.tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError, match=r"cannot write files in it \(Permission denied\)"):
        prepare_output(tmp_path)


# -- peer rows -----------------------------------------------------------------------------------------------
def _synthetic_row(mechanism: str, source: str, counterpart, ms: float, mib: float, length: int = 1024) -> dict:
    row = {column: None for column in CSV_COLUMNS}
    row.update(mechanism=mechanism, source=source, counterpart=counterpart, kind="exact" if mechanism == "softmax" else "approximate",
               length=length, batch=1, heads=4, head_dim=64, dtype="float32", causal=False, device="cpu",
               status="ok", forward_ms=ms / 2, forward_backward_ms=ms, peak_memory_mib=mib, error=0.1,
               forward_backward_ms_samples=[ms] * 3)
    return row


def synthetic_peer_result() -> dict:
    """softmax, attnzoo's performer and performer-pytorch at one length: attnzoo takes 40 ms and 92 MiB,
    the peer 100 ms and 100 MiB."""
    rows = [_synthetic_row("softmax", "attnzoo", None, 200.0, 400.0),
            _synthetic_row("performer", "attnzoo", None, 40.0, 92.0),
            _synthetic_row("peer:performer-pytorch", "performer-pytorch", "performer", 100.0, 100.0)]
    add_ratios(rows)
    return {"schema": SCHEMA, "command": "attnzoo compare --peers", "argv": ["attnzoo", "compare", "--peers"],
            "config": {"batch": 1, "heads": 4, "head_dim": 64, "dtype": "float32", "causal": False,
                       "device": "cpu"},
            "machine": {"threads": 2, "cpu": "test cpu", "cores": 2, "cores_busy_elsewhere": 0.0},
            "rows": rows, "summary": summarize(rows), "uniform_error": [], "sweeps": [], "missing_peers": []}


def test_peer_ratios_are_attnzoos_figure_over_the_peers_for_time_and_memory_alike(tmp_path):
    data = synthetic_peer_result()
    peer = data["rows"][2]
    assert peer["attnzoo_time_over_peer"] == pytest.approx(0.40)  # 40 ms over 100 ms, from paired samples
    assert peer["attnzoo_memory_over_peer"] == pytest.approx(0.92)  # 92 MiB over 100 MiB
    assert all(row["attnzoo_time_over_peer"] is None for row in data["rows"][:2])  # attnzoo's own rows

    wording = "attnzoo performer's time is 0.40x performer-pytorch's, memory 0.92x"
    assert counterpart_note(peer) == wording
    table = results_table(data)
    assert wording in table and "vs performer" not in table
    assert counterpart_note(dict(peer, source="pytorch-fast-transformers")).startswith(
        "attnzoo performer's time is 0.40x pytorch-fast-transformers', ")

    write_results(data, tmp_path)
    with (tmp_path / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert "speed_vs_counterpart" not in rows[0] and "memory_vs_counterpart" not in rows[0]
    assert float(rows[2]["attnzoo_time_over_peer"]) == pytest.approx(0.40)
    assert float(rows[2]["attnzoo_memory_over_peer"]) == pytest.approx(0.92)


def test_sweep_plan_takes_the_option_each_approximate_mechanism_declares():
    from attnzoo import capabilities
    from attnzoo.mechanisms import mechanism_class

    entries = [mechanism_entry(name) for name in available()]
    plan = sweep_plan(CompareConfig(), entries)
    for entry, option in plan:
        assert capabilities(entry["name"]).kind == "approximate"
        assert option == mechanism_class(entry["name"]).sweep_option
    # Exactly the approximations of softmax are swept; attentions of their own (linear, gla, aft, ...) are not.
    approximate = {name for name in available() if capabilities(name).kind == "approximate"}
    assert {entry["name"] for entry, _ in plan} == approximate
    assert {"performer", "linformer", "nystrom"} <= approximate


# -- isolation -----------------------------------------------------------------------------------------------
def _job(tmp_path: Path, body: str) -> dict:
    module = tmp_path / "effect.py"
    module.write_text(body)
    return dict(kind="memory", entry=mechanism_entry("softmax"), length=8, batch=1, heads=1, head_dim=4,
                dtype="float32", causal=False, device="cpu", threads=1, imports=[str(module)])


@pytest.fixture(scope="module")
def fork_launcher():
    with Launcher("fork") as launcher:  # one fork server for the module: it takes seconds to import torch
        yield launcher


@pytest.mark.parametrize("method", ["fork", "subprocess"])
def test_a_hanging_worker_becomes_a_timeout_row(tmp_path, method, fork_launcher):
    launcher = fork_launcher if method == "fork" else Launcher(method)
    result = launcher.run(_job(tmp_path, "import time\ntime.sleep(60)\n"), timeout_s=1.5)
    assert result["status"] == "timeout" and "timed out" in result["reason"]
    if method == "fork":  # the server is still usable after a child was killed
        assert launcher.run(_job(tmp_path, "\n"), timeout_s=60)["status"] == "ok"


def test_a_worker_killed_or_crashing_becomes_a_row_with_the_reason(tmp_path, fork_launcher):
    killed = fork_launcher.run(_job(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"), 60)
    assert killed["status"] == "oom" and "SIGKILL" in killed["reason"]
    crashed = fork_launcher.run(_job(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"), 60)
    assert crashed["status"] == "failed" and "SIGSEGV" in crashed["reason"]
    raised = fork_launcher.run(_job(tmp_path, "raise ImportError('no such thing')\n"), 60)
    assert raised["status"] == "failed" and "no such thing" in raised["reason"]


def test_an_allocation_over_the_memory_cap_is_an_oom_row(fork_launcher):
    # The worker caps its address space to a share of the available memory; a tiny share makes the
    # attention's allocations fail the way a too-large configuration would, without touching real limits.
    job = dict(kind="memory", entry=mechanism_entry("softmax"), length=4096, batch=4, heads=4, head_dim=64,
               dtype="float32", causal=False, device="cpu", threads=1, memory_fraction=1e-4)
    result = fork_launcher.run(job, 60)
    assert result["status"] == "oom" and "out of memory" in result["reason"]


def test_each_memory_job_runs_in_a_fresh_process(tmp_path, fork_launcher):
    # A counter kept in builtins survives within one process only: every job must see it at 1.
    job = _job(tmp_path, "import builtins\nbuiltins.attnzoo_jobs_seen = getattr(builtins, 'attnzoo_jobs_seen', 0) + 1\n"
                         "assert builtins.attnzoo_jobs_seen == 1, 'reused process'\n")
    assert [fork_launcher.run(job, 60)["status"] for _ in range(3)] == ["ok"] * 3


# -- the whole run -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_end_to_end_writes_every_file_and_turns_failures_into_rows(tmp_path):
    out = tmp_path / "out"
    result = run_cli(*TINY, "--mechanisms", "toy_broken,toy_noncausal,toy_truncated", "--import", TOYS,
                     "--output", str(out), cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # toy_broken failed: exit code 1, every file still written
    for name in OUTPUT_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in OUTPUT_FILES:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == PNG_MAGIC

    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == "attnzoo.compare/2"
    assert data["argv"][:2] == ["attnzoo", "compare"] and "--mechanisms" in data["command"]
    for key in ("cpu", "cores", "threads", "torch", "python", "platform"):
        assert data["machine"][key] not in (None, ""), key
    assert data["machine"]["torch"] == torch.__version__
    assert {"started", "finished", "config", "summary", "sweeps", "uniform_error", "missing_peers"} <= set(data)

    rows = {(row["mechanism"], row["length"]): row for row in data["rows"]}
    assert set(rows) == {(name, n) for name in ("softmax", "toy_broken", "toy_noncausal", "toy_truncated")
                         for n in (16, 32)}  # softmax joins as the baseline
    for row in data["rows"]:
        assert set(CSV_COLUMNS) <= set(row) and row["status"] in STATUSES
    for n in (16, 32):
        broken = rows[("toy_broken", n)]
        assert broken["status"] == "failed" and "toy mechanism always fails" in broken["reason"]
        assert broken["forward_ms"] is None
        for name in ("softmax", "toy_noncausal", "toy_truncated"):
            row = rows[(name, n)]
            assert row["status"] == "ok", row
            assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0 and row["peak_memory_mib"] >= 0
        assert rows[("softmax", n)]["speed_vs_softmax"] == 1.0
        assert rows[("toy_noncausal", n)]["error"] < 1e-5  # exact softmax under another name
        assert rows[("toy_truncated", n)]["error"] > 0.05  # sees only 8 of the keys

    sweeps = {item["logit_std"]: item for item in data["sweeps"] if item["mechanism"] == "toy_truncated"}
    assert set(sweeps) == {1.0, 0.25}  # the timing inputs, and q and k scaled to a flatter softmax
    for sweep in sweeps.values():
        assert sweep["option"] == "nb_features"
        errors = [point["error"] for point in sweep["points"]]
        assert errors[0] > 0.01 and errors[-1] < 1e-5  # 16 features of 32 keys, then all of them
    # A flatter softmax is nearer uniform attention, and so is what sees only half of the keys.
    assert sweeps[0.25]["uniform_error"] < sweeps[1.0]["uniform_error"]
    assert sweeps[0.25]["points"][0]["error"] < sweeps[1.0]["points"][0]["error"]

    with (out / "results.csv").open() as handle:
        csv_rows = list(csv.DictReader(handle))
    assert len(csv_rows) == len(data["rows"]) and list(csv_rows[0]) == CSV_COLUMNS
    report = (out / "report.md").read_text()
    assert data["command"] in report and "![time against N](time.png)" in report
    assert "### The error sweep" in report and "| toy_truncated (nb_features) | 0.25 |" in report
    assert f"cores busy with other processes at the start {data['machine']['cores_busy_elsewhere']}" in report
    assert "toy mechanism always fails" in result.stdout  # the reason is in the terminal table too


def test_causal_run_makes_a_non_causal_mechanism_an_unsupported_row(fork_launcher):
    base = dict(length=16, batch=1, heads=2, head_dim=8, dtype="float32", causal=True, device="cpu", threads=1,
                imports=[TOYS])
    entries = [mechanism_entry("softmax"), mechanism_entry("toy_noncausal")]
    timed = fork_launcher.run(dict(base, kind="time", entries=entries, repeats=2, budget_s=5), 60)
    assert timed["status"] == "ok" and timed["entries"]["softmax"]["status"] == "ok"
    toy = timed["entries"]["toy_noncausal"]
    assert toy["status"] == "unsupported" and "causal" in toy["reason"]
    memory = fork_launcher.run(dict(base, kind="memory", entry=entries[1]), 60)
    assert memory["status"] == "unsupported"


# -- peers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PEERS))
def test_installed_peers_run_on_our_shapes(name):
    if not peer_installed(name):
        pytest.skip(f"{name} is not installed (scripts/install-peers.sh)")
    torch.manual_seed(0)
    inputs = make_inputs(1, 2, 128, 16, torch.float32, "cpu", seed=0)
    reference = reference_output(inputs, causal=False)
    for causal in (False, True):
        peer = build_peer(name, 2, 16, 128, causal)
        if isinstance(peer, str):
            assert peer.startswith("unsupported"), peer
            continue
        out = peer(inputs.q, inputs.k, inputs.v, causal)
        assert out.shape == inputs.v.shape and torch.isfinite(out).all()
        if not causal:
            error = relative_error(out, reference)
            # x-transformers computes softmax exactly; local attention with its default 128-wide window over
            # 128 positions sees every key; the others approximate.
            if name in ("x-transformers", "local-attention"):
                assert error < 1e-5, error
            else:
                assert 1e-4 < error < 10, error


def test_missing_peer_is_a_reason_not_an_error(monkeypatch):
    import attnzoo.bench.peers as peers

    monkeypatch.setattr(peers, "peer_installed", lambda name: False)
    assert build_peer("linformer", 2, 8, 16, False).startswith("not installed")
    present, missing = peers.installed_peers()
    assert present == [] and {item["name"] for item in missing} == set(PEERS)
    with pytest.raises(ValueError, match="unknown peer"):
        build_peer("nope", 2, 8, 16, False)


def test_cuda_only_peers_are_listed_on_the_cpu_and_peers_follow_the_mechanisms_asked_for(monkeypatch):
    import attnzoo.bench.compare as compare
    import attnzoo.bench.peers as peers

    monkeypatch.setattr(peers, "peer_installed", lambda name: True)
    monkeypatch.setattr(compare, "installed_peers", lambda: (list(PEERS), []))
    triton = {name for name, peer in PEERS.items() if peer.cuda_only}
    assert triton == {"fla-triton-delta_rule", "fla-triton-gated_delta_rule", "fla-triton-simple_gla",
                      "fla-triton-linear_attn"}
    refusal = build_peer("fla-triton-delta_rule", 2, 16, 128, True, device="cpu")
    assert refusal.startswith("unsupported") and "--device cuda" in refusal
    refusal = build_peer("fla-triton-delta_rule", 2, 16, 128, True, device="cuda", dtype=torch.float32)
    assert refusal.startswith("unsupported") and "bfloat16" in refusal  # fla's Triton delta rule refuses float32
    entries, missing = compare.planned_entries(CompareConfig(peers=True, mechanisms=("linear",)))
    assert {item["name"] for item in missing} == {"fla-triton-linear_attn"}  # the missing peers of linear only
    entries, missing = compare.planned_entries(CompareConfig(peers=True))
    measured = {entry["name"] for entry in entries if entry["kind"] == "peer"}
    assert not measured & triton and {item["name"] for item in missing} == triton
    assert all("CUDA" in item["reason"] for item in missing)
    # On a GPU they are measured; --mechanisms keeps the peers of those mechanisms (softmax is always there).
    entries, missing = compare.planned_entries(CompareConfig(peers=True, device="cuda", mechanisms=("delta",)))
    measured = {entry["name"] for entry in entries if entry["kind"] == "peer"}
    assert measured == {"fla-delta_rule", "fla-triton-delta_rule", "x-transformers"} and missing == []


def test_busy_warning_reads_the_present_load_before_the_load_average():
    # A load average left over from work that just ended does not warn when nothing runs now.
    assert busy_warning({"cores": 2, "load_average": [1.9, 1.0, 0.5], "cores_busy_elsewhere": 0.1}) is None
    assert "1.2 of 2 cores" in busy_warning({"cores": 2, "load_average": [0.1], "cores_busy_elsewhere": 1.2})
    # Without the measurement (not Linux), the load average decides.
    assert "load average 1.9" in busy_warning({"cores": 2, "load_average": [1.9], "cores_busy_elsewhere": None})
    assert busy_warning({"cores": 2, "load_average": [0.4]}) is None


def test_cores_busy_elsewhere_sees_another_process_spinning():
    if cores_busy_elsewhere(0.05) is None:
        pytest.skip("no /proc/stat on this system")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # let it start
        busy = cores_busy_elsewhere(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    # One spinning process keeps one core busy (anything else running only adds to it).
    assert busy is not None and busy > 0.6


def test_the_quick_preset_shares_a_timing_budget_per_length_however_many_mechanisms():
    from attnzoo.bench.worker import MIN_REPEATS, _rounds, _sample_seconds

    job = {"repeats": 9, "timing_budget_s": 20.0, "min_sample_s": 0.2}
    assert _rounds(job, {"a": 1.0, "b": 1.0}) == 9  # few mechanisms: every repeat asked for
    assert _rounds(job, {name: 0.3 for name in range(22)}) == 3  # 22 x 0.3 s a round: three fit in 20 s
    assert _rounds(job, {name: 0.3 for name in range(100)}) == MIN_REPEATS  # never fewer
    assert _sample_seconds(job, 10) == 0.2
    assert _sample_seconds(job, 100) == pytest.approx(20.0 / (MIN_REPEATS * 1.5 * 100))  # shorter samples instead
    assert _rounds(dict(job, timing_budget_s=None), {name: 5.0 for name in range(50)}) == 9
    assert CompareConfig.from_preset("quick").timing_budget_s == 15.0
    assert CompareConfig.from_preset("quick", repeats=5).timing_budget_s is None  # repeats asked for, given in full
    assert CompareConfig.from_preset("full").timing_budget_s is None
    with pytest.raises(ConfigError, match="timing_budget_s"):
        CompareConfig(timing_budget_s=0).validate()


def test_no_timing_round_starts_after_the_deadline_and_every_callable_gets_as_many():
    from attnzoo.bench.measure import time_interleaved

    inputs = make_inputs(1, 2, 16, 8, torch.float32, "cpu")

    def slow(q, k, v, causal):
        time.sleep(0.02)
        return q * 1

    fns, repeats, inner = {"a": slow, "b": slow}, {"a": 9, "b": 9}, {"a": 1, "b": 1}
    timings, failures = time_interleaved(fns, inputs, False, "cpu", repeats, inner, deadline_s=0.1)
    counts = {name: len(timing.forward) for name, timing in timings.items()}
    assert not failures and counts["a"] == counts["b"] and 1 <= counts["a"] < 9, counts
    timings, _ = time_interleaved(fns, inputs, False, "cpu", {"a": 3, "b": 3}, inner)
    assert [len(timing.forward) for timing in timings.values()] == [3, 3]
    # A deadline already past cuts no round before min_rounds (the medians and spreads a report promises).
    timings, _ = time_interleaved(fns, inputs, False, "cpu", repeats, inner, deadline_s=0.0, min_rounds=3)
    assert [len(timing.forward) for timing in timings.values()] == [3, 3]


def test_impossible_timings_are_flagged_in_the_row():
    from attnzoo.bench.results import flag_timings

    def row(mechanism, length, forward, both):
        return {"mechanism": mechanism, "source": "attnzoo", "length": length, "forward_ms": forward,
                "forward_backward_ms": both, "timing_note": None}

    rows = [row("softmax", 256, 10.0, 85.0), row("softmax", 1024, 20.0, 60.0), row("softmax", 4096, 80.0, 300.0),
            row("performer", 256, 161.0, 145.0), row("local", 256, 5.0, 10.5), row("local", 1024, 4.0, 10.0),
            row("sinkhorn", 256, None, None)]
    flag_timings(rows)
    notes = {(r["mechanism"], r["length"]): r["timing_note"] for r in rows}
    assert notes[("softmax", 256)] == "slower than at N=1024: timing unreliable"
    assert notes[("performer", 256)].startswith("forward 161 ms above forward+backward")
    assert notes[("local", 256)] is None  # within 10% of the longer length's: fixed costs, not noise
    assert notes[("softmax", 1024)] is None and notes[("sinkhorn", 256)] is None

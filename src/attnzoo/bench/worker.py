"""The process that measures: ``python -m attnzoo.bench.worker '<json job>'`` prints one JSON result.

A job is one of

* ``{"kind": "time", "entries": [...], "repeats": 9, "budget_s": 10, "timing_budget_s": 20, ...}``: every
  entry at one length, timed round-robin (``repeats`` rounds, fewer for an entry whose repeats would exceed
  ``budget_s``; with ``timing_budget_s``, as many as fit that many seconds for all entries together, and no
  round started after them),
  plus each output's error against exact softmax on the same inputs;
* ``{"kind": "memory", "entry": {...}, ...}``: the peak memory of one entry at one length; the orchestrator
  starts a fresh process for each, so nothing that ran before can inflate or hide a peak;
* ``{"kind": "sweep", "entry": {...}, "option": "nb_features", "values": [...], "logit_std": 1.0, ...}``:
  error against exact softmax as one integer option varies, on q and k scaled so that the logits have that
  standard deviation (1: the timing inputs).

Common fields: length, batch, heads, head_dim, dtype, causal, device, threads, seed, imports (modules that
register extra mechanisms), memory_fraction (CPU: the share of available memory a worker may take before
an allocation fails as "out of memory" rather than waking the system's OOM killer).

A failure never escapes as an exception: it becomes ``{"status": ..., "reason": ...}`` in the result.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .measure import (
    DEFAULT_MIN_SAMPLE_S,
    MIN_REPEATS,
    REPEAT_COST,
    Inputs,
    PeakMemory,
    calibrate,
    fix_malloc_threshold,
    make_inputs,
    parse_dtype,
    reference_output,
    relative_error,
    scaled_logits,
    uniform_attention,
    run_forward,
    run_forward_backward,
    time_interleaved,
)
from .targets import build_target, classify_failure, import_user_modules

Job = Dict[str, Any]
Result = Dict[str, Any]


def _available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        pass
    return None


def _limit_address_space(fraction: float) -> None:
    """Cap this process's address space so a too-large allocation raises instead of swapping or being killed."""
    available = _available_bytes()
    if available is None or fraction <= 0:
        return
    with open("/proc/self/statm") as handle:
        current = int(handle.read().split()[0]) * resource.getpagesize()
    limit = current + int(fraction * available)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def prepare(job: Job) -> None:
    """Process-wide settings every job starts from: threads, seed, user mechanisms, memory cap."""
    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job.get("seed", 0)))
    import_user_modules(job.get("imports", []))
    if job.get("device", "cpu") == "cpu":
        _limit_address_space(float(job.get("memory_fraction", 0.8)))


def _inputs(job: Job, length: Optional[int] = None) -> Inputs:
    return make_inputs(job["batch"], job["heads"], length or job["length"], job["head_dim"],
                       parse_dtype(job["dtype"]), job["device"], seed=int(job.get("seed", 0)))


def _build(job: Job, entry: Dict[str, Any], length: Optional[int] = None) -> Any:
    torch.manual_seed(int(job.get("seed", 0)))  # random features and projections drawn alike in every process
    return build_target(entry, job["heads"], job["head_dim"], length or job["length"], bool(job["causal"]),
                        job["device"], parse_dtype(job["dtype"]))


def _failure(error: BaseException) -> Result:
    status, reason = classify_failure(error)
    return {"status": status, "reason": reason}


def _check_output(out: torch.Tensor, inputs: Inputs) -> None:
    if out.shape != inputs.q.shape[:3] + inputs.v.shape[3:]:
        raise ValueError(f"output of shape {tuple(out.shape)}, expected {tuple(inputs.v.shape)}")
    if not bool(torch.isfinite(out).all()):
        raise FloatingPointError("output contains NaN or inf")


def _sample_seconds(job: Job, entries: int) -> float:
    """How long one timed sample should last: ``min_sample_s``, shortened when a timing budget per length
    (``timing_budget_s``, shared by all entries) could not otherwise give every entry ``MIN_REPEATS``."""
    min_sample = float(job.get("min_sample_s", DEFAULT_MIN_SAMPLE_S))
    shared = job.get("timing_budget_s")
    if shared is None or entries == 0:
        return min_sample
    return min(min_sample, float(shared) / (MIN_REPEATS * REPEAT_COST * entries))


def _rounds(job: Job, costs: Dict[str, float]) -> int:
    """Timed rounds for every entry: ``repeats``, or as many as fit the shared ``timing_budget_s`` (at least
    ``MIN_REPEATS``); ``costs`` are each entry's seconds per repeat."""
    repeats, shared = int(job["repeats"]), job.get("timing_budget_s")
    if shared is None or not costs:
        return repeats
    return max(MIN_REPEATS, min(repeats, int(float(shared) / sum(costs.values()))))


def _calibrated(job: Job, inputs: Inputs, reference: Optional[torch.Tensor], reference_failure: str,
                results: Dict[str, Result]) -> Tuple[Dict[str, Any], Dict[str, int], Dict[str, float]]:
    """Build, check and warm up every entry: (callables, calls per sample, seconds per repeat) of those that can
    be timed; the others' rows (unsupported, failed, too slow) go into ``results``."""
    causal, device, budget = bool(job["causal"]), job["device"], float(job.get("budget_s", 60.0))
    min_sample = _sample_seconds(job, len(job["entries"]))
    fns, inner, costs = {}, {}, {}
    for entry in job["entries"]:
        key = entry["key"]
        try:
            fn = _build(job, entry)
            if isinstance(fn, str):
                results[key] = {"status": "unsupported", "reason": fn}
                continue
            errors: List[Optional[float]] = []

            def check(out: torch.Tensor) -> None:  # the first call's output: its shape, finiteness and error
                _check_output(out, inputs)
                errors.append(relative_error(out, reference) if reference is not None else None)

            n, one = calibrate(fn, inputs, causal, device, min_sample, budget, check=check)
            error = errors[0]
        except Exception as failure:  # noqa: BLE001
            results[key] = _failure(failure)
            continue
        # Fewer repeats keep a slow entry within its budget; one that cannot fit even one is too slow.
        if budget < REPEAT_COST * one * n:
            results[key] = {"status": "timeout", "error": error,
                            "reason": f"too slow: one forward+backward took {one:.1f} s, a timed repeat would "
                                      f"exceed the {budget:.0f} s budget per configuration (--time-budget)"}
            continue
        fns[key], inner[key], costs[key] = fn, n, REPEAT_COST * one * n
        results[key] = {"status": "ok", "reason": None, "error": error}
        if reference is None:
            results[key]["reason"] = f"no error: the exact reference failed ({reference_failure})"
    return fns, inner, costs


def time_job(job: Job) -> Result:
    """Time every entry at one length, round-robin, and measure each output's error against softmax."""
    causal, device, budget = bool(job["causal"]), job["device"], float(job.get("budget_s", 60.0))
    inputs = _inputs(job)
    results: Dict[str, Result] = {}
    reference_failure = ""
    try:
        reference = reference_output(inputs, causal)
    except Exception as error:  # noqa: BLE001 - the error column is then empty, timing goes on
        reference, reference_failure = None, classify_failure(error)[1]
    uniform_error = relative_error(uniform_attention(inputs.v.to(reference.dtype), causal), reference) \
        if reference is not None else None
    fns, inner, costs = _calibrated(job, inputs, reference, reference_failure, results)
    rounds = _rounds(job, costs)
    entry_repeats = {key: min(rounds, int(budget / cost)) for key, cost in costs.items()}
    shared = job.get("timing_budget_s")
    timings, failures = time_interleaved(fns, inputs, causal, device, entry_repeats, inner,
                                         deadline_s=None if shared is None else float(shared),
                                         min_rounds=MIN_REPEATS)
    for key, timing in timings.items():
        if key in failures:
            results[key] = _failure(failures[key])
            continue
        fwd, train = timing.medians_ms()
        results[key].update(forward_ms=fwd, forward_backward_ms=train, repeats=len(timing.forward),
                            inner=timing.inner, forward_spread=timing.spread(timing.forward),
                            forward_backward_spread=timing.spread(timing.forward_backward),
                            forward_ms_samples=[1e3 * t for t in timing.forward],
                            forward_backward_ms_samples=[1e3 * t for t in timing.forward_backward])
        if len(timing.forward) < min(MIN_REPEATS, int(job["repeats"])):  # fewer than asked, and fewer than 3
            results[key]["timing_note"] = (f"{len(timing.forward)} repeat{'s' if len(timing.forward) > 1 else ''}: "
                                           f"one costs {costs[key]:.1f} s of the {budget:g} s --time-budget")
    return {"status": "ok", "entries": results, "uniform_error": uniform_error}


def memory_job(job: Job) -> Result:
    """Peak memory of one entry: forward alone (no autograd graph) and forward+backward."""
    entry, causal, device = job["entry"], bool(job["causal"]), job["device"]
    if device == "cpu" and not PeakMemory.cpu_supported():
        return {"status": "failed", "reason": "peak memory needs Linux /proc (VmHWM and clear_refs)"}
    fix_malloc_threshold()
    try:
        inputs = _inputs(job)
        fn = _build(job, entry)
        if isinstance(fn, str):
            return {"status": "unsupported", "reason": fn}
        # One untimed pass first: lazily created kernels and caches are not what a configuration costs.
        # (Both passes: warmed by a forward alone, the backward's first-call set-up, 2-4 MiB and 50 MiB for
        # nsa, landed in the training peak.)
        run_forward_backward(fn, inputs, causal)
        with PeakMemory(device) as forward:
            run_forward(fn, inputs, causal)
        with PeakMemory(device) as train:
            run_forward_backward(fn, inputs, causal)
    except Exception as error:  # noqa: BLE001
        return _failure(error)
    return {"status": "ok", "reason": None, "forward_peak_bytes": max(0, forward.peak_bytes or 0),
            "peak_bytes": max(0, train.peak_bytes or 0), "method": train.method}


def sweep_job(job: Job) -> Result:
    """Error against exact softmax for each value of one integer option (feature count, rank, landmarks)."""
    causal = bool(job["causal"])
    inputs = scaled_logits(_inputs(job), float(job.get("logit_std", 1.0)))
    reference = reference_output(inputs, causal)
    points: List[Result] = []
    for value in job["values"]:
        entry = dict(job["entry"], options={**job["entry"].get("options", {}), job["option"]: value})
        try:
            fn = _build(job, entry)
            if isinstance(fn, str):
                points.append({"value": value, "status": "unsupported", "reason": fn, "error": None})
                continue
            start = time.perf_counter()
            out = run_forward(fn, inputs, causal)
            seconds = time.perf_counter() - start
            _check_output(out, inputs)
            points.append({"value": value, "status": "ok", "reason": None, "error": relative_error(out, reference),
                           "forward_ms": 1e3 * seconds})
        except Exception as error:  # noqa: BLE001
            points.append({"value": value, **_failure(error), "error": None})
    uniform_error = relative_error(uniform_attention(inputs.v.to(reference.dtype), causal), reference)
    return {"status": "ok", "points": points, "uniform_error": uniform_error}


JOBS: Dict[str, Callable[[Job], Result]] = {"time": time_job, "memory": memory_job, "sweep": sweep_job}


def run_job(job: Job) -> Result:
    """Run one job in this process (the caller provides the fresh process). Never raises."""
    try:
        prepare(job)
        return JOBS[job["kind"]](job)
    except Exception as error:  # noqa: BLE001 - e.g. a user module that fails to import
        return _failure(error)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m attnzoo.bench.worker '<json job>' (or @path/to/job.json)", file=sys.stderr)
        return 2
    text = argv[0]
    if text.startswith("@"):
        with open(text[1:]) as handle:
            text = handle.read()
    job = json.loads(text)
    # Libraries that print would corrupt the JSON on stdout: everything they say goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        result = run_job(job)
    print(json.dumps(finite(result), allow_nan=False))
    return 0


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so it is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


if __name__ == "__main__":
    sys.exit(main())

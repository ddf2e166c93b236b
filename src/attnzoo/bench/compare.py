"""``attnzoo compare``: every mechanism (and optionally its PyPI peers) side by side at several lengths.

The orchestration runs nothing heavy itself. Per sequence length it starts one fresh worker process that
times every mechanism round-robin on the same inputs (and measures each output's error against exact
softmax), then one fresh process per mechanism for its peak memory. A configuration that fails, runs out
of memory or exceeds its time budget becomes a row saying so; after running out of memory or time at one
length a mechanism is skipped at the longer ones.
"""

from __future__ import annotations

import datetime as _dt
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
import platform
import queue
import shlex
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._validation import check_number as check_option_number, device_problem
from ..mechanisms import APPROXIMATE, available, build_mechanism, capabilities, mechanism_class
from .launch import METHODS, Launcher
from .measure import DEFAULT_MIN_SAMPLE_S
from .peers import PEERS, installed_peers
from .targets import Entry, import_user_modules, mechanism_entry, peer_entry
from .results import BASELINE, CSV_COLUMNS, SCHEMA, add_ratios, flag_timings, summarize
from .worker import finite

PRESETS: Dict[str, Dict[str, Any]] = {
    # Under three minutes on two CPU cores however many mechanisms are registered: the timed repeats of one
    # length share 15 s (up to 9 each, at least 3, shorter samples when many mechanisms must share them).
    "quick": dict(lengths=[256, 1024, 4096], batch=1, heads=4, head_dim=64, repeats=9, budget_s=15.0,
                  timing_budget_s=15.0, sweep_values=[16, 32, 64, 128, 256], sweep_logit_stds=[1.0, 0.25],
                  memory_jobs=2),
    # The long sweep: up to 16K positions, minutes per mechanism at the longest lengths.
    "full": dict(lengths=[512, 1024, 2048, 4096, 8192, 16384], batch=1, heads=8, head_dim=64, repeats=7,
                 budget_s=120.0, sweep_values=[16, 32, 64, 128, 256, 512, 1024], sweep_logit_stds=[1.0, 0.25]),
}


@dataclass
class CompareConfig:
    """Everything that determines a comparison run (recorded verbatim in results.json)."""

    preset: str = "quick"
    mechanisms: Optional[List[str]] = None  # None: every registered mechanism
    # Options of particular mechanisms ({name: {option: value}}); a peer of a mechanism gets them too.
    options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    lengths: List[int] = field(default_factory=lambda: list(PRESETS["quick"]["lengths"]))
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    device: str = "cpu"
    repeats: int = 9
    budget_s: float = 10.0  # time budget of one configuration; slower ones are "too slow" rows
    # Seconds of timed repeats per length, shared by every mechanism (None: ``repeats`` each, however long).
    timing_budget_s: Optional[float] = None
    threads: int = 0  # 0: every core os.cpu_count() reports (also what --threads 0 means)
    peers: bool = False
    sweep: bool = True
    sweep_length: Optional[int] = None  # None: the middle of ``lengths``
    sweep_values: List[int] = field(default_factory=lambda: list(PRESETS["quick"]["sweep_values"]))
    # The spreads of the logits q.k/sqrt(d) the sweep is measured at: 1 is the timing inputs' (standard-normal q
    # and k), where softmax is peaked and random features have a large variance; 0.25 is a flatter softmax.
    sweep_logit_stds: List[float] = field(default_factory=lambda: list(PRESETS["quick"]["sweep_logit_stds"]))
    min_sample_s: float = DEFAULT_MIN_SAMPLE_S
    memory_fraction: float = 0.8
    # Memory jobs run at once on the CPU, each in its own fresh process (a peak is a process's own, so they do
    # not disturb one another's; they only share the cores). 1 on a GPU, whose memory all jobs would share;
    # at most one per 8 mechanisms measured, since each more is a fork server importing torch.
    memory_jobs: int = 1
    imports: List[str] = field(default_factory=list)
    seed: int = 0
    launch: str = "fork"

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> "CompareConfig":
        if preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
        values = dict(PRESETS[preset], preset=preset)
        if overrides.get("repeats") is not None and overrides.get("timing_budget_s") is None:
            values["timing_budget_s"] = None  # repeats asked for are given in full
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)

    def resolved_sweep_length(self) -> int:
        return self.sweep_length or sorted(self.lengths)[len(self.lengths) // 2]

    def resolved_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the setting for anything that cannot run.

        Called before anything is measured, so a bad value costs nothing; every numeric setting goes through
        :func:`check_number`, which checks its type, finiteness and range alike."""
        if self.preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("batch", "heads", "head_dim", "repeats", "memory_jobs"):
            check_number(name, getattr(self, name), integer=True, minimum=1)
        check_number("threads", self.threads, integer=True, minimum=0)  # 0: every core
        check_number("budget_s", self.budget_s, minimum=0, exclusive_minimum=True)
        if self.timing_budget_s is not None:
            check_number("timing_budget_s", self.timing_budget_s, minimum=0, exclusive_minimum=True)
        check_number("min_sample_s", self.min_sample_s, minimum=0)
        check_number("memory_fraction", self.memory_fraction, minimum=0, exclusive_minimum=True, maximum=1)
        check_number("seed", self.seed, integer=True)
        if not isinstance(self.lengths, (list, tuple)) or not self.lengths:
            raise ConfigError("lengths", f"must be a non-empty list of positive integers, got {self.lengths!r}")
        for length in self.lengths:
            check_number("lengths", length, integer=True, minimum=1)
        if self.sweep_length is not None:
            check_number("sweep_length", self.sweep_length, integer=True, minimum=1)
        if self.sweep and not self.sweep_values:
            raise ConfigError("sweep_values", "must list at least one feature count when sweep is on")
        for value in self.sweep_values:
            check_number("sweep_values", value, integer=True, minimum=1)
        if self.sweep and not self.sweep_logit_stds:
            raise ConfigError("sweep_logit_stds", "must list at least one logit spread when sweep is on")
        for value in self.sweep_logit_stds:
            check_number("sweep_logit_stds", value, minimum=0, exclusive_minimum=True)
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ConfigError("dtype", f"must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
        self._validate_device()
        if self.launch not in METHODS:
            raise ConfigError("launch", f"must be one of {', '.join(METHODS)}, got {self.launch!r}")
        unknown = [name for name in (self.mechanisms or []) if name not in available()]
        if unknown:
            raise ConfigError("mechanisms", f"names unknown mechanism(s) {', '.join(unknown)}; "
                                            f"valid choices: {', '.join(available())}")
        self._validate_options()

    def _validate_options(self) -> None:
        """Each mechanism named in ``options`` exists and accepts those options with those values (it is built
        once, small, to find out: a bad value must fail here, not as a row per length)."""
        if not isinstance(self.options, dict):
            raise ConfigError("options", f"must map mechanism names to option dicts, got {self.options!r}")
        for name, options in self.options.items():
            if name not in available():
                raise ConfigError("options", f"names unknown mechanism {name!r}; valid choices: {', '.join(available())}")
            try:
                build_mechanism(name, 1, 8, **options)
            except (TypeError, ValueError) as error:
                raise ConfigError("options", f"for {name}: {error}") from None

    def _validate_device(self) -> None:
        # A malformed or missing device would otherwise only fail in the first worker, as a row per configuration.
        problem = device_problem(self.device)
        if problem is not None:
            raise ConfigError("device", problem)


class ConfigError(ValueError):
    """A setting of :class:`CompareConfig` that cannot run: ``setting`` names the field, ``problem`` follows it
    in the message ("budget_s" "must be a number > 0, got nan").

    The command line names the option instead of the field (``--time-budget`` for ``budget_s``)."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem


def check_number(setting: str, value: Any, **bounds: Any) -> None:
    """:func:`attnzoo._validation.check_number` (type, finiteness, range; bools refused), raising
    :class:`ConfigError` so that the command line can name the option behind ``setting``."""
    try:
        check_option_number(setting, value, **bounds)
    except (TypeError, ValueError) as error:
        raise ConfigError(setting, str(error).removeprefix(f"{setting} ")) from None


def cores_busy_elsewhere(window_s: float = 0.5) -> Optional[float]:
    """How many cores other processes kept busy over the next ``window_s`` seconds (Linux /proc/stat), or None.

    Unlike the load average, which trails the last minutes (a benchmark that just ended still shows), this
    reads what runs now."""

    def snapshot() -> Tuple[float, float]:
        with open("/proc/stat") as handle:
            ticks = [int(value) for value in handle.readline().split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system

    try:
        busy_before, own_before = snapshot()
        time.sleep(window_s)
        busy_after, own_after = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    return round(max(0.0, (busy_after - busy_before) - (own_after - own_before)) / window_s, 2)


def machine_description(device: str, threads: int) -> Dict[str, Any]:
    """CPU model, core count, memory, library versions: what a reader needs to weigh the numbers."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory_gib = None
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        load = [round(value, 2) for value in os.getloadavg()]
    except OSError:
        load = None
    description: Dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "threads": threads, "memory_gib": memory_gib, "load_average": load,
        "cores_busy_elsewhere": cores_busy_elsewhere(),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        description["gpu"] = torch.cuda.get_device_name(torch.device(device))
        description["cuda"] = torch.version.cuda
    return description


# -- the run -------------------------------------------------------------------------------------------------
Progress = Callable[[str], None]


@dataclass
class CompareResult:
    """What a run produced; ``data`` is exactly what results.json holds."""

    data: Dict[str, Any]

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self.data["rows"]

    @property
    def failed(self) -> bool:
        return any(row["status"] == "failed" for row in self.rows)


def planned_entries(config: CompareConfig) -> Tuple[List[Entry], List[Dict[str, str]]]:
    """The mechanisms (softmax first, as the baseline every ratio refers to) and peers to measure."""
    names = list(config.mechanisms) if config.mechanisms else available()
    if BASELINE in available() and BASELINE not in names:
        names.insert(0, BASELINE)
    names = sorted(dict.fromkeys(names), key=lambda name: (name != BASELINE, name))
    entries = [mechanism_entry(name, config.options.get(name)) for name in names]
    missing: List[Dict[str, str]] = []
    if config.peers:
        present, missing = installed_peers()
        if not config.device.startswith("cuda"):  # fla's Triton kernels: listed, not a row of refusals
            missing += [{"name": name, "reason": "runs on a CUDA device only (--device cuda)"}
                        for name in present if PEERS[name].cuda_only]
            present = [name for name in present if not PEERS[name].cuda_only]
        if config.mechanisms:  # the peers of the mechanisms asked for (softmax's included)
            present = [name for name in present if PEERS[name].counterpart() in names]
            missing = [item for item in missing if PEERS[item["name"]].counterpart() in names]
        # A peer runs at the settings of its attnzoo counterpart, so the two rows compare like with like.
        entries += [peer_entry(name, config.options.get(PEERS[name].counterpart() or "")) for name in present]
    return entries, missing


def sweep_plan(config: CompareConfig, entries: Sequence[Entry]) -> List[Tuple[Entry, str]]:
    """(entry, option) for each approximate mechanism that declares a ``sweep_option`` (features, rank, ...)."""
    plan = []
    for entry in entries:
        if entry["kind"] != "mechanism" or capabilities(entry["name"]).kind != APPROXIMATE:
            continue
        option = mechanism_class(entry["name"]).sweep_option
        if option is not None:
            plan.append((entry, option))
    return plan


def _job_base(config: CompareConfig, length: int) -> Dict[str, Any]:
    return dict(length=length, batch=config.batch, heads=config.heads, head_dim=config.head_dim,
                dtype=config.dtype, causal=config.causal, device=config.device, threads=config.resolved_threads(),
                seed=config.seed, imports=list(config.imports), memory_fraction=config.memory_fraction)


def _entry_info(entry: Entry) -> Dict[str, Any]:
    if entry["kind"] == "peer":
        peer = PEERS[entry["name"]]
        counterpart = peer.counterpart()
        # A peer computes what its attnzoo counterpart does, so it is of the same kind.
        kind = capabilities(counterpart).kind if counterpart in available() else None
        return {"mechanism": entry["key"], "source": entry["name"], "counterpart": counterpart, "kind": kind}
    return {"mechanism": entry["name"], "source": "attnzoo", "counterpart": None,
            "kind": capabilities(entry["name"]).kind}


def _empty_row(config: CompareConfig, entry: Entry, length: int) -> Dict[str, Any]:
    row = {column: None for column in CSV_COLUMNS}
    row.update(_entry_info(entry))
    row.update(length=length, batch=config.batch, heads=config.heads, head_dim=config.head_dim,
               dtype=config.dtype, causal=config.causal, device=config.device)
    return row


def _apply_time(row: Dict[str, Any], measured: Dict[str, Any]) -> None:
    row["status"], row["reason"] = measured.get("status", "failed"), measured.get("reason")
    for key in ("forward_ms", "forward_backward_ms", "error", "repeats", "forward_spread",
                "forward_backward_spread", "forward_ms_samples", "forward_backward_ms_samples", "timing_note"):
        if measured.get(key) is not None:
            row[key] = measured[key]


def _apply_memory(row: Dict[str, Any], measured: Dict[str, Any]) -> None:
    if measured.get("status") == "ok":
        row["peak_memory_mib"] = measured["peak_bytes"] / 2**20
        row["forward_peak_memory_mib"] = measured["forward_peak_bytes"] / 2**20
        return
    # The timings stand; the row says why its memory is missing.
    status = measured.get("status", "failed")
    row["status"] = status if status in ("oom", "failed", "timeout") else row["status"]
    row["reason"] = f"memory measurement: {measured.get('reason')}"


def run_compare(config: CompareConfig, argv: Sequence[str], progress: Optional[Progress] = None,
                progress_total: Optional[Callable[[int], None]] = None) -> CompareResult:
    """Measure everything ``config`` asks for and return the results (writes nothing).

    ``progress(label)`` is called as each worker job starts; ``progress_total(n)`` once with the job count.
    Interrupted (KeyboardInterrupt), it returns what was measured: every finished row, the rows of the length
    being measured marked ``interrupted`` where they are not, and ``data["interrupted"]`` True.
    """
    import_user_modules(config.imports)
    config.validate()
    started = _dt.datetime.now(_dt.timezone.utc)
    machine = machine_description(config.device, config.resolved_threads())
    entries, missing_peers = planned_entries(config)
    lengths = sorted(set(config.lengths))
    sweeps = sweep_plan(config, entries) if config.sweep else []
    if progress_total:
        progress_total(len(lengths) * (1 + len(entries)) + len(sweeps) * len(config.sweep_logit_stds))
    measured = _Measured()
    preload = list(config.imports)
    if not config.device.startswith("cuda"):
        # A peer's import may initialise CUDA (fla asks for the device's capability), and a child forked from
        # a process that did cannot use CUDA: on a GPU each child imports its peers itself.
        preload += [PEERS[e["name"]].module for e in entries if e["kind"] == "peer"]
    launch_method, interrupted = None, False
    # A second fork server costs a torch import: worth it for a length of many memory jobs, not a few.
    parallel = 1 if config.device.startswith("cuda") else max(1, min(config.memory_jobs, len(entries) // 8))
    try:
        with ExitStack() as stack:
            launchers = [stack.enter_context(Launcher(config.launch, preload=preload)) for _ in range(parallel)]
            launcher = launchers[0]
            launch_method = launcher.method
            _measure_lengths(launchers, config, entries, lengths, progress or (lambda label: None), measured)
            _measure_sweeps(launcher, config, sweeps, progress or (lambda label: None), measured)
    except KeyboardInterrupt:
        interrupted = True
        measured.close_interrupted()
    flag_timings(measured.rows)
    add_ratios(measured.rows)
    finished = _dt.datetime.now(_dt.timezone.utc)
    data = {
        "schema": SCHEMA,
        "command": " ".join(shlex.quote(arg) for arg in argv),
        "argv": list(argv),
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "duration_s": round((finished - started).total_seconds(), 1),
        "machine": machine,
        "config": asdict(config),
        "launch": launch_method,
        "baseline": BASELINE,
        "interrupted": interrupted,
        "rows": measured.rows,
        "summary": summarize(measured.rows),
        "uniform_error": [{"length": length, "error": measured.uniform_error.get(length)} for length in lengths
                          if length in measured.uniform_error or not interrupted],
        "sweeps": measured.sweeps,
        "missing_peers": missing_peers,
        "accuracy": None,
    }
    return CompareResult(finite(data))


@dataclass
class _Measured:
    """What a compare run has measured so far: the rows of finished lengths, those of the length under way,
    the sweeps, uniform attention's error by length."""

    rows: List[Dict[str, Any]] = field(default_factory=list)
    current: List[Dict[str, Any]] = field(default_factory=list)
    sweeps: List[Dict[str, Any]] = field(default_factory=list)
    uniform_error: Dict[int, Optional[float]] = field(default_factory=dict)
    finished_ids: set = field(default_factory=set)  # id() of the current length's rows measured to the end

    def close_interrupted(self) -> None:
        """Keep the current length's rows, those not measured to the end marked interrupted."""
        for row in self.current:
            if id(row) not in self.finished_ids and row["status"] in (None, "ok"):
                timed = row["status"] == "ok"
                row.update(status="interrupted", reason="interrupted before its memory was measured" if timed
                           else "interrupted before it was measured")
        self.rows.extend(self.current)
        self.current = []


def _measure_lengths(launchers: List[Launcher], config: CompareConfig, entries: List[Entry], lengths: List[int],
                     report: Progress, measured: _Measured) -> None:
    """Time and memory of every entry at every length, into ``measured``; an entry that ran out of memory or
    time at one length is skipped at the longer ones. Timing runs on the first launcher; memory jobs on all of
    them at once."""
    stopped: Dict[str, str] = {}  # entry key -> why longer lengths are skipped
    for length in lengths:
        base = _job_base(config, length)
        length_rows = {entry["key"]: _empty_row(config, entry, length) for entry in entries}
        measured.current, measured.finished_ids = list(length_rows.values()), set()
        active = [entry for entry in entries if entry["key"] not in stopped]
        for entry in entries:
            if entry["key"] in stopped:
                length_rows[entry["key"]].update(status="skipped", reason=stopped[entry["key"]])
                measured.finished_ids.add(id(length_rows[entry["key"]]))
        timed, measured.uniform_error[length] = _time_length(launchers[0], config, base, active, report, length)
        for entry in active:
            row = length_rows[entry["key"]]
            _apply_time(row, timed.get(entry["key"], {"status": "failed", "reason": "no result"}))
        _measure_memory(launchers, config, base, [(entry, length_rows[entry["key"]]) for entry in entries],
                        report, measured)
        for entry in entries:
            row = length_rows[entry["key"]]
            if row["status"] in ("oom", "timeout") and entry["key"] not in stopped:
                stopped[entry["key"]] = f"skipped: {row['status']} at N={length}"
        measured.rows.extend(measured.current)
        measured.current = []


def _measure_memory(launchers: List[Launcher], config: CompareConfig, base: Dict[str, Any],
                    pending: List[Tuple[Entry, Dict[str, Any]]], report: Progress, measured: _Measured) -> None:
    """The peak memory of each timed row of ``pending`` (rows not timed get none, but a progress line all the
    same), ``len(launchers)`` jobs at a time, each row marked finished (in ``measured``) once its memory is in.

    Jobs start in order, each on the first launcher free (not in lockstep pairs), with the cores shared
    among the jobs running at once: two jobs of two threads each on two cores would fight over them."""
    timeout = 4 * config.budget_s + 60
    threads = max(1, int(base.get("threads", 1)) // len(launchers))
    free: "queue.Queue[Launcher]" = queue.Queue()
    for launcher in launchers:
        free.put(launcher)
    turn = threading.Condition()
    next_start = [0]
    stopped = threading.Event()

    def measure(index: int, entry: Entry, row: Dict[str, Any]) -> None:
        with turn:  # the progress line is printed when the job starts, and the jobs start in order
            turn.wait_for(lambda: next_start[0] == index)
            if stopped.is_set():
                next_start[0] += 1
                turn.notify_all()
                return
            launcher = free.get() if row["status"] == "ok" else None
            report(f"memory {row['mechanism']} N={row['length']}")
            next_start[0] += 1
            turn.notify_all()
        if launcher is not None:
            try:
                _apply_memory(row, launcher.run(dict(base, kind="memory", entry=entry, threads=threads), timeout))
            finally:
                free.put(launcher)
        with turn:
            measured.finished_ids.add(id(row))

    pool = ThreadPoolExecutor(len(launchers))
    futures = [pool.submit(measure, index, entry, row) for index, (entry, row) in enumerate(pending)]
    try:
        for future in futures:
            future.result()
    except BaseException:
        stopped.set()
        raise
    finally:
        # Interrupted (Ctrl-C): the jobs not started are dropped, not started after the interrupt; those running
        # end with their children, which got the same signal.
        pool.shutdown(wait=True, cancel_futures=True)


def _measure_sweeps(launcher: Launcher, config: CompareConfig, sweeps: List[Tuple[Entry, str]], report: Progress,
                    measured: _Measured) -> None:
    """Each (entry, option) sweep's error against the option's values at each logit spread, into
    ``measured.sweeps``."""
    for logit_std in config.sweep_logit_stds:
        for entry, option in sweeps:
            report(f"sweep {entry['name']}.{option} (logit std {logit_std:g})")
            job = dict(_job_base(config, config.resolved_sweep_length()), kind="sweep", entry=entry,
                       option=option, values=list(config.sweep_values), logit_std=logit_std)
            result = launcher.run(job, timeout_s=len(config.sweep_values) * config.budget_s + 60)
            measured.sweeps.append({"mechanism": entry["name"], "option": option,
                                    "length": config.resolved_sweep_length(), "logit_std": logit_std,
                                    "causal": config.causal, "status": result.get("status"),
                                    "reason": result.get("reason"), "points": result.get("points", []),
                                    "uniform_error": result.get("uniform_error")})


def _time_length(launcher: Launcher, config: CompareConfig, base: Dict[str, Any], active: List[Entry],
                 report: Progress, length: int) -> Tuple[Dict[str, Dict[str, Any]], Optional[float]]:
    """Timings of every active entry at one length (and the error of uniform attention there); if the
    shared worker dies, each entry is measured alone."""
    job = dict(base, kind="time", entries=active, repeats=config.repeats, budget_s=config.budget_s,
               timing_budget_s=config.timing_budget_s, min_sample_s=config.min_sample_s)
    # The budget bounds each entry's measured repeats; warm-up, calibration and the error pass come on top.
    timeout = len(active) * 3 * config.budget_s + 60
    report(f"time N={length}: {len(active)} side by side")
    result = launcher.run(job, timeout_s=timeout)
    if result.get("status") == "ok":
        return dict(result["entries"]), result.get("uniform_error")
    # One entry hung or took the process down: measure each alone so the others still get numbers.
    entries: Dict[str, Dict[str, Any]] = {}
    uniform_error = None
    for entry in active:
        alone = launcher.run(dict(job, entries=[entry]), timeout_s=3 * config.budget_s + 60)
        if alone.get("status") == "ok":
            entries[entry["key"]] = alone["entries"][entry["key"]]
            uniform_error = alone.get("uniform_error")
        else:
            entries[entry["key"]] = alone
    return entries, uniform_error



"""The main job works from a plain install: ``pip install -e .``, no extras.

The test environment has every extra installed, so a missing core dependency would go unnoticed by the
other tests. Here ``attnzoo compare`` runs in an interpreter that can import nothing but the standard
library, attnzoo, and the distributions the core ``dependencies`` of pyproject.toml pull in (with their own
requirements): a ``sitecustomize`` on PYTHONPATH hides every other installed package, as if it were not
installed, and the worker processes the command starts inherit it through the environment.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import pty
import re
import struct
import subprocess
import sys
import sysconfig
import termios
import threading
from pathlib import Path
from typing import Dict, FrozenSet, List, NamedTuple, Set

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
OUTPUT_FILES = ["results.json", "results.csv", "time.png", "memory.png", "error.png", "bubble.png", "report.md"]

# The generated sitecustomize.py: {allowed}, {stdlib} and {log} are filled in by the fixture.
SITECUSTOMIZE = '''\
"""Hides every installed package outside ALLOWED (a plain install of attnzoo), in this process and in every
process started with this directory on PYTHONPATH."""
import sys

ALLOWED = frozenset({allowed!r})
STDLIB = tuple({stdlib!r})  # directories of the standard library (outside their site-packages)
LOG = {log!r}
# Imported by the interpreter's own start-up (site, .pth files) before this file: not attnzoo's doing.
STARTED = frozenset(name.partition(".")[0] for name in sys.modules)


def allowed(top, spec):
    if top in ALLOWED or top in STARTED or top in sys.stdlib_module_names:
        return True
    # stdlib_module_names leaves out build-specific modules such as _sysconfigdata_<platform>: go by place.
    origin = getattr(spec, "origin", None) or ""
    return origin.startswith(STDLIB) and "site-packages" not in origin and "dist-packages" not in origin


class Gate:
    """Wraps a meta-path finder; a module outside ALLOWED is not found, exactly as if it were not installed
    (import raises ModuleNotFoundError, importlib.util.find_spec returns None)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        spec = None if find is None else find(name, path, target)
        top = name.partition(".")[0]
        if spec is None or allowed(top, spec):
            return spec
        with open(LOG, "a") as handle:
            handle.write(top + "\\n")
        return None

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [Gate(finder) for finder in sys.meta_path]
'''


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_requirements() -> List[str]:
    """The ``[project] dependencies`` of pyproject.toml (tomllib from Python 3.11, else a minimal parse)."""
    text = PYPROJECT.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the one array this test needs, written on one line or several
        match = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, flags=re.MULTILINE | re.DOTALL)
        assert match, "no [project] dependencies in pyproject.toml"
        return re.findall(r"""["']([^"']+)["']""", match.group(1))
    return list(tomllib.loads(text)["project"]["dependencies"])


def closure(requirements: List[str]) -> Set[str]:
    """Canonical names of the installed distributions the requirements pull in, their own requirements
    included (matplotlib's numpy, pillow, ...), without extras, with markers evaluated for this interpreter."""
    seen: Set[str] = set()
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = _canonical(requirement.name)
        if name in seen:
            continue
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: then nothing can import it anyway
        seen.add(name)
        pending.extend(Requirement(text) for text in requires)
    return seen


def allowed_modules(distributions: Set[str]) -> FrozenSet[str]:
    """Top-level import names provided by the distributions, and attnzoo's own."""
    provided: Dict[str, Set[str]] = {}
    for module, names in importlib.metadata.packages_distributions().items():
        for name in names:
            provided.setdefault(_canonical(name), set()).add(module)
    modules = {"attnzoo"}
    for name in distributions:
        modules |= provided.get(name, set())
    return frozenset(modules)


class Plain(NamedTuple):
    env: Dict[str, str]  # restricts every Python process started with it to what a plain install provides
    log: Path  # the installed top-level modules those processes asked for and did not get, one a line

    def refused(self) -> List[str]:
        """What was hidden; optional imports (try: import x) that happen to be installed are among them."""
        return sorted(set(self.log.read_text().split()))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Plain:
    root = tmp_path_factory.mktemp("plain-install")
    allowed = allowed_modules(closure(core_requirements()))
    log = root / "refused.txt"
    log.touch()
    stdlib = sorted({os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib")})
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE.format(allowed=sorted(allowed), stdlib=stdlib,
                                                                log=str(log)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return Plain(env, log)


def test_the_restriction_hides_packages_outside_the_core_dependencies_in_child_processes(plain):
    # pytest is installed here but is no core dependency: a grandchild process must not see it either.
    child = ("import subprocess, sys\n"
             "sys.exit(subprocess.run([sys.executable, '-c', 'import numpy, attnzoo.bench.results\\n"
             "import pytest']).returncode)")
    result = subprocess.run([sys.executable, "-c", child], env=plain.env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "No module named 'pytest'" in result.stderr
    assert "pytest" in plain.refused()


def _run_on_a_terminal(command: List[str], env: Dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Run with stderr on a pseudo-terminal (so that the progress bar is drawn, as for a person) and stdout
    on a pipe; returns stdout and what the terminal showed as stderr."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # rows, columns
    shown: List[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has closed it
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=follower,
                                   stdin=subprocess.DEVNULL)
    finally:
        os.close(follower)
    try:
        stdout, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, _ = process.communicate()
    reader.join(timeout=10)
    os.close(leader)
    return subprocess.CompletedProcess(command, process.returncode, stdout.decode(errors="replace"),
                                       b"".join(shown).decode(errors="replace"))


def test_compare_runs_with_nothing_but_the_core_dependencies(plain, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "attnzoo.cli", "compare", "--mechanisms", "softmax,linear", "--lengths",
               "64,128", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--time-budget", "5",
               "--threads", "1", "--no-sweep", "--output", str(out)]
    result = _run_on_a_terminal(command, plain.env, tmp_path)
    assert result.returncode == 0, (f"exit {result.returncode}; refused imports: {plain.refused()}\n"
                                    f"{result.stderr[-3000:]}\n{result.stdout[-3000:]}")
    for name in OUTPUT_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in OUTPUT_FILES:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    data = json.loads((out / "results.json").read_text())
    assert {row["status"] for row in data["rows"]} == {"ok"}
    assert "N = 64" in result.stdout and "N = 128" in result.stdout
    # The progress bar, not the plain "[1/6] ..." lines that stand in for it when tqdm cannot be imported.
    assert "100%" in result.stderr, result.stderr[-2000:]


def test_train_and_eval_run_with_nothing_but_the_core_dependencies(plain, tmp_path):
    """attnzoo train writes its safetensors checkpoints and progress bar, and attnzoo eval reads them back, with
    only the core dependencies importable."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "attnzoo.cli", "train", "recall", "--task-options",
               "train_size=32,validation_size=8,test_size=8,num_pairs=4", "--dim", "16", "--depth", "1", "--heads",
               "2", "--batch-size", "8", "--steps", "3", "--eval-interval", "3", "--threads", "1", "--output", str(out)]
    result = _run_on_a_terminal(command, plain.env, tmp_path)
    assert result.returncode == 0, (f"exit {result.returncode}; refused imports: {plain.refused()}\n"
                                    f"{result.stderr[-3000:]}\n{result.stdout[-3000:]}")
    assert (out / "checkpoints" / "step-000003" / "model.safetensors").stat().st_size > 0
    assert "100%" in result.stderr, result.stderr[-2000:]
    evaluated = _run_on_a_terminal([sys.executable, "-m", "attnzoo.cli", "eval", str(out)], plain.env, tmp_path)
    assert evaluated.returncode == 0 and "baseline" in evaluated.stdout, evaluated.stderr[-2000:]


def test_seq2seq_evaluation_runs_with_nothing_but_the_core_dependencies(plain, tmp_path):
    """The decoded metrics of a seq2seq run (corpus BLEU by sacrebleu among them) need only core dependencies."""
    command = [sys.executable, "-m", "attnzoo.cli", "train", "reverse", "--task-options",
               "train_size=32,validation_size=8,test_size=8,length=5", "--dim", "16", "--depth", "1", "--heads",
               "2", "--batch-size", "8", "--steps", "2", "--eval-interval", "2", "--threads", "1", "--beam-size",
               "2", "--output", str(tmp_path / "run")]
    result = _run_on_a_terminal(command, plain.env, tmp_path)
    assert result.returncode == 0, (f"exit {result.returncode}; refused imports: {plain.refused()}\n"
                                    f"{result.stderr[-3000:]}\n{result.stdout[-3000:]}")
    assert "bleu" in result.stdout and "decoder:    beam (size 2" in result.stdout, result.stdout[-2000:]

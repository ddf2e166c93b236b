"""Running each worker job in a fresh process, with a time limit, turning any death into a result.

Two ways to get a fresh process:

* ``"fork"`` (default on Linux and macOS): one server process (``python -m attnzoo.bench.fork_server``)
  imports torch and attnzoo once, then forks a new child per job. Each child starts from the same
  just-imported state a new interpreter would have (the server itself never runs a tensor operation, so
  no thread pool or allocator state is inherited), without paying the ~2 s torch import per job.
* ``"subprocess"``: ``python -m attnzoo.bench.worker '<json>'`` per job, the command a person can run to
  reproduce one configuration by hand.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .worker import Job, Result

METHODS = ("fork", "subprocess")


def death_result(code: int, log: str) -> Result:
    """The result of a worker that exited without answering (``code`` < 0: killed by that signal)."""
    detail = f"; last output: {log}" if log else ""
    if code == -signal.SIGKILL:
        return {"status": "oom", "reason": f"worker killed by SIGKILL, most likely the system's out-of-memory "
                                           f"killer{detail}"}
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return {"status": "failed", "reason": f"worker crashed with signal {name}{detail}"}
    return {"status": "failed", "reason": f"worker exited with code {code} without a result{detail}"}


def log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as handle:
            text = handle.read().strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


class _Lines:
    """Newline-delimited reads from a pipe with a deadline (a plain readline() could block forever)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def read(self, deadline: float) -> Optional[str]:
        """The next line, or None at the deadline; raises EOFError when the writer is gone."""
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise EOFError("worker server closed its output")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


class Launcher:
    """Runs jobs one at a time, each in a fresh process.

    ``preload``: modules the fork server imports once (peer libraries, user mechanisms), so that children
    do not each pay for importing them.
    """

    def __init__(self, method: str = "fork", preload: Sequence[str] = ()) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if method == "fork" and not hasattr(os, "fork"):
            method = "subprocess"
        self.method = method
        self.preload = list(preload)
        self._logs = tempfile.TemporaryDirectory(prefix="attnzoo-bench-")
        self._server: Optional[subprocess.Popen] = None
        self._lines: Optional[_Lines] = None

    # -- fork server ---------------------------------------------------------------------------------------
    def _start_server(self) -> None:
        command = [sys.executable, "-m", "attnzoo.bench.fork_server", json.dumps(self.preload)]
        server_log = open(os.path.join(self._logs.name, "server.log"), "w")
        self._server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=server_log, bufsize=0)
        server_log.close()
        assert self._server.stdout is not None
        self._lines = _Lines(self._server.stdout.fileno())

    def _stop_server(self) -> None:
        if self._server is not None:
            if self._server.stdin:
                self._server.stdin.close()
            try:
                self._server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            if self._server.stdout:
                self._server.stdout.close()
        self._server, self._lines = None, None

    def _run_forked(self, job: Job, timeout_s: float) -> Result:
        if self._server is None or self._server.poll() is not None:
            self._start_server()
        assert self._server is not None and self._server.stdin is not None and self._lines is not None
        log_path = os.path.join(self._logs.name, "worker.log")
        try:
            self._server.stdin.write((json.dumps({"job": job, "log": log_path}) + "\n").encode())
            # The server answers at once with the child's pid, then with the result once the child ends.
            started = self._lines.read(time.monotonic() + 120)
            if started is None:
                raise EOFError("worker server did not start a job within 120 s")
            pid = json.loads(started)["pid"]
            answer = self._lines.read(time.monotonic() + timeout_s)
            if answer is None:
                _kill(pid)
                # The server then reports the killed child; without that reply the exchange is out of step,
                # so the server is replaced before the next job.
                if self._lines.read(time.monotonic() + 30) is None:
                    self._stop_server()
                return {"status": "timeout", "reason": f"timed out after {timeout_s:.0f} s"}
            reply: Dict[str, Any] = json.loads(answer)
        except (EOFError, BrokenPipeError, OSError, ValueError, KeyError) as error:
            tail = log_tail(os.path.join(self._logs.name, "server.log"))
            self._stop_server()
            return {"status": "failed", "reason": f"worker server failed: {error}" + (f"; {tail}" if tail else "")}
        if "result" in reply:
            return reply["result"]
        return death_result(int(reply["exit"]), log_tail(log_path))

    # -- one interpreter per job ---------------------------------------------------------------------------
    def _run_subprocess(self, job: Job, timeout_s: float) -> Result:
        command = [sys.executable, "-m", "attnzoo.bench.worker", json.dumps(job)]
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": f"timed out after {timeout_s:.0f} s"}
        lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
        if completed.returncode != 0 or not lines:
            return death_result(completed.returncode, " | ".join(completed.stderr.strip().splitlines()[-5:])[-400:])
        parsed: Dict[str, Any] = json.loads(lines[-1])
        return parsed

    # -- public --------------------------------------------------------------------------------------------
    def run(self, job: Job, timeout_s: float) -> Result:
        """Run ``job`` in a fresh process; a timeout, crash or kill comes back as a result with a reason."""
        if self.method == "fork":
            return self._run_forked(job, timeout_s)
        return self._run_subprocess(job, timeout_s)

    def close(self) -> None:
        self._stop_server()
        self._logs.cleanup()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

"""The fork server of :mod:`attnzoo.bench.launch`: ``python -m attnzoo.bench.fork_server '[modules to preload]'``.

It imports torch and attnzoo once, then forks a fresh child per job (see the launcher's docstring for why).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import List, Optional

from .targets import import_user_modules
from .worker import finite, run_job


def serve(preload: List[str]) -> int:
    """The fork server's loop: one JSON request per stdin line, a fresh child per job.

    Replies on stdout: ``{"pid": ...}`` as soon as the child runs, then ``{"result": ...}`` or
    ``{"exit": code}`` (negative: killed by that signal) when it ends.
    """
    # torch imports this lazily on the first backward (it pulls in sympy, ~1 s); imported here once, every
    # child starts with it. Importing runs no tensor operation, so no thread pool is started before forking.
    importlib.import_module("torch.fx.experimental.symbolic_shapes")
    import_user_modules(preload)
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            os.close(read_end)
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)  # libraries that print must not corrupt the protocol
            os.dup2(log, 2)
            try:
                payload = json.dumps(finite(run_job(request["job"])), allow_nan=False).encode()
                with os.fdopen(write_end, "wb") as pipe:
                    pipe.write(payload)
            finally:
                os._exit(0)
        os.close(write_end)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        with os.fdopen(read_end, "rb") as pipe:
            payload = pipe.read()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        try:
            reply = {"result": json.loads(payload)} if payload and code == 0 else {"exit": code or 1}
        except ValueError:
            reply = {"exit": code or 1}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print("usage: python -m attnzoo.bench.fork_server '[modules to preload]'", file=sys.stderr)
        return 2
    return serve(json.loads(argv[0]) if argv else [])


if __name__ == "__main__":
    sys.exit(main())

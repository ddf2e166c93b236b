"""Running ``attnzoo`` in-process from a test: the exit code and what it printed."""

from __future__ import annotations

from typing import Tuple

from attnzoo.cli import main


def run_cli(capsys, *argv: str) -> Tuple[int, str, str]:
    """``attnzoo ARGV...`` through :func:`attnzoo.cli.main`: (exit code, stdout, stderr); argparse's own errors
    (SystemExit) give their code too."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err

"""Checks shared by every training experiment (``attnzoo lra``, ``attnzoo seq2seq-report``, one of your own):
the preset, how cells are run, the names and mechanism options asked for, and the settings an interrupted run
must be continued with. Each error names the command-line option, so the command can print it as it is."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

from ..mechanisms import available as mechanisms_available, build_mechanism


def check_preset(preset: Any, presets: Iterable[str]) -> None:
    """``preset`` is one of ``presets`` (``--preset quick|full``)."""
    valid = list(presets)
    if preset not in valid:
        raise ValueError(f"--preset must be one of {', '.join(valid)}, got {preset!r}")


def check_cell_settings(jobs: Any, threads: Any, cell_timeout_s: Any) -> None:
    """How cells are run: ``--jobs`` at once, ``--threads`` each (None: the default), ``--cell-timeout`` seconds
    at most (None: the preset's); a bad value is an error naming the option."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be an integer >= 1, got {threads!r}")
    if cell_timeout_s is not None and not (cell_timeout_s > 0 and math.isfinite(cell_timeout_s)):
        raise ValueError("--cell-timeout (--cell-time-limit) must be a positive number of seconds, "
                         f"got {cell_timeout_s!r}")


def check_names(option: str, chosen: Optional[Sequence[str]], valid: Sequence[str]) -> None:
    """Every name in ``chosen`` (None: all) is one of ``valid``; the error names ``option``."""
    unknown = [name for name in chosen or [] if name not in valid]
    if unknown:
        raise ValueError(f"{option}: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")


def check_mechanism_options(options: Mapping[str, Mapping[str, Any]]) -> None:
    """Each mechanism named in ``options`` (``--set MECHANISM.OPTION=VALUE``) exists and takes those options
    with those values: it is built once, small, so that a bad value fails before the first cell trains."""
    for name, values in options.items():
        if name not in mechanisms_available():
            raise ValueError(f"--set names unknown mechanism {name!r}; valid: {', '.join(mechanisms_available())} "
                             "(a mechanism of your own: give --import MODULE)")
        try:
            build_mechanism(name, 1, 8, **values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--set for {name}: {error}") from None


def keep_settings(path: Path, settings: Dict[str, Any], what: str) -> None:
    """Record ``settings`` at ``path``, or, when a run already recorded some there, refuse other ones: an
    interrupted run continues only as it was configured. ``what`` names the run in the error."""
    if path.exists():
        if json.loads(path.read_text()) != json.loads(json.dumps(settings)):
            raise ValueError(f"--output {path.parent} holds {what} with other settings (preset, options or "
                             "overrides); continue it with the same ones, or choose another --output")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))

"""What every ``attnzoo`` command shares: exit codes, the one-line usage error, value and list parsing, the
``--set`` mechanism options, ``--import`` of mechanisms of your own, and retired flag spellings.

One meaning per flag across commands:

* ``--preset quick|full``: a budget preset (``compare``, ``lra``, ``seq2seq-report``);
* ``--time-budget SECONDS``: seconds (``compare``);
* ``--set MECHANISM.OPTION=VALUE``: an option of one mechanism, in every command that takes a mechanism
  (``OPTION=VALUE`` alone where the command has exactly one mechanism: ``train``, ``seq2seq-report``);
* ``--import MODULE_OR_PATH``: a module or ``.py`` file that registers mechanisms, in every such command;
* ``--threads N``: torch threads, an integer >= 1 (``compare`` also takes 0: every core);
* ``--output DIR``: a directory that exists or can be created, and where files can be written; checked by
  :func:`check_output_dir` before any work starts, creating nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional, Sequence, Tuple, Union

# One reading of a command-line value (true/false, none, numbers, text), the same in --set and --layers.
from ..models.schedule import parse_value

EXIT_OK = 0
EXIT_FAILED_ROWS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader closed the pipe

# A mechanism option: (mechanism, or None where the command's one mechanism is meant; option; value).
Setting = Tuple[Optional[str], str, Any]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other usage error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but an unknown option is reported by the subcommand it was given to, whose ``--help``
        lists the options it takes."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            self.exit(EXIT_USAGE, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        return parsed


def usage_error(command: str, message: str) -> int:
    """Print a usage error as the one line exit code 2 promises (a message never spans several lines)."""
    text = "; ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"attnzoo {command}: error: {text}", file=sys.stderr)
    return EXIT_USAGE


def describe(error: BaseException) -> str:
    """"No such file or directory" for an OSError, "SyntaxError: invalid syntax (...)" for anything else."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}"


# -- values ----------------------------------------------------------------------------------------------------
def parse_options(text: str) -> Dict[str, Any]:
    """Options given as a JSON object (``'{"size": 16}'``) or as ``key=value`` pairs separated by commas
    (``size=16,seed=1``)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
        return value
    options: Dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...] or a JSON object, got {text!r}")
        options[key.strip()] = parse_value(raw)
    return options


def merged(groups: Optional[Iterable[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """Repeated ``--x-options`` groups as one dict, later ones winning; None when none was given."""
    if not groups:
        return None
    result: Dict[str, Any] = {}
    for group in groups:
        result.update(group)
    return result


def qualified_setting(text: str) -> Setting:
    """``MECHANISM.OPTION=VALUE`` -> (mechanism, option, value), the value read by :func:`parse_value`.
    Whether the mechanism takes it is checked by the command, before anything runs."""
    target, sep, raw = text.partition("=")
    mechanism, dot, option = target.strip().partition(".")
    if not sep or not dot or not mechanism or not option.strip():
        raise argparse.ArgumentTypeError(f"expected MECHANISM.OPTION=VALUE, got {text!r}")
    return mechanism, option.strip(), parse_value(raw)


def setting(text: str) -> Setting:
    """``OPTION=VALUE`` (the command's one mechanism) or ``MECHANISM.OPTION=VALUE`` -> (mechanism or None,
    option, value)."""
    target, sep, raw = text.partition("=")
    if not sep or not target.strip() or target.strip().endswith("."):
        raise argparse.ArgumentTypeError(f"expected OPTION=VALUE or MECHANISM.OPTION=VALUE, got {text!r}")
    if "." in target:
        return qualified_setting(text)
    return None, target.strip(), parse_value(raw)


def options_by_mechanism(settings: Optional[Sequence[Setting]]) -> Dict[str, Dict[str, Any]]:
    """``--set`` values of a command with several mechanisms: {mechanism: {option: value}}."""
    options: Dict[str, Dict[str, Any]] = {}
    for mechanism, option, value in settings or []:
        options.setdefault(str(mechanism), {})[option] = value
    return options


def options_of(mechanism: str, settings: Optional[Sequence[Setting]]) -> Dict[str, Any]:
    """``--set`` values of a command with one mechanism: a qualified one must name that mechanism."""
    options: Dict[str, Any] = {}
    for named, option, value in settings or []:
        if named is not None and named != mechanism:
            raise ValueError(f"--set {named}.{option}: this command's mechanism is {mechanism!r} "
                             f"(give --set {option}=VALUE, or --mechanism {named})")
        options[option] = value
    return options


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (argparse names the flag in its one-line error)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def check_output_dir(option: str, path: Union[str, Path]) -> None:
    """``path`` is a directory that exists or can be created, and files can be written in it; else a
    ValueError naming ``option`` and the path. Checked before any work starts and creating nothing: the
    nearest existing directory is probed with a file written and removed (permissions alone do not tell: root,
    read-only file systems, full disks)."""
    path = Path(path)
    where = f"{option} {path}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where}: exists and is not a directory")
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent  # an existing file on the way is found here (exists() is False below it)
    problem = "cannot write files in it" if existing == path else "cannot create the directory"
    if not existing.is_dir():
        raise ValueError(f"{where}: {problem} ({os.strerror(errno.ENOTDIR)})")
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".attnzoo-write-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"{where}: {problem} ({describe(error)})") from None


def name_list(text: str) -> List[str]:
    """Comma-separated names (mechanisms, tasks)."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def int_list(text: str) -> List[int]:
    """Comma-separated integers; their range is checked by the command with every other setting."""
    try:
        return [int(item) for item in text.replace(" ", "").split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> List[float]:
    """Comma-separated numbers; their range is checked by the command with every other setting."""
    try:
        return [float(item) for item in text.replace(" ", "").split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


# -- flags declared by a config's fields ----------------------------------------------------------------------
def add_declared_flags(parser: Any, config_class: type, command: str, prefix: str = "") -> None:
    """A flag for every field of ``config_class`` declared (:func:`attnzoo.models.settings.setting`) as one of
    ``command``: ``--name-with-dashes`` or the spelling it declares, its values read as the field's type (or one
    of its choices; a yes/no field is a switch, on when given), its help the field's help and default, its
    metavar the declared one. A field holding another config of declared fields (a decoder's
    ``MonotonicInference``) is a switch too, followed by that config's own flags. Each flag stores in
    ``prefix`` + the field's name and defaults to None, "not given", so that the config's own default applies
    and --resume can tell what was given (:func:`given_flags` reads them back)."""
    from ..models.settings import default_of, flag_spelling, flags, value_type

    for item, declared in flags(config_class, command):
        kind = value_type(config_class, item)
        default = default_of(item)  # None: the help says what not giving the flag means
        help_text = declared.help if default is None else f"{declared.help} (default {default})"
        spelled, dest = flag_spelling(item), prefix + item.name
        named = {} if declared.metavar is None else {"metavar": declared.metavar}
        if kind is bool or dataclasses.is_dataclass(kind):
            parser.add_argument(spelled, dest=dest, action="store_const", const=True, help=declared.help)
            if dataclasses.is_dataclass(kind):
                add_declared_flags(parser, kind, command, prefix)
        elif declared.choices is not None:
            parser.add_argument(spelled, dest=dest, choices=declared.choices, help=help_text, **named)
        else:
            parser.add_argument(spelled, dest=dest, type=kind, help=help_text, **named)


def given_flags(args: argparse.Namespace, config_class: type, prefix: str = "") -> Dict[str, Any]:
    """{field: value} for the flags of ``config_class``'s fields (:func:`add_declared_flags`) that the command
    line gave."""
    from ..models.settings import settings_of

    given = {item.name: getattr(args, prefix + item.name, None) for item, declared in settings_of(config_class)
             if declared.flag is not False}
    return {name: value for name, value in given.items() if value is not None}


# -- mechanisms of your own ------------------------------------------------------------------------------------
def add_import_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE_OR_PATH",
                        help="import a module or .py file that registers mechanisms of your own (repeatable)")


def import_modules(specs: Optional[Sequence[str]]) -> List[str]:
    """Import every ``--import`` (a dotted module name or a path of a .py file); returns them as a fresh process
    elsewhere can import them again (paths made absolute). A module that fails is an error naming it."""
    from ..bench.targets import import_user_modules

    portable = []
    for spec in specs or []:
        try:
            import_user_modules([spec])
        except Exception as error:  # noqa: BLE001 - whatever a user's module raises is theirs to fix
            raise ValueError(f"--import {spec}: {describe(error)}") from None
        is_path = spec.endswith(".py") or "/" in spec
        portable.append(str(Path(spec).resolve()) if is_path else spec)
    return portable


def check_mechanism(name: str, option: str = "--mechanism") -> None:
    """``name`` is registered; the error lists the valid names and says how to add one of your own."""
    from ..mechanisms import available

    if name not in available():
        raise ValueError(f"{option}: unknown mechanism {name!r}; valid: {', '.join(available())} (a mechanism of "
                         "your own: give --import MODULE_OR_PATH)")


# -- retired spellings -----------------------------------------------------------------------------------------
class _Retired(argparse.Action):
    """A flag spelling no longer accepted: a one-line usage error naming the flag to use instead."""

    def __init__(self, option_strings: List[str], dest: str, instead: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        parser.error(f"{option_string} is retired: use {self.instead}")


def retire(parser: argparse.ArgumentParser, flag: str, instead: str) -> None:
    """Make ``flag`` an error that names ``instead`` (never a silent different meaning)."""
    parser.add_argument(flag, dest=f"retired_{flag.lstrip('-').replace('-', '_')}", action=_Retired,
                        instead=instead)


# -- progress ----------------------------------------------------------------------------------------------------
def job_progress(quiet: bool, unit: str) -> Tuple[Callable[[str], None], Callable[[int], None], Callable[[], None]]:
    """(start, set_total, close) for a run of jobs, each announced as it starts (``start(label)``): a tqdm bar
    of ``unit``s on a terminal, its description the job under way; else one line per job as it starts (with the
    time the previous one took); nothing if quiet."""
    state: dict = {"done": 0, "total": 0, "bar": None, "since": None}
    if quiet:
        return (lambda label: None), (lambda total: None), (lambda: None)

    def set_total(total: int) -> None:
        state["total"] = total
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if sys.stderr.isatty():
            state["bar"] = tqdm(total=total, file=sys.stderr, unit=unit, dynamic_ncols=True)

    def start(label: str) -> None:
        now = time.perf_counter()
        previous = "" if state["since"] is None else f" (previous: {now - state['since']:.0f} s)"
        state["since"] = now
        if state["bar"] is not None:
            if state["done"]:
                state["bar"].update(1)
            state["bar"].set_description(label)
        else:
            print(f"[{state['done'] + 1}/{state['total']}] {label}{previous}", file=sys.stderr, flush=True)
        state["done"] += 1

    def close() -> None:
        if state["bar"] is not None:
            state["bar"].update(1)
            state["bar"].close()

    return start, set_total, close

"""The ``attnzoo`` command line: ``attnzoo list``, ``attnzoo compare``, ``attnzoo train`` and ``attnzoo eval``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional, Tuple

from .cli_training import add_training_commands
from .mechanisms import available, capabilities, mechanism_options

EXIT_OK = 0
EXIT_FAILED_ROWS = 1
EXIT_USAGE = 2

EXIT_CODES = """exit codes:
  0  every configuration was measured, or reported as unsupported, out of memory or too slow
  1  at least one configuration failed with an error (its reason is in the table and results.json);
     every output file is still written
  2  usage error: bad option value, unknown mechanism, unreadable --accuracy file, a --import that fails,
     an --output directory that cannot be created or written (checked before anything is measured)"""

# The option behind each CompareConfig setting whose name differs from it, for error messages.
OPTION_NAMES = {"budget_s": "--budget", "imports": "--import", "options": "--set"}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other usage error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def list_command(args: argparse.Namespace) -> int:
    header = ["mechanism", "causal", "cross", "padding", "step", "max len", "kind", "complexity"]
    rows = []
    for name in available():
        caps = capabilities(name)
        rows.append([
            name, _yes(caps.causal), _yes(caps.cross), _yes(caps.key_padding), _yes(caps.recurrent_step),
            "-" if caps.max_length is None else str(caps.max_length),
            caps.kind, caps.complexity,
        ])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if args.options:
        print("\noptions (keyword arguments of build_mechanism / MultiHeadAttention, with their defaults):")
        for name in available():
            options = ", ".join(f"{key}={value!r}" for key, value in mechanism_options(name).items())
            print(f"  {name}: {options or 'none'}")
    return EXIT_OK


# -- compare -------------------------------------------------------------------------------------------------
def _int_list(text: str) -> List[int]:
    """Comma-separated integers; their range is checked with every other setting by CompareConfig.validate."""
    try:
        return [int(item) for item in text.replace(" ", "").split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _mechanism_setting(text: str) -> Tuple[str, str, object]:
    """``MECHANISM.OPTION=VALUE`` -> (mechanism, option, value); the value is read as an int, a float, true or
    false, none, or else kept as a string. Whether the mechanism takes it is checked by CompareConfig.validate."""
    target, sep, raw = text.partition("=")
    mechanism, dot, option = target.strip().partition(".")
    if not sep or not dot or not mechanism or not option.strip():
        raise argparse.ArgumentTypeError(f"expected MECHANISM.OPTION=VALUE (e.g. nystrom.landmarks=256), got {text!r}")
    raw = raw.strip()
    value: object
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif raw.lower() == "none":
        value = None
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    return mechanism, option.strip(), value


def _name_list(text: str) -> List[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated mechanism names")
    return names


def _progress(quiet: bool) -> Tuple[Callable[[str], None], Callable[[int], None], Callable[[], None]]:
    """(step, set_total, close) callbacks: a tqdm bar on a terminal, plain lines otherwise, nothing if quiet."""
    if quiet:
        return (lambda label: None), (lambda total: None), (lambda: None)
    state = {"done": 0, "total": 0, "bar": None}
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    def set_total(total: int) -> None:
        state["total"] = total
        if tqdm is not None and sys.stderr.isatty():
            state["bar"] = tqdm(total=total, file=sys.stderr, unit="job", dynamic_ncols=True)

    def step(label: str) -> None:
        state["done"] += 1
        if state["bar"] is not None:
            state["bar"].set_description(label)
            state["bar"].update(1)
        else:
            print(f"[{state['done']}/{state['total']}] {label}", file=sys.stderr, flush=True)

    def close() -> None:
        if state["bar"] is not None:
            state["bar"].close()

    return step, set_total, close


def _usage_error(message: str) -> int:
    """Print a usage error as the one line the exit code 2 promises; a message never spans several lines."""
    print(f"attnzoo compare: error: {'; '.join(line.strip() for line in message.splitlines() if line.strip())}",
          file=sys.stderr)
    return EXIT_USAGE


def _describe(error: BaseException) -> str:
    """"No such file or directory" for an OSError, "SyntaxError: invalid syntax (...)" for anything else."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}"


def _collect_settings(settings: List[Tuple[str, str, object]]) -> Dict[str, Dict[str, object]]:
    options: Dict[str, Dict[str, object]] = {}
    for mechanism, option, value in settings:
        options.setdefault(mechanism, {})[option] = value
    return options


def compare_command(args: argparse.Namespace) -> int:
    from .bench.compare import CompareConfig, ConfigError, run_compare
    from .bench.results import load_accuracy, prepare_output, write_results
    from .bench.plots import write_plots
    from .bench.report import write_report
    from .bench.table import results_table
    from .bench.targets import import_user_modules

    # Every usage error is found here, before the first measurement: a bad value must not cost a run.
    output = Path(args.output)
    try:
        accuracy = load_accuracy(args.accuracy) if args.accuracy is not None else None
        config = CompareConfig.from_preset(
            args.preset, mechanisms=args.mechanisms, lengths=args.lengths, batch=args.batch, heads=args.heads,
            head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, device=args.device,
            repeats=args.repeats, threads=args.threads, budget_s=args.budget, peers=args.peers,
            sweep=not args.no_sweep, imports=args.imports or None, launch=args.launch,
            options=_collect_settings(args.settings or []) or None,
        )
        for spec in config.imports:  # first: the modules register mechanisms that --mechanisms may name
            try:
                import_user_modules([spec])
            except Exception as error:  # noqa: BLE001 - whatever a user's module raises is theirs to fix
                raise ValueError(f"--import {spec}: {_describe(error)}") from None
        config.validate()
        try:
            prepare_output(output)
        except ValueError as error:
            raise ValueError(f"--output {output}: {error}") from None
    except ConfigError as error:
        option = OPTION_NAMES.get(error.setting, "--" + error.setting.replace("_", "-"))
        return _usage_error(f"{option} {error.problem}")
    except ValueError as error:
        return _usage_error(str(error))

    step, set_total, close = _progress(args.quiet or args.json)
    argv = ["attnzoo", "compare", *args.raw_argv]
    try:
        result = run_compare(config, argv, progress=step, progress_total=set_total)
    finally:
        close()
    if accuracy is not None:
        result.data["accuracy"] = {"path": str(args.accuracy), "values": accuracy}

    # The directory was writable at the start; should that change during the run (removed, disk full), the
    # table or JSON is still printed so the measurements are not lost, then the error.
    paths: Dict[str, Path] = {}
    write_failure: Optional[str] = None
    try:
        paths.update(write_results(result.data, output))
        paths.update(write_plots(result.data, output, accuracy))
        paths["report"] = write_report(result.data, output, str(args.accuracy) if args.accuracy else None)
    except OSError as error:
        write_failure = f"--output {output}: cannot write {error.filename or 'the results'} ({_describe(error)})"

    if args.json:
        print(json.dumps(result.data, indent=2))
    elif not args.quiet:
        print(results_table(result.data))
        if write_failure is None:
            print(f"\nwrote {', '.join(path.name for path in paths.values())} to {output}/")
    if write_failure is not None:
        return _usage_error(write_failure)
    return EXIT_FAILED_ROWS if result.failed else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnzoo", description="Attention mechanisms behind one API.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="registered mechanisms and their capabilities")
    listing.add_argument("--options", action="store_true", help="also list each mechanism's options and defaults")
    listing.set_defaults(run=list_command)

    compare = commands.add_parser(
        "compare", help="time, memory and error of every mechanism side by side, with plots",
        description="Measure forward and forward+backward time, peak memory and the error against exact softmax "
                    "of every registered mechanism (and, with --peers, of installed peer libraries) at several "
                    "sequence lengths. Prints a table; writes results.json, results.csv, time.png, memory.png, "
                    "error.png, bubble.png and report.md to --output. Options given explicitly override the "
                    "preset.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("--preset", choices=["quick", "full"], default="quick",
                         help="quick: 256-4096 positions, a few minutes on 2 CPU cores (default); "
                              "full: 512-16384 positions, 8 heads, the long sweep")
    compare.add_argument("--mechanisms", type=_name_list, metavar="A,B,...",
                         help="comma-separated mechanisms (default: every registered one; softmax is always "
                              "included as the baseline)")
    compare.add_argument("--lengths", type=_int_list, metavar="N,N,...", help="sequence lengths")
    compare.add_argument("--batch", type=int, help="batch size")
    compare.add_argument("--heads", type=int, help="number of heads")
    compare.add_argument("--head-dim", type=int, help="dimension per head")
    compare.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    compare.add_argument("--causal", action="store_true", help="causal (autoregressive) attention; mechanisms "
                                                                "without causal support become rows saying so")
    compare.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    compare.add_argument("--repeats", type=int, help="timed repeats per configuration (the median is reported; "
                                                      "quick: 9, full: 7)")
    compare.add_argument("--threads", type=int, help="torch threads (default, or 0: every core)")
    compare.add_argument("--budget", type=float, metavar="SECONDS",
                         help="time budget per configuration; slower ones are reported as too slow and skipped "
                              "at longer lengths (quick: 10, full: 120)")
    compare.add_argument("--output", default="compare-results", metavar="DIR",
                         help="directory for results and plots, created if missing and checked to be writable "
                              "before anything is measured (default: compare-results/)")
    compare.add_argument("--peers", action="store_true",
                         help="also measure the installed peer libraries (pip install 'attnzoo[peers]' or "
                              "scripts/install-peers.sh); missing ones are listed")
    compare.add_argument("--accuracy", type=Path, metavar="RESULTS.json",
                         help="training-benchmark results: their accuracy is the quality axis of bubble.png")
    compare.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                         help="import a module or .py file that registers extra mechanisms (repeatable)")
    compare.add_argument("--set", dest="settings", action="append", type=_mechanism_setting,
                         metavar="MECHANISM.OPTION=VALUE",
                         help="an option of one mechanism, also given to its peer library (repeatable), e.g. "
                              "--set nystrom.landmarks=256 --set linformer.rank=128")
    compare.add_argument("--no-sweep", action="store_true", help="skip the error against feature count sweep")
    compare.add_argument("--launch", choices=["fork", "subprocess"], default="fork",
                         help="fresh process per job: forked from a server that imported torch once (default) "
                              "or a new interpreter per job")
    output = compare.add_mutually_exclusive_group()
    output.add_argument("--quiet", action="store_true", help="no progress and no table (files are still written)")
    output.add_argument("--json", action="store_true", help="print results.json to stdout instead of the table")
    compare.set_defaults(run=compare_command)
    add_training_commands(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.raw_argv = argv[1:]
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("attnzoo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``attnzoo list`` and ``attnzoo compare``: the registered mechanisms, and the kernel benchmark of them side
by side (:mod:`attnzoo.bench`)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..mechanisms import available, capabilities, mechanism_options
from .common import (
    EXIT_FAILED_ROWS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_import_option,
    check_output_dir,
    describe,
    float_list,
    import_modules,
    int_list,
    job_progress,
    name_list,
    options_by_mechanism,
    qualified_setting,
    retire,
    usage_error,
)

EXIT_CODES = """exit codes:
  0  every configuration was measured, or reported as unsupported, out of memory or too slow
  1  at least one configuration failed with an error (its reason is in the table and results.json);
     every output file is still written
  2  usage error: bad option value, unknown mechanism, unreadable --accuracy file, a --import that fails,
     an --output directory that cannot be created or written (checked before anything is measured)
  130 interrupted (Ctrl-C): the rows measured before are written, marked as interrupted"""

# The option behind each CompareConfig setting whose name differs from it, for error messages.
OPTION_NAMES = {"budget_s": "--time-budget", "imports": "--import", "options": "--set"}


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


LIST_WIDTH = 120  # attnzoo list's lines, unless --wide
COMPLEXITY_INDENT = "    "


def list_command(args: argparse.Namespace) -> int:
    try:
        import_modules(args.imports)
    except ValueError as error:
        return usage_error("list", str(error))
    # grouped kv: how k, v with fewer heads than q are taken (native, repeat, none); packing: cu_seqlens
    # (native, split, none); v width: any, or only head_dim (capability any_value_width). Each one word, so
    # that the rows split on whitespace.
    header = ["mechanism", "causal", "cross", "padding", "step", "grouped kv", "packing", "v width", "max len",
              "kind", "complexity"]
    rows = []
    for name in available():
        caps = capabilities(name)
        rows.append([
            name, _yes(caps.causal), _yes(caps.cross), _yes(caps.key_padding), _yes(caps.recurrent_step),
            caps.grouped_kv, caps.packing, "any" if caps.any_value_width else "head_dim",
            "-" if caps.max_length is None else str(caps.max_length),
            caps.kind, caps.complexity,
        ])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    if args.wide:
        for row in [header, ["-" * w for w in widths]] + rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    else:  # the complexity on its own lines under each row, wrapped: rows start at column 0
        widths = widths[:-1]
        print("  ".join(cell.ljust(w) for cell, w in zip(header, widths)).rstrip())
        print(f"{COMPLEXITY_INDENT}complexity")
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            print(textwrap.fill(row[-1], LIST_WIDTH, initial_indent=COMPLEXITY_INDENT,
                                subsequent_indent=COMPLEXITY_INDENT, break_on_hyphens=False))
    if args.options:
        print("\noptions (keyword arguments of build_mechanism / MultiHeadAttention, with their defaults):")
        for name in available():
            options = ", ".join(f"{key}={value!r}" for key, value in mechanism_options(name).items())
            print(f"  {name}: {options or 'none'}")
    return EXIT_OK


# -- compare -------------------------------------------------------------------------------------------------
def _compare_config(args: argparse.Namespace) -> Any:
    """The validated CompareConfig of the command line, its --import modules imported first (they register
    mechanisms that --mechanisms and --set may name); raises ConfigError or ValueError."""
    from ..bench.compare import CompareConfig

    config = CompareConfig.from_preset(
        args.preset, mechanisms=args.mechanisms, lengths=args.lengths, batch=args.batch, heads=args.heads,
        head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, device=args.device,
        repeats=args.repeats, threads=args.threads, budget_s=args.time_budget, peers=args.peers,
        sweep=not args.no_sweep, sweep_logit_stds=args.sweep_logit_stds, imports=args.imports or None,
        launch=args.launch,
        options=options_by_mechanism(args.settings) or None,
    )
    import_modules(config.imports)
    config.validate()
    return config


def _write_outputs(data: Dict[str, Any], output: Path, accuracy: Optional[Dict[str, float]],
                   accuracy_path: Optional[Path]) -> Tuple[Dict[str, Path], Optional[str]]:
    """Every output file; (paths written, or why writing failed). The directory was writable at the start;
    should that change during the run (removed, disk full), the caller still prints the measurements."""
    from ..bench.plots import write_plots
    from ..bench.report import write_report
    from ..bench.results import write_results

    paths: Dict[str, Path] = {}
    try:
        paths.update(write_results(data, output))
        paths.update(write_plots(data, output, accuracy))
        paths["report"] = write_report(data, output, str(accuracy_path) if accuracy_path else None)
    except OSError as error:
        return paths, f"--output {output}: cannot write {error.filename or 'the results'} ({describe(error)})"
    return paths, None


def compare_command(args: argparse.Namespace) -> int:
    from ..bench.compare import ConfigError, run_compare
    from ..bench.results import load_accuracy, prepare_output
    from ..bench.table import results_table

    # Every usage error is found here, before the first measurement: a bad value must not cost a run.
    output = Path(args.output)
    try:
        accuracy = load_accuracy(args.accuracy) if args.accuracy is not None else None
        config = _compare_config(args)
        check_output_dir("--output", output)
        try:
            prepare_output(output)
        except ValueError as error:
            raise ValueError(f"--output {output}: {error}") from None
    except ConfigError as error:
        option = OPTION_NAMES.get(error.setting, "--" + error.setting.replace("_", "-"))
        return usage_error("compare", f"{option} {error.problem}")
    except ValueError as error:
        return usage_error("compare", str(error))

    start, set_total, close = job_progress(args.quiet or args.json, "job")
    argv = ["attnzoo", "compare", *args.raw_argv]
    try:
        result = run_compare(config, argv, progress=start, progress_total=set_total)
    finally:
        close()
    if accuracy is not None:
        result.data["accuracy"] = {"path": str(args.accuracy), "values": accuracy}
    paths, write_failure = _write_outputs(result.data, output, accuracy, args.accuracy)
    if args.json:
        print(json.dumps(result.data, indent=2))
    elif not args.quiet:
        print(results_table(result.data))
        if write_failure is None:
            print(f"\nwrote {', '.join(path.name for path in paths.values())} to {output}/")
    if write_failure is not None:
        return usage_error("compare", write_failure)
    if result.data.get("interrupted"):
        kept = sum(row["status"] != "interrupted" for row in result.rows)
        print(f"attnzoo compare: interrupted; the {kept} rows measured are written to {output}/", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED_ROWS if result.failed else EXIT_OK


def add_list_command(commands: Any) -> None:
    listing = commands.add_parser("list", help="registered mechanisms and their capabilities")
    listing.add_argument("--options", action="store_true", help="also list each mechanism's options and defaults")
    listing.add_argument("--wide", action="store_true",
                         help=f"one line per mechanism, the complexity last, as wide as it needs (default: the "
                              f"complexity on the lines below, within {LIST_WIDTH} columns)")
    add_import_option(listing)
    listing.set_defaults(run=list_command)


def add_compare_command(commands: Any) -> None:
    from ..bench.compare import PRESETS

    quick, full = PRESETS["quick"], PRESETS["full"]
    compare = commands.add_parser(
        "compare", help="time, memory and error of every mechanism side by side, with plots",
        description="Measure forward and forward+backward time, peak memory and the error against exact softmax "
                    "of every registered mechanism (and, with --peers, of installed peer libraries) at several "
                    "sequence lengths. Prints a table; writes results.json, results.csv, time.png, memory.png, "
                    "error.png, bubble.png and report.md to --output. Options given explicitly override the "
                    "preset.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("--preset", choices=list(PRESETS), default="quick",
                         help=f"quick: {quick['lengths'][0]}-{quick['lengths'][-1]} positions, under 3 minutes on "
                              "2 CPU cores however many mechanisms (default); full: "
                              f"{full['lengths'][0]}-{full['lengths'][-1]} positions, {full['heads']} heads, the "
                              "long sweep")
    compare.add_argument("--mechanisms", type=name_list, metavar="A,B,...",
                         help="comma-separated mechanisms (default: every registered one; softmax is always "
                              "included as the baseline)")
    compare.add_argument("--lengths", type=int_list, metavar="N,N,...", help="sequence lengths")
    compare.add_argument("--batch", type=int, help="batch size")
    compare.add_argument("--heads", type=int, help="number of heads")
    compare.add_argument("--head-dim", type=int, help="dimension per head")
    compare.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    compare.add_argument("--causal", action="store_true", help="causal (autoregressive) attention; mechanisms "
                                                                "without causal support become rows saying so")
    compare.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    compare.add_argument("--repeats", type=int,
                         help=f"timed repeats per configuration (the median is reported; full: {full['repeats']}; "
                              f"quick: up to {quick['repeats']}, as many as fit {quick['timing_budget_s']:g} s per "
                              "length for all mechanisms together, at least 3; given here, exactly this many)")
    compare.add_argument("--threads", type=int, help="torch threads (default, or 0: every core)")
    compare.add_argument("--time-budget", type=float, metavar="SECONDS",
                         help="time budget per configuration; slower ones are reported as too slow and skipped "
                              f"at longer lengths (quick: {quick['budget_s']:g}, full: {full['budget_s']:g})")
    retire(compare, "--budget", "--time-budget SECONDS (a time per configuration) or --preset quick|full")
    compare.add_argument("--output", default="compare-results", metavar="DIR",
                         help="directory for results and plots, created if missing and checked to be writable "
                              "before anything is measured (default: compare-results/)")
    compare.add_argument("--peers", action="store_true",
                         help="also measure the installed peer libraries of the mechanisms measured (pip install "
                              "'attnzoo[peers]' or scripts/install-peers.sh; fla's Triton kernels with --device "
                              "cuda only); missing ones are listed")
    compare.add_argument("--accuracy", type=Path, metavar="RESULTS.json",
                         help="training-benchmark results: their accuracy is the quality axis of bubble.png")
    add_import_option(compare)
    compare.add_argument("--set", dest="settings", action="append", type=qualified_setting,
                         metavar="MECHANISM.OPTION=VALUE",
                         help="an option of one mechanism, also given to its peer library (repeatable); "
                              "attnzoo list --options names them")
    compare.add_argument("--no-sweep", action="store_true", help="skip the error against feature count sweep")
    compare.add_argument("--sweep-logit-stds", type=float_list, metavar="S,S,...",
                         help="spreads of the logits q.k/sqrt(d) the error sweep is measured at, q and k scaled "
                              "to each (default: 1 (the timing inputs), 0.25 (a flatter softmax))")
    compare.add_argument("--launch", choices=["fork", "subprocess"], default="fork",
                         help="fresh process per job: forked from a server that imported torch once (default) "
                              "or a new interpreter per job")
    output = compare.add_mutually_exclusive_group()
    output.add_argument("--quiet", action="store_true", help="no progress and no table (files are still written)")
    output.add_argument("--json", action="store_true", help="print results.json to stdout instead of the table")
    compare.set_defaults(run=compare_command)

"""``attnzoo lra``, ``attnzoo mqar`` and ``attnzoo seq2seq-report``: the training experiments
(:mod:`attnzoo.experiments`), many ``attnzoo train`` runs at one preset, each in a fresh process that imports the
same ``--import`` modules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict

from .common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_import_option,
    check_output_dir,
    float_list,
    import_modules,
    int_list,
    merged,
    name_list,
    options_by_mechanism,
    options_of,
    parse_options,
    parse_value,
    qualified_setting,
    retire,
    setting,
    usage_error,
)
from .train import name_option

RETIRED_BUDGET = "--preset quick|full"


def _line_progress(command: str, quiet: bool) -> Any:
    """A progress callback printing one line per finished cell to stderr (nothing when quiet)."""
    counts = {"total": 0, "done": 0}

    def set_total(total: int) -> None:
        counts["total"] = total

    def progress(label: str) -> None:
        counts["done"] += 1
        if not quiet:
            print(f"[{counts['done']}/{counts['total']}] {label}" if counts["total"] else f"{command}: {label}",
                  file=sys.stderr, flush=True)

    return progress, set_total


def lra_command(args: argparse.Namespace) -> int:
    from ..experiments.lra import LraConfig, has_curves, render_markdown, run_lra

    overrides: Dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    output = Path(args.output)
    try:
        imports = import_modules(args.imports)  # first: they register mechanisms --mechanisms may name
        config = LraConfig(preset=args.preset, mechanisms=args.mechanisms, tasks=args.tasks, threads=args.threads,
                           jobs=args.jobs, cell_timeout_s=args.cell_timeout, overrides=overrides,
                           options=options_by_mechanism(args.settings), imports=imports,
                           long_length=args.long_length, device=args.device)
        config.validate()
        check_output_dir("--output", output)
    except (TypeError, ValueError) as error:
        return usage_error("lra", name_option(str(error)))
    def report(data: Dict[str, Any]) -> None:
        print(render_markdown(data))
        curves = ", lra-curves.png" if has_curves(data) else ""
        print(f"wrote lra.json, lra.md, lra.png, lra-long.png{curves} and long-length/ to {output}/")

    return _run_cells("lra", args, run_lra, config, output, report)


def mqar_command(args: argparse.Namespace) -> int:
    from ..experiments.mqar import MQAR_CSV, MQAR_JSON, MQAR_MD, MQAR_PNG, MqarConfig, render_markdown, run_mqar

    output = Path(args.output)
    try:
        imports = import_modules(args.imports)  # first: they register mechanisms a --schedule may name
        config = MqarConfig(preset=args.preset, schedules=args.schedules, widths=args.widths, lrs=args.lrs,
                            steps=args.steps, threads=args.threads, jobs=args.jobs, cell_timeout_s=args.cell_timeout,
                            imports=imports, device=args.device)
        config.validate()
        check_output_dir("--output", output)
    except (TypeError, ValueError) as error:
        return usage_error("mqar", str(error))
    def report(data: Dict[str, Any]) -> None:
        print(render_markdown(data))
        print(f"wrote {MQAR_JSON}, {MQAR_CSV}, {MQAR_MD} and {MQAR_PNG} to {output}/")

    return _run_cells("mqar", args, run_mqar, config, output, report)


def _run_cells(command: str, args: argparse.Namespace, run: Callable[..., Dict[str, Any]], config: Any,
               output: Path, report: Callable[[Dict[str, Any]], None]) -> int:
    """What every cell experiment's command does once its settings are checked: progress lines, the run, a
    Ctrl-C that keeps the finished cells, and the table (``report``) or the JSON."""
    progress, set_total = _line_progress(command, args.quiet)
    try:
        data = run(config, output, ["attnzoo", command, *args.raw_argv], progress, set_total)
    except ValueError as error:
        return usage_error(command, str(error))
    except KeyboardInterrupt:
        print(f"attnzoo {command}: interrupted; finished cells are kept: run the same command to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(data, indent=2))
    elif not args.quiet:
        report(data)
    return EXIT_OK


def seq2seq_report_command(args: argparse.Namespace) -> int:
    from ..experiments.seq2seq_report import REPORT_MD, ReportConfig, run_report

    overrides: Dict[str, Any] = {}
    if args.steps is not None:  # a quick check of the command itself, not a report
        overrides.update(steps=args.steps, eval_interval=max(args.steps // 2, 1))
    if args.task_options:
        overrides["task_options"] = merged(args.task_options)
    output = Path(args.output)
    try:
        imports = import_modules(args.imports)
        mechanism = args.mechanism or "softmax"
        config = ReportConfig(preset=args.preset, jobs=args.jobs, threads=args.threads,
                              cell_timeout_s=args.cell_timeout, overrides=overrides, mechanism=mechanism,
                              options=options_of(mechanism, args.settings), imports=imports)
        config.validate()
        check_output_dir("--output", output)
        progress, _ = _line_progress("seq2seq-report", args.quiet)
        run_report(config, output, ["attnzoo", "seq2seq-report", *args.raw_argv], progress)
    except (TypeError, ValueError) as error:
        return usage_error("seq2seq-report", name_option(str(error)))
    except KeyboardInterrupt:
        print("attnzoo seq2seq-report: interrupted; finished runs are kept: run the same command to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if not args.quiet:
        print(f"wrote {REPORT_MD}, seq2seq-report.json and the figures to {output}/")
    return EXIT_OK


def _add_cell_options(parser: argparse.ArgumentParser, runs: str) -> None:
    """The options of how cells run, alike in every experiment."""
    parser.add_argument("--jobs", type=int, default=1, help=f"{runs} trained at once, each in its own process "
                                                             "(default 1; e.g. the number of cores)")
    parser.add_argument("--threads", type=int, help=f"torch threads per {runs[:-1]} (default: torch's choice; 1 "
                                                    "with --jobs > 1)")
    parser.add_argument("--cell-timeout", "--cell-time-limit", dest="cell_timeout", type=float, metavar="SECONDS",
                        help=f"wall-clock limit per {runs[:-1]}; one out of time is a row saying so (with its last "
                             "validation), its checkpoint kept for the same command to continue")
    add_import_option(parser)


def add_lra_command(commands: Any) -> None:
    lra = commands.add_parser(
        "lra", help="every mechanism on every task at one budget: accuracy table and bubble chart",
        description="Train every registered mechanism (or --mechanisms) on every task (or --tasks) with the same "
                    "settings per task, each cell an `attnzoo train` run in a fresh process under "
                    "OUTPUT/cells/. Writes lra.json (rows readable by attnzoo compare --accuracy), lra.md (the "
                    "accuracy table, baselines as the last row), lra.png (accuracy against training speed at the "
                    "tasks' lengths) and lra-long.png (accuracy against the speed and memory of each attention at "
                    "--long-length tokens, measured by the kernel benchmark into OUTPUT/long-length/); a preset that "
                    "validates more than once (full, long) also draws lra-curves.png (validation against step, "
                    "with the published figure where there is one). Rerunning "
                    "the same command continues an interrupted run: finished cells are kept, interrupted ones "
                    "resume from their checkpoint.")
    from ..experiments.lra import BUDGETS
    from ..experiments.lra_speed import DEFAULT_LONG_LENGTH

    lra.add_argument("--preset", choices=list(BUDGETS), default="quick",
                     help="quick: small models and a few hundred steps per cell (default); full: longer; long: "
                          "the Long Range Arena's lengths (ListOps 500-2,000 tokens, Pathfinder 32 x 32) at the "
                          "Nystromformer paper's small model, meant for a GPU")
    retire(lra, "--budget", RETIRED_BUDGET)
    lra.add_argument("--mechanisms", type=name_list, metavar="A,B,...", help="mechanisms (default: every one)")
    lra.add_argument("--set", dest="settings", action="append", type=qualified_setting,
                     metavar="MECHANISM.OPTION=VALUE", help="an option of one mechanism in every task (repeatable)")
    lra.add_argument("--tasks", type=name_list, metavar="A,B,...", help="tasks (default: every one)")
    lra.add_argument("--steps", type=int, help="override the preset's steps for every cell (for a quick check)")
    lra.add_argument("--long-length", type=parse_value, default=DEFAULT_LONG_LENGTH, metavar="TOKENS",
                     help="where lra-long.png measures speed and memory: every mechanism's attention "
                          "(forward+backward, the model's heads and width) at this many tokens, by the kernel "
                          f"benchmark, in the same run (default {DEFAULT_LONG_LENGTH})")
    _add_cell_options(lra, "cells")
    lra.add_argument("--device", help="cpu (default) or cuda[:N]: where every cell trains (several cells share one "
                                      "GPU with --jobs) and the long length is measured")
    lra.add_argument("--output", default="lra-results", metavar="DIR", help="default lra-results/")
    lra_output = lra.add_mutually_exclusive_group()
    lra_output.add_argument("--quiet", action="store_true", help="no progress and no table")
    lra_output.add_argument("--json", action="store_true", help="print lra.json to stdout")
    lra.set_defaults(run=lra_command)


def add_mqar_command(commands: Any) -> None:
    mqar = commands.add_parser(
        "mqar", help="Zoology's multi-query associative recall: accuracy against width and state size",
        description="Train every schedule (--schedule, or the preset's) at every model width and learning rate on "
                    "the mqar task, each cell an `attnzoo train` run in a fresh process under OUTPUT/cells/. Per "
                    "schedule and width the learning rate with the best validation accuracy is kept. Writes "
                    "mqar.json (every cell, the table, the settings), mqar.csv (the table), mqar.md and mqar.png "
                    "(test accuracy against width and against the decoding state's bytes per sequence). Rerunning "
                    "the same command continues an interrupted run: finished cells are kept, interrupted ones "
                    "resume from their checkpoint.")
    from ..experiments.mqar_presets import PRESETS

    mqar.add_argument("--preset", choices=list(PRESETS), default="quick",
                      help="quick: 8 pairs in 32 tokens, widths 16-64, 200 steps per cell, 24 cells in about 8 minutes "
                           "on 2 busy cores with --jobs 2 (default); medium: 32 pairs in 128 tokens, widths 64 and 128, "
                           "800 steps per cell, where the mechanisms separate on a CPU; full: Zoology's 64 pairs in 256 tokens, vocabulary 8,192, widths "
                           "64-256, meant for a GPU")
    mqar.add_argument("--schedule", dest="schedules", action="append", metavar="LAYERS",
                      help="a schedule of layers, as attnzoo train --layers takes it ('softmax', "
                           "'gated_delta,softmax'; repeatable; default: the preset's)")
    mqar.add_argument("--widths", type=int_list, metavar="W,W,...", help="model widths (default: the preset's)")
    mqar.add_argument("--lrs", type=float_list, metavar="LR,LR,...",
                      help="learning rates; the best on validation is kept (default: the preset's four)")
    mqar.add_argument("--steps", type=int, help="override the preset's steps for every cell")
    _add_cell_options(mqar, "cells")
    mqar.add_argument("--device", help="cpu (default) or cuda[:N]: where every cell trains (several cells share "
                                       "one GPU with --jobs)")
    mqar.add_argument("--output", default="mqar-results", metavar="DIR", help="default mqar-results/")
    output = mqar.add_mutually_exclusive_group()
    output.add_argument("--quiet", action="store_true", help="no progress and no table")
    output.add_argument("--json", action="store_true", help="print mqar.json to stdout")
    mqar.set_defaults(run=mqar_command)


def add_seq2seq_report_command(commands: Any) -> None:
    report = commands.add_parser(
        "seq2seq-report", help="the seq2seq comparisons (AT/NAT, scheduled sampling, copy, guide loss, beam)",
        description="Train every comparison of docs/seq2seq.md at one budget, each run an `attnzoo train` process "
                    "under OUTPUT/cells/, then measure them and write seq2seq-report.md, seq2seq-report.json and "
                    "the figures. Rerunning the same command continues: finished runs are kept, interrupted ones "
                    "resume from their checkpoint.")
    from ..experiments.seq2seq_report import BUDGETS

    report.add_argument("--preset", choices=list(BUDGETS), default="quick",
                        help="quick: tiny models, about 15 minutes on 2 busy cores with --jobs 2 (default); "
                             "full: longer")
    retire(report, "--budget", RETIRED_BUDGET)
    report.add_argument("--mechanism", help="the attention mechanism of every run (default softmax)")
    report.add_argument("--set", dest="settings", action="append", type=setting, metavar="OPTION=VALUE",
                        help="an option of the mechanism (repeatable)")
    _add_cell_options(report, "runs")
    report.add_argument("--output", default="seq2seq-report", metavar="DIR", help="default seq2seq-report/")
    report.add_argument("--quiet", action="store_true", help="no progress")
    report.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # checks of the command itself
    report.add_argument("--task-options", type=parse_options, action="append", help=argparse.SUPPRESS)
    report.set_defaults(run=seq2seq_report_command)

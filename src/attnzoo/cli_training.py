"""``attnzoo train``, ``attnzoo eval`` and ``attnzoo lra``: train a model on a task, score a saved one, and
train every mechanism on every task at one budget.

Usage errors (an unknown task, mechanism or option, a bad value, a checkpoint that is missing, corrupt or made
for another configuration) are one line on stderr and exit code 2, found before any training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130

# Command-line option -> TrainConfig field, for every training setting (all default to None: "not given").
TRAIN_OPTIONS = {
    "--dim": "dim", "--depth": "depth", "--heads": "heads", "--ff-dim": "ff_dim", "--dropout": "dropout",
    "--positional": "positional", "--pooling": "pooling", "--batch-size": "batch_size", "--steps": "steps",
    "--lr": "lr", "--warmup-steps": "warmup_steps", "--min-lr-ratio": "min_lr_ratio",
    "--weight-decay": "weight_decay", "--grad-clip": "grad_clip", "--precision": "precision", "--seed": "seed",
    "--eval-interval": "eval_interval", "--eval-batches": "eval_batches",
    "--label-smoothing": "label_smoothing", "--scheduled-sampling": "scheduled_sampling",
    "--sampling-decay": "sampling_decay", "--sampling-k": "sampling_k",
    "--sampling-min-teacher": "sampling_min_teacher", "--guide-loss": "guide_loss", "--guide-width": "guide_width",
    "--decoding": "decoding", "--length-mode": "length_mode", "--length-loss": "length_loss",
    "--block": "block",
}
# Command-line option -> DecoderSettings / MonotonicInference field: the decoder of a seq2seq task's decoded
# metrics, chosen at train and eval time alike and never part of the training config.
DECODER_OPTIONS = {
    "--beam-size": "beam_size", "--length-penalty": "length_penalty", "--sampling-temperature": "temperature",
    "--top-k": "top_k", "--top-p": "top_p", "--sampling-seed": "seed", "--monotonic-ahead": "ahead",
    "--monotonic-behind": "behind",
}
# Switches: on when given (store_const True), otherwise None ("not given").
TRAIN_FLAGS = {"--copy-mechanism": "copy_mechanism", "--token-shift": "token_shift"}
OPTION_OF_FIELD = {field: option for option, field in {**TRAIN_OPTIONS, **TRAIN_FLAGS}.items()}
OPTION_OF_FIELD.update(task="TASK", mechanism="--mechanism", mechanism_options="--mechanism-options",
                       task_options="--task-options", block_options="--block-options")


def parse_value(raw: str) -> Any:
    """A command-line value: true/false, none, an int, a float, else the string itself."""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(text: str) -> Dict[str, Any]:
    """Options given as a JSON object (``'{"nb_features": 64}'``) or as ``key=value`` pairs separated by commas
    (``nb_features=64,orthogonal=false``)."""
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


def _merged(groups: Optional[List[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    if not groups:
        return None
    merged: Dict[str, Any] = {}
    for group in groups:
        merged.update(group)
    return merged


def _usage_error(command: str, message: str) -> int:
    print(f"attnzoo {command}: error: {'; '.join(l.strip() for l in str(message).splitlines() if l.strip())}",
          file=sys.stderr)
    return EXIT_USAGE


def _given_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """The TrainConfig fields the command line set explicitly."""
    given = {field: getattr(args, field) for field in (*TRAIN_OPTIONS.values(), *TRAIN_FLAGS.values())
             if getattr(args, field) is not None}
    if args.task is not None:
        given["task"] = args.task
    if args.mechanism is not None:
        given["mechanism"] = args.mechanism
    for name in ("mechanism_options", "task_options", "block_options"):
        merged = _merged(getattr(args, name))
        if merged is not None:
            given[name] = merged
    return given


def _format_metrics(metrics: Dict[str, float]) -> str:
    shown = {k: v for k, v in metrics.items() if k != "scored"}
    return ", ".join(f"{k} {v:.4f}" for k, v in shown.items())


def _tasks_epilog() -> str:
    from .tasks import available, task_class, task_options

    lines = ["tasks (options for --task-options, with their defaults):"]
    for name in available():
        cls = task_class(name)
        options = ", ".join(f"{k}={v!r}" for k, v in task_options(name).items())
        lines.append(f"  {name:<11} {cls.summary}")
        lines.append(f"  {'':<11} {cls.kind}, metric {cls.metric}; {options}")
    return "\n".join(lines)


def _add_decoder_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "decoding", "seq2seq tasks: the decoder of the decoded metrics (exact match, token error rate, BLEU, "
                    "ms per sentence); greedy unless one of these is given")
    group.add_argument("--beam-size", dest="decoder_beam_size", metavar="N", type=int,
                       help="beam search with this many beams")
    group.add_argument("--length-penalty", dest="decoder_length_penalty", metavar="X", type=float,
                       help="beam search: scores divided by length ** this (default 1.0)")
    group.add_argument("--sampling-temperature", dest="decoder_temperature", metavar="T", type=float,
                       help="sampling at this temperature (seeded: --sampling-seed)")
    group.add_argument("--top-k", dest="decoder_top_k", metavar="K", type=int,
                       help="sampling: keep the k likeliest tokens")
    group.add_argument("--top-p", dest="decoder_top_p", metavar="P", type=float,
                       help="sampling: nucleus of this probability")
    group.add_argument("--sampling-seed", dest="decoder_seed", metavar="SEED", type=int,
                       help="sampling: the generator's seed (default 0)")
    group.add_argument("--monotonic-inference", action="store_true",
                       help="hold the cross-attention to a window that moves left to right with its focus "
                            "(any decoder)")
    group.add_argument("--monotonic-ahead", dest="decoder_ahead", metavar="N", type=int,
                       help="monotonic: source positions visible past the focus (default 3)")
    group.add_argument("--monotonic-behind", dest="decoder_behind", metavar="N", type=int,
                       help="monotonic: positions visible before the focus (default 0)")


def _check_decoder_fits(decoding: Any, run: Dict[str, Any]) -> None:
    """Refuse, before training, a decoder the run's model cannot decode with (its evaluations would fail)."""
    from .training.decoders import GREEDY

    if run.get("decoding", "autoregressive") != "autoregressive" and decoding != GREEDY:
        raise ValueError(f"a --decoding {run['decoding']!r} model decodes in one parallel pass: the decoder "
                         f"options ({decoding.describe()}) are for autoregressive models")
    if run.get("copy_mechanism") and decoding.monotonic is not None:
        raise ValueError("--monotonic-inference holds the cross-attention to a window, but the copy mechanism's "
                         "own attention reads every source position: leave it off with --copy-mechanism")


def _decoder_settings(args: argparse.Namespace, task: Optional[str]) -> Any:
    """The :class:`DecoderSettings` the decoding options ask for (greedy when none is given) for a run on
    ``task`` (None: not known yet, not checked); errors name the option."""
    from .models.monotonic import MonotonicInference
    from .tasks import task_class
    from .training import DecoderSettings

    given = {field: getattr(args, "decoder_" + field) for field in DECODER_OPTIONS.values()
             if getattr(args, "decoder_" + field) is not None}
    window = {field: given.pop(field) for field in ("ahead", "behind") if field in given}
    if window and not args.monotonic_inference:
        raise ValueError("--monotonic-ahead / --monotonic-behind set the window of --monotonic-inference: give it")
    if (given or args.monotonic_inference) and task is not None and task_class(task).kind != "seq2seq":
        raise ValueError(f"the decoding options apply to seq2seq tasks only; {task} is {task_class(task).kind!r}")
    beam = bool({"beam_size", "length_penalty"} & set(given))
    if beam and len(given) > len({"beam_size", "length_penalty"} & set(given)):
        raise ValueError("--beam-size / --length-penalty (beam search) and --sampling-temperature / --top-k / "
                         "--top-p / --sampling-seed (sampling) choose different decoders: give one kind")
    try:
        monotonic = MonotonicInference(**window) if args.monotonic_inference else None
        return DecoderSettings("beam" if beam else "sample" if given else "greedy", monotonic=monotonic, **given)
    except (TypeError, ValueError) as error:
        message = str(error)
        for option, field in DECODER_OPTIONS.items():
            if message.startswith(field + " "):
                message = option + message[len(field):]
        raise ValueError(message) from None


def train_command(args: argparse.Namespace) -> int:
    from .mechanisms import UnsupportedOptionError, available
    from .tasks import available as tasks_available
    from .training import CheckpointError, TrainConfig, keep_freed_memory, train
    from .training.checkpoint import find_checkpoint, read_config
    from .parallel.data import launched_by_torchrun, start_from_environment, stop
    from .training import data_parallel_reasons

    given = _given_settings(args)
    output = args.output
    try:
        if args.resume is not None:
            output = args.resume
            saved = read_config(find_checkpoint(args.resume))["train"]
            conflicts = [f"{OPTION_OF_FIELD.get(key, key)} {value!r} (the checkpoint has {saved.get(key)!r})"
                         for key, value in given.items() if saved.get(key) != value]
            if conflicts:
                raise ValueError(f"--resume {args.resume} continues the run as it was configured; these differ: "
                                 + ", ".join(conflicts))
            config = None
            decoding = _decoder_settings(args, saved["task"])
        else:
            if args.task is None:
                raise ValueError(f"give a TASK ({', '.join(tasks_available())}) or --resume DIR")
            if args.task not in tasks_available():
                raise ValueError(f"unknown task {args.task!r}; valid: {', '.join(tasks_available())}")
            mechanism = given.get("mechanism", "softmax")
            if mechanism not in available():
                raise ValueError(f"--mechanism: unknown mechanism {mechanism!r}; valid: {', '.join(available())}")
            try:
                config = TrainConfig(**given)
            except (TypeError, ValueError) as error:
                raise ValueError(_name_option(str(error))) from None
            decoding = _decoder_settings(args, config.task)
            if output is None:
                output = f"runs/{config.task}-{config.model_label}"
            _check_buildable(config)
            if Path(output, "checkpoints").exists():
                raise ValueError(f"--output {output} already holds a run: resume it with --resume {output}, "
                                 "or choose another --output")
        _check_decoder_fits(decoding, saved if config is None else config.as_dict())
        if launched_by_torchrun():  # data parallel: settings it cannot honour fail here, on every rank
            world = int(os.environ["WORLD_SIZE"])
            reasons = data_parallel_reasons(config or TrainConfig.from_dict(saved), world)
            if reasons:
                raise ValueError(f"torchrun with {world} processes: " + "; ".join(map(_name_option, reasons)))
    except (ValueError, TypeError, CheckpointError, UnsupportedOptionError) as error:
        return _usage_error("train", str(error))

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    keep_freed_memory()  # each step reuses the last one's pages instead of faulting in fresh ones
    command = ["attnzoo", "train", *args.raw_argv]
    parallel = start_from_environment()
    main = parallel is None or parallel.is_main
    try:
        result = train(config, output, resume=args.resume is not None, progress=not args.quiet and main,
                       command=command, parallel=parallel, decoding=decoding)
    except KeyboardInterrupt:
        if not main:
            return EXIT_INTERRUPTED
        print(f"attnzoo train: interrupted; the last finished step is saved: resume with "
              f"attnzoo train --resume {output}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CheckpointError as error:
        return _usage_error("train", str(error))
    finally:
        stop(parallel)
    if not main:  # rank 0 reports for the whole data-parallel run
        return EXIT_OK
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return EXIT_OK
    metric = "accuracy" if "accuracy" in result.test else "bits_per_byte"
    print(f"{result.config.model_label} on {result.config.task}: {result.steps} steps, {result.parameters:,} "
          f"parameters, {result.train_seconds:.1f} s ({result.tokens_per_second:,.0f} tokens/s)")
    print(f"  validation: {_format_metrics(result.validation)}")
    print(f"  test:       {_format_metrics(result.test)}")
    if "bleu" in result.test:
        print(f"  decoder:    {decoding.describe()}")
    print(f"  baseline:   {metric} {result.baseline[metric]:.4f} "
          f"({'majority class' if metric == 'accuracy' else 'unigram entropy'} of the test split)")
    print(f"wrote checkpoints/, metrics.csv and results.json to {output}/")
    return EXIT_OK


def _name_option(message: str) -> str:
    """Put the command-line spelling on a TrainConfig field named at the start of an error message."""
    for field, option in sorted(OPTION_OF_FIELD.items(), key=lambda item: -len(item[0])):
        if message.startswith(field + " "):
            return option + message[len(field):]
    return message


def _check_buildable(config: Any) -> None:
    """Build the task and the model once, so that bad task or mechanism options fail before training starts."""
    import torch

    from .tasks import load
    from .training import build_model

    try:
        task = load(config.task, **config.task_options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--task-options: {error}") from None
    with torch.random.fork_rng(devices=[]):
        try:
            build_model(config, task)
        except TypeError as error:
            options = "--mechanism-options" if config.block == "attention" else "--block-options"
            raise ValueError(f"{options}: {error}") from None
        except ValueError as error:  # a setting that does not fit the task (scheduled sampling off seq2seq)
            raise ValueError(_name_option(str(error))) from None


def eval_command(args: argparse.Namespace) -> int:
    from .training import CheckpointError, evaluate_checkpoint
    from .training.checkpoint import find_checkpoint, read_config

    try:
        saved = read_config(find_checkpoint(args.checkpoint)).get("train")
        decoding = _decoder_settings(args, saved.get("task") if isinstance(saved, dict) else None)
        report = evaluate_checkpoint(args.checkpoint, args.split, decoding)
    except (CheckpointError, ValueError, TypeError) as error:
        return _usage_error("eval", str(error))
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    metrics, baseline = report["metrics"], report["baseline"]
    model = report["mechanism"] if report["block"] == "attention" else report["block"]  # as TrainConfig.model_label
    print(f"{model} on {report['task']} ({report['split']} split): {_format_metrics(metrics)}")
    print("  baseline: " + ", ".join(f"{k} {v:.4f}" for k, v in baseline.items()))
    if "decoder" in report:
        print(f"  decoder:  {report['decoder']}")
    return EXIT_OK


def _names(text: str) -> List[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def lra_command(args: argparse.Namespace) -> int:
    from .bench.lra import LraConfig, run_lra

    overrides: Dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    config = LraConfig(budget=args.budget, mechanisms=args.mechanisms, tasks=args.tasks, threads=args.threads,
                       jobs=args.jobs, cell_timeout_s=args.cell_timeout, overrides=overrides)
    output = Path(args.output)
    try:
        config.validate()
    except (TypeError, ValueError) as error:
        return _usage_error("lra", _name_option(str(error)))
    total = {"n": 0, "done": 0}

    def set_total(n: int) -> None:
        total["n"] = n

    def progress(label: str) -> None:
        total["done"] += 1
        if not args.quiet:
            print(f"[{total['done']}/{total['n']}] {label}", file=sys.stderr, flush=True)

    try:
        data = run_lra(config, output, ["attnzoo", "lra", *args.raw_argv], progress, set_total)
    except ValueError as error:
        return _usage_error("lra", str(error))
    except KeyboardInterrupt:
        print(f"attnzoo lra: interrupted; finished cells are kept: run the same command to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(data, indent=2))
    elif not args.quiet:
        from .bench.lra import render_markdown

        print(render_markdown(data))
        print(f"wrote lra.json, lra.md and lra.png to {output}/")
    return EXIT_OK


def add_training_commands(commands: Any) -> None:
    """The ``train``, ``eval`` and ``lra`` subcommands, added to the ``attnzoo`` parser's subparsers."""
    from .training import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}
    train = commands.add_parser(
        "train", help="train a model on a task (listops, pathfinder, bytes, recall, g2p, copy, ...)",
        description="Train a classifier, tagger or language model with one attention mechanism on a task; "
                    "evaluates on the validation split every --eval-interval steps (writing an atomic "
                    "checkpoint each time), then on the test split. Writes checkpoints/, metrics.csv and "
                    "results.json (with this command line) to --output.",
        epilog=_tasks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("task", nargs="?", metavar="TASK", help="the task (listed below)")
    train.add_argument("--mechanism", help="attention mechanism (default softmax; attnzoo list names them)")
    train.add_argument("--mechanism-options", type=parse_options, action="append", metavar="OPTIONS",
                       help="mechanism options as JSON or KEY=VALUE,... (repeatable)")
    train.add_argument("--block-options", type=parse_options, action="append", metavar="OPTIONS",
                       help="options of the gated units of --block gau|flash (shared_dim, expansion_dim, scores, "
                            "chunk_size) as JSON or KEY=VALUE,... (repeatable)")
    train.add_argument("--task-options", type=parse_options, action="append", metavar="OPTIONS",
                       help="task options as JSON or KEY=VALUE,... (repeatable), e.g. num_pairs=32,seed=1")
    numeric = {"--dropout": float, "--lr": float, "--min-lr-ratio": float, "--weight-decay": float,
               "--grad-clip": float, "--label-smoothing": float, "--sampling-k": float,
               "--sampling-min-teacher": float, "--guide-loss": float, "--guide-width": float,
               "--length-loss": float}
    choices = {"--positional": ["sinusoidal", "learned", "rotary", "none"], "--pooling": ["mean", "cls"],
               "--precision": ["float32", "bfloat16"], "--scheduled-sampling": ["none", "token", "two-pass"],
               "--sampling-decay": ["linear", "exponential", "inverse-sigmoid"],
               "--decoding": ["autoregressive", "non-autoregressive"], "--length-mode": ["predicted", "max"],
               "--block": ["attention", "gau", "flash"]}
    for option, field in TRAIN_OPTIONS.items():
        default = defaults[field]
        if option in choices:
            train.add_argument(option, dest=field, choices=choices[option], help=f"default {default}")
        else:
            train.add_argument(option, dest=field, type=numeric.get(option, int), help=f"default {default}")
    train.add_argument("--copy-mechanism", dest="copy_mechanism", action="store_const", const=True,
                       help="seq2seq: a pointer-generator output that can copy source tokens (See et al. 2017)")
    train.add_argument("--token-shift", dest="token_shift", action="store_const", const=True,
                       help="half of each position's embedding features come from the token before it "
                            "(RWKV's token shift); not for seq2seq tasks")
    train.add_argument("--output", metavar="DIR", help="run directory (default runs/TASK-MECHANISM)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint "
                                                       "(its settings are kept; options given must match)")
    train.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_decoder_options(train)
    train.set_defaults(run=train_command)

    evaluate = commands.add_parser("eval", help="score a saved model on a split of its task",
                                   description="Rebuild the model of a checkpoint written by attnzoo train and "
                                               "report its loss and metric beside the task's baseline.")
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                          help="a run directory (its latest checkpoint) or a checkpoint directory")
    evaluate.add_argument("--split", default="test", choices=["train", "validation", "test"])
    evaluate.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_decoder_options(evaluate)
    evaluate.set_defaults(run=eval_command)

    lra = commands.add_parser(
        "lra", help="every mechanism on every task at one budget: accuracy table and bubble chart",
        description="Train every registered mechanism (or --mechanisms) on every task (or --tasks) with the same "
                    "settings per task, each cell an `attnzoo train` run in a fresh process under "
                    "OUTPUT/cells/. Writes lra.json (rows readable by attnzoo compare --accuracy), lra.md (the "
                    "accuracy table, baselines as the last row) and lra.png. Rerunning the same command continues "
                    "an interrupted run: finished cells are kept, interrupted ones resume from their checkpoint.")
    lra.add_argument("--budget", choices=["quick", "full"], default="quick",
                     help="quick: small models and a few hundred steps per cell (default); full: longer")
    lra.add_argument("--mechanisms", type=_names, metavar="A,B,...", help="mechanisms (default: every one)")
    lra.add_argument("--tasks", type=_names, metavar="A,B,...", help="tasks (default: every one)")
    lra.add_argument("--steps", type=int, help="override the budget's steps for every cell (for a quick check)")
    lra.add_argument("--jobs", type=int, default=1, help="cells trained at once, each in its own process "
                                                          "(default 1; e.g. the number of cores)")
    lra.add_argument("--threads", type=int, help="torch threads per cell (default: torch's choice; 1 with --jobs > 1)")
    lra.add_argument("--cell-timeout", type=float, metavar="SECONDS",
                     help="wall-clock limit per cell (quick: 1200, full: 7200); a slower cell is reported as too slow")
    lra.add_argument("--output", default="lra-results", metavar="DIR", help="default lra-results/")
    lra_output = lra.add_mutually_exclusive_group()
    lra_output.add_argument("--quiet", action="store_true", help="no progress and no table")
    lra_output.add_argument("--json", action="store_true", help="print lra.json to stdout")
    lra.set_defaults(run=lra_command)
    _add_seq2seq_report_command(commands)


def seq2seq_report_command(args: argparse.Namespace) -> int:
    from .bench.seq2seq_report import REPORT_MD, ReportConfig, run_report

    overrides: Dict[str, Any] = {}
    if args.steps is not None:  # a quick check of the command itself, not a report
        overrides.update(steps=args.steps, eval_interval=max(args.steps // 2, 1))
    if args.task_options:
        overrides["task_options"] = {k: v for options in args.task_options for k, v in options.items()}
    config = ReportConfig(budget=args.budget, jobs=args.jobs, threads=args.threads,
                          cell_timeout_s=args.cell_timeout, overrides=overrides)
    output = Path(args.output)
    try:
        config.validate()
        progress = None if args.quiet else (lambda line: print(f"seq2seq-report: {line}", file=sys.stderr,
                                                                flush=True))
        run_report(config, output, ["attnzoo", "seq2seq-report", *args.raw_argv], progress)
    except (TypeError, ValueError) as error:
        return _usage_error("seq2seq-report", _name_option(str(error)))
    except KeyboardInterrupt:
        print("attnzoo seq2seq-report: interrupted; finished runs are kept: run the same command to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if not args.quiet:
        print(f"wrote {REPORT_MD}, seq2seq-report.json and the figures to {output}/")
    return EXIT_OK


def _add_seq2seq_report_command(commands: Any) -> None:
    report = commands.add_parser(
        "seq2seq-report", help="the seq2seq comparisons (AT/NAT, scheduled sampling, copy, guide loss, beam)",
        description="Train every comparison of docs/seq2seq.md at one budget, each run an `attnzoo train` process "
                    "under OUTPUT/cells/, then measure them and write seq2seq-report.md, seq2seq-report.json and "
                    "the figures. Rerunning the same command continues: finished runs are kept, interrupted ones "
                    "resume from their checkpoint.")
    report.add_argument("--budget", choices=["quick", "full"], default="quick",
                        help="quick: tiny models, about 15 minutes on 2 busy cores with --jobs 2 (default); full: longer")
    report.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    report.add_argument("--threads", type=int, help="torch threads per training run (default: torch's choice; 1 "
                                                    "with --jobs > 1) and for the measurements (default 1)")
    report.add_argument("--cell-timeout", type=float, metavar="SECONDS", help="wall-clock limit per training run")
    report.add_argument("--output", default="seq2seq-report", metavar="DIR", help="default seq2seq-report/")
    report.add_argument("--quiet", action="store_true", help="no progress")
    report.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # checks of the command itself
    report.add_argument("--task-options", type=parse_options, action="append", help=argparse.SUPPRESS)
    report.set_defaults(run=seq2seq_report_command)

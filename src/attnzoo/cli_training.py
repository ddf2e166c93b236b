"""``attnzoo train``, ``attnzoo eval`` and ``attnzoo lra``: train a model on a task, score a saved one, and
train every mechanism on every task at one budget.

Usage errors (an unknown task, mechanism or option, a bad value, a checkpoint that is missing, corrupt or made
for another configuration) are one line on stderr and exit code 2, found before any training starts.
"""

from __future__ import annotations

import argparse
import json
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
    "--block": "block",
}
OPTION_OF_FIELD = {field: option for option, field in TRAIN_OPTIONS.items()}
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
    given = {field: getattr(args, field) for field in TRAIN_OPTIONS.values() if getattr(args, field) is not None}
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


def train_command(args: argparse.Namespace) -> int:
    from .mechanisms import UnsupportedOptionError, available
    from .tasks import available as tasks_available
    from .training import CheckpointError, TrainConfig, train
    from .training.checkpoint import find_checkpoint, read_config

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
            if output is None:
                output = f"runs/{config.task}-{config.mechanism if config.block == 'attention' else config.block}"
            _check_buildable(config)
            if Path(output, "checkpoints").exists():
                raise ValueError(f"--output {output} already holds a run: resume it with --resume {output}, "
                                 "or choose another --output")
    except (ValueError, TypeError, CheckpointError, UnsupportedOptionError) as error:
        return _usage_error("train", str(error))

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    command = ["attnzoo", "train", *args.raw_argv]
    try:
        result = train(config, output, resume=args.resume is not None, progress=not args.quiet, command=command)
    except KeyboardInterrupt:
        print(f"attnzoo train: interrupted; the last finished step is saved: resume with "
              f"attnzoo train --resume {output}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CheckpointError as error:
        return _usage_error("train", str(error))
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return EXIT_OK
    metric = "accuracy" if "accuracy" in result.test else "bits_per_byte"
    print(f"{result.config.model_label} on {result.config.task}: {result.steps} steps, {result.parameters:,} "
          f"parameters, {result.train_seconds:.1f} s ({result.tokens_per_second:,.0f} tokens/s)")
    print(f"  validation: {_format_metrics(result.validation)}")
    print(f"  test:       {_format_metrics(result.test)}")
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

    try:
        report = evaluate_checkpoint(args.checkpoint, args.split)
    except (CheckpointError, ValueError, TypeError) as error:
        return _usage_error("eval", str(error))
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    metrics, baseline = report["metrics"], report["baseline"]
    print(f"{report['mechanism'] if report['block'] == 'attention' else report['block']} on {report['task']} ({report['split']} split): {_format_metrics(metrics)}")
    print("  baseline: " + ", ".join(f"{k} {v:.4f}" for k, v in baseline.items()))
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
               "--sampling-min-teacher": float, "--guide-loss": float, "--guide-width": float}
    choices = {"--positional": ["sinusoidal", "learned", "rotary", "none"], "--pooling": ["mean", "cls"],
               "--precision": ["float32", "bfloat16"], "--scheduled-sampling": ["none", "token", "two-pass"],
               "--sampling-decay": ["linear", "exponential", "inverse-sigmoid"], "--block": ["attention", "gau", "flash"]}
    for option, field in TRAIN_OPTIONS.items():
        default = defaults[field]
        if option in choices:
            train.add_argument(option, dest=field, choices=choices[option], help=f"default {default}")
        else:
            train.add_argument(option, dest=field, type=numeric.get(option, int), help=f"default {default}")
    train.add_argument("--output", metavar="DIR", help="run directory (default runs/TASK-MECHANISM)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint "
                                                       "(its settings are kept; options given must match)")
    train.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--json", action="store_true", help="print the results as JSON")
    train.set_defaults(run=train_command)

    evaluate = commands.add_parser("eval", help="score a saved model on a split of its task",
                                   description="Rebuild the model of a checkpoint written by attnzoo train and "
                                               "report its loss and metric beside the task's baseline.")
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                          help="a run directory (its latest checkpoint) or a checkpoint directory")
    evaluate.add_argument("--split", default="test", choices=["train", "validation", "test"])
    evaluate.add_argument("--json", action="store_true", help="print the report as JSON")
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
                     help="wall-clock limit per cell (quick: 600, full: 7200); a slower cell is reported as too slow")
    lra.add_argument("--output", default="lra-results", metavar="DIR", help="default lra-results/")
    lra_output = lra.add_mutually_exclusive_group()
    lra_output.add_argument("--quiet", action="store_true", help="no progress and no table")
    lra_output.add_argument("--json", action="store_true", help="print lra.json to stdout")
    lra.set_defaults(run=lra_command)

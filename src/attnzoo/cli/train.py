"""``attnzoo train`` and ``attnzoo eval``: train a model with one attention mechanism on a task, and score a
saved one.

Usage errors (an unknown task, mechanism or option, a bad value, a checkpoint that is missing, corrupt or made
for another configuration) are one line on stderr and exit code 2, found before any training starts.

A mechanism of your own comes with ``--import MODULE_OR_PATH``; the run records it in ``OUTPUT/imports.json``,
so ``attnzoo train --resume OUTPUT`` and ``attnzoo eval OUTPUT`` import it again by themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..models.config import BLOCKS
from .common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_declared_flags,
    add_import_option,
    check_mechanism,
    check_output_dir,
    given_flags,
    import_modules,
    integer_at_least,
    merged,
    options_of,
    parse_options,
    setting,
    usage_error,
)

IMPORTS_JSON = "imports.json"  # in a run directory: the --import modules its mechanism needs

# The decoder of a seq2seq task's decoded metrics is chosen at train and eval time alike, by the flags that
# DecoderSettings and MonotonicInference declare, and is never part of the training config. Their values are
# stored under this prefix, apart from TrainConfig's (which has a seed of its own).
DECODING = "decoder_"
# The TrainConfig fields whose command-line form is written by hand (not one flag of the field's own name).
HAND_WRITTEN = {"task": "TASK", "mechanism": "--mechanism", "mechanism_options": "--set",
                "task_options": "--task-options", "block_options": "--block-options"}


def _flag_fields() -> List[str]:
    """The TrainConfig fields that are flags of attnzoo train, each declared in the config with its help."""
    from ..training import TrainConfig
    from ..training.settings import flags

    return [item.name for item, _ in flags(TrainConfig, "train")]


def option_of_field() -> Dict[str, str]:
    """TrainConfig field -> how the command line spells it, for messages."""
    from ..training import TrainConfig

    return {**_spellings(TrainConfig), **HAND_WRITTEN}


def _spellings(config_class: type) -> Dict[str, str]:
    """Field -> its flag, for the fields of ``config_class`` that are flags."""
    from ..training.settings import flag_spelling, settings_of

    return {item.name: flag_spelling(item) for item, declared in settings_of(config_class)
            if declared.flag is not False}


def _given_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """The TrainConfig fields the command line set explicitly."""
    given = {field: getattr(args, field) for field in _flag_fields() if getattr(args, field) is not None}
    if args.task is not None:
        given["task"] = args.task
    if args.mechanism is not None:
        given["mechanism"] = args.mechanism
    for name in ("task_options", "block_options"):
        groups = merged(getattr(args, name))
        if groups is not None:
            given[name] = groups
    if args.mechanism_options or args.settings:
        mechanism = args.mechanism or "softmax"
        given["mechanism_options"] = {**(merged(args.mechanism_options) or {}), **options_of(mechanism, args.settings)}
    return given


# -- mechanisms of your own, recorded with the run -----------------------------------------------------------
def recorded_imports(run: Path) -> List[str]:
    """The --import modules a run directory recorded (none if it recorded none)."""
    path = run / IMPORTS_JSON
    return list(json.loads(path.read_text())) if path.exists() else []


def record_imports(run: Path, imports: List[str]) -> None:
    """Record the run's imports (replacing, atomically, what a run stopped in ``run`` before recorded)."""
    path = run / IMPORTS_JSON
    if not imports:
        path.unlink(missing_ok=True)
        return
    run.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{IMPORTS_JSON}.partial")
    temporary.write_text(json.dumps(imports))
    os.replace(temporary, path)  # a kill never leaves a half-written list for --resume to read


def _import_for_run(run: Path, saved: Any, given: Optional[List[str]], option: str) -> List[str]:
    """Import what the run in ``run`` recorded and what the command line gives; the run's mechanism (of its
    saved train config ``saved``) must then be registered (else an error saying which --import is missing).
    Returns every import, portable."""
    from ..mechanisms import available

    imports = import_modules(list(dict.fromkeys(recorded_imports(run) + list(given or []))))
    mechanism = saved.get("mechanism", "softmax") if isinstance(saved, dict) else "softmax"
    if isinstance(saved, dict) and isinstance(saved.get("layers"), str):  # a schedule: its items' mechanisms
        try:
            _schedule(saved["layers"])
        except ValueError as error:
            raise ValueError(f"{option} {run}: the run's {error}; give --import MODULE_OR_PATH with the module "
                             "that registers it (the run recorded "
                             + (f"only {', '.join(imports)})" if imports else "none)")) from None
    elif isinstance(saved, dict) and saved.get("block", "attention") == "attention" and mechanism not in available():
        raise ValueError(f"{option} {run}: the run's mechanism {mechanism!r} is not registered: give --import "
                         "MODULE_OR_PATH with the module that registers it (the run recorded "
                         + (f"only {', '.join(imports)})" if imports else "none)"))
    return imports


def _schedule(text: str, name: str = "layers") -> str:
    """A ``--layers`` schedule in the one spelling a run records; an unknown item is an error naming it."""
    from ..models.schedule import format_schedule, parse_schedule

    return format_schedule(parse_schedule(text, BLOCKS, name))


def _format_metrics(metrics: Dict[str, float]) -> str:
    shown = {k: v for k, v in metrics.items() if k != "scored"}
    return ", ".join(f"{k} {v:.4f}" for k, v in shown.items())


def _add_decoder_options(parser: argparse.ArgumentParser, command: str) -> None:
    from ..training import DecoderSettings

    group = parser.add_argument_group(
        "decoding", "seq2seq tasks: the decoder of the decoded metrics (exact match, token error rate, BLEU, "
                    "ms per sentence); greedy unless one of these is given")
    add_declared_flags(group, DecoderSettings, command, prefix=DECODING)


def _check_decoder_fits(decoding: Any, run: Dict[str, Any]) -> None:
    """Refuse, before training, a decoder the run's model cannot decode with (its evaluations would fail)."""
    from ..training.decoders import GREEDY

    if run.get("decoding", "autoregressive") != "autoregressive" and decoding != GREEDY:
        raise ValueError(f"a --decoding {run['decoding']!r} model decodes in one parallel pass: the decoder "
                         f"options ({decoding.describe()}) are for autoregressive models")
    if run.get("copy_mechanism") and decoding.monotonic is not None:
        raise ValueError("--monotonic-inference holds the cross-attention to a window, but the copy mechanism's "
                         "own attention reads every source position: leave it off with --copy-mechanism")


def _decoder_settings(args: argparse.Namespace, task: Optional[str]) -> Any:
    """The :class:`DecoderSettings` the decoding options ask for (greedy when none is given) for a run on
    ``task`` (None: not known yet, not checked): the decoder is the one whose options are given (each option
    declares its decoder, ``owner``); errors name the option."""
    from ..models.monotonic import MonotonicInference
    from ..tasks import task_class
    from ..training import DecoderSettings
    from ..training.decoders import DECODER_NAMES, GREEDY

    given, window = given_flags(args, DecoderSettings, DECODING), given_flags(args, MonotonicInference, DECODING)
    monotonic = given.pop("monotonic", None)  # the switch; its window comes from MonotonicInference's own flags
    spelled = {**_spellings(DecoderSettings), **_spellings(MonotonicInference)}
    if window and not monotonic:
        raise ValueError(f"{' / '.join(_spellings(MonotonicInference).values())} set the window of "
                         f"{spelled['monotonic']}: give it")
    if (given or monotonic) and task is not None and task_class(task).kind != "seq2seq":
        raise ValueError(f"the decoding options apply to seq2seq tasks only; {task} is {task_class(task).kind!r}")
    owners = _owners(DecoderSettings)
    chosen = [decoder for decoder in DECODER_NAMES if decoder in {owners.get(field) for field in given}]
    if len(chosen) > 1:
        kinds = [f"{' / '.join(spelled[field] for field, owner in owners.items() if owner == decoder)} "
                 f"({DECODER_NAMES[decoder]})" for decoder in chosen]
        raise ValueError(f"{' and '.join(kinds)} choose different decoders: give one kind")
    try:
        settings = MonotonicInference(**window) if monotonic else None
        return DecoderSettings(chosen[0] if chosen else GREEDY.decoder, monotonic=settings, **given)
    except (TypeError, ValueError) as error:
        message = str(error)
        for field, option in spelled.items():
            if message.startswith(field + " "):
                message = option + message[len(field):]
        raise ValueError(message) from None


def _owners(config_class: type) -> Dict[str, str]:
    """Field -> the choice it is an option of (its declared ``owner``), in declaration order."""
    from ..training.settings import settings_of

    return {item.name: declared.owner for item, declared in settings_of(config_class) if declared.owner is not None}


def _resume_settings(args: argparse.Namespace, given: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The saved settings of the run ``--resume`` continues (refusing options that differ), and its imports. A
    run stopped before its first checkpoint is continued from the config it recorded (from step 0)."""
    from ..training.checkpoint import find_run

    check_output_dir("--resume", args.resume)
    checkpoint, recorded = find_run(args.resume)
    saved = recorded.get("train")
    if not isinstance(saved, dict):
        raise ValueError(f"--resume {args.resume}: its saved config does not describe a training run")
    run = Path(args.resume) if checkpoint is None else checkpoint.parent.parent  # OUTPUT/checkpoints/step-N
    imports = _import_for_run(run, saved, args.imports, "--resume")
    spelled = option_of_field()
    if given.get("layers") is not None:  # compared in the spelling the run recorded
        given = {**given, "layers": _schedule(given["layers"], "--layers")}
    conflicts = [f"{spelled.get(key, key)} {value!r} (the checkpoint has {saved.get(key)!r})"
                 for key, value in given.items() if saved.get(key) != value]
    if conflicts:
        raise ValueError(f"--resume {args.resume} continues the run as it was configured; these differ: "
                         + ", ".join(conflicts))
    return saved, imports


def _new_config(args: argparse.Namespace, given: Dict[str, Any]) -> Tuple[Any, Any]:
    """The TrainConfig of a new run, every setting checked and the model built once (before training), and
    its task, loaded for that check (training takes it rather than generating the data again)."""
    from ..tasks import available as tasks_available
    from ..training import TrainConfig

    if args.task is None:
        raise ValueError(f"give a TASK ({', '.join(tasks_available())}) or --resume DIR")
    if args.task not in tasks_available():
        raise ValueError(f"unknown task {args.task!r}; valid: {', '.join(tasks_available())}")
    check_mechanism(given.get("mechanism", "softmax"))
    try:
        config = TrainConfig(**given)
    except (TypeError, ValueError) as error:
        raise ValueError(name_option(str(error))) from None
    return config, _check_buildable(config)


def _prepare_run(args: argparse.Namespace) -> Tuple[Any, Any, str, List[str], Any, Any]:
    """(config or None when resuming, decoder settings, output directory, imports, the loaded task or None when
    resuming, the device or None), every usage error raised."""
    from ..training import TrainConfig
    from ..parallel.data import launched_by_torchrun
    from ..training import data_parallel_reasons

    if args.resume is not None:
        given = _given_settings(args)
        saved, imports = _resume_settings(args, given)
        config, output, task = None, args.resume, None
        decoding = _decoder_settings(args, saved["task"])
    else:
        imports = import_modules(args.imports)  # first: they register mechanisms --mechanism may name
        config, task = _new_config(args, _given_settings(args))
        saved = config.as_dict()
        decoding = _decoder_settings(args, config.task)
        output = args.output or f"runs/{config.task}-{config.model_label}"
        check_output_dir("--output", output)
        if Path(output, "checkpoints", "LATEST").exists():
            raise ValueError(f"--output {output} already holds a run: resume it with --resume {output}, "
                             "or choose another --output")
    _check_decoder_fits(decoding, saved)
    if launched_by_torchrun():  # data parallel: settings it cannot honour fail here, on every rank
        world = int(os.environ["WORLD_SIZE"])
        reasons = data_parallel_reasons(config or TrainConfig.from_dict(saved), world)
        if reasons:
            raise ValueError(f"torchrun with {world} processes: " + "; ".join(map(name_option, reasons)))
    return config, decoding, output, imports, task, _training_device(args.device, saved["task"])


def _training_device(device: Optional[str], task_name: str) -> Any:
    """--device as a torch.device (None when not given), or a usage error naming it."""
    from ..parallel.data import launched_by_torchrun
    from ..tasks import task_class
    from ..training.loop import training_device

    if device is None:
        return None
    if launched_by_torchrun():
        raise ValueError("--device cannot be combined with torchrun: each rank trains on the device torchrun gives it")
    try:
        chosen = training_device(device)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    if chosen.type != "cpu" and task_class(task_name).kind == "seq2seq":
        raise ValueError(f"--device {device}: {task_name} is a seq2seq task, and seq2seq tasks train on the CPU only")
    return chosen


def train_command(args: argparse.Namespace) -> int:
    from ..mechanisms import UnsupportedOptionError
    from ..training import CheckpointError, keep_freed_memory, train
    from ..parallel.data import start_from_environment, stop

    from ..training.checkpoint import stopped_before_first_checkpoint

    try:
        config, decoding, output, imports, task, device = _prepare_run(args)
    except (ValueError, TypeError, CheckpointError, UnsupportedOptionError) as error:
        return usage_error("train", str(error))
    finished = _finished_step(output) if args.resume is not None else None
    if finished is not None:
        print(f"attnzoo train: the run in {output} is complete ({finished} of {finished} steps); its results are "
              f"in {Path(output) / 'results.json'} (attnzoo eval {output} measures it again)", file=sys.stderr)
        return EXIT_OK
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    keep_freed_memory()  # each step reuses the last one's pages instead of faulting in fresh ones
    command = ["attnzoo", "train", *args.raw_argv]
    parallel = start_from_environment()
    main = parallel is None or parallel.is_main
    if main:
        if stopped_before_first_checkpoint(output):  # what it wrote is replaced: nothing it did is lost
            print(f"attnzoo train: {output} holds a run stopped before its first checkpoint; starting it afresh"
                  + ("" if args.resume is not None else " with these settings"), file=sys.stderr)
        record_imports(Path(output), imports)
    try:
        result = train(config, output, resume=args.resume is not None, progress=not args.quiet and main,
                       command=command, parallel=parallel, decoding=decoding, task=task, device=device)
    except KeyboardInterrupt:
        if main:
            print(f"attnzoo train: interrupted; the last finished step is saved: resume with "
                  f"attnzoo train --resume {output}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (CheckpointError, ValueError) as error:  # settings that only fail once the run is built
        return usage_error("train", name_option(str(error)))
    finally:
        stop(parallel)
    if main:  # rank 0 reports for the whole data-parallel run
        _print_result(result, decoding, output, args.json)
    return EXIT_OK


def _finished_step(output: str) -> Optional[int]:
    """The run's step count when the run in ``output`` took every step its checkpoint's settings ask for and
    wrote its results, else None."""
    from ..training.checkpoint import CHECKPOINTS, LATEST, find_checkpoint, read_config
    from ..training.loop import RESULTS_JSON

    try:
        step = json.loads((Path(output) / CHECKPOINTS / LATEST).read_text())["step"]
        steps = read_config(find_checkpoint(output))["train"]["steps"]
    except Exception:  # noqa: BLE001 - anything unreadable: the resume itself reports it
        return None
    done = isinstance(step, int) and step >= steps and (Path(output) / RESULTS_JSON).is_file()
    return steps if done else None


def _print_result(result: Any, decoding: Any, output: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
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


def name_option(message: str) -> str:
    """Put the command-line spelling on a TrainConfig field named at the start of an error message."""
    for field, option in sorted(option_of_field().items(), key=lambda item: -len(item[0])):
        if message.startswith(field + " "):
            return option + message[len(field):]
    return message


def _check_buildable(config: Any) -> Any:
    """Build the task and the model once, so that bad task or mechanism options fail before training starts;
    returns the task."""
    import torch

    from ..mechanisms import check_option_names
    from ..tasks import load
    from ..training import build_model, check_length_grouping

    if config.layers is None and config.block == "attention":
        try:  # a misspelt option fails before the task's data is generated (seconds for some tasks)
            check_option_names(config.mechanism, config.mechanism_options)
        except TypeError as error:
            raise ValueError(f"--set: {error}") from None
    try:
        task = load(config.task, **config.task_options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--task-options: {error}") from None
    with torch.random.fork_rng(devices=[]):
        try:
            check_length_grouping(config, task, build_model(config, task))
        except TypeError as error:
            if config.layers is not None:  # an item's options, the error naming the item
                raise ValueError(name_option(str(error))) from None
            options = "--set" if config.block == "attention" else "--block-options"
            raise ValueError(f"{options}: {error}") from None
        except ValueError as error:  # a setting that does not fit the task (scheduled sampling off seq2seq)
            raise ValueError(name_option(str(error))) from None
    return task


def eval_command(args: argparse.Namespace) -> int:
    from ..training import CheckpointError, evaluate_checkpoint
    from ..training.checkpoint import find_checkpoint, read_config

    try:
        checkpoint = find_checkpoint(args.checkpoint)
        saved = read_config(checkpoint).get("train")
        _import_for_run(checkpoint.parent.parent, saved, args.imports, "CHECKPOINT_DIR")
        task_name = saved.get("task") if isinstance(saved, dict) else None
        decoding = _decoder_settings(args, task_name)
        device = _training_device(args.device, task_name) if task_name is not None else None
        report = evaluate_checkpoint(args.checkpoint, args.split, decoding, device, progress=not args.json)
    except (CheckpointError, ValueError, TypeError) as error:
        return usage_error("eval", str(error))
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    metrics, baseline = report["metrics"], report["baseline"]
    model = report["model"]  # TrainConfig.model_label
    print(f"{model} on {report['task']} ({report['split']} split): {_format_metrics(metrics)}")
    print("  baseline: " + ", ".join(f"{k} {v:.4f}" for k, v in baseline.items()))
    if "decoder" in report:
        print(f"  decoder:  {report['decoder']}")
    return EXIT_OK



def _tasks_epilog() -> str:
    from ..tasks import available, task_class, task_options

    lines = ["tasks (options for --task-options, with their defaults):"]
    for name in available():
        cls = task_class(name)
        options = ", ".join(f"{k}={v!r}" for k, v in task_options(name).items())
        lines.append(f"  {name:<11} {cls.summary}")
        lines.append(f"  {'':<11} {cls.kind}, metric {cls.metric}; {options}")
    return "\n".join(lines)


def _add_model_options(train: argparse.ArgumentParser) -> None:
    """TASK, the mechanism and its options, and every TrainConfig setting (each defaults to "not given")."""
    from ..training import TrainConfig

    train.add_argument("task", nargs="?", metavar="TASK", help="the task (listed below)")
    train.add_argument("--mechanism", help="attention mechanism (default softmax; attnzoo list names them)")
    train.add_argument("--set", dest="settings", action="append", type=setting, metavar="OPTION=VALUE",
                       help="an option of the mechanism (repeatable; MECHANISM.OPTION=VALUE is accepted too); "
                            "attnzoo list --options names them")
    train.add_argument("--mechanism-options", type=parse_options, action="append", metavar="OPTIONS",
                       help="the same as --set, several at once: JSON or KEY=VALUE,... (repeatable)")
    add_import_option(train)
    gated = [block for block in BLOCKS if block != "attention"]
    train.add_argument("--block-options", type=parse_options, action="append", metavar="OPTIONS",
                       help=f"options of the blocks of --block {'|'.join(gated)} (gated units: shared_dim, "
                            "expansion_dim, scores, chunk_size; mamba2: state_dim, expansion, conv_size, groups, "
                            "chunk_size; mla: head_dim, latent_dim, rope_dim, q_latent_dim, rotary_base, bias) as "
                            "JSON or KEY=VALUE,... (repeatable)")
    train.add_argument("--task-options", type=parse_options, action="append", metavar="OPTIONS",
                       help="task options as JSON or KEY=VALUE,... (repeatable), e.g. num_pairs=32,seed=1")
    add_declared_flags(train, TrainConfig, "train")


def add_train_command(commands: Any) -> None:
    train = commands.add_parser(
        "train", help="train a model on a task (listops, pathfinder, bytes, recall, g2p, copy, ...)",
        description="Train a classifier, tagger or language model with one attention mechanism on a task; "
                    "evaluates on the validation split every --eval-interval steps (writing an atomic "
                    "checkpoint each time), then on the test split. Writes checkpoints/, metrics.csv and "
                    "results.json (with this command line) to --output.",
        epilog=_tasks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_options(train)
    train.add_argument("--output", metavar="DIR", help="run directory (default runs/TASK-MECHANISM)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint "
                                                       "(its settings are kept; options given must match)")
    train.add_argument("--threads", type=integer_at_least(1), help="torch threads (default: torch's choice)")
    train.add_argument("--device", help="cpu (default) or cuda[:N]: where the run trains (classify, tag and lm "
                                        "tasks; a resumed run may change it)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_decoder_options(train, "train")
    train.set_defaults(run=train_command)


def add_eval_command(commands: Any) -> None:
    evaluate = commands.add_parser("eval", help="score a saved model on a split of its task",
                                   description="Rebuild the model of a checkpoint written by attnzoo train and "
                                               "report its loss and metric beside the task's baseline.")
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                          help="a run directory (its latest checkpoint) or a checkpoint directory")
    evaluate.add_argument("--split", default="test", choices=["train", "validation", "test"])
    evaluate.add_argument("--json", action="store_true", help="print the report as JSON")
    evaluate.add_argument("--device", help="cpu (default) or cuda[:N]: where the model is evaluated (classify, tag "
                                           "and lm tasks; seq2seq ones on the CPU only)")
    add_import_option(evaluate)
    _add_decoder_options(evaluate, "eval")
    evaluate.set_defaults(run=eval_command)

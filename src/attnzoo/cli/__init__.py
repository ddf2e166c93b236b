"""The ``attnzoo`` command line, one module per family of commands:

* :mod:`~attnzoo.cli.compare`: ``attnzoo list`` (the registered mechanisms) and ``attnzoo compare`` (the kernel
  benchmark, :mod:`attnzoo.bench`);
* :mod:`~attnzoo.cli.train`: ``attnzoo train`` (a model on a task) and ``attnzoo eval`` (a saved one);
* :mod:`~attnzoo.cli.experiments`: ``attnzoo lra``, ``attnzoo mqar`` and ``attnzoo seq2seq-report`` (the training
  experiments, :mod:`attnzoo.experiments`);
* :mod:`~attnzoo.cli.convert`: ``attnzoo convert`` (a pretrained model to linear-time attention,
  :mod:`attnzoo.conversion`);
* :mod:`~attnzoo.cli.lm_eval`: ``attnzoo lm-eval`` (a pretrained model on real text and long contexts);
* :mod:`~attnzoo.cli.common`: exit codes, usage errors, value parsing, ``--set``, ``--import`` and retired flags.

Every usage error is one line on stderr with exit code 2.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from .common import EXIT_BROKEN_PIPE, EXIT_FAILED_ROWS, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Parser

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAILED_ROWS", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


def build_parser() -> Parser:
    from .compare import add_compare_command, add_list_command
    from .convert import add_convert_command
    from .experiments import add_lra_command, add_mqar_command, add_seq2seq_report_command
    from .lm_eval import add_lm_eval_command
    from .train import add_eval_command, add_train_command

    from .. import __version__

    parser = Parser(prog="attnzoo", description="Attention mechanisms behind one API.")
    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (add_list_command, add_compare_command, add_train_command, add_eval_command, add_lra_command,
                add_mqar_command, add_seq2seq_report_command, add_convert_command, add_lm_eval_command):
        add(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.raw_argv = argv[1:]
    try:
        code = args.run(args)
        sys.stdout.flush()  # inside the try: a closed pipe must surface here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        print("attnzoo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`attnzoo eval --json | head`): stop quietly, as other Unix tools do, and
        # point stdout at /dev/null so the interpreter's final flush does not raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE

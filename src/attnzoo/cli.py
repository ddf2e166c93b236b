"""The ``attnzoo`` command line: ``attnzoo list`` and ``attnzoo compare``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .mechanisms import available, capabilities


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
            "approximate" if caps.approximate else "exact", caps.complexity,
        ])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description="Attention mechanisms behind one API.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="registered mechanisms and their capabilities").set_defaults(run=list_command)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Time per decoded token and the decoding state's size against the context length, one decoder layer each.

A mechanism whose ``step`` carries a constant-size state (the linear family, the delta rule, SSD) should
decode in the same time at every context; a KV cache (softmax and its relatives) grows with the context, and
so does its time per token. Each row is one decoder layer at one width (batch 1, float32, one thread by
default): for a mechanism, a :class:`~attnzoo.models.DecoderLayer` (its self-attention + a feed-forward
network of 4 dim) with ``heads`` heads; for a block (``--blocks``), the block's decoder layer, the Mamba-2
block with ``heads`` SSM heads and state ``state_dim``. Each context is prefilled with the layer's own
``prefill``, then ``steps`` tokens are decoded one ``step`` at a time; the time is the median step after the
first ``warmup`` (the contexts take turns, one step each, so that the load of a shared machine falls on
all of them alike), and the state size is the sum of the bytes of the state's tensors after the prefill (a KV
cache counts its whole allocation: softmax's grows in blocks of 256 positions and at least doubles).

Output: a table on stdout; with ``--output``, JSON (the command, settings, load average before and after,
ms/token, state bytes and prefill seconds per context) and a PNG plot (``--plot``, by default the output's
path with ``.png``).

Usage:
    PYTHONPATH=src python scripts/bench_decode_flatness.py [--mechanisms softmax] [--blocks mamba2] \\
        [--contexts 1024,4096,16384] [--steps 200] [--output out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

import attnzoo
from attnzoo.cli.common import Parser
from attnzoo.models import AttentionSpec, BlockConfig, Decoder
from attnzoo.models.config import BLOCKS
from attnzoo.state import map_tensors

ATTENTION_BLOCK = "attention"
BLOCK_PREFIX = "block="
"""Rows of blocks are named ``block=<name>``: a block may share its name with a mechanism (``gau``)."""


@dataclass(frozen=True)
class Measurement:
    """One layer at one context: median ms per decoded token, the state's bytes after the prefill, and the
    prefill's seconds."""

    ms_per_token: float
    state_bytes: int
    prefill_s: float


def parse_contexts(text: str) -> List[int]:
    """Comma-separated context lengths, each an integer > 0."""
    contexts = []
    for item in (part.strip() for part in text.split(",")):
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"--contexts: {item!r} is not an integer") from None
        if value <= 0:
            raise ValueError(f"--contexts: {value} is not a context length > 0")
        contexts.append(value)
    return contexts


def parse_mechanisms(text: str) -> List[str]:
    """Comma-separated registered mechanisms, each with a recurrent step (empty: none)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in attnzoo.available():
            raise ValueError(f"--mechanisms: unknown mechanism {name!r} (available: {', '.join(attnzoo.available())})")
        if not attnzoo.capabilities(name).recurrent_step:
            stepping = [n for n in attnzoo.available() if attnzoo.capabilities(n).recurrent_step]
            raise ValueError(f"--mechanisms: {name!r} has no recurrent step to decode with "
                             f"(those with one: {', '.join(stepping)})")
    return names


def parse_blocks(text: str) -> List[str]:
    """Comma-separated decoder blocks other than attention + feed-forward (empty: none)."""
    choices = [block for block in BLOCKS if block != ATTENTION_BLOCK]
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in choices:
            raise ValueError(f"--blocks: unknown block {name!r} (choices: {', '.join(choices)})")
    return names


def build_layer(row: str, dim: int, heads: int, state_dim: int) -> nn.Module:
    """The decoder layer of a row: a mechanism's name, or ``block=<name>``; seeded, in eval mode."""
    torch.manual_seed(0)
    if row.startswith(BLOCK_PREFIX):
        block = row[len(BLOCK_PREFIX):]
        # state_dim is the Mamba-2 block's option; the gated blocks take theirs at their defaults.
        options = {"state_dim": state_dim} if block == "mamba2" else None
        config = BlockConfig(dim, heads, block=block, block_options=options)
        layer_type = Decoder.mamba2_layer_type if block == "mamba2" else Decoder.gated_layer_type
    else:
        config = BlockConfig(dim, heads, self_attention=AttentionSpec(row))
        layer_type = Decoder.layer_type
    return layer_type(config).eval()


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a state tree (dataclasses, dicts, lists and tuples of tensors)."""
    sizes: List[int] = []
    map_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


def measure(layer: nn.Module, contexts: Sequence[int], steps: int, warmup: int, dim: int) -> Dict[int, Measurement]:
    """Prefill each context of a seeded input (1, context + steps, dim), then decode ``steps`` tokens after
    each, the contexts taking turns step by step so that a busy machine's slow spells fall on all of them
    alike instead of on whichever context was running at the time."""
    states: Dict[int, Any] = {}
    inputs: Dict[int, Tensor] = {}
    prefill: Dict[int, float] = {}
    with torch.no_grad():
        for context in contexts:
            inputs[context] = torch.randn(1, context + steps, dim, generator=torch.Generator().manual_seed(0))
            start = time.perf_counter()
            _, states[context] = layer.prefill(inputs[context][:, :context])
            prefill[context] = time.perf_counter() - start
        sizes = {context: state_bytes(states[context]) for context in contexts}
        samples: Dict[int, List[float]] = {context: [] for context in contexts}
        for offset in range(steps):
            for context in contexts:
                x_t = inputs[context][:, context + offset: context + offset + 1]
                start = time.perf_counter()
                _, states[context] = layer.step(x_t, states[context])
                samples[context].append(time.perf_counter() - start)
    return {n: Measurement(statistics.median(samples[n][warmup:]) * 1e3, sizes[n], prefill[n]) for n in contexts}


def _parser() -> Parser:
    parser = Parser(prog="bench_decode_flatness.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mechanisms", default="softmax",
                        help="comma-separated mechanisms with a recurrent step, each in a DecoderLayer (default: "
                             "softmax; empty: none)")
    parser.add_argument("--blocks", default="mamba2", help="comma-separated blocks, of "
                        + ", ".join(b for b in BLOCKS if b != ATTENTION_BLOCK) + " (default: mamba2; empty: none)")
    parser.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths > 0")
    parser.add_argument("--steps", type=int, default=200, help="decoded tokens per context")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--state-dim", type=int, default=128, help="the Mamba-2 block's state size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="write the figures as JSON here")
    parser.add_argument("--plot", help="write the PNG plot here (default: the output's path with .png)")
    return parser


def _rows(parser: Parser, args: Any) -> Tuple[List[str], List[int]]:
    """The rows and contexts the arguments ask for; a bad one is a usage error (one line, exit 2)."""
    try:
        rows = parse_mechanisms(args.mechanisms) + [BLOCK_PREFIX + b for b in parse_blocks(args.blocks)]
        contexts = parse_contexts(args.contexts)
    except ValueError as error:
        parser.error(str(error))
    for option in ("steps", "dim", "heads", "state_dim", "threads"):
        if getattr(args, option) <= 0:
            parser.error(f"--{option.replace('_', '-')} must be > 0, got {getattr(args, option)}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if not rows:
        parser.error("nothing to measure: --mechanisms and --blocks are both empty")
    return rows, contexts


def _print_row(row: str, figures: Dict[int, Measurement]) -> None:
    times = "".join(f"{m.ms_per_token:>10.3f}" for m in figures.values())
    sizes = "".join(f"{m.state_bytes / 1024:>12.1f}" for m in figures.values())
    print(f"{row:<16}{times}  {sizes}", flush=True)


def write_plot(data: Dict[str, Any], path: Path) -> None:
    """ms/token and state size against the context, log-log, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, sizes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for row, figures in data["ms_per_token"].items():
        contexts = [int(n) for n in figures]
        style = "--" if row.startswith(BLOCK_PREFIX) else "-"
        times.plot(contexts, list(figures.values()), style, marker="o", label=row)
        sizes.plot(contexts, [b / 2 ** 20 for b in data["state_bytes"][row].values()], style, marker="o", label=row)
    contexts = sorted({int(n) for figures in data["ms_per_token"].values() for n in figures})
    for axes, label in ((times, "ms per decoded token"), (sizes, "decoding state (MiB)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(contexts, [str(n) for n in contexts])
        axes.set_xlabel("context (positions)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    times.legend(fontsize=8)
    settings = data["settings"]
    figure.suptitle(f"decoding one layer: batch 1, dim {settings['dim']}, {settings['heads']} heads, float32, "
                    f"{settings['threads']} thread(s), median of {settings['steps'] - settings['warmup']} steps; "
                    f"load average {data['load_average']['before'][0]:.1f}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    rows, contexts = _rows(parser, args)
    torch.set_num_threads(args.threads)
    try:
        layers = {row: build_layer(row, args.dim, args.heads, args.state_dim) for row in rows}
    except (ValueError, TypeError) as error:
        parser.error(str(error).splitlines()[0])
    load_before = os.getloadavg()
    print(f"batch 1, dim {args.dim}, {args.heads} heads, Mamba-2 state {args.state_dim}, float32, {args.threads} "
          f"thread(s), median of {args.steps - args.warmup} steps; load average {load_before[0]:.1f}")
    print(f"{'layer':<16}" + "".join(f"{f'ms@{n}':>10}" for n in contexts) + "  "
          + "".join(f"{f'KiB@{n}':>12}" for n in contexts))
    results: Dict[str, Dict[int, Measurement]] = {}
    for row, layer in layers.items():
        results[row] = measure(layer, contexts, args.steps, args.warmup, args.dim)
        _print_row(row, results[row])
    data = {
        "command": " ".join(["python", "scripts/bench_decode_flatness.py"] + list(sys.argv[1:] if argv is None
                                                                                   else argv)),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "plot")},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "ms_per_token": {r: {str(n): round(m.ms_per_token, 4) for n, m in f.items()} for r, f in results.items()},
        "state_bytes": {r: {str(n): m.state_bytes for n, m in f.items()} for r, f in results.items()},
        "prefill_s": {r: {str(n): round(m.prefill_s, 3) for n, m in f.items()} for r, f in results.items()},
    }
    if args.output:
        Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
        write_plot(data, Path(args.plot or Path(args.output).with_suffix(".png")))
    elif args.plot:
        write_plot(data, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())

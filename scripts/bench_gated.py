"""Block-level cost of gated attention units (GAU, FLASH) against a softmax attention + feed-forward block of
the same parameter count (docs/gated.md).

The softmax block is one ``DecoderLayer`` (causal) or ``EncoderLayer`` (non-causal): SDPA attention with
``heads`` heads and a GELU feed-forward network of width ``4 * dim``, pre-norm. A gated unit has about half
its parameters, so it is measured as two units in a row, with ``expansion_dim`` chosen so that the two have
the same parameter count as the block (to within a few parameters). "2 x FLASH, no attention" is the same pair
with the attention replaced by ``A V = V``: the cost of the projections, SiLU, gate and norms that equal
parameters force on both designs, the floor of the FLASH pair's time.

Forward+backward of each candidate on one (batch, N, dim) input, timed side by side in one process, taking
turns (median of the repeats, after one warm-up call); peak memory of each configuration in a fresh process
(resident high-water mark above the state just before the call, glibc's mmap threshold fixed, one untimed pass
first), as ``attnzoo compare`` measures them.

    PYTHONPATH=src .venv/bin/python scripts/bench_gated.py --causal --output docs/results/gated-causal.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from attnzoo.bench.measure import PeakMemory, fix_malloc_threshold
from attnzoo.models import BlockConfig, DecoderLayer, EncoderLayer, GatedDecoderLayer, GatedEncoderLayer

CANDIDATES = ("softmax block", "2 x GAU", "2 x FLASH", "2 x FLASH, no attention")


class NoAttention(nn.Module):
    """In place of a unit's attention: ``A V = V``. The units then do everything but attend (norm, projections,
    SiLU, gate, output projection, residual): the time no attention at these widths can go below."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        return v


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def softmax_block(args: argparse.Namespace) -> nn.Module:
    layer = DecoderLayer if args.causal else EncoderLayer
    return layer(BlockConfig(args.dim, args.heads, cross_attention=None))


def matched_expansion(args: argparse.Namespace, block: str, target: int) -> int:
    """The expansion width e whose two units have ``target`` parameters (parameters are linear in e)."""
    def units(e: int) -> int:
        return 2 * count(gated_unit(args, block, e))

    low, high = units(1), units(2)
    return max(1, round(1 + (target - low) / (high - low)))


def gated_unit(args: argparse.Namespace, block: str, expansion: int) -> nn.Module:
    options: Dict[str, object] = {"shared_dim": args.shared_dim, "expansion_dim": expansion}
    if block == "flash_gau":
        options["chunk_size"] = args.chunk_size
    config = BlockConfig(args.dim, args.heads, block=block, block_options=options)
    return (GatedDecoderLayer if args.causal else GatedEncoderLayer)(config)


def candidates(args: argparse.Namespace) -> Dict[str, nn.Module]:
    torch.manual_seed(0)
    block = softmax_block(args)
    target = count(block)
    built: Dict[str, nn.Module] = {"softmax block": block}
    for name, kind in (("2 x GAU", "gau"), ("2 x FLASH", "flash_gau")):
        e = matched_expansion(args, kind, target)
        built[name] = nn.Sequential(gated_unit(args, kind, e), gated_unit(args, kind, e))
    floor = nn.Sequential(*(gated_unit(args, "flash_gau", matched_expansion(args, "flash_gau", target)) for _ in range(2)))
    for unit in floor:
        unit.attention = NoAttention()
    built["2 x FLASH, no attention"] = floor
    return built


def forward_backward(module: nn.Module, x: Tensor, grad: Tensor) -> None:
    x = x.detach().requires_grad_(True)
    module(x).backward(grad)
    module.zero_grad(set_to_none=True)


def inputs(args: argparse.Namespace, length: int) -> List[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(args.batch, length, args.dim, generator=generator) for _ in range(2)]


def skipped(args: argparse.Namespace, name: str, length: int) -> Optional[str]:
    if name == "2 x GAU" and length > args.gau_max_length:
        return f"not run above N={args.gau_max_length} (quadratic: --gau-max-length)"
    return None


def peak_memory_mib(args: argparse.Namespace, name: str, length: int) -> float:
    command = [sys.executable, __file__, "--memory-of", name, "--lengths", str(length)] + args.passthrough
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(json.loads(result.stdout)["peak_mib"])


def memory_child(args: argparse.Namespace) -> None:
    fix_malloc_threshold()
    module = candidates(args)[args.memory_of]
    x, grad = inputs(args, int(args.lengths))
    forward_backward(module, x, grad)  # lazily created kernels and caches
    with PeakMemory("cpu") as peak:
        forward_backward(module, x, grad)
    print(json.dumps({"peak_mib": (peak.peak_bytes or 0) / 2**20}))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--shared-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--gau-max-length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--output", help="write the figures to this JSON file")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.passthrough = [
        "--batch", str(args.batch), "--dim", str(args.dim), "--heads", str(args.heads), "--shared-dim",
        str(args.shared_dim), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads),
    ] + (["--causal"] if args.causal else [])
    torch.set_num_threads(args.threads)
    if args.memory_of:
        memory_child(args)
        return 0

    built = candidates(args)
    parameters = {name: count(module) for name, module in built.items()}
    print(json.dumps({"parameters": parameters}), flush=True)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        x, grad = inputs(args, length)
        active = {name: module for name, module in built.items() if not skipped(args, name, length)}
        for module in active.values():  # warm-up
            forward_backward(module, x, grad)
        samples: Dict[str, List[float]] = {name: [] for name in active}
        names = list(active)
        for round_index in range(args.repeats):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                forward_backward(active[name], x, grad)
                samples[name].append(1e3 * (time.perf_counter() - start))
        for name in built:
            row: Dict[str, object] = {"N": length, "candidate": name, "parameters": parameters[name]}
            reason = skipped(args, name, length)
            if reason:
                row["skipped"] = reason
            else:
                ms = statistics.median(samples[name])
                row.update(ms=ms, spread=(max(samples[name]) - min(samples[name])) / ms,
                           time_over_softmax_block=ms / statistics.median(samples["softmax block"]))
                if not args.no_memory:
                    row["peak_mib"] = peak_memory_mib(args, name, length)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output:
        settings = {key: value for key, value in vars(args).items() if key not in ("passthrough", "memory_of")}
        report = {"command": " ".join(sys.argv), "settings": settings, "torch": torch.__version__,
                  "machine": platform.processor() or platform.machine(), "rows": rows}
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

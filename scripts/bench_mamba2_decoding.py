"""Time per decoded token of one Mamba-2 block against the context length, beside a softmax decoder layer.

A Mamba-2 block decodes from a constant-size state (the convolution's last inputs and the SSM state), so its
time per token should not grow with the context; a softmax layer's KV cache does. Both layers are built at
one width (batch 1, float32, one thread by default): the Mamba-2 block with ``heads`` SSM heads of
``expansion * dim / heads`` and state ``state_dim``, the softmax layer (attention + feed-forward of 4 dim) with
``heads`` attention heads. Each context is prefilled, then ``steps`` tokens are decoded; the figure is the
median step time after the first five.

Usage:
    PYTHONPATH=src python scripts/bench_mamba2_decoding.py [--contexts 1024,4096,16384] [--output out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from attnzoo.models import BlockConfig, DecoderLayer, Mamba2DecoderLayer


def _layers(dim: int, heads: int, state_dim: int) -> Dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mamba2 = BlockConfig(dim, heads, block="mamba2", block_options={"state_dim": state_dim})
    return {"mamba2": Mamba2DecoderLayer(mamba2).eval(), "softmax": DecoderLayer(BlockConfig(dim, heads)).eval()}


def time_per_token(layer: torch.nn.Module, context: int, steps: int, dim: int) -> Tuple[float, float]:
    """(median ms per decoded token after a prefill of ``context`` positions, the prefill's seconds)."""
    x = torch.randn(1, context + steps, dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        start = time.perf_counter()
        _, state = layer.prefill(x[:, :context])
        prefill = time.perf_counter() - start
        samples: List[float] = []
        for t in range(context, context + steps):
            start = time.perf_counter()
            _, state = layer.step(x[:, t: t + 1], state)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[5:]) * 1e3, prefill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--state-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    layers = _layers(args.dim, args.heads, args.state_dim)
    results: Dict[str, Dict[str, float]] = {name: {} for name in layers}
    runs: List[Tuple[str, Callable[[int], Tuple[float, float]]]] = [
        (name, lambda n, layer=layer: time_per_token(layer, n, args.steps, args.dim)) for name, layer in layers.items()
    ]
    print(f"ms per token (batch 1, dim {args.dim}, {args.heads} heads, state {args.state_dim}, "
          f"{args.threads} thread(s), median of {args.steps - 5} steps)")
    print("layer    " + "".join(f"{n:>10}" for n in contexts))
    for name, run in runs:
        for context in contexts:
            results[name][str(context)] = round(run(context)[0], 4)
        print(f"{name:<9}" + "".join(f"{results[name][str(n)]:>10.3f}" for n in contexts), flush=True)
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k != "output"}
        with open(args.output, "w") as out:
            json.dump({"settings": settings, "ms_per_token": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

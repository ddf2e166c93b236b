"""Training throughput of attnzoo's softmax LanguageModel against the same model built from
torch.nn.TransformerEncoder with a causal mask (dim 256, 4 layers, 4 heads, N=1024, batch 8, AdamW steps),
interleaved in one process so that both see the same machine load; medians of the repeats.

Usage: python scripts/bench_training_throughput.py [--steps 5] [--repeats 5] [--length 1024] [--threads N]
       [--output results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo import LanguageModel
from attnzoo.positional import SinusoidalPositionalEncoding

VOCAB, DIM, HEADS, DEPTH = 256, 256, 4, 4


class TorchLanguageModel(nn.Module):
    """The same architecture from torch's own layers: embedding + sinusoidal positions, pre-norm GELU blocks
    with a 4x feed-forward, final norm, untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.position = SinusoidalPositionalEncoding(DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, DEPTH, norm=nn.LayerNorm(DIM), enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        x = self.position(self.embedding(tokens))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def steps_per_second(model: nn.Module, tokens: torch.Tensor, steps: int) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = LanguageModel(VOCAB, DIM, HEADS, DEPTH, ff_dim=4 * DIM, activation="gelu")
    theirs = TorchLanguageModel()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    tokens = torch.randint(0, VOCAB, (args.batch, args.length + 1))
    steps_per_second(ours, tokens, 1), steps_per_second(theirs, tokens, 1)  # warm-up
    rates = {"attnzoo": [], "torch": []}
    for _ in range(args.repeats):
        rates["attnzoo"].append(steps_per_second(ours, tokens, args.steps))
        rates["torch"].append(steps_per_second(theirs, tokens, args.steps))
    tokens_per_step = args.batch * args.length
    print(f"batch {args.batch}, N={args.length}, dim {DIM}, {DEPTH} layers, {HEADS} heads, {torch.get_num_threads()} "
          f"threads; parameters: attnzoo {count(ours):,}, torch {count(theirs):,}")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:8s} {median * tokens_per_step:9.0f} tokens/s  ({median:.3f} steps/s, median of {args.repeats})")
    ratio = statistics.median(rates["attnzoo"]) / statistics.median(rates["torch"])
    print(f"attnzoo / torch throughput: {ratio:.3f}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "threads": torch.get_num_threads(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "load_average_1min": os.getloadavg()[0]},
            "batch": args.batch, "length": args.length, "steps_per_repeat": args.steps,
            "steps_per_second": rates, "tokens_per_second_median":
                {name: statistics.median(values) * tokens_per_step for name, values in rates.items()},
            "attnzoo_over_torch": ratio,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()

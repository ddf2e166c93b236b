"""Attention sinks (Xiao et al. 2023, StreamingLLM) on a byte-level language model evaluated past its window.

Trains three small LanguageModels on the ``bytes`` task (sequences of ``--train-len`` bytes, rotary positions):
``local`` attention with window W, ``local`` with window W and ``--sinks`` sink tokens, and full ``softmax``
attention. Then evaluates bits per byte on test sequences of ``--eval-len`` bytes (longer than the training
sequences and than the window) by streaming decoding, one byte at a time through ``model.step``, whose state
is constant-size for ``local`` (sinks + a ring buffer of W keys and values per layer):

* local        -> decoded as trained (window only);
* local+sinks  -> decoded as trained (sinks kept), and with the sinks dropped (same weights, window only);
* softmax      -> decoded with its full KV cache (unbounded), with a window-only cache (W), and with sinks + a
  window (StreamingLLM's cache); a bounded cache is the same weights under ``local``.

The first batch of every streamed evaluation is also run in parallel and must agree (the step equals the
forward). Prints a table and writes JSON with the command that made it.

Usage: python scripts/bench_sinks.py [--steps 400] [--window 32] [--sinks 4] [--threads 1]
       [--output docs/results/sinks.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from attnzoo import LanguageModel
from attnzoo.tasks import task_class


def make_model(attention: str, options: Dict, args: argparse.Namespace) -> LanguageModel:
    return LanguageModel(256, args.dim, args.heads, args.depth, positional="rotary", self_attention=attention,
                         self_attention_options=options)


def train(attention: str, options: Dict, data: torch.Tensor, targets: torch.Tensor,
          args: argparse.Namespace) -> LanguageModel:
    torch.manual_seed(args.seed)
    model = make_model(attention, options, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(args.steps):
        rows = torch.randint(0, data.shape[0], (args.batch,), generator=generator)
        logits = model(data[rows])
        loss = F.cross_entropy(logits.reshape(-1, 256), targets[rows].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:  # linear warm-up, then cosine decay
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        optimizer.step()
    return model.eval()


def streamed_losses(model: LanguageModel, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(batch, seq) cross-entropy in bits of each target, decoding one byte at a time."""
    with torch.no_grad():
        logits, state = model.prefill(tokens[:, :1])
        steps = [logits[:, 0]]
        for t in range(1, tokens.shape[1]):
            logits_t, state = model.step(tokens[:, t], state)
            steps.append(logits_t)
        logits = torch.stack(steps, dim=1)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") / math.log(2)


def evaluate(model: LanguageModel, tokens: torch.Tensor, targets: torch.Tensor, args: argparse.Namespace) -> Dict:
    losses = []
    for start in range(0, tokens.shape[0], args.eval_batch):
        rows = slice(start, start + args.eval_batch)
        streamed = streamed_losses(model, tokens[rows], targets[rows])
        if start == 0:  # the step equals the parallel forward
            with torch.no_grad():
                parallel = F.cross_entropy(model(tokens[rows]).transpose(1, 2), targets[rows], reduction="none")
            gap = float((parallel / math.log(2) - streamed).abs().max())
            assert gap < 1e-3, f"streamed and parallel losses differ by {gap}"
        losses.append(streamed)
    bits = torch.cat(losses)
    cut = args.train_len
    return {
        "bpb_all": float(bits.mean()),
        f"bpb_first_{cut}": float(bits[:, :cut].mean()),
        f"bpb_after_{cut}": float(bits[:, cut:].mean()),
        f"bpb_last_{args.eval_len // 4}": float(bits[:, -(args.eval_len // 4):].mean()),
    }


def decoded_as(model: LanguageModel, attention: str, options: Dict, args: argparse.Namespace) -> LanguageModel:
    """The same weights under another attention (no mechanism here has parameters)."""
    other = make_model(attention, options, args)
    other.load_state_dict(model.state_dict())
    return other.eval()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=128)
    parser.add_argument("--eval-len", type=int, default=1024)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--eval-batch", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train_split = task_class("bytes")(seed=args.seed, seq_len=args.train_len).split("train")
    test_split = task_class("bytes")(seed=args.seed, seq_len=args.eval_len,
                            test_bytes=(args.eval_len + 1) * args.eval_sequences).split("test")
    tokens, targets = test_split.inputs[: args.eval_sequences], test_split.targets[: args.eval_sequences]

    window = {"window": args.window}
    sinks = {"window": args.window, "sink_tokens": args.sinks}
    trained = {
        "local": train("local", window, train_split.inputs, train_split.targets, args),
        "local+sinks": train("local", sinks, train_split.inputs, train_split.targets, args),
        "softmax": train("softmax", {}, train_split.inputs, train_split.targets, args),
    }
    runs = [
        ("local", "window only (as trained)", trained["local"]),
        ("local+sinks", "sinks + window (as trained)", trained["local+sinks"]),
        ("local+sinks", "window only (sinks dropped)", decoded_as(trained["local+sinks"], "local", window, args)),
        ("softmax", "full KV cache (unbounded)", trained["softmax"]),
        ("softmax", "window only", decoded_as(trained["softmax"], "local", window, args)),
        ("softmax", "sinks + window (StreamingLLM)", decoded_as(trained["softmax"], "local", sinks, args)),
    ]
    rows = []
    for model_name, decoding, model in runs:
        row = {"trained": model_name, "decoded": decoding, **evaluate(model, tokens, targets, args)}
        rows.append(row)
        print(" | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    print(f"{result['seconds']} s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

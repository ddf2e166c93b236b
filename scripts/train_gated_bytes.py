"""A gated-unit language model (FLASH or GAU) against a softmax one of equal parameters and steps, on the
``bytes`` task of ``attnzoo train`` (docs/gated.md, "Quality on the bytes task").

``attnzoo train`` builds its models from a mechanism name and has no block option, so this script runs its
training loop (``attnzoo.training.loop.train``) with the model built here: the softmax model has ``--depth``
attention + feed-forward layers, the gated one twice as many units (a unit has about half a layer's
parameters) with the expansion width chosen to match the parameter count.

    PYTHONPATH=src python scripts/train_gated_bytes.py attention --steps 400
    PYTHONPATH=src python scripts/train_gated_bytes.py flash --steps 400 --chunk-size 64
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import torch
from torch import nn

from attnzoo.models import LanguageModel


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("block", choices=["attention", "flash", "gau"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2, help="attention + feed-forward layers of the softmax model")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--shared-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="run directory (default runs/bytes-<block>)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import attnzoo.training.loop as loop  # the training loop of `attnzoo train`
    from attnzoo.training import TrainConfig

    def build(config: object, task: object) -> nn.Module:
        common = dict(dim=args.dim, heads=args.heads, positional="rotary", max_length=task.seq_len)
        softmax = LanguageModel(task.vocab_size, depth=args.depth, **common)
        if args.block == "attention":
            return softmax

        def gated(expansion: int) -> LanguageModel:
            options = {"expansion_dim": expansion, "shared_dim": args.shared_dim}
            if args.block == "flash":
                options["chunk_size"] = args.chunk_size
            return LanguageModel(task.vocab_size, depth=2 * args.depth, block=args.block, block_options=options,
                                 **common)

        low, high = count(gated(100)), count(gated(101))  # parameters are linear in the expansion width
        model = gated(round(100 + (count(softmax) - low) / (high - low)))
        print(json.dumps({"parameters": count(model), "softmax_parameters": count(softmax)}), flush=True)
        return model

    loop.build_model = build
    config = TrainConfig(task="bytes", dim=args.dim, depth=args.depth, heads=args.heads, positional="rotary",
                         batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                         eval_interval=max(args.steps // 4, 1), seed=0)
    result = loop.train(config, args.output or f"runs/bytes-{args.block}", progress=False)
    print(json.dumps({"validation": result.validation, "test": result.test, "parameters": result.parameters,
                      "tokens_per_second": result.tokens_per_second}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

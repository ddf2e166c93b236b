"""What the copy mechanism costs: a training step (forward + backward) and greedy decoding on ``copy-names``,
with and without it, the same model otherwise (docs/seq2seq.md, "Copy mechanism"). The two are timed in
turns in one process, best of ``--repeats``, so a busy machine slows both alike.

    PYTHONPATH=src python scripts/bench_copy_mechanism.py --repeats 20
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, List, Optional

import torch

from attnzoo.experiments.seq2seq_eval import greedy_outputs
from attnzoo.tasks import load
from attnzoo.training import TrainConfig, build_model


def elapsed(run: Callable[[], None]) -> float:
    """Seconds one call of ``run`` takes."""
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = load("copy-names")
    data = task.split("test")
    index = torch.arange(args.batch_size)
    source, mask = data.inputs[index], data.padding_mask[index]
    inputs, targets = data.decoder_inputs[index], data.targets[index]
    models = {}
    for copy in (False, True):
        torch.manual_seed(0)
        models[copy] = build_model(TrainConfig("copy-names", copy_mechanism=copy), task)

    def train_step(model: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            logits = model(source, inputs, src_padding_mask=mask)
            torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100).backward()
        return run

    def decode(model: torch.nn.Module) -> Callable[[], None]:
        return lambda: greedy_outputs(model.eval(), task, source, mask)

    timings = {"train_step": {False: [], True: []}, "greedy_decode": {False: [], True: []}}
    for _ in range(args.repeats):  # in turns: each round times both models once
        for copy, model in models.items():
            timings["train_step"][copy].append(elapsed(train_step(model.train())))
            timings["greedy_decode"][copy].append(elapsed(decode(model)))
    result = {}
    for what, by_copy in timings.items():
        plain, copying = min(by_copy[False]), min(by_copy[True])
        result[what] = {"without_ms": round(plain * 1e3, 2), "with_ms": round(copying * 1e3, 2),
                        "ratio": round(copying / plain, 3)}
    print(json.dumps({"batch_size": args.batch_size, "repeats": args.repeats, "threads": args.threads, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The decoded metrics of one trained seq2seq run under several decoders, side by side in one process
(docs/seq2seq.md, "Decoding: greedy, beam, monotonic").

Loads the run's model once and evaluates a split with each decoder in turn (``attnzoo eval DIR`` with the
matching options gives the same numbers, one decoder per process), ``--repeats`` rounds in rotation; the
metrics come from the first round (they do not change: sampling is not among these decoders), the decoding
time is the fastest round's, which is the least disturbed by other work on the machine.

    PYTHONPATH=src python scripts/compare_decoders.py runs/g2p-softmax --split test --threads 1
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Tuple

import torch

from attnzoo.models.monotonic import MonotonicInference
from attnzoo.training import DecoderSettings, evaluate, load_trained

DECODERS: List[Tuple[str, DecoderSettings]] = [
    ("greedy", DecoderSettings()),
    ("beam 4", DecoderSettings("beam", beam_size=4)),
    ("greedy, monotonic (ahead 3)", DecoderSettings(monotonic=MonotonicInference(ahead=3))),
    ("greedy, monotonic (ahead 2)", DecoderSettings(monotonic=MonotonicInference(ahead=2))),
    ("beam 4, monotonic (ahead 3)", DecoderSettings("beam", beam_size=4, monotonic=MonotonicInference(ahead=3))),
]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory written by attnzoo train on a seq2seq task")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the decoders (fastest time kept)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, task, config = load_trained(args.run)
    results: Dict[str, Dict[str, float]] = {}
    for _ in range(args.repeats):
        for name, settings in DECODERS:
            metrics = evaluate(model, task, args.split, batch_size=config.batch_size, precision=config.precision,
                               decoding=settings)
            if name in results:
                metrics = {**results[name], "ms_per_sentence": min(results[name]["ms_per_sentence"],
                                                                   metrics["ms_per_sentence"])}
            results[name] = metrics
    words = len(task.split(args.split))
    print(f"{task.name}, {args.split} split ({words} sequences), batches of {config.batch_size}, "
          f"{torch.get_num_threads()} thread(s)\n")
    print("| decoder | exact match | token error rate | BLEU | ms / sentence |")
    print("|---|---|---|---|---|")
    for name, _ in DECODERS:
        m = results[name]
        print(f"| {name} | {m['exact_match']:.3f} | {m['token_error_rate']:.3f} | {m['bleu']:.1f} | "
              f"{m['ms_per_sentence']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

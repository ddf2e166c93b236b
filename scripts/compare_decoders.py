"""The decoded metrics of one trained seq2seq run under several decoders, side by side in one process
(docs/seq2seq.md, "Decoding: greedy, beam, monotonic"; :func:`attnzoo.bench.seq2seq_eval.compare_decoders`,
which ``attnzoo seq2seq-report`` runs on its g2p models). ``attnzoo eval DIR`` with the matching options gives
the same metrics, one decoder per process.

    PYTHONPATH=src python scripts/compare_decoders.py runs/g2p-softmax --split test --threads 1
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from attnzoo.bench.seq2seq_eval import compare_decoders


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory written by attnzoo train on a seq2seq task")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the decoders (fastest time kept)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = compare_decoders(args.run, args.split, args.repeats)
    print(f"{result['task']}, {args.split} split ({result['sentences']} sequences), batches of "
          f"{result['batch_size']}, {torch.get_num_threads()} thread(s)\n")
    print("| decoder | exact match | token error rate | BLEU | ms / sentence |")
    print("|---|---|---|---|---|")
    for m in result["rows"]:
        print(f"| {m['decoder']} | {m['exact_match']:.3f} | {m['token_error_rate']:.3f} | {m['bleu']:.1f} | "
              f"{m['ms_per_sentence']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

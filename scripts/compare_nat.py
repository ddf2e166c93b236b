"""Autoregressive against non-autoregressive decoding of two trained seq2seq models (docs/seq2seq.md,
"Non-autoregressive decoding"): quality and decoding time per sentence, side by side in one process
(:func:`attnzoo.experiments.seq2seq_eval.compare_at_nat`; ``attnzoo seq2seq-report`` runs it on its own runs).

    PYTHONPATH=src python scripts/compare_nat.py runs/reverse-at runs/reverse-nat --threads 1
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional

import torch

from attnzoo.experiments.seq2seq_eval import compare_at_nat


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("autoregressive", help="run directory of the autoregressive model")
    parser.add_argument("non_autoregressive", help="run directory of the non-autoregressive model")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-sizes", default="1,10,100",
                        help="comma-separated batch sizes to time (quality is scored at the largest)")
    parser.add_argument("--timed-sentences", type=int, default=200,
                        help="the first N sentences of the split are timed at each batch size (default 200)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        result = compare_at_nat(args.autoregressive, args.non_autoregressive, args.split,
                                [int(b) for b in args.batch_sizes.split(",")], args.timed_sentences, args.repeats)
    except ValueError as error:
        parser.error(str(error))
    print(f"{result['task']}, {args.split} split: quality over its {result['sentences']} sentences; time over its "
          f"first {result['timed_sentences']}, {args.threads} thread(s), median of {args.repeats}; parameters "
          f"AT {result['parameters']['AT']:,}, NAT {result['parameters']['NAT']:,}")
    print("| decoder | exact match | token error rate | batch | ms / sentence | speed-up over AT greedy |")
    print("|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['decoder']} | {row['exact_match']:.3f} | {row['token_error_rate']:.4f} | {row['batch_size']} "
              f"| {row['ms_per_sentence']:.3f} | {row['speedup']:.1f}x |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({**result, "threads": args.threads}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

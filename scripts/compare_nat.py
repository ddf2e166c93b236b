"""Autoregressive against non-autoregressive decoding of two trained seq2seq models (docs/seq2seq.md,
"Non-autoregressive decoding"): quality and decoding time per sentence, side by side in one process.

Give the run directories of ``attnzoo train TASK`` with ``--decoding autoregressive`` and with
``--decoding non-autoregressive`` (same task, same model size). On the chosen split, each decoder runs over
the first ``--timed-sentences`` sentences at each of ``--batch-sizes``, ``--repeats`` times, alternating
between the decoders; the time reported is the median of those repeats divided by the number of sentences.
Quality (exact match, token error rate) is scored over the whole split. The NAT model is also decoded
with each target's true length, which separates the loss due to length prediction from the rest.

    PYTHONPATH=src python scripts/compare_nat.py runs/reverse-at runs/reverse-nat --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from attnzoo.decoding import nat_decode
from attnzoo.training.loop import load_trained
from attnzoo.training.nat import nat_outputs, target_lengths
from attnzoo.training.seq2seq import decoded_metrics, greedy_outputs, strip_output


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
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    at_model, task, at_config = load_trained(args.autoregressive)
    nat_model, nat_task, nat_config = load_trained(args.non_autoregressive)
    if nat_config.decoding != "non-autoregressive" or at_config.decoding != "autoregressive":
        parser.error("give the autoregressive run first, then the non-autoregressive one")
    if (at_config.task, at_config.task_options) != (nat_config.task, nat_config.task_options):
        parser.error("the two runs were trained on different tasks")
    data = task.split(args.split)
    references = [strip_output(row.tolist(), task.eos_id) for row in data.targets]

    def true_length_outputs(index: torch.Tensor) -> List[List[int]]:
        decoded = nat_decode(nat_model, data.inputs[index], eos_id=task.eos_id,
                             source_padding_mask=data.padding_mask[index],
                             target_lengths=target_lengths(data.targets[index]))
        return [strip_output(row.tolist(), task.eos_id) for row in decoded]

    decoders: Dict[str, Callable[[torch.Tensor], List[List[int]]]] = {
        "AT greedy": lambda i: greedy_outputs(at_model, task, data.inputs[i], data.padding_mask[i]),
        f"NAT ({nat_model.nat.length_mode} length)": lambda i: nat_outputs(nat_model, task, data.inputs[i],
                                                                            data.padding_mask[i]),
        "NAT (true length)": true_length_outputs,
    }

    def batches(count: int, size: int) -> List[torch.Tensor]:
        return [torch.arange(start, min(start + size, count)) for start in range(0, count, size)]

    parameters = {name: sum(p.numel() for p in model.parameters())
                  for name, model in (("AT", at_model), ("NAT", nat_model))}
    rows = []
    with torch.no_grad():
        quality = {name: decoded_metrics([row for index in batches(len(data), max(batch_sizes))
                                          for row in decode(index)], references)
                   for name, decode in decoders.items()}
        timed = min(args.timed_sentences, len(data))
        for size in batch_sizes:
            seconds: Dict[str, List[float]] = {name: [] for name in decoders}
            for _ in range(args.repeats):
                for name, decode in decoders.items():  # alternating, so that load on the machine hits all alike
                    began = time.perf_counter()
                    for index in batches(timed, size):
                        decode(index)
                    seconds[name].append(time.perf_counter() - began)
            base = statistics.median(seconds["AT greedy"])
            for name in decoders:
                median = statistics.median(seconds[name])
                rows.append({"decoder": name, "batch_size": size, **quality[name],
                             "ms_per_sentence": 1000 * median / timed, "speedup": base / median,
                             "seconds": seconds[name]})
    print(f"{task.name}, {args.split} split: quality over its {len(data)} sentences (batches of "
          f"{max(batch_sizes)}); time over its first {timed}, {args.threads} thread(s), median of {args.repeats}; "
          f"parameters AT {parameters['AT']:,}, NAT {parameters['NAT']:,}")
    print("| decoder | exact match | token error rate | batch | ms / sentence | speed-up over AT greedy |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['decoder']} | {row['exact_match']:.3f} | {row['token_error_rate']:.4f} | {row['batch_size']} "
              f"| {row['ms_per_sentence']:.3f} | {row['speedup']:.1f}x |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"task": task.name, "split": args.split, "threads": args.threads, "timed_sentences": timed,
                       "parameters": parameters, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

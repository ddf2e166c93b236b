"""Decoding speed of SmolLM2-135M with its own attention against the same model with a linear-time attention,
side by side after the same long prompts.

    PYTHONPATH=src python scripts/bench_pretrained_decode.py [--contexts 1024,8192] [--batches 1,4] \\
        [--mechanism lolcats --options sink_tokens=4 | --converted runs/lolcats-sinks4[:sparse_cache=64]] \\
        [--steps 8] \\
        [--rounds 5] [--threads 1] [--output result.json]

For each (context, batch): ``batch`` random token sequences of ``context`` tokens are prefilled by both models,
then each model decodes ``steps`` greedy tokens from its state after the prompt, the two taking turns for
``rounds`` rounds so that machine noise falls on both; per model the median over rounds of the ms per step.
tokens/s counts every sequence of the batch. The other model is the raw swap (``--mechanism``, its own
parameters untrained: a step does the same work as a trained one's) or a converted model (``--converted``,
written by ``attnzoo convert``; options after a colon are set on its layers at inference, as ``attnzoo lm-eval
--converted`` takes them). glibc keeps freed memory for reuse (as ``attnzoo lm-eval`` does), so a step's
state tensors are not page-faulted in afresh. Prints (and with ``--output`` writes) JSON with the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from attnzoo._malloc import keep_freed_memory
from attnzoo.cli.common import parse_options
from attnzoo.cli.lm_eval import converted_spec
from attnzoo.pretrained import smollm2
from attnzoo.pretrained.evaluation import _layers, state_bytes, swapped


def _steps(model: Any, token: torch.Tensor, state: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        logits, state = model.step(token, state)
        token = logits.argmax(-1)
    return (time.perf_counter() - start) / steps * 1e3


def measure(models: Dict[str, Any], context: int, batch: int, steps: int, rounds: int) -> Dict[str, Any]:
    prompts = torch.randint(0, 49152, (batch, context), generator=torch.Generator().manual_seed(context + batch))
    after: Dict[str, Any] = {}
    row: Dict[str, Any] = {"context": context, "batch": batch}
    for name, model in models.items():
        start = time.perf_counter()
        hidden, state = _layers(model, prompts, keep_state=True)
        after[name] = (model.head(hidden[:, -1]).argmax(-1), state)
        row[f"{name}_prefill_s"] = round(time.perf_counter() - start, 2)
        row[f"{name}_state_mib"] = round(state_bytes(state) / 2**20, 2)
    times: Dict[str, List[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(_steps(model, *after[name], steps))
    for name in models:
        ms = statistics.median(times[name])
        row[f"{name}_ms_per_step"] = round(ms, 2)
        row[f"{name}_tokens_per_s"] = round(batch * 1e3 / ms, 2)
        row[f"{name}_rounds_ms"] = [round(t, 2) for t in times[name]]
    names = list(models)
    row["speedup"] = round(row[f"{names[0]}_ms_per_step"] / row[f"{names[1]}_ms_per_step"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--mechanism", default="lolcats")
    parser.add_argument("--options", type=parse_options, default={"sink_tokens": 4})
    parser.add_argument("--converted", type=converted_spec,
                        help="a folder written by attnzoo convert, DIR[:OPTION=VALUE,...] (instead of --mechanism)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    teacher, _ = smollm2()
    teacher.eval()
    if args.converted:
        from attnzoo.conversion import load_converted

        folder, options = (args.converted, {}) if isinstance(args.converted, str) else args.converted
        other = load_converted(folder, merged=True, options=options)[0].eval()
        label = f"converted {folder}" + "".join(f" {key}={value}" for key, value in options.items())
    else:
        other, _ = swapped(teacher, args.mechanism, args.options)
        label = f"{args.mechanism} {args.options}"
    models = {"softmax": teacher, "other": other}
    rows = []
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(measure(models, context, batch, args.steps, args.rounds))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"command": ["python", "scripts/bench_pretrained_decode.py", *sys.argv[1:]], "other": label,
              "threads": args.threads, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""``lolcats``'s decoding step beside ``softmax``'s at SmolLM2-135M's attention shapes, after a long prompt.

    PYTHONPATH=src python scripts/bench_lolcats_step.py [--contexts 1024,8192] [--tokens 64] [--repeats 7]
        [--threads 1] [--profile] [--output result.json]

One layer's mechanism at SmolLM2-135M's shapes (batch 1, 9 query heads sharing 3 key/value heads, head dim 64)
and the options its conversion uses (``window=64``, ``sink_tokens=4``, ``feature_dim`` = head dim, so 128
Hedgehog features; the maps' parameters drawn at random, as trained ones would be). For each context: ``prefill``
over that many random positions, then ``tokens`` single-token ``step`` calls through the public method (its
checks included, as a model calls it), ``lolcats`` and ``softmax`` taking turns step by step so that machine
noise falls on both, each continuing its own state. Per mechanism the median of ``repeats`` rounds of the
per-round median ms per step, float32, no grad. ``--profile`` adds torch.profiler's table of the ``lolcats``
steps at the last context. Prints (and with ``--output`` writes) JSON with the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import attnzoo
from attnzoo._malloc import keep_freed_memory

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
LOLCATS_OPTIONS = {"window": 64, "sink_tokens": 4}


def build() -> dict:
    """The two mechanisms, ``lolcats`` with its maps' parameters drawn at random."""
    generator = torch.Generator().manual_seed(1)
    lolcats = attnzoo.build_mechanism("lolcats", HEADS, HEAD_DIM, **LOLCATS_OPTIONS)
    with torch.no_grad():
        for parameter in lolcats.parameters():
            parameter.copy_(parameter + 0.1 * torch.randn(parameter.shape, generator=generator))
    return {"lolcats": lolcats.eval(), "softmax": attnzoo.build_mechanism("softmax", HEADS, HEAD_DIM).eval()}


def draw(generator: torch.Generator, length: int) -> tuple:
    q = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator)
    return q, k, torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator)


def time_steps(mechanisms: dict, context: int, tokens: int, repeats: int) -> dict:
    """Median over ``repeats`` rounds of each round's median ms per step, the mechanisms taking turns."""
    generator = torch.Generator().manual_seed(context)
    prompt = draw(generator, context)
    states = {name: mechanism.prefill(*prompt)[1] for name, mechanism in mechanisms.items()}
    inputs = [draw(generator, 1) for _ in range(tokens)]
    rounds = {name: [] for name in mechanisms}
    for _ in range(repeats):
        times = {name: [] for name in mechanisms}
        current = dict(states)  # every round continues the prompt's state
        for q_t, k_t, v_t in inputs:
            for name, mechanism in mechanisms.items():
                started = time.perf_counter()
                _, current[name] = mechanism.step(q_t, k_t, v_t, current[name])
                times[name].append(1000 * (time.perf_counter() - started))
        for name in mechanisms:
            rounds[name].append(statistics.median(times[name]))
    return {name: statistics.median(values) for name, values in rounds.items()}


def profile(mechanism, context: int, tokens: int) -> str:
    """torch.profiler's operator table of ``tokens`` steps after a prompt of ``context``."""
    generator = torch.Generator().manual_seed(context)
    _, state = mechanism.prefill(*draw(generator, context))
    inputs = [draw(generator, 1) for _ in range(tokens)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for q_t, k_t, v_t in inputs:
            _, state = mechanism.step(q_t, k_t, v_t, state)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--fresh-memory", action="store_true",
                        help="leave glibc's allocator as it is (by default freed memory is kept for reuse, as "
                             "attnzoo lm-eval does, so a step's state tensors are not page-faulted in afresh)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.fresh_memory:
        keep_freed_memory()
    contexts = [int(c) for c in args.contexts.split(",")]
    mechanisms = build()
    rows = []
    with torch.no_grad():
        for context in contexts:
            ms = time_steps(mechanisms, context, args.tokens, args.repeats)
            rows.append({"context": context, "lolcats_ms": ms["lolcats"], "softmax_ms": ms["softmax"],
                         "lolcats_speed_vs_softmax": ms["softmax"] / ms["lolcats"]})
            print(f"context {context}: lolcats {ms['lolcats']:.3f} ms/step, softmax {ms['softmax']:.3f} ms/step",
                  file=sys.stderr)
        if args.profile:
            print(profile(mechanisms["lolcats"], contexts[-1], args.tokens), file=sys.stderr)
    result = {"command": " ".join(["python", *sys.argv]), "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "lolcats_options": LOLCATS_OPTIONS, "tokens": args.tokens,
              "repeats": args.repeats, "threads": args.threads, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

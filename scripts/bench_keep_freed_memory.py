"""What ``attnzoo train``'s allocator setting (:func:`attnzoo.training.keep_freed_memory`) saves: training
steps of the quick lra budget's cells with glibc's default allocator and with freed memory kept, side by side.

    PYTHONPATH=src python scripts/bench_keep_freed_memory.py [--task listops] [--repeats 3]
        [--mechanisms softmax,flash_gau,performer,vq,reformer]

Each run is a fresh process (the setting is process-wide) on one thread that trains the cell's model for
``WARMUP + MEASURED`` steps and stops; the two settings take turns. The table gives the median over runs of
each run's median step time, their ratio, and each setting's peak resident memory. The losses of the two
settings must be equal: the allocator changes no arithmetic."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WARMUP, MEASURED = 5, 10

# One cell's first steps in this process: prints its median step time, last loss and peak memory as JSON.
_RUN = """
import json, resource, statistics, sys, time, torch
torch.set_num_threads(1)
from attnzoo.experiments.lra import LraConfig
from attnzoo.training import keep_freed_memory, train
task, mechanism, setting, warmup, measured = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
if setting == "keep" and not keep_freed_memory():
    raise SystemExit("glibc's mallopt is not available here")
config = LraConfig(preset="quick").train_config(task, mechanism)
stamps, losses = [], []

def on_step(step, metrics):
    stamps.append(time.perf_counter())
    losses.append(metrics["loss"])
    if step == warmup + measured:
        raise KeyboardInterrupt  # stop before the evaluation: only training steps are timed

try:
    train(config, None, progress=False, on_step=on_step)
except KeyboardInterrupt:
    pass
steps = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
print(json.dumps({"step_seconds": statistics.median(steps), "loss": losses[-1],
                  "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(task: str, mechanism: str, setting: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN, task, mechanism, setting, str(WARMUP), str(MEASURED)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="listops")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mechanisms", default="softmax,flash_gau,performer,vq,reformer")
    args = parser.parse_args()
    print(f"{args.task} at the quick budget, 1 thread: seconds per training step (median of {MEASURED} after "
          f"{WARMUP}), median of {args.repeats} runs")
    print()
    print("| mechanism | default s/step | kept s/step | default / kept | peak MiB default | peak MiB kept |")
    print("|---|---|---|---|---|---|")
    for mechanism in args.mechanisms.split(","):
        runs = {"default": [], "keep": []}
        for _ in range(args.repeats):
            for setting in runs:
                runs[setting].append(run(args.task, mechanism, setting))
        losses = {r["loss"] for setting in runs for r in runs[setting]}
        if len(losses) != 1:
            raise SystemExit(f"{mechanism}: the two settings gave different losses {sorted(losses)}")
        seconds = {s: statistics.median(r["step_seconds"] for r in runs[s]) for s in runs}
        peak = {s: max(r["peak_memory_mib"] for r in runs[s]) for s in runs}
        print(f"| {mechanism} | {seconds['default']:.3f} | {seconds['keep']:.3f} | "
              f"{seconds['default'] / seconds['keep']:.2f} | {peak['default']:.0f} | {peak['keep']:.0f} |", flush=True)


if __name__ == "__main__":
    main()

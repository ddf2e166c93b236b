"""Sequence-parallel causal linear attention over gloo processes against one process.

Times forward+backward of causal ``linear`` attention (the mechanism on per-head q, k, v of batch 1, 8 heads,
head dim 64, float32) over ``--length`` positions:

* one process with 1 thread, and one with ``--ranks`` threads (the same cores as the parallel run);
* ``--ranks`` gloo processes of 1 thread each, each holding ``length / ranks`` positions
  (:func:`attnzoo.distributed.sequence_parallel_attention`); a barrier before each repeat, and a repeat's time
  is its slowest rank's.

``--work-ratio`` instead measures, in one process with 1 thread, one rank's work (half the positions, plus the
prefix term) against the whole single-process pass, the two taking turns: what the parallel run costs per rank
with the cores to itself, whatever else runs on the machine.

Also times the communication alone (the gather of one state per rank, and the all-reduce of its gradient, as
a layer's forward and backward make them) and measures each configuration's peak memory per process in a
pass of its own (resident high-water mark above the resident size just before, glibc's mmap threshold fixed,
as ``attnzoo compare`` measures it). Writes JSON.

    .venv/bin/python scripts/bench_sequence_parallel.py --length 65536 --output docs/results/sequence-parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import attnzoo
from attnzoo.bench.measure import PeakMemory, fix_malloc_threshold
from attnzoo.distributed import sequence_parallel_attention

HEADS, HEAD_DIM = 8, 64


def inputs(length: int, start: int = 0, stop: Optional[int] = None):
    """q, k, v (1, heads, length, head_dim), the same values however they are split; positions [start, stop)."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
    stop = length if stop is None else stop
    return [x[:, :, start:stop].clone().requires_grad_() for x in (q, k, v)]


def run_once(mechanism, q, k, v, parallel: bool) -> float:
    if parallel:
        dist.barrier()
    start = time.perf_counter()
    if parallel:
        out = sequence_parallel_attention(mechanism, q, k, v)
    else:
        out = mechanism(q, k, v, causal=True)
    out.sum().backward()
    elapsed = time.perf_counter() - start
    for x in (q, k, v):
        x.grad = None
    return elapsed


def worker(args) -> Dict[str, object]:
    """One process of a configuration: its times (and the communication's), or its peak memory."""
    torch.set_num_threads(args.threads)
    parallel = args.world > 1
    if parallel:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world,
                                timeout=timedelta(seconds=600))
    mechanism = attnzoo.build_mechanism("linear", heads=HEADS, head_dim=HEAD_DIM)
    part = args.length // args.world
    q, k, v = inputs(args.length, args.rank * part, (args.rank + 1) * part)
    result: Dict[str, object] = {"rank": args.rank}
    if args.memory:
        fix_malloc_threshold()
        run_once(mechanism, q, k, v, parallel)  # untimed: first-call allocations
        with PeakMemory("cpu") as peak:
            run_once(mechanism, q, k, v, parallel)
        result["peak_mib"] = peak.peak_bytes / 2**20
    else:
        run_once(mechanism, q, k, v, parallel)
        result["times_s"] = [run_once(mechanism, q, k, v, parallel) for _ in range(args.repeats)]
        if parallel:
            state = torch.randn(1, HEADS, HEAD_DIM * (HEAD_DIM + 1))
            gathered = [torch.empty_like(state) for _ in range(args.world)]
            comm = []
            for _ in range(20):
                dist.barrier()
                start = time.perf_counter()
                dist.all_gather(gathered, state)
                grads = torch.stack(gathered)
                dist.all_reduce(grads)
                comm.append(time.perf_counter() - start)
            result["communication_s"] = comm
            result["state_bytes"] = state.numel() * state.element_size()
    if parallel:
        dist.destroy_process_group()
    return result


def work_ratio(length: int, ranks: int, repeats: int) -> Dict[str, object]:
    """One rank's forward+backward (its 1/ranks of the positions: the zero-state pass, its state, the prefix term)
    against the whole sequence's, in this process, taking turns."""
    from attnzoo.functional.state_scan import finish_part, part_terms

    torch.set_num_threads(1)
    mechanism = attnzoo.build_mechanism("linear", heads=HEADS, head_dim=HEAD_DIM)
    prefix = torch.rand(1, HEADS, HEAD_DIM, HEAD_DIM + 1, generator=torch.Generator().manual_seed(1))

    def whole() -> float:
        return run_once(mechanism, *inputs(length), parallel=False)

    def one_rank() -> float:
        q, k, v = inputs(length, length - length // ranks)  # the last part: it has a prefix
        start = time.perf_counter()
        phi_q, phi_k, _ = mechanism.features(q, k, None)
        terms = part_terms(phi_q, phi_k, v, chunk_size=mechanism.chunk_size)
        out = finish_part(terms, phi_q, prefix.requires_grad_(), out_dtype=v.dtype)
        (out.sum() + terms.state.sum()).backward()
        return time.perf_counter() - start

    whole(), one_rank()
    samples: Dict[str, List[float]] = {"whole": [], "one_rank": []}
    for _ in range(repeats):
        samples["whole"].append(whole())
        samples["one_rank"].append(one_rank())
    medians = {name: statistics.median(times) for name, times in samples.items()}
    return {"whole_median_s": round(medians["whole"], 3), "one_rank_median_s": round(medians["one_rank"], 3),
            "ratio": round(medians["one_rank"] / medians["whole"], 3),
            "samples_s": {name: [round(t, 3) for t in times] for name, times in samples.items()}}


def launch(length: int, world: int, threads: int, repeats: int, memory: bool) -> List[Dict[str, object]]:
    with tempfile.TemporaryDirectory() as directory:
        outputs = [os.path.join(directory, f"rank{rank}.json") for rank in range(world)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        processes = [
            subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(rank), "--world", str(world),
                              "--threads", str(threads), "--length", str(length), "--repeats", str(repeats),
                              "--store", os.path.join(directory, "store"), "--result", outputs[rank]]
                             + (["--memory"] if memory else []), env=env)
            for rank in range(world)
        ]
        for process in processes:
            if process.wait(timeout=3600) != 0:
                raise RuntimeError(f"a worker failed with exit code {process.returncode}")
        results = []
        for path in outputs:
            with open(path) as handle:
                results.append(json.load(handle))
        return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=None)
    parser.add_argument("--work-ratio", action="store_true", help="one rank's work against the whole, in one process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.result, "w") as handle:
            json.dump(worker(args), handle)
        return 0

    if args.work_ratio:
        ratio = work_ratio(args.length, args.ranks, args.repeats)
        print(f"causal linear, N={args.length}, 1 thread: one of {args.ranks} ranks' work {ratio['one_rank_median_s']} s, "
              f"the whole {ratio['whole_median_s']} s: {ratio['ratio']}x ({ratio['samples_s']})")
        if args.output:
            with open(args.output, "w") as handle:
                json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "torch": torch.__version__, "load_average_after": os.getloadavg()},
                           "work_ratio": ratio}, handle, indent=2)
        return 0

    configurations = {
        "one process, 1 thread": (1, 1),
        f"one process, {args.ranks} threads": (1, args.ranks),
        f"{args.ranks} gloo processes, 1 thread each": (args.ranks, 1),
    }
    rows = []
    for label, (world, threads) in configurations.items():
        print(f"{label} ...", flush=True)
        timed = launch(args.length, world, threads, args.repeats, memory=False)
        memory = launch(args.length, world, threads, 1, memory=True)
        per_repeat = [max(result["times_s"][i] for result in timed) for i in range(args.repeats)]
        row = {"configuration": label, "processes": world, "threads": threads,
               "median_s": round(statistics.median(per_repeat), 3), "samples_s": [round(t, 3) for t in per_repeat],
               "peak_mib_per_process": [round(result["peak_mib"], 1) for result in memory]}
        if world > 1:
            comm = sorted(t for result in timed for t in result["communication_s"])
            row["communication_median_ms"] = round(1000 * statistics.median(comm), 3)
            row["state_bytes_per_rank"] = timed[0]["state_bytes"]
        rows.append(row)
        print(f"  {row}", flush=True)
    single = {row["threads"]: row["median_s"] for row in rows if row["processes"] == 1}
    parallel = rows[-1]["median_s"]
    print(f"\ncausal linear, batch 1, {HEADS} heads, head dim {HEAD_DIM}, N={args.length}, forward+backward:")
    for row in rows:
        print(f"  {row['configuration']:34s} {row['median_s']:7.3f} s  peak {row['peak_mib_per_process']} MiB "
              f"(rounds: {row['samples_s']})")
    print(f"  parallel / one process with {args.ranks} threads: {parallel / single[args.ranks]:.2f}x; "
          f"/ one process with 1 thread: {parallel / single[1]:.2f}x")
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "settings": {"length": args.length, "ranks": args.ranks, "repeats": args.repeats, "heads": HEADS,
                     "head_dim": HEAD_DIM, "dtype": "float32", "mechanism": "linear", "causal": True},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_after": os.getloadavg()},
        "rows": rows,
        "parallel_over_single": {f"{t} threads": round(parallel / s, 3) for t, s in single.items()},
    }
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

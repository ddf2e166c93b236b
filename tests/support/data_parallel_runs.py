"""Running a data-parallel job on gloo ranks in fresh processes (``data_parallel_worker.py``), for the tests of
data-parallel training and of mechanisms that train with hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.training import TrainConfig, find_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "data_parallel_worker.py"
TIMEOUT_S = 150  # two processes on two busy cores start in seconds; a hang fails instead of blocking CI


def run_ranks(tmp_path: Path, jobs: list, world: int = 2) -> list:
    """Run the worker on ``world`` gloo ranks with ``jobs`` (in order, in one launch); returns per job the list
    of each rank's result (a job's error fails the test)."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    job_path = folder / "jobs.json"
    job_path.write_text(json.dumps(jobs))
    store = folder / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    outs = [folder / f"rank{rank}.pt" for rank in range(world)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(store), str(rank), str(world), str(job_path),
                                   str(outs[rank])], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank in range(world)]
    deadline = time.monotonic() + TIMEOUT_S
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=max(deadline - time.monotonic(), 1))[0].decode())
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"data-parallel workers did not finish within {TIMEOUT_S} s")
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log
    per_rank = [torch.load(out, weights_only=False) for out in outs]
    for results in per_rank:
        for result in results:
            assert "error" not in result, result.get("traceback")
        assert len(results) == len(jobs)
    return [list(results) for results in zip(*per_rank)]


def job(config: TrainConfig, output: Path, **extra) -> dict:
    return {"config": config.as_dict(), "output": str(output), **extra}


def weights(output: Path) -> dict:
    return load_file(str(find_checkpoint(output) / "model.safetensors"))

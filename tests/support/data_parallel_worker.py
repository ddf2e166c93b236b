"""One rank of a data-parallel training test: ``python data_parallel_worker.py STORE RANK WORLD JOBS OUT``.

Joins a gloo group through a file store and runs ``attnzoo.training.train`` once for each job of JOBS (a JSON
list written by tests/training/test_data_parallel.py, each with ``config``, ``output``, ``resume``, ``stop_at``, and
``imports``: files of mechanisms of the test's own to import first, as ``attnzoo train --import`` does), in
order, then saves, per job, what it returned and its model's parameters and buffers, or the error it raised,
to OUT. Several jobs in one launch spare the tests the start-up of new processes."""

import importlib.util
import json
import os
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from attnzoo.distributed import assert_replicated
from attnzoo.training import TrainConfig, find_checkpoint, train
from attnzoo.parallel import DataParallel

TRAINED = []  # the model this rank trained, as the run wrapped it


class RecordingDataParallel(DataParallel):
    def wrap(self, model):
        TRAINED.append(model)
        return super().wrap(model)


def main():
    store, rank, world, job_path, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = []
    for job in json.loads(open(job_path).read()):
        results.append(run_job(job, rank, world))
        if "error" in results[-1]:  # the ranks may be out of step now: stop rather than wait
            break
    torch.save(results, out_path)
    dist.destroy_process_group()


def import_file(path):
    """Import the module at ``path`` once (registering the mechanisms it defines)."""
    name = os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def run_job(job, rank, world):
    for path in job.get("imports", []):
        import_file(path)
    config = None if job.get("config") is None else TrainConfig.from_dict(job["config"])
    stop_at = job.get("stop_at")
    signal_at = job.get("signal_at")  # {"rank": r, "step": s}: rank r alone receives SIGTERM after step s

    def on_step(step, metrics):
        if step == stop_at:
            raise KeyboardInterrupt
        if signal_at is not None and (rank, step) == (signal_at["rank"], signal_at["step"]):
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        done = train(config, job["output"], resume=job.get("resume", False), progress=False, on_step=on_step,
                     parallel=RecordingDataParallel(rank, world))
        model = TRAINED[-1]
        assert_replicated(model)  # parameters and buffers (random projections among them) equal on every rank
        result = {"test": done.test, "validation": done.validation, "steps": done.steps,
                  "tokens_per_second": done.tokens_per_second, "train_seconds": done.train_seconds,
                  "state": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}}
    except KeyboardInterrupt:
        # What the interrupted run left (rank 0 wrote it before the barrier that every rank passed).
        checkpoint = find_checkpoint(job["output"])
        result = {"interrupted": True, "step": int(find_checkpoint(job["output"]).name.split("-")[1]),
                  "checkpoints": sorted(p.name for p in checkpoint.parent.iterdir()),
                  "saved_state": torch.load(checkpoint / "state.pt", weights_only=True)}
    except Exception as error:  # reported to the test, which decides whether it was expected
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    return result


if __name__ == "__main__":
    main()

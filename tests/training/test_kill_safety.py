"""A real ``attnzoo train`` process killed with SIGKILL in the middle of a save: the run continues (``--resume``, or
``train TASK --output`` for one stopped before its first checkpoint) to the parameters of a run never killed,
and nothing the killed save left behind remains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.training import find_checkpoint

RECALL = {"train_size": 32, "validation_size": 8, "test_size": 8, "num_pairs": 4, "num_keys": 8, "num_values": 4}
ARGS = ["recall", "--task-options", json.dumps(RECALL), "--dim", "16", "--depth", "1", "--heads", "2",
        "--batch-size", "8", "--steps", "6", "--eval-interval", "2", "--dropout", "0.1", "--quiet", "--threads", "1"]

# Run in a child process: the save pauses at one point of its writing (after the files of the temporary checkpoint
# directory are written, or after LATEST's temporary file is written and before it is renamed), says so in a
# marker file, and waits there to be killed. The library itself is unchanged: the child wraps its functions.
PAUSING_CHILD = r"""
import sys, time
from pathlib import Path
from attnzoo.training import checkpoint
from attnzoo.cli import main

point, step, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

def pause():
    marker.write_text("paused")
    time.sleep(600)

if point == "checkpoint files":
    fsync_file = checkpoint._fsync_file
    def paused_fsync_file(path):
        fsync_file(path)
        if path.name == checkpoint.MANIFEST and path.parent.name.startswith(f".step-{step:06d}."):
            pause()
    checkpoint._fsync_file = paused_fsync_file
else:
    write_json = checkpoint._write_json_atomically
    def paused_write_json(path, data):
        if path.name == checkpoint.LATEST and data["step"] == step:
            temporary = path.with_name(f".{checkpoint.LATEST}.killed")
            temporary.write_text(json.dumps(data)[:10])  # half written
            pause()
        write_json(path, data)
    import json
    checkpoint._write_json_atomically = paused_write_json
sys.exit(main(sys.argv[4:]))
"""


def _attnzoo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnzoo.cli", *argv], capture_output=True, text=True, timeout=300)


def _killed_during_save(output: Path, point: str, step: int) -> None:
    """Start ``attnzoo train`` into ``output`` and SIGKILL it while it is paused in the save of ``step``."""
    marker = output.parent / f"{output.name}.paused"
    child = subprocess.Popen([sys.executable, "-c", PAUSING_CHILD, point, str(step), str(marker), "train", *ARGS,
                              "--output", str(output)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"the run ended before the pause: {child.stderr.read().decode()}")
        if time.monotonic() > deadline:
            child.kill()
            raise AssertionError("the run never reached the pause")
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL


def _weights(output: Path) -> dict:
    return load_file(str(find_checkpoint(output) / "model.safetensors"))


def _leftovers(output: Path) -> list:
    """Temporary files anywhere in the run directory, and checkpoints other than the latest."""
    hidden = [str(path.relative_to(output)) for path in output.rglob(".*")]
    latest = find_checkpoint(output).name
    others = [path.name for path in (output / "checkpoints").iterdir() if path.name not in ("LATEST", latest)]
    return hidden + others


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output = tmp_path_factory.mktemp("whole") / "run"
    done = _attnzoo("train", *ARGS, "--output", str(output))
    assert done.returncode == 0, done.stderr
    return output


# Each kill point once in each restart mode: before the first checkpoint (a run started afresh) and at a later
# save (the run falls back to the checkpoint of step 2). Every case is two processes, the cost of this module.
@pytest.mark.parametrize("point, step, restart", [
    ("checkpoint files", 2, "resume"),    # the first save, its temporary directory written
    ("latest", 2, "output"),              # the first save, complete and renamed, LATEST not yet replaced; the
                                          # same directory started again as a new run
    ("checkpoint files", 4, "resume"),    # a later save
    ("latest", 4, "resume"),
])
def test_a_run_killed_during_a_save_continues_to_the_uninterrupted_parameters(tmp_path, uninterrupted, point,
                                                                              step, restart):
    output = tmp_path / "run"
    _killed_during_save(output, point, step)
    stale = [path.name for path in (output / "checkpoints").iterdir() if path.name.startswith(".")]
    assert stale, "the kill left no temporary file: it did not happen during the save"
    if step == 2:
        assert not (output / "checkpoints" / "LATEST").exists()
    else:
        assert find_checkpoint(output).name == "step-000002"  # the last complete checkpoint still counts
    again = ["--resume", str(output), "--quiet", "--threads", "1"] if restart == "resume" else [*ARGS, "--output", str(output)]
    done = _attnzoo("train", *again)
    assert done.returncode == 0, done.stderr
    if step == 2:  # one line says the run starts again from step 0
        assert done.stderr.strip() == (f"attnzoo train: {output} holds a run stopped before its first checkpoint; "
                                       "starting it afresh" + (" with these settings" if restart == "output" else ""))
    else:
        assert done.stderr.strip() == ""
    whole, resumed = _weights(uninterrupted), _weights(output)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert _leftovers(output) == []
    columns = lambda run: [row.split(",")[:5] for row in (run / "metrics.csv").read_text().splitlines()]
    assert columns(output) == columns(uninterrupted)

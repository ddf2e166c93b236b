"""Data-parallel training (attnzoo.parallel.data): 2 gloo processes reach the parameters of one process
on the same global batch, random features are redrawn alike on every rank, rank 0 alone writes the checkpoint,
an interrupted 2-process run resumes exactly, and settings data parallelism cannot honour are refused.

Tolerances: the loop computes its loss in float32 (the logits are cast to float32), so two ranks' gradients,
summed by DDP, differ from one process's by float32 rounding of a reordered sum (relative 1e-7 of the largest
terms). Over four AdamW steps of lr 1e-3 that moves a parameter by about 1e-8 (measured: 1.5e-8 at most),
while a shard weighted wrongly moves some by the order of lr (1e-3) per step: the tolerance 1e-6 tells the two
apart. One exception: the key bias of softmax attention has a gradient that is zero in exact arithmetic (adding
q . b to every logit of a row leaves its softmax unchanged), so both runs feed AdamW pure rounding noise, which
AdamW normalises into steps of size lr in random directions; such a parameter says nothing about the gradient and
is left out of the comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.cli import main
from attnzoo.feature_maps import RandomFeatureMap
from attnzoo.mechanisms import hooks
from attnzoo.models import LanguageModel
from attnzoo.tasks import IGNORE_INDEX, load
import attnzoo.parallel.data
from attnzoo.parallel import DataParallel, launched_by_torchrun, mechanism_reasons
from attnzoo.training import TrainConfig, build_model, data_parallel_reasons, find_checkpoint, train
from attnzoo.training.loop import loss_and_tally

from data_parallel_runs import ROOT, TIMEOUT_S, job, run_ranks, weights

ATOL = 1e-6

TASKS = {
    "listops": {"train_size": 64, "validation_size": 16, "test_size": 16, "min_length": 8, "max_length": 24},
    "bytes": {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32},
    "copy": {"train_size": 64, "validation_size": 8, "test_size": 8, "length": 8, "min_length": 2},
}
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=4, eval_interval=2)


def small(task: str, **changes) -> TrainConfig:
    return TrainConfig(task, **{**SMALL, "task_options": TASKS[task], **changes})


def noise_only(name: str, config: TrainConfig) -> bool:
    """A softmax attention's key bias (see the module docstring): every cross-attention's, and the self-attention's
    when the mechanism is softmax."""
    softmax = "cross_attention" in name or (config.mechanism == "softmax" and "self_attention" in name)
    return softmax and name.endswith("k_proj.bias")


def assert_states_close(expected: dict, got: dict, config: TrainConfig) -> None:
    assert expected.keys() == got.keys()
    compared = [name for name in expected if not noise_only(name, config)]
    assert len(compared) > len(expected) - 4
    for name in compared:
        torch.testing.assert_close(got[name], expected[name], atol=ATOL, rtol=0, msg=name)


# -- two processes against one -------------------------------------------------------------------------------
CASES = {
    "listops": small("listops"),                                  # classification: equal shards
    "bytes": small("bytes", mechanism="performer"),               # byte-level language model
    "copy": small("copy", guide_loss=0.5, label_smoothing=0.1),  # unequal scored targets per shard, guide loss
    # No mechanism seed: the initial projection comes from the run's seed, the redraws from (seed, step).
    "redraw": small("listops", mechanism="performer", steps=5,
                    mechanism_options={"nb_features": 16, "redraw_interval": 2}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case of CASES trained by one process (here) and by two gloo ranks (all cases in one launch):
    {case: (one-process result, output directory, two-rank output directory, each rank's result)}."""
    tmp_path = tmp_path_factory.mktemp("data-parallel")
    ones = {case: train(config, tmp_path / f"{case}-one", progress=False) for case, config in CASES.items()}
    twos = run_ranks(tmp_path, [job(config, tmp_path / f"{case}-two") for case, config in CASES.items()])
    return {case: (ones[case], tmp_path / f"{case}-one", tmp_path / f"{case}-two", ranks)
            for case, ranks in zip(CASES, twos)}


@pytest.mark.slow  # starting two processes takes seconds (importing torch in each)
@pytest.mark.parametrize("case", ["listops", "bytes", "copy"])
def test_two_ranks_reach_the_parameters_of_one_process_on_the_global_batch(runs, case):
    config = CASES[case]
    one, one_output, two_output, ranks = runs[case]
    assert_states_close(weights(one_output), weights(two_output), config)
    for result in ranks:  # every rank returns rank 0's evaluation
        assert result["steps"] == config.steps and result["test"] == ranks[0]["test"]
        for key, value in one.test.items():
            if key == "ms_per_sentence":  # a wall-clock time, not a result of the parameters
                continue
            assert result["test"][key] == pytest.approx(value, abs=1e-4), key
    # The logged training loss is the global batch's, not rank 0's share of it.
    rows = lambda run: [row.split(",")[:5] for row in (run / "metrics.csv").read_text().splitlines()[1:]]
    for a, b in zip(rows(one_output), rows(two_output), strict=True):
        assert a[:2] == b[:2] and float(a[2]) == pytest.approx(float(b[2]), abs=1e-4)


@pytest.mark.slow
def test_random_features_are_redrawn_alike_on_every_rank(runs):
    config = CASES["redraw"]
    _, one_output, _, ranks = runs["redraw"]  # the worker has checked that the ranks' models agree
    projections = [name for name in ranks[0]["state"] if name.endswith("feature_map.projection")]
    assert projections
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # the model as the run built it, before any redraw
        initial = build_model(config, load(config.task, **config.task_options)).state_dict()
    one = weights(one_output)
    for name in projections:
        torch.testing.assert_close(ranks[0]["state"][name], ranks[1]["state"][name], atol=0, rtol=0)
        torch.testing.assert_close(ranks[0]["state"][name], one[name], atol=0, rtol=0)
        assert not torch.equal(one[name], initial[name])  # redrawn twice in 5 steps
    assert_states_close(one, {k: v for k, v in ranks[1]["state"].items() if k in one}, config)


def test_redraws_are_seeded_by_step_and_happen_every_interval():
    """What the loop calls after each optimiser step (the mechanisms' training hooks)."""
    torch.manual_seed(0)
    model = LanguageModel(20, dim=16, heads=2, depth=2, self_attention="performer",
                          self_attention_options={"nb_features": 8, "redraw_interval": 2})
    maps = [m for m in model.modules() if isinstance(m, RandomFeatureMap)]
    first = [m.projection.clone() for m in maps]
    hooks.after_optimizer_step(model, step=0, seed=3)  # one step counted, none due yet
    assert all(torch.equal(m.projection, p) for m, p in zip(maps, first))
    twin = LanguageModel(20, dim=16, heads=2, depth=2, self_attention="performer",
                         self_attention_options={"nb_features": 8, "redraw_interval": 2})
    twin.load_state_dict(model.state_dict())
    torch.manual_seed(123)  # the global generator plays no part in a redraw
    hooks.after_optimizer_step(model, step=1, seed=3)
    torch.manual_seed(456)
    hooks.after_optimizer_step(twin, step=1, seed=3)
    for m, t, p in zip(maps, [m for m in twin.modules() if isinstance(m, RandomFeatureMap)], first):
        assert torch.equal(m.projection, t.projection) and not torch.equal(m.projection, p)
    assert not torch.equal(maps[0].projection, maps[1].projection)  # layers draw differently, not the same one
    model.eval()
    redrawn = [m.projection.clone() for m in maps]
    hooks.after_optimizer_step(model, step=2, seed=3)
    hooks.after_optimizer_step(model, step=3, seed=3)  # evaluation counts no steps
    assert all(torch.equal(m.projection, p) for m, p in zip(maps, redrawn))


def test_a_run_that_redraws_resumes_to_bit_identical_parameters(tmp_path):
    config = CASES["redraw"]  # redraws after steps 2 and 4; interrupted after 3, between them
    train(config, tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut", progress=False, on_step=lambda step, metrics: step == 3 and stop())
    train(None, tmp_path / "cut", resume=True, progress=False)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stop():
    raise KeyboardInterrupt


# -- loss normalisation ------------------------------------------------------------------------------------------
def test_shard_weights_make_the_mean_of_shard_gradients_the_global_batch_gradient():
    """The DDP gradient (the mean over ranks) of the weighted shard losses equals the global batch's, with shards
    holding different numbers of scored targets (to float32 rounding: the loss casts the logits to float32)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, 7, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, 7, (8, 5), generator=generator)
    targets[:4, 1:] = IGNORE_INDEX  # the first shard scores 4 targets, the second 20
    weight = torch.randn(7, 7, dtype=torch.float64, generator=generator, requires_grad=True)

    def loss_of(rows):
        mean, tally = loss_and_tally("lm", logits[rows] @ weight, targets[rows], label_smoothing=0.1)
        return mean, tally

    whole = torch.autograd.grad(loss_of(slice(0, 8))[0], weight)[0]
    global_count = int((targets != IGNORE_INDEX).sum())
    shards = []
    for rank in range(2):
        parallel = DataParallel(rank, 2)
        rows = parallel.shard(torch.arange(8))
        mean, tally = loss_of(rows)
        shards.append(torch.autograd.grad(mean * parallel.loss_weight(tally.scored, global_count), weight)[0])
    torch.testing.assert_close(sum(shards) / 2, whole, atol=1e-6, rtol=1e-5)
    unweighted = sum(torch.autograd.grad(loss_of(DataParallel(r, 2).shard(torch.arange(8)))[0], weight)[0]
                     for r in range(2)) / 2
    assert (unweighted - whole).abs().max() > 1e-2  # plain per-shard means would be wrong here


# -- checkpoints and resume ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rank_zero_writes_one_checkpoint_and_an_interrupted_run_resumes_exactly(tmp_path):
    config = small("listops", dropout=0.1, steps=5)  # dropout: each rank's generator is saved and restored
    whole, cut, resumed, signalled = run_ranks(tmp_path, [
        job(config, tmp_path / "whole-run"),
        job(config, tmp_path / "cut-run", stop_at=3),
        {"config": None, "output": str(tmp_path / "cut-run"), "resume": True},
        job(config, tmp_path / "signalled-run", signal_at={"rank": 1, "step": 2}),
    ])
    # SIGTERM on one rank after step 2's all_reduce: both ranks stop after step 3 and save it together.
    assert [result.get("step") for result in signalled] == [3, 3]
    assert all(result.get("interrupted") for result in cut)
    # One complete checkpoint, no stray temporary directory, seen alike by both ranks.
    assert cut[0]["checkpoints"] == cut[1]["checkpoints"] == ["LATEST", "step-000003"]
    state = cut[1]["saved_state"]
    assert state["step"] == 3 and len(state["rank_rng"]) == 2 and not torch.equal(state["rank_rng"][0], state["rank_rng"][1])
    a, b = weights(tmp_path / "whole-run"), weights(tmp_path / "cut-run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for rank in range(2):
        assert all(torch.equal(whole[rank]["state"][k], resumed[rank]["state"][k]) for k in a)
    assert resumed[0]["test"] == whole[0]["test"]
    columns = lambda run: [row.split(",")[:5] for row in (tmp_path / run / "metrics.csv").read_text().splitlines()]
    assert columns("cut-run") == columns("whole-run")  # each evaluation logged once, by rank 0


class _RankOfTwo:
    """The parts of DataParallel that Replicas uses for generators: rank 1 of 2 on ``device``, gathering by
    pairing this rank's value with a stand-in for rank 0's."""

    world_size, rank, is_main = 2, 1, False

    def __init__(self, device):
        self.device, self.seeded = torch.device(device), None

    def wrap(self, model):
        return model

    def gather(self, value):
        return [torch.zeros_like(value), value]

    def seed_dropout(self, seed, step):
        self.seeded = (seed, step)


def _cuda_generator_stand_in(monkeypatch):
    """torch.cuda's generator calls, recorded (no GPU here): get returns a fixed state, set appends its args."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((8,), 7, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    return calls


def test_ranks_on_gpus_save_and_restore_every_rank_s_cuda_generator(monkeypatch):
    """Dropout on a GPU draws from the CUDA generator: a data-parallel checkpoint keeps each rank's, and a resume
    on as many ranks sets this rank's, so a resumed run draws the same dropout as an uninterrupted one."""
    from attnzoo.training.ranks import Replicas

    calls = _cuda_generator_stand_in(monkeypatch)
    cuda_rank = Replicas(_RankOfTwo("cuda:0"))
    saved = cuda_rank.rng_states()
    assert len(saved["rank_rng"]) == len(saved["rank_cuda_rng"]) == 2
    assert torch.equal(saved["rank_cuda_rng"][1], torch.full((8,), 7, dtype=torch.uint8))
    assert torch.equal(saved["cuda_rng"], saved["rank_cuda_rng"][1])  # what a single process resuming it reads
    before, model = torch.get_rng_state(), torch.nn.Linear(1, 1)
    try:
        assert cuda_rank.restore_rng(saved)
        cuda_rank.prepare(model, seed=0, start=3, restored=True)
        assert torch.equal(torch.get_rng_state(), saved["rank_rng"][1]) and cuda_rank.parallel.seeded is None
        assert calls[-1][1] == torch.device("cuda:0") and torch.equal(calls[-1][0], saved["rank_cuda_rng"][1])
        # A checkpoint without the CUDA generators (or from another number of ranks) cannot resume them: the
        # rank draws fresh ones from (seed, rank, step) instead of pairing a saved CPU state with a stale GPU one.
        assert not cuda_rank.restore_rng({"rank_rng": saved["rank_rng"]})
        cuda_rank.prepare(model, seed=0, start=3, restored=False)
        assert cuda_rank.parallel.seeded == (0, 3)
        # On the CPU the CPU generator is the whole story, and CUDA's is never touched.
        calls.clear()
        cpu_rank = Replicas(_RankOfTwo("cpu"))
        assert set(cpu_rank.rng_states()) == {"rank_rng"}
        assert cpu_rank.restore_rng({"rank_rng": saved["rank_rng"]}) and not calls
        assert torch.equal(torch.get_rng_state(), saved["rank_rng"][1])
        # A damaged state raises inside the checkpoint loading, which reports it as a CheckpointError.
        with pytest.raises((TypeError, RuntimeError)):
            cpu_rank.restore_rng({"rank_rng": ["not a state", "not a state"]})
    finally:
        torch.set_rng_state(before)


# -- refusals -------------------------------------------------------------------------------------------------
def test_a_batch_the_ranks_cannot_share_equally_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="batch_size 7 .* divisible by the 2 ranks"):
        train(small("listops", batch_size=7), tmp_path, progress=False, parallel=DataParallel(0, 2))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("changes, named", [
    ({"mechanism": "vq"}, "mechanism 'vq'"),
    ({"scheduled_sampling": "token"}, "scheduled_sampling 'token'"),
])
def test_settings_data_parallelism_cannot_honour_are_named(changes, named):
    task = "copy" if "scheduled_sampling" in changes else "listops"
    reasons = data_parallel_reasons(small(task, **changes), 2)
    assert len(reasons) == 1 and reasons[0].startswith(named)
    assert data_parallel_reasons(small(task), 2) == []


def test_a_model_whose_mechanisms_refuse_is_not_wrapped():
    model = LanguageModel(20, dim=16, heads=2, depth=2, self_attention="vq",
                          self_attention_options={"codebook_size": 4, "block_size": 4})
    (reason,) = mechanism_reasons(model)  # each reason once, however many layers give it
    assert reason.startswith("mechanism 'vq'")
    with pytest.raises(ValueError, match="mechanism 'vq' updates its codebooks"):
        DataParallel(0, 2).wrap(model)  # refused before any process group is needed
    assert mechanism_reasons(LanguageModel(20, dim=16, heads=2, depth=2)) == []


def test_the_old_import_path_still_works():
    import attnzoo.training.distributed
    from attnzoo.training.distributed import DataParallel as Old

    assert Old is DataParallel and attnzoo.training.distributed is attnzoo.parallel.data
    assert attnzoo.training.distributed.start_from_environment is attnzoo.parallel.start_from_environment


def test_a_torchrun_launch_is_recognised_by_its_environment():
    assert launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert not launched_by_torchrun({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    assert not launched_by_torchrun({})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        launched_by_torchrun({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"})


def test_the_train_command_under_torchrun_names_a_batch_the_ranks_cannot_share(capsys, tmp_path, monkeypatch):
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)  # as torchrun sets them; the check comes before joining any group
    options = ",".join(f"{key}={value}" for key, value in TASKS["listops"].items())
    code = main(["train", "listops", "--task-options", options, "--batch-size", "7", "--steps", "2",
                 "--output", str(tmp_path / "run")])
    assert code == 2
    assert "--batch-size 7 is the global batch and must be divisible by the 2 ranks" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_attnzoo_train_runs_under_torchrun(tmp_path, runs):
    options = ",".join(f"{key}={value}" for key, value in TASKS["listops"].items())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "attnzoo.cli", "train", "listops", "--task-options", options, "--dim", "16", "--depth", "1",
               "--heads", "2", "--batch-size", "8", "--steps", "4", "--eval-interval", "2", "--threads", "1",
               "--quiet", "--json", "--output", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # rank 0 alone prints the results
    assert printed["steps"] == 4 and printed["config"]["batch_size"] == 8
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["LATEST", "step-000004"]
    one, one_output, _, _ = runs["listops"]  # the same settings, trained by one process
    assert_states_close(weights(one_output), weights(tmp_path / "run"), CASES["listops"])
    assert printed["test"]["loss"] == pytest.approx(one.test["loss"], abs=1e-4)

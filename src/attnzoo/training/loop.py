"""The training loop: AdamW with warm-up and cosine decay, periodic evaluation, atomic checkpoints, exact resume.

Everything random is seeded from the config and saved with each checkpoint: the model's initial weights and
dropout draw from torch's generator, seeded at the start and restored on resume (the caller's own generator
state is left as it was: the run happens inside :func:`torch.random.fork_rng`); the order of the training
examples is a pure function of ``(seed, step)`` (:func:`batch_indices`). A run interrupted and resumed
therefore ends with exactly the parameters of one that was never interrupted.

A run is cut in three: :func:`_start` builds (or resumes) it, :func:`_train_step` takes one optimiser step, and
:func:`_evaluate_and_save` evaluates and writes a checkpoint. What the mechanisms add to training (an auxiliary
loss, an update after each optimiser step) comes through the training hooks of the mechanism contract
(:mod:`attnzoo.mechanisms.hooks`); whether the run spans several processes, through :mod:`attnzoo.training.ranks`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import tasks as task_registry
from .._validation import check_device
from ..mechanisms import hooks
from ..parallel.data import DataParallel
from ..tasks import Split, Task
from .checkpoint import (
    CheckpointError,
    begin_run,
    find_checkpoint,
    find_run,
    load_state,
    load_weights,
    read_config,
    save_checkpoint,
)
from .config import TrainConfig
from .decoders import GREEDY, DecoderSettings
from .evaluation import (  # noqa: F401  (Tally, loss_and_tally and model_logits are also public here)
    Tally,
    autocast,
    evaluate,
    input_tokens,
    loss_and_tally,
    model_logits,
    on_device,
    scored_targets,
    split_of,
    take,
    take_batch,
)
from .interrupts import Interrupts
from .length_groups import (
    LengthGroupedOrder,
    check_trimming_exact,
    epoch_permutation,
    example_lengths,
    trimmed_batch,
)
from .metrics_log import METRICS_CSV, MetricsLog  # noqa: F401  (METRICS_CSV is also public here)
from .model import build_model
from .nat import DEFAULT_LENGTH_LOSS
from .ranks import SingleProcess, ranks_of

RESULTS_JSON = "results.json"


# -- data order ----------------------------------------------------------------------------------------------
def batch_indices(size: int, batch_size: int, step: int, seed: int) -> Tensor:
    """Indices of the training examples of optimiser step ``step``: epoch after epoch, each a permutation of
    the ``size`` examples drawn from ``(seed, epoch)`` alone, cut into consecutive batches (a batch may span
    two epochs). A pure function of its arguments, so a resumed run sees the same batches."""
    start, stop = step * batch_size, (step + 1) * batch_size
    pieces = []
    for epoch in range(start // size, (stop - 1) // size + 1):
        order = epoch_permutation(size, seed, epoch)
        lo, hi = max(start - epoch * size, 0), min(stop - epoch * size, size)
        pieces.append(order[lo:hi])
    return torch.cat(pieces)


# -- results -------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a run reached: the metrics of its last validation and of the test split, beside the baseline."""

    config: TrainConfig
    steps: int
    validation: Dict[str, float]
    test: Dict[str, float]
    baseline: Dict[str, float]
    parameters: int
    train_seconds: float
    tokens_per_second: float
    peak_memory_mib: Optional[float] = None
    output: Optional[str] = None
    history: List[Dict[str, Any]] = field(default_factory=list)
    device: str = "cpu"
    peak_device_memory_mib: Optional[float] = None  # a CUDA run's peak allocated on the GPU (peak_memory_mib: host)

    def as_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["config"] = self.config.as_dict()
        return data


@dataclass
class _Run:
    """One training run between its steps: what :func:`_start` built and what the steps have reached."""

    config: TrainConfig
    task: Task
    ranks: SingleProcess
    model: nn.Module
    trained: nn.Module  # what the step calls: the model, or its data-parallel replica
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    out: Optional[Path]
    decoding: DecoderSettings
    log: MetricsLog
    bar: Any
    step: int
    validation: Dict[str, float]
    history: List[Dict[str, Any]] = field(default_factory=list)
    last_saved: int = 0
    batches: Optional[Callable[[int], Tensor]] = None  # step -> the global batch's example indices
    began: float = field(default_factory=time.perf_counter)
    evaluating: float = 0.0  # seconds spent evaluating, left out of the training throughput
    tokens_seen: int = 0
    smoothed: Optional[float] = None

    @property
    def train_split(self) -> Split:
        return split_of(self.task, "train", self.config.pack)

    @property
    def elapsed(self) -> float:
        """Seconds spent training so far (evaluations left out)."""
        return time.perf_counter() - self.began - self.evaluating


# -- building or resuming ------------------------------------------------------------------------------------
def _resolved_config(
    config: Optional[TrainConfig], out: Optional[Path], resume: bool
) -> Tuple[TrainConfig, Optional[Path]]:
    """The run's config and, when resuming, its latest checkpoint (None: the run stopped before its first one,
    and starts afresh from the config it recorded); a config given must equal the saved one."""
    if not resume:
        if config is None:
            raise ValueError("config is required unless resume=True")
        return config, None
    if out is None:
        raise ValueError("resume=True needs the output directory of the run to resume")
    checkpoint, saved = _resumable_run(out)
    if config is not None and config != saved:
        differences = ", ".join(f"{key}: {theirs!r} in the checkpoint, {mine!r} given"
                                for key, (mine, theirs) in config.differences(saved).items())
        raise CheckpointError(f"{checkpoint or out} was trained with another configuration ({differences})")
    return saved, checkpoint


def _start(
    config: TrainConfig, task: Task, checkpoint: Optional[Path], ranks: SingleProcess, out: Optional[Path],
    decoding: DecoderSettings, progress: bool,
) -> _Run:
    """Build the model, optimiser and schedule from the seed (inside the caller's forked generator), load the
    checkpoint's state when resuming, and open the log and progress bar."""
    torch.manual_seed(config.seed)
    model = build_model(config, task).to(ranks.device)  # before the optimiser, which follows its device
    optimizer = _optimizer(model, config)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, config.learning_rate_factor)
    start, validation, restored = 0, {}, False
    if checkpoint is not None:
        load_weights(checkpoint, model)
        state = load_state(checkpoint)
        try:
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            torch.set_rng_state(state["rng"])
            restored = ranks.restore_rng(state)  # a CUDA device's generator, and a data-parallel rank's own
            start = int(state["step"])
            validation = dict(state.get("validation", {}))
        except (KeyError, ValueError, RuntimeError, TypeError) as error:
            raise CheckpointError(f"{checkpoint}: training state does not fit this run ({error})") from None
    trained = ranks.prepare(model, config.seed, start, restored)
    if out is not None and ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out if ranks.is_main else None, start if checkpoint is not None else None)
    bar = _progress_bar(progress and ranks.is_main, config.steps, start, f"{config.model_label} on {task.name}")
    model.train()
    batches = _length_grouped_batches(config, task, model, ranks.device, checkpoint is not None) \
        if config.group_by_length else None
    return _Run(config, task, ranks, model, trained, optimizer, schedule, out, decoding, log, bar, start,
                validation, last_saved=start, batches=batches)


def check_length_grouping(
    config: TrainConfig, task: Task, model: nn.Module, device: torch.device = torch.device("cpu")
) -> None:
    """Raise ValueError if ``config.group_by_length`` would change what ``model`` computes: unless its outputs
    on a batch cut to its longest example equal those on the padded batch (see
    :func:`~attnzoo.training.length_groups.check_trimming_exact`). Nothing to check without the option."""
    if not config.group_by_length:
        return
    size = len(task.split("train"))
    if config.batch_size > size:
        raise ValueError(f"group_by_length needs batch_size at most the {size} training examples (every batch is "
                         f"full), got {config.batch_size}")

    def logits_of(data: Split) -> Tensor:
        index = torch.arange(len(data))
        inputs, _, mask, _ = take_batch(data, index, False, device)
        return model_logits(model, task, data, index, inputs, mask)[0]

    # Off the run's random stream, so that the run draws as it would without the check.
    with torch.random.fork_rng(devices=[]):
        check_trimming_exact(logits_of, model, task.split("train"), config.model_label)


def _length_grouped_batches(
    config: TrainConfig, task: Task, model: nn.Module, device: torch.device, resuming: bool
) -> LengthGroupedOrder:
    """The run's length-grouped batch order, once the model is shown to compute the same on cut batches (when the
    run starts: a resumed run was checked then, and its trained weights may sit nearer the tolerance)."""
    if not resuming:
        check_length_grouping(config, task, model, device)
    split = task.split("train")
    return LengthGroupedOrder(example_lengths(split), config.batch_size, config.seed)


# -- one step ------------------------------------------------------------------------------------------------
def _train_step(run: _Run, interrupts: Interrupts) -> Tuple[Dict[str, float], float, bool]:
    """One optimiser step on the global batch of step ``run.step`` (this rank's share of it): the task's loss
    plus the model's and the mechanisms' auxiliary losses, then the mechanisms' updates after the optimiser
    step. Returns the global batch's metrics, the step's learning rate and whether any rank had an interrupt
    requested by the end of the step."""
    config, split, step = run.config, run.train_split, run.step
    whole = run.batches(step) if run.batches is not None else batch_indices(len(split), config.batch_size, step,
                                                                            config.seed)
    index = run.ranks.shard(whole)  # the global batch; a data-parallel rank trains on its share of it
    data = split
    if config.group_by_length:  # this rank's share as a split of its own, cut to its longest example
        data, index = trimmed_batch(split, index), torch.arange(len(index))
    inputs, targets, mask, offsets = take_batch(data, index, config.pack, run.ranks.device)
    with autocast(config.precision, run.ranks.device):
        logits, auxiliary = model_logits(run.trained, run.task, data, index, inputs, mask, config=config,
                                         step=step, cu_seqlens=offsets)
    loss, tally = loss_and_tally(run.task.kind, logits, targets, label_smoothing=config.label_smoothing)
    if auxiliary is not None:  # the length head's loss (NAT) or the guide loss
        weight = config.guide_loss if config.decoding == "autoregressive" else (
            DEFAULT_LENGTH_LOSS if config.length_loss is None else config.length_loss)
        loss = loss + weight * auxiliary
    mechanisms_loss = hooks.auxiliary_loss(run.model)
    if mechanisms_loss is not None:
        loss = loss + mechanisms_loss
    (loss * run.ranks.loss_weight(tally.scored, scored_targets(split, whole))).backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    lr = run.optimizer.param_groups[0]["lr"]
    run.optimizer.step()
    hooks.after_optimizer_step(run.model, step, config.seed)  # seeded by (seed, step): alike on every rank
    run.optimizer.zero_grad(set_to_none=True)
    run.schedule.step()
    run.step += 1
    run.tokens_seen += input_tokens(split, whole)  # the global batch's, on every rank
    sums, interrupted = run.ranks.reduce((tally.loss_sum, tally.scored, tally.correct),
                                         interrupts.requested is not None)
    metrics = Tally(*sums).metrics(run.task)
    run.smoothed = metrics["loss"] if run.smoothed is None else 0.9 * run.smoothed + 0.1 * metrics["loss"]
    return metrics, lr, interrupted


def _show(run: _Run, metrics: Dict[str, float]) -> None:
    """The progress bar's smoothed loss, throughput and metric."""
    if run.bar is None:
        return
    shown = {"loss": f"{run.smoothed:.3f}", "tok/s": f"{run.tokens_seen / max(run.elapsed, 1e-9):.0f}"}
    if "accuracy" in metrics:
        shown["acc"] = f"{metrics['accuracy']:.3f}"
    else:
        shown["bpb"] = f"{metrics['bits_per_byte']:.3f}"
    run.bar.set_postfix(shown, refresh=False)
    run.bar.update(1)


# -- evaluating and saving -----------------------------------------------------------------------------------
def _validate(run: _Run) -> Dict[str, float]:
    """Rank 0's metrics on the validation split, on every rank."""
    config = run.config
    validation: Dict[str, float] = {}
    if run.ranks.is_main:
        validation = evaluate(run.model, run.task, "validation", batch_size=config.batch_size,
                              max_batches=config.eval_batches, precision=config.precision, decoding=run.decoding,
                              pack=config.pack, progress=run.bar is not None)
    return run.ranks.broadcast(validation)


def _evaluate_and_save(run: _Run, metrics: Dict[str, float], lr: float) -> None:
    """Log the step's training metrics, evaluate on the validation split and write a checkpoint."""
    elapsed = run.elapsed
    run.log.write({"step": run.step, "split": "train", "lr": lr, "elapsed_s": round(elapsed, 3),
                   "tokens_per_s": round(run.tokens_seen / max(elapsed, 1e-9), 1),
                   **{k: v for k, v in metrics.items() if k != "scored"}})
    evaluation_began = time.perf_counter()
    run.validation = _validate(run)
    run.evaluating += time.perf_counter() - evaluation_began
    row = {"step": run.step, "split": "validation", **run.validation}
    run.history.append(row)
    run.log.write(row)
    if run.bar is not None:
        run.bar.write(f"step {run.step}: validation " + ", ".join(
            f"{k} {v:.4f}" for k, v in run.validation.items() if k != "scored"))
    _save(run)


def _save(run: _Run) -> None:
    """A checkpoint of the step reached (rank 0 writes it; every rank waits until it is written)."""
    if run.out is None:
        return
    state = {"optimizer": run.optimizer.state_dict(), "schedule": run.schedule.state_dict(),
             "rng": torch.get_rng_state(), "validation": run.validation, **run.ranks.rng_states()}
    if run.ranks.is_main:
        save_checkpoint(run.out, run.step, run.model, _saved_config(run.config, run.task), state)
    run.ranks.barrier()
    run.last_saved = run.step


def _train_steps(run: _Run, on_step: Optional[Callable[[int, Dict[str, float]], None]]) -> None:
    """Step until ``config.steps``, evaluating and saving every ``eval_interval`` steps and at the end. An
    interrupt is taken at the end of a step: that step is saved and KeyboardInterrupt raised."""
    config, interrupts = run.config, Interrupts()
    try:
        with interrupts.deferred():
            while run.step < config.steps:
                metrics, lr, interrupted = _train_step(run, interrupts)
                _show(run, metrics)
                if run.step % config.eval_interval == 0 or run.step == config.steps:
                    _evaluate_and_save(run, metrics, lr)
                if on_step is not None:
                    on_step(run.step, metrics)
                if run.ranks.stops(interrupted, interrupts.requested is not None):
                    raise KeyboardInterrupt(interrupts.requested or "interrupted on another rank")
    except KeyboardInterrupt:
        if run.step > run.last_saved:
            _save(run)  # the step just finished is complete: the run resumes from it
        raise
    finally:
        if run.bar is not None:
            run.bar.close()
        run.log.close()


def _finish(run: _Run, command: Optional[Sequence[str]]) -> TrainResult:
    """Test (and, for a resumed finished run, validation) metrics from rank 0, and ``results.json``."""
    train_seconds = run.elapsed
    config, task, test = run.config, run.task, {}
    if run.ranks.is_main:
        if not run.validation:  # resumed a finished run: nothing trained, evaluate once
            run.validation = evaluate(run.model, task, "validation", batch_size=config.batch_size,
                                      max_batches=config.eval_batches, precision=config.precision,
                                      decoding=run.decoding, pack=config.pack)
        test = evaluate(run.model, task, "test", batch_size=config.batch_size, precision=config.precision,
                        decoding=run.decoding, pack=config.pack, progress=run.bar is not None)
    validation, test = run.ranks.broadcast((run.validation, test))
    result = TrainResult(
        config=config, steps=run.step, validation=validation, test=test, baseline=task.baseline(),
        parameters=sum(p.numel() for p in run.model.parameters()), train_seconds=round(train_seconds, 3),
        tokens_per_second=round(run.tokens_seen / max(train_seconds, 1e-9), 1), peak_memory_mib=_peak_memory_mib(),
        output=None if run.out is None else str(run.out), history=run.history, device=str(run.ranks.device),
        peak_device_memory_mib=_peak_device_memory_mib(run.ranks.device),
    )
    if run.out is not None and run.ranks.is_main:
        data = {"command": list(command) if command is not None else None, **result.as_dict()}
        (run.out / RESULTS_JSON).write_text(json.dumps(data, indent=2))
    return result


def _the_task(config: TrainConfig, loaded: Optional[Task]) -> Task:
    """The config's task: ``loaded`` if :func:`attnzoo.tasks.load` built it from the config's task and options
    (defaults included), else loaded now; any other task is refused."""
    if loaded is None:
        return task_registry.load(config.task, **config.task_options)
    built_from = getattr(loaded, "loaded_with", None)
    if getattr(loaded, "name", None) != config.task or built_from is None or built_from != {
            **task_registry.task_options(config.task), **config.task_options}:
        raise ValueError(f"task: the config trains {config.task!r} with options {config.task_options}; the task "
                         f"given is {getattr(loaded, 'name', type(loaded).__name__)!r} built from {built_from} "
                         "(pass what attnzoo.tasks.load(config.task, **config.task_options) returns)")
    return loaded


def train(
    config: Optional[TrainConfig],
    output: Optional[Union[str, Path]] = None,
    *,
    resume: bool = False,
    progress: bool = True,
    command: Optional[Sequence[str]] = None,
    on_step: Optional[Callable[[int, Dict[str, float]], None]] = None,
    parallel: Optional[DataParallel] = None,
    decoding: DecoderSettings = GREEDY,
    task: Optional[Task] = None,
    device: Union[str, torch.device, None] = None,
) -> TrainResult:
    """Train a model on a task; returns its validation and test metrics beside the task's trivial baseline.

    Args:
        config: what to train. With ``resume=True`` it may be None (the checkpoint's config is used); if given,
            it must equal the checkpoint's (a different run is refused, naming the fields that differ).
        output: directory for checkpoints (``checkpoints/``), ``metrics.csv`` and ``results.json``; None keeps
            nothing on disk.
        resume: continue from the latest checkpoint in ``output`` (same data order, optimiser, schedule, RNG); a
            run stopped before its first checkpoint starts afresh from the config it recorded in ``run.json``.
        progress: a tqdm bar with loss, the metric and tokens per second.
        command: the command line that started the run, recorded in ``results.json``.
        on_step: called after each optimiser step with (steps done, the step's training metrics).
        parallel: train data-parallel across the ranks of a process group (:mod:`attnzoo.parallel.data`;
            every rank calls ``train`` with the same arguments): each trains on its share of the configured
            (global) batch, and the parameters are those one process reaches on the global batch. Rank 0 alone
            evaluates and writes the output directory; every rank returns the same result. Settings or
            mechanisms it cannot honour are refused first (:func:`~attnzoo.training.data_parallel_reasons`).
        decoding: the decoder of a seq2seq task's decoded metrics, in every evaluation (greedy by default).
        task: the config's task as :func:`attnzoo.tasks.load` returns it for ``config.task`` and
            ``config.task_options`` (``attnzoo train`` loads it once to check the settings), so its data is not
            generated again; a task built otherwise, or from other options, is refused. None: loaded here.
        device: where a run of one process trains ("cpu", the default, or "cuda[:N]"); a data-parallel run
            trains on its ranks' devices. Not part of the config: a run may resume on another device (its
            dropout then draws from that device's generator, so it is no longer bit-identical).

    An interrupt (Ctrl-C, SIGTERM) is taken at the end of the current step: a checkpoint of that step is
    written (atomically) and KeyboardInterrupt raised, so ``resume=True`` carries on from there. A run killed
    at any moment (``kill -9``) resumes from its last complete checkpoint; what the stopped save left behind is
    removed when the run starts again (the rules: :mod:`attnzoo.training.checkpoint`).
    """
    out = None if output is None else Path(output)
    config, checkpoint = _resolved_config(config, out, resume)
    task = _the_task(config, task)
    ranks = ranks_of(parallel, None if device is None else training_device(device))
    ranks.check(config)
    if ranks.device.type != "cpu" and task.kind == "seq2seq":
        raise ValueError(f"{task.name}: seq2seq tasks train on the CPU only (asked to train on {ranks.device})")
    if out is not None and ranks.is_main:  # stale temporaries of a stopped save go; a new run records its config
        begin_run(out, _saved_config(config, task), checkpoint)
    # The caller's generators are left as they were: the CPU's, and the CUDA device's a single process trains on.
    cuda = [ranks.device] if ranks.device.type == "cuda" and parallel is None else []
    with torch.random.fork_rng(devices=cuda):
        run = _start(config, task, checkpoint, ranks, out, decoding, progress)
        _train_steps(run, on_step)
        return _finish(run, command)


def training_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as the torch.device a run trains on: the CPU, or a CUDA device this process sees, with its
    index (``"cuda"``: the current one); ValueError naming ``device`` otherwise."""
    chosen = check_device("device", device)
    if chosen.type == "cuda" and chosen.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return chosen


def _peak_device_memory_mib(device: torch.device) -> Optional[float]:
    """The most a CUDA run allocated on its GPU so far, in MiB (None on the CPU)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def _peak_memory_mib() -> Optional[float]:
    """Peak resident memory of this process so far, in MiB (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS, KiB elsewhere


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW that decays matrices only: biases, norm gains and embeddings keep their scale."""
    untouched = {id(p) for module in model.modules() if isinstance(module, (nn.Embedding, nn.LayerNorm))
                 for p in module.parameters(recurse=False)}
    decay, keep = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.dim() >= 2 and id(parameter) not in untouched else keep).append(parameter)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98), eps=1e-8)


def _progress_bar(enabled: bool, total: int, initial: int, label: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True, mininterval=0.5)


def _saved_config(config: TrainConfig, task: Task) -> Dict[str, Any]:
    return {"train": config.as_dict(), "task_built_with": task.options()}


def _train_config(saved: Dict[str, Any], where: Path) -> TrainConfig:
    try:
        return TrainConfig.from_dict(saved["train"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: does not describe a training run ({error})") from None


def _load_run(output: Path) -> Tuple[Path, TrainConfig]:
    checkpoint = find_checkpoint(output)
    return checkpoint, _train_config(read_config(checkpoint), checkpoint / "config.json")


def _resumable_run(output: Path) -> Tuple[Optional[Path], TrainConfig]:
    """The latest checkpoint of the run in ``output`` (None if it stopped before its first) and its config."""
    checkpoint, saved = find_run(output)
    return checkpoint, _train_config(saved, output / "run.json" if checkpoint is None else checkpoint / "config.json")


def load_trained(path: Union[str, Path]) -> Tuple[nn.Module, Task, TrainConfig]:
    """The model of a checkpoint (a run's output directory or a checkpoint directory), its task and config."""
    checkpoint, config = _load_run(Path(path))
    task = task_registry.load(config.task, **config.task_options)
    with torch.random.fork_rng(devices=[]):
        model = build_model(config, task)
    load_weights(checkpoint, model)
    return model.eval(), task, config


def evaluate_checkpoint(
    path: Union[str, Path], split: str = "test", decoding: DecoderSettings = GREEDY,
    device: Optional[torch.device] = None, progress: bool = False,
) -> Dict[str, Any]:
    """Metrics of a saved model on a split (a seq2seq model's decoded by ``decoding``), with the task's
    baseline and the run's config; on ``device`` (:func:`training_device`; None: the CPU); ``progress``: a bar
    of the batches."""
    model, task, config = load_trained(path)
    if device is not None:
        model = model.to(device)
    metrics = evaluate(model, task, split, batch_size=config.batch_size, precision=config.precision,
                       decoding=decoding, pack=config.pack, progress=progress)
    report = {"task": task.name, "mechanism": config.mechanism, "block": config.block, "layers": config.layers,
              "model": config.model_label, "split": split,
              "metrics": metrics, "baseline": task.baseline(), "config": config.as_dict()}
    if task.kind == "seq2seq":
        report["decoder"] = decoding.describe()
    return report

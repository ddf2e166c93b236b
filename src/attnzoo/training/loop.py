"""The training loop: AdamW with warm-up and cosine decay, periodic evaluation, atomic checkpoints, exact resume.

Everything random is seeded from the config and saved with each checkpoint: the model's initial weights and
dropout draw from torch's generator, seeded at the start and restored on resume (the caller's own generator
state is left as it was: the run happens inside :func:`torch.random.fork_rng`); the order of the training
examples is a pure function of ``(seed, step)`` (:func:`batch_indices`). A run interrupted and resumed
therefore ends with exactly the parameters of one that was never interrupted.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import tasks as task_registry
from ..feature_maps import RandomFeatureMap, redraw_random_features
from ..mechanisms.base import UnsupportedOptionError
from ..mechanisms.vq import auxiliary_loss as vq_auxiliary_loss, update_codebooks
from ..tasks import IGNORE_INDEX, Split, Task
from .checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_state,
    load_weights,
    read_config,
    save_checkpoint,
)
from .config import TrainConfig
from .distributed import DataParallel
from .decoders import GREEDY, DecoderSettings, corpus_bleu, timed_outputs
from .model import build_model
from .nat import DEFAULT_LENGTH_LOSS, is_non_autoregressive, nat_logits, nat_outputs
from .seq2seq import (
    DEFAULT_GUIDE_WIDTH,
    decoded_metrics,
    decoder_inputs,
    seq2seq_logits,
    smoothed_cross_entropy,
    strip_output,
)

LN2 = math.log(2.0)
METRICS_CSV = "metrics.csv"
RESULTS_JSON = "results.json"
CSV_FIELDS = ["step", "split", "loss", "accuracy", "bits_per_byte", "lr", "tokens_per_s", "elapsed_s",
              "exact_match", "token_error_rate", "guide_loss", "length_loss", "rare_token_recall", "bleu",
              "ms_per_sentence"]


# -- data order ----------------------------------------------------------------------------------------------
def batch_indices(size: int, batch_size: int, step: int, seed: int) -> Tensor:
    """Indices of the training examples of optimiser step ``step``: epoch after epoch, each a permutation of
    the ``size`` examples drawn from ``(seed, epoch)`` alone, cut into consecutive batches (a batch may span
    two epochs). A pure function of its arguments, so a resumed run sees the same batches."""
    start, stop = step * batch_size, (step + 1) * batch_size
    pieces = []
    for epoch in range(start // size, (stop - 1) // size + 1):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        lo, hi = max(start - epoch * size, 0), min(stop - epoch * size, size)
        pieces.append(order[lo:hi])
    return torch.cat(pieces)


def _take(split: Split, index: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    mask = None if split.padding_mask is None else split.padding_mask[index]
    return split.inputs[index], split.targets[index], mask


def _scored(split: Split, index: Tensor) -> int:
    """Scored targets of the examples ``index``: what the mean loss of their batch divides by."""
    return int((split.targets[index] != IGNORE_INDEX).sum())


def _tokens(split: Split, index: Tensor) -> int:
    """Input tokens (padding left out) of the examples ``index``."""
    if split.padding_mask is None:
        return split.inputs[index].numel()
    return int((~split.padding_mask[index]).sum())


# -- loss and metrics ----------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Sums over an evaluation: loss (nats) and counts, so that batches of any size average correctly."""

    loss_sum: float = 0.0
    scored: int = 0      # examples (classify) or scored positions (tag, lm)
    correct: int = 0

    def add(self, other: "Tally") -> None:
        self.loss_sum += other.loss_sum
        self.scored += other.scored
        self.correct += other.correct

    def metrics(self, task: Task) -> Dict[str, float]:
        loss = self.loss_sum / max(self.scored, 1)
        result = {"loss": loss, "scored": float(self.scored)}
        if task.metric == "bits_per_byte":
            result["bits_per_byte"] = loss / LN2
        else:
            result["accuracy"] = self.correct / max(self.scored, 1)
        return result


def loss_and_tally(
    kind: str, logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0
) -> Tuple[Tensor, Tally]:
    """Mean cross-entropy over the scored targets and its :class:`Tally`.

    kind "classify": logits (batch, classes), targets (batch,); "tag", "lm" and "seq2seq": logits
    (batch, seq, classes), targets (batch, seq) with :data:`IGNORE_INDEX` where nothing is scored.
    ``label_smoothing`` > 0: the label-smoothed loss (:func:`~attnzoo.training.seq2seq.smoothed_cross_entropy`)."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    scored = targets != IGNORE_INDEX
    count = int(scored.sum())
    if label_smoothing > 0:
        total = smoothed_cross_entropy(logits, targets, label_smoothing)
    else:
        total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = int(((logits.argmax(dim=-1) == targets) & scored).sum())
    tally = Tally(float(total.detach()), count, correct)
    return total / max(count, 1), tally


def model_logits(
    model: nn.Module, task: Task, data: Split, index: Tensor, inputs: Tensor, mask: Optional[Tensor], *,
    config: Optional[TrainConfig] = None, step: int = 0,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The model's logits for the examples ``index`` of ``data`` (inputs and mask already taken), and an
    auxiliary loss or None: the one call that differs per kind. A seq2seq model reads the decoder inputs
    too, mixed with its own predictions under scheduled sampling when ``config`` (training only) asks for it;
    its auxiliary loss is the (unweighted) guide loss of its cross-attention, in evaluation always (a measure
    of how diagonal the attention is) and in training when ``config.guide_loss`` > 0. A non-autoregressive
    model runs its one parallel pass instead; its auxiliary loss is the length head's (None without one)."""
    if task.kind != "seq2seq":
        return model(inputs, padding_mask=mask), None
    if is_non_autoregressive(model):
        return nat_logits(model, data, index, inputs, mask)
    mode = "none" if config is None else config.scheduled_sampling
    teacher = 1.0 if config is None else config.teacher_probability(step)
    seed = 0 if config is None else config.seed
    target_inputs = decoder_inputs(model, data, index, inputs, mask, mode=mode, teacher=teacher, seed=seed,
                                   step=step)
    guide_width = None
    if config is None or config.guide_loss > 0:
        guide_width = DEFAULT_GUIDE_WIDTH if config is None else config.guide_width
    return seq2seq_logits(model, data, index, inputs, mask, target_inputs, guide_width)


def _autocast(precision: str, device: torch.device = torch.device("cpu")) -> contextlib.AbstractContextManager:
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _on(device: torch.device, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """The tensors on ``device`` (a no-op on the CPU, where the splits live)."""
    return tuple(None if t is None else t.to(device) for t in tensors)


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, split: str = "validation", *, batch_size: int = 64,
    max_batches: Optional[int] = None, precision: str = "float32", decoding: DecoderSettings = GREEDY,
) -> Dict[str, float]:
    """Loss and the task's metric (accuracy, or bits per byte) of ``model`` on a split, in order, over its
    first ``max_batches`` batches (None: all of it). The model is put back in its training mode afterwards.
    A seq2seq task adds the decoded metrics of the decoder ``decoding`` (greedy by default): ``exact_match``,
    ``token_error_rate``, corpus ``bleu`` (0-100) and the decoding time ``ms_per_sentence``
    (:mod:`attnzoo.training.decoders`, the batch decoded at once), and the cross-attention's ``guide_loss`` at
    width 0.2 (0 when the attention is on the diagonal: how monotonic it has become); one with rare tokens to
    copy (``rare_ids``, as copy-names) also their ``rare_token_recall``. A non-autoregressive model decodes in
    one pass (``decoding`` must be greedy) and reports its ``length_loss`` instead of the guide loss."""
    data = task.split(split)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tally = Tally()
    predictions: List[List[int]] = []
    references: List[List[int]] = []
    auxiliary_sum, decode_seconds = 0.0, 0.0
    nat = is_non_autoregressive(model)
    if nat and decoding != GREEDY:
        raise UnsupportedOptionError(f"decoder {decoding.describe()}: a non-autoregressive model decodes in one "
                                     "parallel pass; leave the decoder options at greedy")
    generator = decoding.generator()
    try:
        for number, start in enumerate(range(0, len(data), batch_size)):
            if max_batches is not None and number >= max_batches:
                break
            index = torch.arange(start, min(start + batch_size, len(data)))
            inputs, targets, mask = _on(device, *_take(data, index))
            with _autocast(precision, device):
                logits, auxiliary = model_logits(model, task, data, index, inputs, mask)
                if task.kind == "seq2seq":
                    auxiliary_sum += 0.0 if auxiliary is None else float(auxiliary) * len(index)
                    if nat:
                        began = time.perf_counter()
                        outputs = nat_outputs(model, task, inputs, mask)
                        seconds = time.perf_counter() - began
                    else:
                        outputs, seconds = timed_outputs(model, inputs, mask, bos_id=task.bos_id,
                                                         eos_id=task.eos_id, max_new_tokens=task.target_len,
                                                         settings=decoding, generator=generator)
                    predictions += outputs
                    decode_seconds += seconds
                    references += [strip_output(row.tolist(), task.eos_id) for row in targets]
            tally.add(loss_and_tally(task.kind, logits, targets)[1])
    finally:
        model.train(was_training)
    metrics = tally.metrics(task)
    if task.kind == "seq2seq":
        metrics.update(decoded_metrics(predictions, references, getattr(task, "rare_ids", None)))
        if not nat or model.nat.length_head is not None:
            metrics["length_loss" if nat else "guide_loss"] = auxiliary_sum / max(len(references), 1)
        # Extended ids (source tokens outside the target vocabulary, produced by copying) are named too.
        metrics["bleu"] = corpus_bleu(predictions, references, (*task.target_tokens, *task.extended_tokens))
        metrics["ms_per_sentence"] = 1000.0 * decode_seconds / max(len(references), 1)
    return metrics


def _reduced(parallel: DataParallel, tally: Tally, stopping: bool) -> Tuple[Tally, bool]:
    """The tally of the whole global batch (summed over the ranks), and whether any rank is stopping."""
    loss_sum, scored, correct, stops = parallel.sum([tally.loss_sum, tally.scored, tally.correct, float(stopping)])
    return Tally(loss_sum, int(round(scored)), int(round(correct))), stops > 0


# -- interrupts ----------------------------------------------------------------------------------------------
class _Interrupts:
    """Ctrl-C or SIGTERM during a step is deferred to the end of that step, so the checkpoint written on the
    way out holds a consistent optimiser and model. A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    @contextlib.contextmanager
    def deferred(self) -> Iterator["_Interrupts"]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)


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

    def as_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["config"] = self.config.as_dict()
        return data


class _MetricsLog:
    """metrics.csv (and TensorBoard when it is installed). A resumed run drops the rows past its checkpoint."""

    def __init__(self, output: Optional[Path], resumed_step: Optional[int]) -> None:
        self.path = None if output is None else output / METRICS_CSV
        self.rows: List[Dict[str, Any]] = []
        self.board = None
        if self.path is None:
            return
        kept: List[Dict[str, str]] = []
        if resumed_step is not None and self.path.exists():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= resumed_step]
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(kept)
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
        except Exception:  # noqa: BLE001 - any failure to import just means no TensorBoard log
            SummaryWriter = None
        if SummaryWriter is not None:
            self.board = SummaryWriter(log_dir=str(output / "tensorboard"), purge_step=resumed_step)

    def write(self, row: Dict[str, Any]) -> None:
        row = {key: row.get(key, "") for key in CSV_FIELDS}
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=CSV_FIELDS).writerow(row)
        if self.board is not None:
            for key in ("loss", "accuracy", "bits_per_byte", "lr", "tokens_per_s"):
                if row[key] != "":
                    self.board.add_scalar(f"{row['split']}/{key}", float(row[key]), int(row["step"]))

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


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


def _load_run(output: Path) -> Tuple[Path, TrainConfig]:
    checkpoint = find_checkpoint(output)
    saved = read_config(checkpoint)
    try:
        return checkpoint, TrainConfig.from_dict(saved["train"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{checkpoint}: config.json does not describe a training run ({error})") from None


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
) -> TrainResult:
    """Train a model on a task; returns its validation and test metrics beside the task's trivial baseline.

    Args:
        config: what to train. With ``resume=True`` it may be None (the checkpoint's config is used); if given,
            it must equal the checkpoint's (a different run is refused, naming the fields that differ).
        output: directory for checkpoints (``checkpoints/``), ``metrics.csv`` and ``results.json``; None keeps
            nothing on disk.
        resume: continue from the latest checkpoint in ``output`` (same data order, optimiser, schedule, RNG).
        progress: a tqdm bar with loss, the metric and tokens per second.
        command: the command line that started the run, recorded in ``results.json``.
        on_step: called after each optimiser step with (steps done, the step's training metrics).
        parallel: train data-parallel across the ranks of a process group (:mod:`attnzoo.training.distributed`;
            every rank calls ``train`` with the same arguments): each trains on its share of the configured
            (global) batch, and the parameters are those one process reaches on the global batch. Rank 0 alone
            evaluates and writes the output directory; every rank returns the same result.
        decoding: the decoder of a seq2seq task's decoded metrics, in every evaluation (greedy by default).

    An interrupt (Ctrl-C, SIGTERM) is taken at the end of the current step: a checkpoint of that step is
    written (atomically) and KeyboardInterrupt raised, so ``resume=True`` carries on from there.
    """
    out = None if output is None else Path(output)
    checkpoint: Optional[Path] = None
    if resume:
        if out is None:
            raise ValueError("resume=True needs the output directory of the run to resume")
        checkpoint, saved = _load_run(out)
        if config is not None and config != saved:
            differences = ", ".join(f"{key}: {theirs!r} in the checkpoint, {mine!r} given"
                                    for key, (mine, theirs) in config.differences(saved).items())
            raise CheckpointError(f"{checkpoint} was trained with another configuration ({differences})")
        config = saved
    if config is None:
        raise ValueError("config is required unless resume=True")
    task = task_registry.load(config.task, **config.task_options)
    device = torch.device("cpu") if parallel is None else parallel.device
    if parallel is not None:
        parallel.check(config)
        if device.type != "cpu" and task.kind == "seq2seq":
            raise ValueError(f"{task.name}: seq2seq tasks train on the CPU only (data parallel on {device})")
    main = parallel is None or parallel.is_main  # the process that evaluates and writes files

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config, task)
        if parallel is not None:
            model.to(device)  # before the optimiser and its loaded state, which follow the parameters' device
        optimizer = _optimizer(model, config)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, config.learning_rate_factor)
        start = 0
        rank_rng = None  # every rank's generator state, in a checkpoint of a data-parallel run
        history: List[Dict[str, Any]] = []
        validation: Dict[str, float] = {}
        if checkpoint is not None:
            load_weights(checkpoint, model)
            state = load_state(checkpoint)
            try:
                optimizer.load_state_dict(state["optimizer"])
                schedule.load_state_dict(state["schedule"])
                torch.set_rng_state(state["rng"])
                start = int(state["step"])
                rank_rng = state.get("rank_rng")
                validation = dict(state.get("validation", {}))
            except (KeyError, ValueError, RuntimeError, TypeError) as error:
                raise CheckpointError(f"{checkpoint}: training state does not fit this run ({error})") from None
        trained: nn.Module = model  # what the training step calls: the model, or its data-parallel replica
        if parallel is not None:
            trained = parallel.wrap(model)
            if checkpoint is not None and isinstance(rank_rng, list) and len(rank_rng) == parallel.world_size:
                torch.set_rng_state(rank_rng[parallel.rank])  # resumed on as many ranks as it was saved from
            else:
                parallel.seed_dropout(config.seed, start)
        if out is not None and main:
            out.mkdir(parents=True, exist_ok=True)
        log = _MetricsLog(out if main else None, start if checkpoint is not None else None)
        saved_config = _saved_config(config, task)

        def save(step: int) -> None:
            if out is None:
                return
            state = {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                     "rng": torch.get_rng_state(), "validation": validation}
            if parallel is not None:  # every rank's dropout generator, for a resume on as many ranks
                state["rank_rng"] = parallel.gather(torch.get_rng_state())
            if main:
                save_checkpoint(out, step, model, saved_config, state)
            if parallel is not None:
                parallel.barrier()  # no rank runs ahead of a checkpoint still being written

        train_split = task.split("train")
        redraws = any(isinstance(m, RandomFeatureMap) and m.redraw_interval is not None for m in model.modules())
        bar = _progress_bar(progress and main, config.steps, start, f"{config.model_label} on {task.name}")
        began, tokens_seen, smoothed = time.perf_counter(), 0, None
        evaluating = 0.0  # seconds spent evaluating, left out of the training throughput
        model.train()
        step = last_saved = start
        interrupts = _Interrupts()
        try:
            with interrupts.deferred():
                while step < config.steps:
                    index = batch_indices(len(train_split), config.batch_size, step, config.seed)
                    whole = index  # the global batch; a data-parallel rank trains on its share of it
                    if parallel is not None:
                        index = parallel.shard(index)
                    inputs, targets, mask = _on(device, *_take(train_split, index))
                    with _autocast(config.precision, device):
                        logits, auxiliary = model_logits(trained, task, train_split, index, inputs, mask,
                                                         config=config, step=step)
                    loss, tally = loss_and_tally(task.kind, logits, targets, label_smoothing=config.label_smoothing)
                    if auxiliary is not None:  # the length head's loss (NAT) or the guide loss
                        weight = config.guide_loss if config.decoding == "autoregressive" else (
                            DEFAULT_LENGTH_LOSS if config.length_loss is None else config.length_loss)
                        loss = loss + weight * auxiliary
                    loss = loss + vq_auxiliary_loss(model)  # the commitment loss of vq attention (zero without it)
                    if parallel is not None:
                        # Both terms are means over this shard's scored targets; weighted by the shard's share
                        # of the global batch's, DDP's mean gradient is the one of the global batch's mean.
                        loss = loss * parallel.loss_weight(tally.scored, _scored(train_split, whole))
                    loss.backward()
                    if config.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                    lr = optimizer.param_groups[0]["lr"]
                    optimizer.step()
                    update_codebooks(model)  # vq's codebooks follow their keys by EMA, after the optimiser step
                    if redraws:  # seeded by (seed, step): alike on every rank and on resume
                        redraw_random_features(model, config.seed, step)
                    optimizer.zero_grad(set_to_none=True)
                    schedule.step()
                    step += 1
                    tokens_seen += _tokens(train_split, whole)  # the global batch's, on every rank
                    if parallel is not None:  # the global batch's metrics, and whether any rank is interrupted
                        tally, stopping = _reduced(parallel, tally, interrupts.requested is not None)
                    elapsed = time.perf_counter() - began - evaluating
                    metrics = tally.metrics(task)
                    smoothed = metrics["loss"] if smoothed is None else 0.9 * smoothed + 0.1 * metrics["loss"]
                    if bar is not None:
                        shown = {"loss": f"{smoothed:.3f}", "tok/s": f"{tokens_seen / max(elapsed, 1e-9):.0f}"}
                        if "accuracy" in metrics:
                            shown["acc"] = f"{metrics['accuracy']:.3f}"
                        else:
                            shown["bpb"] = f"{metrics['bits_per_byte']:.3f}"
                        bar.set_postfix(shown, refresh=False)
                        bar.update(1)
                    if step % config.eval_interval == 0 or step == config.steps:
                        log.write({"step": step, "split": "train", "lr": lr, "elapsed_s": round(elapsed, 3),
                                   "tokens_per_s": round(tokens_seen / max(elapsed, 1e-9), 1),
                                   **{k: v for k, v in metrics.items() if k != "scored"}})
                        evaluation_began = time.perf_counter()
                        if main:
                            validation = evaluate(model, task, "validation", batch_size=config.batch_size,
                                                  max_batches=config.eval_batches, precision=config.precision,
                                                  decoding=decoding)
                        if parallel is not None:
                            validation = parallel.broadcast(validation)
                        evaluating += time.perf_counter() - evaluation_began
                        row = {"step": step, "split": "validation", **validation}
                        history.append(row)
                        log.write(row)
                        if bar is not None:
                            bar.write(f"step {step}: validation " + ", ".join(
                                f"{k} {v:.4f}" for k, v in validation.items() if k != "scored"))
                        save(step)
                        last_saved = step
                    if on_step is not None:
                        on_step(step, metrics)
                    # Data parallel: every rank stops at the step whose all_reduce first carried an interrupt (one
                    # arriving later on one rank waits for the next step's), so all reach the checkpoint together.
                    if stopping if parallel is not None else interrupts.requested is not None:
                        raise KeyboardInterrupt(interrupts.requested or "interrupted on another rank")
        except KeyboardInterrupt:
            if step > last_saved and out is not None:
                save(step)  # the step just finished is complete: the run resumes from it
            raise
        finally:
            if bar is not None:
                bar.close()
            log.close()

        train_seconds = time.perf_counter() - began - evaluating
        test: Dict[str, float] = {}
        if main:
            if not validation:  # resumed a finished run: nothing trained, evaluate once
                validation = evaluate(model, task, "validation", batch_size=config.batch_size,
                                      max_batches=config.eval_batches, precision=config.precision,
                                      decoding=decoding)
            test = evaluate(model, task, "test", batch_size=config.batch_size, precision=config.precision,
                            decoding=decoding)
        if parallel is not None:
            validation, test = parallel.broadcast((validation, test))
    result = TrainResult(
        config=config, steps=step, validation=validation, test=test, baseline=task.baseline(),
        parameters=sum(p.numel() for p in model.parameters()), train_seconds=round(train_seconds, 3),
        tokens_per_second=round(tokens_seen / max(train_seconds, 1e-9), 1), peak_memory_mib=_peak_memory_mib(),
        output=None if out is None else str(out),
        history=history,
    )
    if out is not None and main:
        data = {"command": list(command) if command is not None else None, **result.as_dict()}
        (out / RESULTS_JSON).write_text(json.dumps(data, indent=2))
    return result


def load_trained(path: Union[str, Path]) -> Tuple[nn.Module, Task, TrainConfig]:
    """The model of a checkpoint (a run's output directory or a checkpoint directory), its task and config."""
    checkpoint, config = _load_run(Path(path))
    task = task_registry.load(config.task, **config.task_options)
    with torch.random.fork_rng(devices=[]):
        model = build_model(config, task)
    load_weights(checkpoint, model)
    return model.eval(), task, config


def evaluate_checkpoint(
    path: Union[str, Path], split: str = "test", decoding: DecoderSettings = GREEDY
) -> Dict[str, Any]:
    """Metrics of a saved model on a split (a seq2seq model's decoded by ``decoding``), with the task's
    baseline and the run's config."""
    model, task, config = load_trained(path)
    metrics = evaluate(model, task, split, batch_size=config.batch_size, precision=config.precision,
                       decoding=decoding)
    report = {"task": task.name, "mechanism": config.mechanism, "block": config.block, "split": split,
              "metrics": metrics, "baseline": task.baseline(), "config": config.as_dict()}
    if task.kind == "seq2seq":
        report["decoder"] = decoding.describe()
    return report

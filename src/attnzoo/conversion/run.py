"""A whole conversion, resumable at any moment: :func:`convert`.

The output folder holds ``conversion.json`` (the settings, what the teacher is, the command), ``checkpoint.pt``
(replaced atomically every ``checkpoint_every`` steps and at each stage's end: the trained tensors, the
optimiser, the step, the losses so far), and at the end ``model/`` (the converted model,
:func:`~attnzoo.conversion.load_converted`), ``results.json``, ``history.csv`` and ``loss.png``.

Every step is a function of the settings and the step number alone (windows taken in order, learning rates from
the step, adapters drawn from the seed, no dropout), so a conversion killed at any point and started again
with the same command redoes the steps since its last checkpoint exactly and ends with the same model.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ..pretrained import CausalLM
from .config import ConversionConfig
from .finetune import finetune_loss, mean_token_nll
from .lora import add_lora, attention_projection_names, lora_state
from .saved import save_converted
from .student import build_student, layer_plan, load_tensors, mechanism_state, trainable_only
from .transfer import held_out_errors, layers_to_keep, transfer_losses

CHECKPOINT = "checkpoint.pt"
SETTINGS = "conversion.json"
FORMAT = 1
TRANSFER, FINETUNE, DONE = "transfer", "finetune", "done"


# The settings that decide what stage 1 does: a conversion whose stage 1 ran with the same ones (and the same
# teacher) can start its stage 2 from that one's (``transfer_from``).
TRANSFER_SETTINGS = ("target", "target_options", "seq_len", "batch_size", "transfer_steps", "transfer_lr",
                     "transfer_lora", "selection_windows", "seed")


@dataclass
class ConversionResult:
    """What :func:`convert` did: the converted model's folder, the layers kept in softmax, each layer's held-out
    transfer error after stage 1, the losses by step and the perplexities measured; ``transfer_from``: the
    conversion whose stage 1 it started from, if any."""

    output: Path
    kept_softmax: List[int]
    layer_errors: List[float]
    history: List[Dict[str, Any]] = field(default_factory=list)
    perplexity: Dict[str, Dict[str, float]] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    transfer_from: Optional[str] = None


def learning_rate(base: float, step: int, total: int) -> float:
    """Linear warm-up over a tenth of the steps (at most 20), then cosine decay to a tenth of ``base``; a
    function of the step alone, so a resumed run follows the same schedule."""
    warmup = min(20, max(1, total // 10))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def _batch(windows: Tensor, step: int, batch_size: int) -> Tensor:
    """The windows of ``step``: the next ``batch_size`` in order, wrapping around."""
    indices = [(step * batch_size + offset) % windows.shape[0] for offset in range(batch_size)]
    return windows[indices]


def _perplexities(model: CausalLM, windows: Mapping[str, Tensor]) -> Dict[str, float]:
    return {name: math.exp(mean_token_nll(model, ids)) for name, ids in windows.items()}


def _layer_of(name: str) -> int:
    """The layer index of a CausalLM parameter name (``layers.3.attention...`` -> 3)."""
    return int(name.split(".")[1])


def _save_atomically(path: Path, state: Dict[str, Any]) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(descriptor)
    try:
        torch.save(state, temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _settings(config: ConversionConfig, source: Mapping[str, Any]) -> Dict[str, Any]:
    return {"format": FORMAT, "config": config.to_dict(), "source": dict(source)}


def check_output(output: Union[str, os.PathLike], config: ConversionConfig, source: Mapping[str, Any]) -> bool:
    """Whether ``output`` holds a conversion to resume (False: a new one starts there); a folder holding a
    conversion with other settings or another teacher is refused, naming it. Reads only."""
    written = Path(output) / SETTINGS
    if not written.exists():
        return False
    saved = json.loads(written.read_text())
    if isinstance(saved.get("config"), dict):  # settings added since it was written take their defaults
        try:
            saved["config"] = ConversionConfig.from_dict(saved["config"]).to_dict()
        except (TypeError, ValueError):
            pass  # unreadable settings: refused below as other settings
    settings = _settings(config, source)
    if {key: saved.get(key) for key in json.loads(json.dumps(settings))} != json.loads(json.dumps(settings)):
        raise ValueError(f"output {str(output)!r} holds a conversion with other settings or another teacher "
                         f"({written}): choose a new folder, or repeat that conversion's settings to resume it")
    return (Path(output) / CHECKPOINT).exists()


def _start(output: Path, config: ConversionConfig, source: Mapping[str, Any], command: Optional[Sequence[str]],
           transfer_from: Optional[str], resuming: bool) -> Optional[Dict[str, Any]]:
    """Write the folder's settings (:func:`check_output` has checked them and said whether it is ``resuming``);
    returns the checkpoint to resume from, or None."""
    output.mkdir(parents=True, exist_ok=True)
    if not (output / SETTINGS).exists():
        settings = {**_settings(config, source), "command": list(command) if command else None,
                    "transfer_from": transfer_from}
        (output / SETTINGS).write_text(json.dumps(settings, indent=2))
    return torch.load(output / CHECKPOINT, weights_only=True) if resuming else None


def _stage_1_source(output: Path, given: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    """The conversion whose stage 1 this one starts from: ``given``, or what the folder's settings recorded (a
    conversion stopped before its first checkpoint starts from the same one); another one than recorded is
    refused."""
    recorded = json.loads((output / SETTINGS).read_text()).get("transfer_from") if (output / SETTINGS).exists() \
        else None
    if given is not None and recorded is not None and str(given) != recorded:
        raise ValueError(f"--transfer-from {given}: output {str(output)!r} started from {recorded}")
    return str(given) if given is not None else recorded


def transfer_start(folder: Union[str, os.PathLike], config: ConversionConfig, source: Mapping[str, Any],
                   depth: int) -> Dict[str, Any]:
    """The state a conversion starts from to skip its stage 1: the stage 1 of the conversion in ``folder``,
    which must have the same teacher (``source``) and :data:`TRANSFER_SETTINGS` and have finished that stage
    with every one of the ``depth`` layers converted; the layers kept in softmax are chosen again from its
    held-out errors for ``config.keep_softmax``. Reads only; errors name what differs."""
    folder = Path(folder)
    if not (folder / SETTINGS).exists():
        raise FileNotFoundError(f"--transfer-from {str(folder)!r} holds no conversion ({SETTINGS} is missing)")
    saved = json.loads((folder / SETTINGS).read_text())
    if saved.get("source") != json.loads(json.dumps(dict(source))):
        raise ValueError(f"--transfer-from {folder}: converted from another model file")
    ours = json.loads(json.dumps(config.to_dict()))
    if config.transfer_lora:  # its stage 2 trained the stage 1 adapters on: they are not kept apart
        raise ValueError(f"--transfer-from {folder}: a stage 1 with transfer_lora trains the adapters stage 2 goes on "
                         "training, so a finished conversion no longer holds them; convert from the start")
    defaults = ConversionConfig().to_dict()  # for settings added since that conversion was written
    for name in TRANSFER_SETTINGS:
        if saved["config"].get(name, defaults[name]) != ours[name]:
            raise ValueError(f"--transfer-from {folder}: its stage 1 ran with {name} {saved['config'].get(name)!r}, "
                             f"this conversion asks for {ours[name]!r}")
    state = torch.load(folder / CHECKPOINT, weights_only=True) if (folder / CHECKPOINT).exists() else None
    if state is None or state["stage"] == TRANSFER:
        raise ValueError(f"--transfer-from {folder}: its stage 1 has not finished (resume it first)")
    tensors = {name: t for name, t in state["tensors"].items() if ".lora_" not in name}
    missing = sorted(set(range(depth)) - {_layer_of(name) for name in tensors})
    if missing:
        raise ValueError(f"--transfer-from {folder}: it kept layers {missing} in softmax, whose stage 1 tensors it "
                         "did not save; take a conversion with --keep-softmax 0")
    return {
        "format": FORMAT, "stage": FINETUNE, "step": 0, "tensors": tensors, "optimizer": {},
        "history": [row for row in state["history"] if row["stage"] == TRANSFER],
        "layer_errors": list(state["layer_errors"]),
        "kept": layers_to_keep(state["layer_errors"], list(range(depth)), config.keep_softmax),
        "perplexity": {}, "seconds": {TRANSFER: state["seconds"].get(TRANSFER, 0.0)},
        "transfer_from": str(folder),
    }


def _progress(enabled: bool, total: int, initial: int, label: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=label, disable=not enabled, dynamic_ncols=True)


def _train(
    stage: str, student: CausalLM, names: Sequence[str], steps: int, lr: float, state: Dict[str, Any],
    step_loss: Callable[[Tensor], float], windows: Tensor, config: ConversionConfig, output: Path,
    progress: bool, on_step: Optional[Callable[[str, int], None]],
) -> None:
    """Run ``stage`` from ``state["step"]`` to ``steps`` with AdamW on ``names``, checkpointing; ``step_loss``
    computes a batch's loss and back-propagates it, returning its value."""
    parameters = trainable_only(student, names)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    if state.get("optimizer"):
        optimizer.load_state_dict(state["optimizer"])
    bar = _progress(progress, steps, state["step"], f"{stage} ({len(parameters)} tensors)")
    started = time.perf_counter() - state["seconds"].get(stage, 0.0)
    while state["step"] < steps:
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(lr, step, steps)
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(_batch(windows, step, config.batch_size))
        if not math.isfinite(loss):
            raise FloatingPointError(f"{stage} step {step}: the loss is {loss}; lower the learning rate")
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        state["step"] = step + 1
        tokens = state["step"] * config.batch_size * windows.shape[1]
        state["history"].append({"stage": stage, "step": state["step"], "tokens": tokens, "loss": loss})
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        state["seconds"][stage] = time.perf_counter() - started
        if state["step"] % config.checkpoint_every == 0 or state["step"] == steps:
            state["tensors"] = {**state["tensors"], **{name: p.detach().clone() for name, p in zip(names, parameters)}}
            state["optimizer"] = optimizer.state_dict()
            _save_atomically(output / CHECKPOINT, state)
        if on_step is not None:
            on_step(stage, state["step"])
    bar.close()


def convert(
    teacher: CausalLM,
    train_windows: Tensor,
    selection_windows: Tensor,
    output: Union[str, os.PathLike],
    config: ConversionConfig,
    *,
    source: Mapping[str, Any],
    evaluation_windows: Optional[Mapping[str, Tensor]] = None,
    progress: bool = True,
    command: Optional[Sequence[str]] = None,
    on_step: Optional[Callable[[str, int], None]] = None,
    transfer_from: Optional[Union[str, os.PathLike]] = None,
    finetune_windows: Optional[Tensor] = None,
) -> ConversionResult:
    """Convert ``teacher`` (a softmax :class:`~attnzoo.pretrained.CausalLM`, frozen) to ``config.target``.

    Args:
        teacher: the pretrained model.
        train_windows: (n, seq_len) token ids the two stages train on, taken in order.
        selection_windows: (m, seq_len) held-out ids on which each layer's transfer error is measured.
        output: the conversion's folder; a folder holding a checkpoint of the same settings is resumed.
        config: the settings (:class:`ConversionConfig`).
        source: JSON-serialisable facts naming the teacher (e.g. its GGUF file), saved with the model and
            compared on resume.
        evaluation_windows: named sets of held-out ids, each (k, length) (e.g. ``{"prose": ..., "code": ...}``);
            the perplexity of the teacher, the raw swap, the model after stage 1 and the converted model is
            measured on each.
        progress: show progress bars.
        command: the command line that asked for this, saved in ``conversion.json``.
        on_step: called with (stage, steps done) after every step (and after each checkpoint it implies).
        transfer_from: another conversion's folder whose stage 1 this one takes instead of running its own
            (:func:`transfer_start`): a hybrid with another ``keep_softmax``, or another stage 2, at the cost of
            stage 2 alone. Its raw swap is not measured again.
        finetune_windows: (n, finetune_seq_len) ids stage 2 trains on, required when ``config.finetune_seq_len``
            differs from ``seq_len`` (otherwise stage 2 takes ``train_windows``).
    """
    output = Path(output)
    config.check_fits(teacher.config)
    if finetune_windows is None and config.stage_2_seq_len == config.seq_len:
        finetune_windows = train_windows
    for name, windows, length in (("train_windows", train_windows, config.seq_len),
                                  ("selection_windows", selection_windows, config.seq_len),
                                  ("finetune_windows", finetune_windows, config.stage_2_seq_len)):
        if not isinstance(windows, Tensor) or windows.dim() != 2 or windows.shape[1] != length:
            setting = "seq_len" if length == config.seq_len else "finetune_seq_len"
            raise ValueError(f"{name} must be a (n, {setting}={length}) tensor of token ids")
    teacher.requires_grad_(False).eval()
    resuming = check_output(output, config, source)  # before anything is written
    reused = _stage_1_source(output, transfer_from)
    reused_state = None
    if reused is not None and not resuming:
        reused_state = transfer_start(reused, config, source, teacher.config.depth)
    state = _start(output, config, source, command, reused, resuming) or reused_state or {
        "format": FORMAT, "stage": TRANSFER, "step": 0, "tensors": {}, "optimizer": {}, "history": [],
        "layer_errors": [], "kept": [], "perplexity": {}, "seconds": {},
    }
    job = _Job(teacher, train_windows, finetune_windows, selection_windows, output, config, dict(source),
               evaluation_windows, progress, on_step, state)
    if state["stage"] == TRANSFER:
        _transfer_stage(job)
    if state["stage"] == FINETUNE:
        _finetune_stage(job)
    result = ConversionResult(output, list(state["kept"]), list(state["layer_errors"]), list(state["history"]),
                              dict(state["perplexity"]), dict(state["seconds"]), state.get("transfer_from"))
    _write_results(output, result, config)
    return result


@dataclass
class _Job:
    """One conversion's inputs and its running state (what the checkpoint saves)."""

    teacher: CausalLM
    train_windows: Tensor
    finetune_windows: Tensor
    selection_windows: Tensor
    output: Path
    config: ConversionConfig
    source: Dict[str, Any]
    evaluation_windows: Optional[Mapping[str, Tensor]]
    progress: bool
    on_step: Optional[Callable[[str, int], None]]
    state: Dict[str, Any]

    def measure(self, label: str, model: CausalLM) -> None:
        """Record ``model``'s perplexity on the evaluation windows under ``label`` (once; kept on resume)."""
        if self.evaluation_windows is not None and label not in self.state["perplexity"]:
            self.state["perplexity"][label] = _perplexities(model, self.evaluation_windows)

    def train(self, stage: str, student: CausalLM, names: Sequence[str], steps: int, lr: float,
              step_loss: Callable[[Tensor], float]) -> None:
        windows = self.finetune_windows if stage == FINETUNE else self.train_windows
        _train(stage, student, names, steps, lr, self.state, step_loss, windows, self.config, self.output,
               self.progress, self.on_step)


def _transfer_stage(job: _Job) -> None:
    """Stage 1 on every layer, then each layer's held-out error and the layers a hybrid keeps."""
    teacher, config, state = job.teacher, job.config, job.state
    every_layer = list(range(teacher.config.depth))
    student = build_student(teacher, layer_plan(len(every_layer), every_layer, config.target, config.target_options),
                            config.seed)
    job.measure("teacher", teacher)
    job.measure("raw_swap", student)
    names = list(mechanism_state(student)) if config.transfer_steps else []
    if config.transfer_lora:  # the adapters stage 2 continues, trained on the layer-wise loss first
        names += add_lora(student, attention_projection_names(every_layer), config.lora_rank, config.lora_alpha,
                          config.seed)
    if state["tensors"]:
        load_tensors(student, state["tensors"])
    if names:
        job.train(TRANSFER, student, names, config.transfer_steps, config.transfer_lr,
                  lambda tokens: sum(transfer_losses(teacher, student, tokens, every_layer, backward=True))
                  / len(every_layer))
    student.requires_grad_(False)
    state["layer_errors"] = held_out_errors(teacher, student, job.selection_windows, every_layer)
    state["kept"] = layers_to_keep(state["layer_errors"], every_layer, config.keep_softmax)
    state.update(stage=FINETUNE, step=0, tensors={**mechanism_state(student), **lora_state(student)}, optimizer={})
    _save_atomically(job.output / CHECKPOINT, state)


def _finetune_stage(job: _Job) -> None:
    """Stage 2: adapters on the converted layers of the final plan; then the model is saved."""
    teacher, config, state = job.teacher, job.config, job.state
    depth = teacher.config.depth
    converted = [index for index in range(depth) if index not in state["kept"]]
    plan = layer_plan(depth, converted, config.target, config.target_options)
    student = build_student(teacher, plan, config.seed)
    job.measure("teacher", teacher)  # measured in stage 1, unless that stage was another conversion's
    lora_names = add_lora(student, attention_projection_names(converted), config.lora_rank, config.lora_alpha,
                          config.seed)
    # The converted layers' tensors: stage 1's (its adapters too, with transfer_lora), or stage 2's on resume.
    load_tensors(student, {name: tensor for name, tensor in state["tensors"].items() if _layer_of(name) in converted})
    job.measure("transferred", student)  # the adapters are zero here unless stage 1 trained them
    trained = lora_names + (list(mechanism_state(student)) if config.finetune_mechanism else [])
    if config.finetune_steps:
        reference = teacher if config.finetune_loss == "teacher_logits" else None

        def step_loss(tokens: Tensor) -> float:
            loss = finetune_loss(student, tokens, config.finetune_loss, reference)
            loss.backward()
            return loss.item()

        job.train(FINETUNE, student, trained, config.finetune_steps, config.finetune_lr, step_loss)
    student.requires_grad_(False).eval()
    job.measure("converted", student)
    state.update(stage=DONE, tensors={**mechanism_state(student), **lora_state(student)}, optimizer={})
    save_converted(job.output / "model", student, plan, config, job.source)
    _save_atomically(job.output / CHECKPOINT, state)


def _write_results(output: Path, result: ConversionResult, config: ConversionConfig) -> None:
    """results.json, history.csv and loss.png (conversion loss against training tokens, one panel a stage)."""
    summary = {"config": config.to_dict(), "kept_softmax": result.kept_softmax, "layer_errors": result.layer_errors,
               "perplexity": result.perplexity, "seconds": result.seconds, "transfer_from": result.transfer_from,
               "final_loss": {stage: [row["loss"] for row in result.history if row["stage"] == stage][-1:]
                              for stage in (TRANSFER, FINETUNE)}}
    (output / "results.json").write_text(json.dumps(summary, indent=2))
    lines = ["stage,step,tokens,loss"] + [f"{r['stage']},{r['step']},{r['tokens']},{r['loss']:.6g}"
                                          for r in result.history]
    (output / "history.csv").write_text("\n".join(lines) + "\n")
    from .figures import plot_history

    plot_history(result.history, result.layer_errors, result.kept_softmax, output / "loss.png")

"""What one training run is: the task, the model, the optimiser and the schedule, in one validated record.

A :class:`TrainConfig` is written into every checkpoint (``config.json``) and is all ``attnzoo eval`` and
``--resume`` need to rebuild the task, the model and the optimiser.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from .._validation import check_bool, check_choice, check_number, check_positive_int, check_probability
from ..models.config import BLOCKS
from .nat import check_decoding_settings
from .seq2seq import (
    DEFAULT_GUIDE_WIDTH,
    SAMPLING_DECAYS,
    SCHEDULED_SAMPLING,
    check_sampling_k,
    default_sampling_k,
    teacher_probability,
)

PRECISIONS = ("float32", "bfloat16")
POOLINGS = ("mean", "cls")
POSITIONALS = ("sinusoidal", "learned", "rotary", "none")



@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run.

    Args:
        task, task_options: a task of :mod:`attnzoo.tasks` and the options it is built with (its data ``seed``
            among them; the task's own default otherwise).
        mechanism, mechanism_options: the attention of every self-attention slot and its options. A mechanism
            whose option must equal the sequence length (``length_option``) gets the task's length by default.
        block, block_options: "attention" (attention + feed-forward layers), or "gau" / "flash" (every layer a
            gated attention unit, with ``block_options`` such as ``chunk_size``; ``mechanism`` stays softmax).
        dim, depth, heads, ff_dim, dropout, positional, pooling: the model (pooling for classification only).
        kv_heads: key/value heads of the self-attention (grouped-query attention), dividing ``heads``; None: heads.
        token_shift: half of each position's embedding features come from the token before it
            (:class:`~attnzoo.models.TokenEmbedding`); not for seq2seq tasks.
        batch_size, steps: sequences per step and optimiser steps in all.
        lr, warmup_steps, min_lr_ratio: AdamW's peak learning rate, reached linearly over ``warmup_steps``
            (None: a tenth of ``steps``), then cosine decay down to ``min_lr_ratio * lr`` at the last step.
        weight_decay: AdamW's decoupled decay, applied to matrices only (not to biases, norms or embeddings).
        grad_clip: the largest gradient norm (0 switches clipping off).
        precision: "float32", or "bfloat16" for autocast (mixed precision) on the run's device, in training and
            in every evaluation and decoding of the run.
        seed: weights, dropout and the order of the training examples.
        eval_interval: steps between evaluations on the validation split (and checkpoints).
        eval_batches: batches per evaluation (None: the whole split).
        label_smoothing: the share of each target's probability spread evenly over all classes in the
            training loss (0: plain cross-entropy; evaluation always reports the plain loss).
        scheduled_sampling: seq2seq tasks only: "none" (teacher forcing), "token" (per-token, Bengio et al.
            2015) or "two-pass" (Mihaylova & Martins 2019); see :mod:`attnzoo.training.seq2seq`.
        sampling_decay, sampling_k, sampling_min_teacher: how the probability of feeding the gold token decays
            over the steps: "linear" ``1 - step/k``, "exponential" ``k**step`` or "inverse-sigmoid"
            ``k / (k + exp(step/k))``, never below ``sampling_min_teacher``; ``sampling_k=None`` fits the
            schedule to ``steps`` (linear reaches 0, exponential 0.01 at the end; inverse sigmoid 1/2 halfway).
        guide_loss, guide_width: seq2seq tasks only: the weight (>= 0; 0 switches it off) of the diagonal guide
            loss on the cross-attention (Tachibana et al. 2018) and its width g (> 0).
        pack: train (and evaluate) on packed batches (:mod:`attnzoo.training.packing`): a batch's documents
            back to back in one row with no padding, each attending only within itself, the loss masked at
            document boundaries; for the tasks whose :meth:`~attnzoo.tasks.Task.packing_refusal` is None
            (``bytes``, ``listops``) and mechanisms that take packed batches.
        group_by_length: train on batches of examples of similar length, each cut to its longest example
            (:mod:`attnzoo.training.length_groups`): for tasks whose examples are padded (g2p, listops), and
            models whose outputs do not depend on the padded length (checked when training starts). Not with
            ``pack``, which removes the padding another way.
        copy_mechanism: seq2seq tasks only: a pointer-generator output (See et al. 2017) that can copy source
            tokens (:mod:`attnzoo.models.pointer`); the loss is the NLL of its mixed distribution. Not with
            ``label_smoothing``.
        decoding, length_mode, length_loss: seq2seq tasks only: "autoregressive" (the default) or
            "non-autoregressive" (one parallel pass, :mod:`attnzoo.training.nat`); for the latter, where the
            output length comes from, "predicted" (None: the default) or "max", and the weight of the length
            head's loss (None: 0.1). Both stay None in autoregressive mode.
    """

    task: str
    task_options: Dict[str, Any] = field(default_factory=dict)
    mechanism: str = "softmax"
    mechanism_options: Dict[str, Any] = field(default_factory=dict)
    block: str = "attention"
    block_options: Dict[str, Any] = field(default_factory=dict)
    dim: int = 64
    depth: int = 2
    heads: int = 4
    kv_heads: Optional[int] = None
    ff_dim: Optional[int] = None
    dropout: float = 0.0
    positional: str = "sinusoidal"
    pooling: str = "mean"
    token_shift: bool = False
    pack: bool = False
    group_by_length: bool = False
    batch_size: int = 32
    steps: int = 500
    lr: float = 1e-3
    warmup_steps: Optional[int] = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    precision: str = "float32"
    seed: int = 0
    eval_interval: int = 100
    eval_batches: Optional[int] = None
    label_smoothing: float = 0.0
    scheduled_sampling: str = "none"
    sampling_decay: str = "linear"
    sampling_k: Optional[float] = None
    sampling_min_teacher: float = 0.0
    guide_loss: float = 0.0
    guide_width: float = DEFAULT_GUIDE_WIDTH
    copy_mechanism: bool = False
    decoding: str = "autoregressive"
    length_mode: Optional[str] = None
    length_loss: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise TypeError(f"task must be a task name, got {self.task!r}")
        if not isinstance(self.mechanism, str) or not self.mechanism:
            raise TypeError(f"mechanism must be a mechanism name, got {self.mechanism!r}")
        for name in ("task_options", "mechanism_options", "block_options"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
                raise TypeError(f"{name} must be a dict of option names to values, got {value!r}")
        for name in ("dim", "depth", "heads", "batch_size", "steps", "eval_interval"):
            check_positive_int(name, getattr(self, name))
        check_number("ff_dim", self.ff_dim, integer=True, minimum=1, optional=True)
        check_number("eval_batches", self.eval_batches, integer=True, minimum=1, optional=True)
        check_number("warmup_steps", self.warmup_steps, integer=True, minimum=0, optional=True)
        check_number("seed", self.seed, integer=True, minimum=0)
        check_probability("dropout", self.dropout)
        check_number("lr", self.lr, minimum=0.0, exclusive_minimum=True)
        check_number("min_lr_ratio", self.min_lr_ratio, minimum=0.0, maximum=1.0)
        check_number("weight_decay", self.weight_decay, minimum=0.0)
        check_number("grad_clip", self.grad_clip, minimum=0.0)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("positional", self.positional, POSITIONALS)
        check_choice("block", self.block, BLOCKS)
        if self.block == "attention" and self.block_options:
            raise ValueError("block_options given but block is 'attention': they are options of a gated unit "
                             f"(block {' or '.join(BLOCKS[1:])})")
        if self.block != "attention" and (self.mechanism != "softmax" or self.mechanism_options):
            raise ValueError(f"block {self.block!r} replaces every attention by a gated unit with its own attention: "
                             f"leave mechanism and mechanism_options at their defaults")
        check_probability("label_smoothing", self.label_smoothing)
        check_choice("scheduled_sampling", self.scheduled_sampling, SCHEDULED_SAMPLING)
        check_choice("sampling_decay", self.sampling_decay, SAMPLING_DECAYS)
        check_number("sampling_k", self.sampling_k, optional=True)
        check_sampling_k(self.sampling_decay, self.sampling_k)
        check_number("sampling_min_teacher", self.sampling_min_teacher, minimum=0.0, maximum=1.0)
        check_number("guide_loss", self.guide_loss, minimum=0.0)
        check_number("guide_width", self.guide_width, minimum=0.0, exclusive_minimum=True)
        check_bool("copy_mechanism", self.copy_mechanism)
        check_bool("token_shift", self.token_shift)
        check_bool("pack", self.pack)
        check_bool("group_by_length", self.group_by_length)
        if self.pack and self.group_by_length:
            raise ValueError("group_by_length cannot be combined with pack: packing already leaves no padding")
        if self.copy_mechanism and self.label_smoothing > 0:
            # Smoothing spreads mass over every output, but the extended ids a source does not hold have
            # probability 0 under the copy mixture: their log is -inf.
            raise ValueError(f"label_smoothing {self.label_smoothing!r} cannot be combined with copy_mechanism "
                             "(the mixture gives some outputs probability 0); use 0")
        check_decoding_settings(self.decoding, self.length_mode, self.length_loss, self.scheduled_sampling,
                                self.guide_loss)
        if self.copy_mechanism and self.decoding != "autoregressive":
            raise ValueError(f"copy_mechanism is built for autoregressive decoding; decoding is {self.decoding!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim must be a multiple of heads, got dim={self.dim} and heads={self.heads}")
        check_number("kv_heads", self.kv_heads, integer=True, minimum=1, optional=True)
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads, got kv_heads={self.kv_heads} and heads={self.heads}")

    @property
    def model_label(self) -> str:
        """What the model attends with, for messages: the mechanism, or the gated unit of ``block``."""
        return self.mechanism if self.block == "attention" else self.block

    @property
    def warmup(self) -> int:
        """Warm-up steps in effect: ``warmup_steps``, or a tenth of the run."""
        return self.steps // 10 if self.warmup_steps is None else min(self.warmup_steps, self.steps)

    def learning_rate_factor(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (0-based) as a fraction of ``lr``: linear warm-up to
        1, then a cosine down to ``min_lr_ratio`` at the last step."""
        warmup = self.warmup
        if step < warmup:
            return (step + 1) / warmup
        decay_steps = max(self.steps - warmup - 1, 1)
        progress = min((step - warmup) / decay_steps, 1.0)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def teacher_probability(self, step: int) -> float:
        """The probability of feeding the gold token at optimiser step ``step`` (1 without scheduled sampling)."""
        if self.scheduled_sampling == "none":
            return 1.0
        k = default_sampling_k(self.sampling_decay, self.steps) if self.sampling_k is None else self.sampling_k
        return teacher_probability(self.sampling_decay, step, k, self.sampling_min_teacher)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainConfig":
        """Rebuild from :meth:`as_dict`; an unknown or missing field is an error naming it."""
        if not isinstance(data, dict):
            raise TypeError(f"a training config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown training config field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        if "task" not in data:
            raise ValueError("training config has no task")
        return cls(**data)

    def differences(self, other: "TrainConfig") -> Dict[str, Any]:
        """{field: (mine, other's)} for every field whose values differ."""
        mine, theirs = self.as_dict(), other.as_dict()
        return {key: (mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]}


"""The task contract and the registry.

A task is a data set in three splits ("train", "validation", "test") of token-id tensors, built
deterministically from a seed when the task is constructed. Each task is one :class:`Task` subclass,
registered by name; its options are the keyword-only, annotated, defaulted parameters of its ``__init__``,
each stored on the instance under its own name (which is how :meth:`Task.options` reads them back).

Three kinds of task, which decide the shape of the targets and the metric:

* ``"classify"``: one class per sequence, targets ``(n,)``; metric ``"accuracy"``.
* ``"tag"``: one class per position, targets ``(n, seq_len)`` with :data:`IGNORE_INDEX` where no answer is
  scored; metric ``"accuracy"`` over the scored positions. The model is bidirectional unless the task asks
  for a causal one (:attr:`Task.needs_causal_model`, e.g. ``recall`` with ``causal=True``).
* ``"lm"``: next-token prediction, targets ``(n, seq_len)`` = the inputs shifted by one; metric
  ``"bits_per_byte"``; a model must be causal.
* ``"seq2seq"``: a source sequence to a target sequence of another length (and vocabulary); the splits are
  :class:`Seq2SeqSplit` objects: inputs ``(n, seq_len)`` are the source, targets ``(n, target_len)`` the target
  tokens to predict (ending with the task's ``eos_id``, :data:`IGNORE_INDEX` after it) and ``decoder_inputs``
  the same tokens shifted right behind ``bos_id`` (teacher forcing); metric ``"accuracy"`` over the
  scored target tokens (decoded metrics such as exact match come from the training code).
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Type

import torch
from torch import Tensor

from .._validation import check_number

IGNORE_INDEX = -100
"""Target value that no loss or metric counts (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""

SPLITS = ("train", "validation", "test")
KINDS = {"classify": "accuracy", "tag": "accuracy", "lm": "bits_per_byte", "seq2seq": "accuracy"}
"""Each kind of task and its metric."""


@dataclass(frozen=True)
class Split:
    """One split of a task.

    Attributes:
        inputs: (n, seq_len) int64 token ids, padded with the task's ``pad_id``.
        targets: kind ``"classify"``: (n,) int64 class ids; kind ``"tag"``: (n, seq_len) int64 class ids,
            :data:`IGNORE_INDEX` where unscored; kind ``"lm"``: (n, seq_len) int64 next-token ids.
        padding_mask: (n, seq_len) bool, True = padding; None when nothing is padded.
    """

    inputs: Tensor
    targets: Tensor
    padding_mask: Optional[Tensor]

    def __post_init__(self) -> None:
        # A malformed split is a bug in a task, caught where it is made rather than inside a training step.
        if not isinstance(self.inputs, Tensor) or self.inputs.dtype != torch.int64 or self.inputs.dim() != 2:
            raise TypeError(f"inputs must be a 2-D int64 tensor (n, seq_len), got {_describe_tensor(self.inputs)}")
        n, seq_len = self.inputs.shape
        if not isinstance(self.targets, Tensor) or self.targets.dtype != torch.int64:
            raise TypeError(f"targets must be an int64 tensor, got {_describe_tensor(self.targets)}")
        if self.targets.shape not in ((n,), (n, seq_len)):
            raise ValueError(f"targets must have shape ({n},) or ({n}, {seq_len}), got {tuple(self.targets.shape)}")
        if self.padding_mask is not None and (
            not isinstance(self.padding_mask, Tensor)
            or self.padding_mask.dtype != torch.bool
            or self.padding_mask.shape != (n, seq_len)
        ):
            raise TypeError(
                f"padding_mask must be None or a bool tensor of shape ({n}, {seq_len}), "
                f"got {_describe_tensor(self.padding_mask)}"
            )

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


@dataclass(frozen=True)
class Seq2SeqSplit(Split):
    """One split of a ``"seq2seq"`` task: a :class:`Split` whose targets have their own length.

    Attributes:
        inputs: (n, seq_len) int64 source ids, padded with the task's ``pad_id``.
        targets: (n, target_len) int64 target ids to predict, the last scored one the task's ``eos_id``,
            :data:`IGNORE_INDEX` after it.
        padding_mask: (n, seq_len) bool source padding, True = padding.
        decoder_inputs: (n, target_len) int64: ``bos_id`` then the targets shifted right by one, ``pad_id``
            where the target is :data:`IGNORE_INDEX` (what a teacher-forced decoder reads).
    """

    decoder_inputs: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if not isinstance(self.inputs, Tensor) or self.inputs.dtype != torch.int64 or self.inputs.dim() != 2:
            raise TypeError(f"inputs must be a 2-D int64 tensor (n, seq_len), got {_describe_tensor(self.inputs)}")
        n, seq_len = self.inputs.shape
        for name in ("targets", "decoder_inputs"):
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.dtype != torch.int64 or value.dim() != 2 or len(value) != n:
                raise TypeError(f"{name} must be a 2-D int64 tensor ({n}, target_len), got {_describe_tensor(value)}")
        if self.targets.shape != self.decoder_inputs.shape:
            raise ValueError(f"targets {tuple(self.targets.shape)} and decoder_inputs "
                             f"{tuple(self.decoder_inputs.shape)} must have the same shape")
        if not isinstance(self.padding_mask, Tensor) or self.padding_mask.dtype != torch.bool \
                or self.padding_mask.shape != (n, seq_len):
            raise TypeError(f"padding_mask must be a bool tensor of shape ({n}, {seq_len}), "
                            f"got {_describe_tensor(self.padding_mask)}")


def _describe_tensor(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} of shape {tuple(x.shape)}"
    return type(x).__name__


class Task:
    """Base class of every task.

    A subclass sets the class attributes, takes ``seed`` and its own options as keyword-only, annotated,
    defaulted parameters of ``__init__``, stores every option (validated) on ``self`` under its own name,
    sets the instance attributes below, and finishes with :meth:`_set_splits`.

    Class attributes:
        name: the word ``load`` and ``attnzoo train`` take.
        kind: ``"classify"``, ``"tag"``, ``"lm"`` or ``"seq2seq"`` (see the module docstring).
        metric: ``"accuracy"`` (classify, tag) or ``"bits_per_byte"`` (lm).
        needs_causal: True for ``"lm"`` only: the model must not see the token it predicts. What the kind
            demands; :attr:`needs_causal_model` says what this instance, with its options, demands.
        summary: one line for listings.

    Instance attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        seq_len: every split's inputs are ``(n, seq_len)``.
        num_classes: classify/tag: the number of classes; lm: ``vocab_size``.
        pad_id: the padding token id, None if the task never pads.
        loaded_with: the options :func:`load` built it from, defaults included (None when constructed
            directly).

    A ``"seq2seq"`` task also sets ``target_len`` (the length of its targets) and ``bos_id``, ``eos_id``;
    ``vocab_size`` is then the source vocabulary and ``num_classes`` the target vocabulary.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    metric: ClassVar[str] = ""
    needs_causal: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    vocab_size: int
    seq_len: int
    num_classes: int
    pad_id: Optional[int]
    seed: int
    loaded_with: Optional[Dict[str, Any]] = None

    def __init__(self, *, seed: int = 0) -> None:
        raise NotImplementedError("Task is a base class: construct a registered task (attnzoo.tasks.load)")

    # -- for subclasses ------------------------------------------------------------------------------------
    @staticmethod
    def _check_seed(seed: object) -> int:
        """A seed is an int >= 0 (what numpy's and Python's generators both take)."""
        return check_number("seed", seed, integer=True, minimum=0)

    def _set_split_sizes(self, train_size: object, validation_size: object, test_size: object) -> None:
        """Keep the number of examples of each split (each an int >= 1), named in errors."""
        self.train_size = check_number("train_size", train_size, integer=True, minimum=1)
        self.validation_size = check_number("validation_size", validation_size, integer=True, minimum=1)
        self.test_size = check_number("test_size", test_size, integer=True, minimum=1)

    def _set_splits(self, splits: Dict[str, Split]) -> None:
        """Keep the three splits, after checking them against the task's declared sizes and vocabulary."""
        if set(splits) != set(SPLITS):
            raise ValueError(f"a task needs exactly the splits {', '.join(SPLITS)}, got {', '.join(splits)}")
        for split_name, split in splits.items():
            if split.inputs.shape[1] != self.seq_len:
                raise ValueError(f"{self.name} {split_name} inputs have length {split.inputs.shape[1]}, "
                                 f"not seq_len={self.seq_len}")
            expected = (len(split),) if self.kind == "classify" else (len(split), self.seq_len)
            if self.kind == "seq2seq":  # targets have their own length
                if not isinstance(split, Seq2SeqSplit):
                    raise TypeError(f"{self.name} {split_name}: a seq2seq task's splits are Seq2SeqSplits")
                expected = (len(split), getattr(self, "target_len", -1))
            if split.targets.shape != expected:
                raise ValueError(f"{self.name} {split_name} targets have shape {tuple(split.targets.shape)}, "
                                 f"expected {expected} for kind {self.kind!r}")
            if (self.pad_id is None) != (split.padding_mask is None):
                raise ValueError(f"{self.name} {split_name}: padding_mask must be given exactly when pad_id is set")
        self._check_causal_model()
        self._splits = {name: splits[name] for name in SPLITS}

    def _check_causal_model(self) -> None:
        """A kind that needs a causal model (lm) gets one; only a tag task may ask for one on its own."""
        causal = self.needs_causal_model
        if not isinstance(causal, bool):
            raise TypeError(f"{self.name}: needs_causal_model must be a bool, got {type(causal).__name__}")
        if self.needs_causal and not causal:
            raise ValueError(f"{self.name}: a {self.kind!r} task's model must be causal (needs_causal)")
        if causal and self.kind not in ("lm", "tag"):
            raise ValueError(f"{self.name}: only lm and tag tasks have causal models, not kind {self.kind!r}")

    def _describe_extra(self) -> List[str]:
        """Task-specific lines for :meth:`describe` (where the data comes from, its knobs)."""
        return []

    # -- the API ---------------------------------------------------------------------------------------------
    @property
    def needs_causal_model(self) -> bool:
        """Whether the model serving this task, with its options, must be causal: each position sees only
        itself and earlier positions. Always for an ``"lm"`` task (:attr:`needs_causal`); a ``"tag"`` task may
        ask for it through an option (``recall``'s ``causal``), its targets staying where they are. The
        training code builds the model, and checks the mechanism, from this."""
        return self.needs_causal

    def split(self, name: str) -> Split:
        """The split ``name``: ``"train"``, ``"validation"`` or ``"test"``."""
        if not isinstance(name, str) or name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; valid splits: {', '.join(SPLITS)}")
        return self._splits[name]

    def scored_targets(self, name: str) -> Tensor:
        """The targets of split ``name`` that a metric counts, flattened (1-D int64): every target of a
        classify or lm task, the positions other than :data:`IGNORE_INDEX` of a tag task."""
        targets = self.split(name).targets.reshape(-1)
        return targets[targets != IGNORE_INDEX]

    def packing_refusal(self) -> Optional[str]:
        """Why this task cannot train on packed batches (``attnzoo train --pack``); None when it can.

        A classify or tag task that pads its sequences packs batch by batch: the padding of a batch is dropped
        and its sequences laid back to back in one row (:meth:`packed_split` is then the split itself). A task
        of documents (``bytes``) overrides this and :meth:`packed_split`."""
        if self.kind == "seq2seq":
            return "its model is a Seq2SeqTransformer; packed batches are for the classify, tag and lm models"
        if self.kind == "lm":
            return "it has no documents to pack (only the bytes task lays out its files as documents)"
        if self.pad_id is None:
            return f"every sequence has the full length {self.seq_len}: there is no padding to remove"
        return None

    def packed_split(self, name: str) -> Split:
        """The split ``name`` as packed training reads it (see :meth:`packing_refusal`)."""
        reason = self.packing_refusal()
        if reason is not None:
            raise ValueError(f"{self.name} cannot be packed: {reason}")
        return self.split(name)

    def baseline(self) -> Dict[str, float]:
        """A trivial baseline on the test split, in the task's metric.

        classify / tag: ``{"accuracy": share of the most frequent class}`` (tag: among the scored positions),
        what always answering that class scores. lm: ``{"bits_per_byte": order-0 entropy}`` of the test
        targets (the bytes a model is scored on), what the best single distribution over bytes, fitted on
        the test split itself, would pay per byte.
        """
        scored = self.scored_targets("test")
        counts = torch.bincount(scored, minlength=self.num_classes).double()
        if self.metric == "accuracy":
            return {"accuracy": float(counts.max() / counts.sum())}
        p = counts[counts > 0] / counts.sum()
        return {"bits_per_byte": float(-(p * torch.log2(p)).sum())}

    def options(self) -> Dict[str, Any]:
        """The options the task was built with, ``seed`` included: ``load(task.name, **task.options())``
        rebuilds the same data. Plain Python values (JSON-serialisable)."""
        return {name: getattr(self, name) for name in task_options(self.name)}

    def describe(self) -> str:
        """A few human-readable lines: the kind and sizes, the lengths and the label distribution."""
        lines = [
            f"{self.name} ({self.kind}, metric {self.metric}): {self.summary}",
            f"vocab_size {self.vocab_size}, seq_len {self.seq_len}, num_classes {self.num_classes}, "
            f"pad_id {self.pad_id}",
        ]
        for split_name in SPLITS:
            split = self._splits[split_name]
            line = f"{split_name}: {len(split)} sequences"
            if split.padding_mask is not None:
                lengths = (~split.padding_mask).sum(dim=1).double()
                line += (f", unpadded length {int(lengths.min())}..{int(lengths.max())} "
                         f"(mean {float(lengths.mean()):.1f})")
            lines.append(line)
        if self.kind != "lm":
            counts = Counter(self.scored_targets("test").tolist())
            total = sum(counts.values())
            share = lambda label: f"{label}: {100 * counts[label] / total:.1f}%"  # noqa: E731
            if len(counts) <= 12:
                lines.append("test labels: " + ", ".join(share(label) for label in sorted(counts)))
            else:  # too many to list: the extremes
                ranked = sorted(counts, key=lambda label: (-counts[label], label))
                lines.append(f"test labels: {len(counts)} of {self.num_classes} classes seen, most frequent "
                             f"{share(ranked[0])}, least {share(ranked[-1])} ({total} scored targets)")
        lines.extend(self._describe_extra())
        lines.append("baseline: " + ", ".join(f"{k} {v:.4f}" for k, v in self.baseline().items()))
        return "\n".join(lines)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({settings})"


# -- registry ------------------------------------------------------------------------------------------------
_REGISTRY: Dict[str, Type[Task]] = {}


def register(cls: Type[Task]) -> Type[Task]:
    """Class decorator adding a task to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} must set a non-empty class attribute 'name'")
    if cls.kind not in KINDS or cls.metric != KINDS[cls.kind]:
        raise ValueError(f"{cls.__qualname__}: kind must be one of {', '.join(KINDS)} with its metric "
                         f"({KINDS}), got kind={cls.kind!r}, metric={cls.metric!r}")
    if cls.needs_causal != (cls.kind == "lm"):
        raise ValueError(f"{cls.__qualname__}: needs_causal must be True exactly for kind 'lm'")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"task name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    parameters = inspect.signature(cls.__init__).parameters.values()
    loose = [p.name for p in parameters if p.name != "self" and (
        p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty
        or p.annotation is inspect.Parameter.empty)]
    if loose or "seed" not in {p.name for p in parameters}:
        raise ValueError(f"{cls.__qualname__}: every option must be keyword-only, annotated and defaulted, "
                         f"seed included; not so: {', '.join(loose) or 'seed missing'}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> List[str]:
    """Sorted names of the registered tasks."""
    return sorted(_REGISTRY)


def task_class(name: str) -> Type[Task]:
    """The class of the registered task ``name``."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(available())}")
    return _REGISTRY[name]


def task_options(name: str) -> Dict[str, Any]:
    """The options a task takes, ``seed`` included, with their defaults (read from its signature)."""
    signature = inspect.signature(task_class(name).__init__)
    return {p.name: p.default for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def load(name: str, **options: Any) -> Task:
    """Build the task ``name`` with ``options``; one it does not take raises a TypeError listing the valid ones."""
    cls = task_class(name)
    valid = task_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"task {name!r} got unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
    task = cls(**options)
    task.loaded_with = {**valid, **options}  # what it was built from, defaults included, for train(task=...)
    return task


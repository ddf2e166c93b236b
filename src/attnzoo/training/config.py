"""What one training run is: the task, the model, the optimiser and the schedule, in one validated record.

A :class:`TrainConfig` is written into every checkpoint (``config.json``) and is all ``attnzoo eval`` and
``--resume`` need to rebuild the task, the model and the optimiser.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

from ..models.config import BLOCKS
from ..models.schedule import LayerSpec, format_schedule, parse_schedule
from ..models.nat import DECODING_MODES, LENGTH_MODES
from .nat import check_decoding_settings
from .settings import (
    boolean,
    check_declared,
    needs_padding,
    needs_seq2seq,
    nonempty_name,
    not_seq2seq,
    number,
    option_dict,
    positive_int,
    probability,
    setting,
)
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


# -- the rules between fields, each declared by the field it concerns (``agrees``) -----------------------------
def _gated_block_keeps_default_attention(config: "TrainConfig") -> None:
    if config.block != "attention" and (config.mechanism != "softmax" or config.mechanism_options):
        raise ValueError(f"block {config.block!r} replaces every attention by a gated unit with its own attention: "
                         f"leave mechanism and mechanism_options at their defaults")


def _block_options_need_a_gated_block(config: "TrainConfig") -> None:
    if config.block == "attention" and config.block_options:
        raise ValueError("block_options given but block is 'attention': they are options of a gated unit "
                         f"(block {' or '.join(BLOCKS[1:])})")


def _schedule_text(name: str, value: Any) -> None:
    if value is not None:
        parse_schedule(value, BLOCKS, name)


def _schedule_replaces_mechanism_and_block(config: "TrainConfig") -> None:
    if config.layers is None:
        return
    for field, default in (("mechanism", "softmax"), ("mechanism_options", {}), ("block", "attention"),
                           ("block_options", {})):
        if getattr(config, field) != default:
            raise ValueError(f"layers gives each layer's mechanism or block with its options, so {field} "
                             f"{getattr(config, field)!r} cannot be used with it: put it in the schedule's items")
    count = len(config.schedule)
    if config.depth % count:
        raise ValueError(f"layers has {count} items ({config.layers}), which does not divide depth {config.depth}: "
                         "give a pattern whose length divides the depth")


def _schedule_fits(name: str, value: Any, task: Any) -> Optional[str]:
    """A seq2seq task's decoder layers all attend to the source: its schedule names mechanisms only."""
    if task.kind != "seq2seq":
        return None
    blocks = [item for item in parse_schedule(value, BLOCKS, name) if not item.is_attention]
    if not blocks:
        return None
    return (f"{name} item {str(blocks[0])!r} cannot train on {task.name}: its model, a Seq2SeqTransformer, "
            f"uses the schedule on both sides and its decoder layers cross-attend, which a block does not")


def _heads_divide_dim(config: "TrainConfig") -> None:
    if config.dim % config.heads:
        raise ValueError(f"dim must be a multiple of heads, got dim={config.dim} and heads={config.heads}")


def _kv_heads_divide_heads(config: "TrainConfig") -> None:
    if config.kv_heads is not None and config.heads % config.kv_heads:
        raise ValueError(f"kv_heads must divide heads, got kv_heads={config.kv_heads} and heads={config.heads}")


def _length_groups_not_with_pack(config: "TrainConfig") -> None:
    if config.pack and config.group_by_length:
        raise ValueError("group_by_length cannot be combined with pack: packing already leaves no padding")


def _sampling_k_fits_the_decay(config: "TrainConfig") -> None:
    check_sampling_k(config.sampling_decay, config.sampling_k)


def _copy_fits_the_loss_and_decoding(config: "TrainConfig") -> None:
    if config.copy_mechanism and config.label_smoothing > 0:
        # Smoothing spreads mass over every output, but the extended ids a source does not hold have
        # probability 0 under the copy mixture: their log is -inf.
        raise ValueError(f"label_smoothing {config.label_smoothing!r} cannot be combined with copy_mechanism "
                         "(the mixture gives some outputs probability 0); use 0")
    if config.copy_mechanism and config.decoding != "autoregressive":
        raise ValueError(f"copy_mechanism is built for autoregressive decoding; decoding is {config.decoding!r}")


def _decoding_settings_fit(config: "TrainConfig") -> None:
    check_decoding_settings(config.decoding, config.length_mode, config.length_loss, config.scheduled_sampling,
                            config.guide_loss)


TOKEN_MODELS = "classify, tag and lm tasks"


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run.

    Each field is declared once, by :func:`~attnzoo.training.settings.setting`: its default, its meaning
    (``help``, also the help of its ``attnzoo train`` flag), the check of its value, the rule it has with other
    fields (``agrees``) and the tasks it fits (``fits_task``). Making the config checks every field, and
    :func:`~attnzoo.training.build_model` asks every setting whether it fits the task; errors name the field.
    A field that :class:`~attnzoo.models.ModelConfig` has under the same name reaches the token models as is.
    """

    task: str = setting(help="a task of attnzoo.tasks", check=nonempty_name("a task name"), flag=False)
    task_options: Dict[str, Any] = setting(
        default_factory=dict, check=option_dict, flag=False,
        help="the options the task is built with (its data seed among them; the task's own default otherwise)")
    mechanism: str = setting(
        "softmax", check=nonempty_name("a mechanism name"), flag=False,
        help="the attention of every self-attention slot")
    mechanism_options: Dict[str, Any] = setting(
        default_factory=dict, check=option_dict, flag=False,
        help="the mechanism's options; one that must equal the sequence length (its length_option) gets the "
             "task's length by default")
    block: str = setting(
        "attention", choices=BLOCKS, agrees=_gated_block_keeps_default_attention,
        fits_task=not_seq2seq(f"gated units (block options exist for {TOKEN_MODELS})"),
        help="what a layer is: attention + feed-forward, or a gated attention unit (gau, flash_gau) or a Mamba-2 "
             "block in their place, or attention + feed-forward with multi-head latent attention (mla) "
             "(mechanism stays softmax)")
    block_options: Dict[str, Any] = setting(
        default_factory=dict, check=option_dict, agrees=_block_options_need_a_gated_block, flag=False,
        help="options of a gated, Mamba-2 or MLA block (chunk_size, state_dim, latent_dim, ...)")
    layers: Optional[str] = setting(
        None, check=_schedule_text, agrees=_schedule_replaces_mechanism_and_block, fits_task=_schedule_fits,
        metavar="SCHEDULE",
        help="a per-layer schedule in place of --mechanism and --block (a hybrid stack, docs/hybrids.md): "
             "ITEM[,ITEM...] repeated to --depth (its length dividing it), each ITEM a mechanism or block:KIND, "
             "with optional (OPTION=VALUE,...) and *COUNT, e.g. 'gated_delta*3,softmax', "
             "'local(window=64),block:mamba2'; a seq2seq task takes mechanisms only, on both sides")
    dim: int = setting(64, check=positive_int, help="model width")
    depth: int = setting(2, check=positive_int, help="layers (on each side of a seq2seq model)")
    heads: int = setting(4, check=positive_int, agrees=_heads_divide_dim, help="attention heads, dividing dim")
    kv_heads: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True), agrees=_kv_heads_divide_heads,
        help="key/value heads of the self-attention, dividing heads (grouped-query attention); None: heads")
    output_gate: bool = setting(
        False, check=boolean,
        help="gated attention: a sigmoid gate from the layer input on each head's output before the output "
             "projection (Qiu et al. 2025), on every self-attention; with --layers an item may set its own, "
             "e.g. 'gated_delta*3,softmax(output_gate=true)'")
    ff_dim: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True),
        help="feed-forward hidden width; None: 4 * dim")
    dropout: float = setting(0.0, check=probability, help="dropout probability")
    positional: str = setting("sinusoidal", choices=POSITIONALS, help="position encoding")
    pooling: str = setting("mean", choices=POOLINGS, help="how a classifier pools its positions")
    token_shift: bool = setting(
        False, check=boolean, fits_task=not_seq2seq(f"token shift (it exists for {TOKEN_MODELS})"),
        help="half of each position's embedding features come from the token before it (RWKV's token shift); "
             "not for seq2seq tasks")
    pack: bool = setting(
        False, check=boolean,
        help="packed batches (attnzoo.training.packing): a batch's documents back to back in one row, no padding, "
             "the loss masked at document boundaries (bytes: its files; listops: its sequences), each attending "
             "only within itself; for tasks and mechanisms that take packed batches; recorded in the run's "
             "config, so --resume and attnzoo eval pack too")
    group_by_length: bool = setting(
        False, check=boolean, agrees=_length_groups_not_with_pack, fits_task=needs_padding,
        help="batches of examples of similar length, each cut to its longest example (g2p, listops: less padding "
             "to compute; attnzoo.training.length_groups); refused for a model whose outputs depend on the "
             "padded length, and with pack")
    batch_size: int = setting(32, check=positive_int, help="sequences per step")
    steps: int = setting(500, check=positive_int, help="optimiser steps in all")
    lr: float = setting(
        1e-3, check=number(minimum=0.0, exclusive_minimum=True),
        help="AdamW's peak learning rate, reached linearly over the warm-up, then cosine decay")
    warmup_steps: Optional[int] = setting(
        None, check=number(integer=True, minimum=0, optional=True),
        help="steps of linear warm-up; None: a tenth of steps")
    min_lr_ratio: float = setting(
        0.1, check=number(minimum=0.0, maximum=1.0), help="the learning rate of the last step, as a share of lr")
    weight_decay: float = setting(
        0.01, check=number(minimum=0.0),
        help="AdamW's decoupled decay, applied to matrices only (not to biases, norms or embeddings)")
    grad_clip: float = setting(1.0, check=number(minimum=0.0),
                               help="the largest gradient norm (0 switches clipping off)")
    precision: str = setting(
        "float32", choices=PRECISIONS,
        help="bfloat16: autocast (mixed precision) on the run's device, in training and in every evaluation and "
             "decoding of the run")
    seed: int = setting(
        0, check=number(integer=True, minimum=0),
        help="the seed of the weights, dropout and the order of the training examples")
    eval_interval: int = setting(
        100, check=positive_int, help="steps between evaluations on the validation split (and checkpoints)")
    eval_batches: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True),
        help="batches per evaluation; None: the whole split")
    label_smoothing: float = setting(
        0.0, check=probability,
        help="the share of each target's probability spread evenly over all classes in the training loss "
             "(evaluation always reports the plain loss)")
    scheduled_sampling: str = setting(
        "none", choices=SCHEDULED_SAMPLING, fits_task=needs_seq2seq(),
        help="seq2seq: none (teacher forcing), token (per-token, Bengio et al. 2015) or two-pass (Mihaylova & "
             "Martins 2019); see attnzoo.training.seq2seq")
    sampling_decay: str = setting(
        "linear", choices=SAMPLING_DECAYS,
        help="how the probability of feeding the gold token decays over the steps: linear 1 - step/k, "
             "exponential k**step or inverse-sigmoid k / (k + exp(step/k))")
    sampling_k: Optional[float] = setting(
        None, check=number(optional=True), agrees=_sampling_k_fits_the_decay,
        help="k of the decay; None fits it to steps (linear reaches 0, exponential 0.01 at the end, inverse "
             "sigmoid 1/2 halfway)")
    sampling_min_teacher: float = setting(
        0.0, check=number(minimum=0.0, maximum=1.0),
        help="the least probability of feeding the gold token")
    guide_loss: float = setting(
        0.0, check=number(minimum=0.0), fits_task=needs_seq2seq(" (cross-attention)"),
        help="seq2seq: the weight of the diagonal guide loss on the cross-attention (Tachibana et al. 2018); "
             "0 switches it off")
    guide_width: float = setting(
        DEFAULT_GUIDE_WIDTH, check=number(minimum=0.0, exclusive_minimum=True),
        help="the width g of the guide loss's diagonal")
    copy_mechanism: bool = setting(
        False, check=boolean, agrees=_copy_fits_the_loss_and_decoding,
        fits_task=needs_seq2seq(" (a source to copy from)"),
        help="seq2seq: a pointer-generator output that can copy source tokens (See et al. 2017, "
             "attnzoo.models.pointer); the loss is the NLL of its mixed distribution. Not with label smoothing")
    decoding: str = setting(
        "autoregressive", choices=DECODING_MODES, agrees=_decoding_settings_fit, fits_task=needs_seq2seq(),
        help="seq2seq: autoregressive, or non-autoregressive (one parallel pass, attnzoo.training.nat)")
    length_mode: Optional[str] = setting(
        None, choices=LENGTH_MODES,
        help="non-autoregressive decoding: where the output length comes from; None: predicted")
    length_loss: Optional[float] = setting(
        None, check=number(minimum=0.0, optional=True),
        help="non-autoregressive decoding: the weight of the length head's loss; None: 0.1")

    def __post_init__(self) -> None:
        check_declared(self)
        if self.layers is not None:  # recorded in one spelling, the compact one (a frozen dataclass sets it so)
            object.__setattr__(self, "layers", format_schedule(self.schedule))

    @property
    def schedule(self) -> Optional[Tuple[LayerSpec, ...]]:
        """The items of ``layers`` (None without a schedule)."""
        return None if self.layers is None else parse_schedule(self.layers, BLOCKS)

    def attention_items(self) -> List[Tuple[str, Dict[str, Any]]]:
        """Each distinct (mechanism, options) of the model's attention layers, as given: the schedule's, or
        the one mechanism (none with a gated or Mamba-2 block)."""
        if self.layers is None:
            return [(self.mechanism, dict(self.mechanism_options))] if self.block == "attention" else []
        items: List[Tuple[str, Dict[str, Any]]] = []
        for spec in self.schedule:
            item = (spec.mechanism, spec.mechanism_options)
            if spec.is_attention and item not in items:
                items.append(item)
        return items

    @property
    def model_label(self) -> str:
        """What the model attends with, for messages and directory names: the mechanism, the gated unit of
        ``block``, or the schedule's kinds joined by ``+``."""
        if self.layers is not None:
            return "+".join(dict.fromkeys(spec.kind for spec in self.schedule))
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


"""What a conversion does, one declaration per setting (:mod:`attnzoo.training.settings`), checked once:
:class:`ConversionConfig`. ``attnzoo convert`` takes each field as a flag."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping

from .._validation import check_choice
from ..mechanisms import LolcatsAttention, UnsupportedOptionError, available, build_mechanism
from ..mechanisms.made_inputs import shapes_only
from ..pretrained import CausalLMConfig
from ..pretrained.causal_lm import windowed_options
from ..training.settings import boolean, check_declared, number, option_dict, positive_int, setting

FINETUNE_LOSSES = ("next_token", "teacher_logits")
COMMAND = ("convert",)


def _mechanism(name: str, value: Any) -> None:
    check_choice(name, value, available())


def _non_negative_int(name: str, value: Any) -> Any:
    return number(integer=True, minimum=0)(name, value)


def _positive(name: str, value: Any) -> Any:
    return number(minimum=0.0, exclusive_minimum=True)(name, value)


def _adapters_need_stage_1(config: "ConversionConfig") -> None:
    if config.transfer_lora and not config.transfer_steps:
        raise ValueError("transfer_lora=True trains adapters in stage 1, but transfer_steps=0 runs no stage 1 step")


@dataclass(frozen=True)
class ConversionConfig:
    """A conversion of a pretrained softmax model to another attention, in LoLCATs' two stages (Zhang et al.
    2024); each field's help says what it does (``attnzoo convert --help`` shows them)."""

    target: str = setting(LolcatsAttention.name, check=_mechanism, commands=COMMAND,
                          help="the mechanism every converted layer gets")
    target_options: Dict[str, Any] = setting(
        default_factory=dict, check=option_dict, flag=False, commands=COMMAND,
        help="the target's options, e.g. window=64 (--target-options)")
    keep_softmax: int = setting(
        0, check=_non_negative_int, commands=COMMAND,
        help="layers kept in softmax attention (a hybrid): those with the largest held-out transfer error after "
             "stage 1")
    seq_len: int = setting(1024, check=positive_int, commands=COMMAND, help="tokens per training window")
    finetune_seq_len: int = setting(
        0, check=_non_negative_int, commands=COMMAND,
        help="tokens per stage 2 window, when longer windows should teach the converted model longer contexts "
             "than stage 1 saw (0: seq_len)")
    batch_size: int = setting(1, check=positive_int, commands=COMMAND, help="windows per optimiser step")
    transfer_steps: int = setting(
        200, check=_non_negative_int, commands=COMMAND,
        help="stage 1 steps: each converted layer's mechanism trained to give the frozen teacher layer's "
             "attention output")
    transfer_lr: float = setting(1e-2, check=_positive, commands=COMMAND, help="stage 1 AdamW learning rate")
    transfer_lora: bool = setting(
        False, check=boolean, agrees=_adapters_need_stage_1, commands=COMMAND,
        help="stage 1 also trains the adapters (LoRA on q, k, v and the output projection of every layer) on the "
             "layer-wise loss, which stage 2 then continues: how a target with no parameters of its own (liger) "
             "learns from the teacher's attention")
    finetune_steps: int = setting(
        100, check=_non_negative_int, commands=COMMAND,
        help="stage 2 steps: low-rank adapters on the converted layers' q, k, v and output projections")
    finetune_lr: float = setting(1e-3, check=_positive, commands=COMMAND, help="stage 2 AdamW learning rate")
    finetune_mechanism: bool = setting(
        False, check=boolean, commands=COMMAND,
        help="stage 2 also trains the converted layers' own parameters (lolcats' feature maps and window "
             "factors), at the same rate as the adapters, on the stage 2 loss; LoLCATs keeps them frozen")
    finetune_loss: str = setting(
        "next_token", choices=FINETUNE_LOSSES, commands=COMMAND,
        help="stage 2 loss: next-token cross-entropy, or KL divergence from the teacher's predictions")
    lora_rank: int = setting(8, check=positive_int, commands=COMMAND, help="rank of the adapters")
    lora_alpha: float = setting(16.0, check=_positive, commands=COMMAND,
                                help="scale numerator of the adapters (scale = alpha / rank)")
    selection_windows: int = setting(
        2, check=positive_int, commands=COMMAND,
        help="held-out windows on which each layer's transfer error is measured")
    checkpoint_every: int = setting(25, check=positive_int, commands=COMMAND,
                                    help="steps between checkpoints (and one at each stage's end)")
    seed: int = setting(0, check=_non_negative_int, commands=COMMAND,
                        help="seeds the new mechanisms' parameters and the adapters")

    def __post_init__(self) -> None:
        check_declared(self)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "ConversionConfig":
        known = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(saved) - known)
        if unknown:
            raise ValueError(f"conversion settings {', '.join(unknown)} are not known to this version of attnzoo")
        return cls(**saved)

    @property
    def stage_2_seq_len(self) -> int:
        """Tokens per stage 2 window."""
        return self.finetune_seq_len or self.seq_len

    def check_fits(self, model_config: CausalLMConfig) -> None:
        """Refuse, before any work, a target that cannot take the place of this model's causal self-attention
        (no causal form, no grouped key/value heads, a length limit below ``seq_len``), and a ``keep_softmax``
        of every layer; errors name the option."""
        if self.keep_softmax >= model_config.depth:
            raise ValueError(f"keep_softmax={self.keep_softmax} keeps every one of the model's {model_config.depth} "
                             f"layers: nothing would be converted")
        try:
            options = windowed_options(model_config, self.target, self.target_options)
        except UnsupportedOptionError as error:
            raise ValueError(f"target {self.target!r} cannot replace this model's causal self-attention: "
                             f"{error}") from None
        try:
            mechanism = build_mechanism(self.target, model_config.heads, model_config.head_dim, **options)
        except (TypeError, ValueError) as error:
            raise type(error)(f"target_options: {error}") from None
        longest = max(self.seq_len, self.stage_2_seq_len)
        q, k, v = shapes_only(1, model_config.heads, longest, longest, model_config.head_dim,
                              kv_heads=model_config.kv_heads)
        reasons = mechanism.unsupported_reasons(q, k, v, causal=True)
        if reasons:
            raise ValueError(f"target {self.target!r} cannot replace this model's causal self-attention: "
                             + "; ".join(reasons))

"""The model a task is trained with: a classifier, a tagger or a language model around one mechanism, or
around a per-layer schedule of mechanisms and blocks (``layers``)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..mechanisms import UnsupportedOptionError, build_mechanism, mechanism_class, shapes_only
from ..models import LanguageModel, ModelConfig, Seq2SeqTransformer, SequenceClassifier, SequenceTagger
from ..models.schedule import LayerSpec, format_item
from ..tasks import Task
from .config import TrainConfig
from .settings import task_refusal


def model_length(config: TrainConfig, task: Task) -> int:
    """Positions the model's attention sees: the task's length, plus the classification vector of cls pooling."""
    return task.seq_len + int(task.kind == "classify" and config.pooling == "cls")


def mechanism_options_for(config: TrainConfig, task: Task, mechanism: Optional[str] = None,
                          options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A mechanism's options (``config``'s own unless given, as for an item of its schedule), with its length
    option (if it has one) set to the task's length unless given."""
    name = config.mechanism if mechanism is None else mechanism
    options = dict(config.mechanism_options if options is None else options)
    length_option = mechanism_class(name).length_option
    if length_option is not None and length_option not in options:
        options[length_option] = model_length(config, task)
    return options


def _who(config: TrainConfig, mechanism: str, options: Dict[str, Any]) -> str:
    """How a refusal names the mechanism: by name, or as the item of the schedule (``layers item 'x'``)."""
    if config.layers is None:
        return mechanism
    return f"layers item {format_item(LayerSpec(mechanism, options or None))!r}"


def unsupported_reasons(config: TrainConfig, task: Task) -> List[str]:
    """Why the mechanisms (with their options) cannot train on this task: empty when they can; with a schedule,
    each reason names its item.

    Asks each mechanism itself (:meth:`~attnzoo.Mechanism.unsupported_reasons`) about the calls the model will
    make: causal attention for a task whose model is causal (:attr:`~attnzoo.tasks.Task.needs_causal_model`:
    language modelling, or a tag task that asks for it), key padding for a task that pads, its length.
    Invalid options raise their own errors (a typo is not an unsupported task)."""
    reasons = []
    for mechanism, options in config.attention_items():
        found = _mechanism_reasons(config, task, mechanism, options)
        reasons += found if config.layers is None else [f"{_who(config, mechanism, options)}: {r}" for r in found]
    return reasons


def _built(config: TrainConfig, task: Task, name: str, options: Dict[str, Any]) -> Any:
    """The mechanism of one attention item, built with the task's length; with a schedule, an invalid option is
    an error naming the item."""
    try:
        return build_mechanism(name, config.heads, config.dim // config.heads,
                               **mechanism_options_for(config, task, name, options))
    except UnsupportedOptionError:
        raise
    except (TypeError, ValueError) as error:
        if config.layers is None:
            raise
        raise type(error)(f"{_who(config, name, options)}: {error}") from None


def _mechanism_reasons(config: TrainConfig, task: Task, name: str, options: Dict[str, Any]) -> List[str]:
    try:
        mechanism = _built(config, task, name, options)
    except UnsupportedOptionError as error:  # valid options that cannot serve this length (rank > length)
        return [str(error)]
    length = model_length(config, task)
    padding = None if task.pad_id is None else torch.zeros(1, length, dtype=torch.bool, device="meta")
    q, k, v = shapes_only(1, config.heads, length, length, config.dim // config.heads, kv_heads=config.kv_heads)
    causal = task.needs_causal_model
    reasons = mechanism.unsupported_reasons(q, k, v, causal=causal, key_padding_mask=padding)
    if task.kind == "seq2seq":  # the mechanism is also the decoder's self-attention: causal unless NAT
        target = shapes_only(1, config.heads, task.target_len, task.target_len, config.dim // config.heads,
                             kv_heads=config.kv_heads)
        decoder_causal = config.decoding == "autoregressive"
        target_padding = None if decoder_causal else torch.zeros(1, task.target_len, dtype=torch.bool, device="meta")
        reasons += [f"as the decoder's self-attention: {reason}" for reason in
                    mechanism.unsupported_reasons(*target, causal=decoder_causal, key_padding_mask=target_padding)]
    if causal and not mechanism.capabilities.causal:
        why = ("is next-token prediction" if task.needs_causal
               else "asks for a causal model (each position sees only itself and earlier ones)")
        reasons = [f"{task.name} {why}, which needs causal attention: " + "; ".join(reasons)]
    return reasons


def packing_refusal(config: TrainConfig, task: Task) -> Optional[str]:
    """Why ``config.pack`` cannot train ``task`` with these mechanisms (None when it can, or without pack)."""
    if not config.pack:
        return None
    reason = task.packing_refusal()
    if reason is not None:
        return f"{task.name} cannot be packed: {reason}"
    # Gated units and Mamba-2 blocks run each document alone: only the attention layers are asked.
    for name, options in config.attention_items():
        who = _who(config, name, options)
        if mechanism_class(name).length_option is not None:
            return (f"{who + ': ' if config.layers is not None else ''}{name}'s learned tables span the task's "
                    f"length, and a packed row holds a whole batch (batch_size * seq_len positions)")
        mechanism = _built(config, task, name, options)
        if not mechanism.capabilities.packed:
            return (f"{who if config.layers is not None else mechanism.name} does not take packed batches "
                    f"(capability packing={mechanism.capabilities.packing!r}): a document's output would depend "
                    f"on the others")
    return None


def model_schedule(config: TrainConfig, task: Task) -> Optional[Tuple[LayerSpec, ...]]:
    """The items of ``config.layers`` with each mechanism's length option filled in (None without one)."""
    if config.layers is None:
        return None
    return tuple(replace(spec, options=mechanism_options_for(config, task, spec.mechanism, dict(spec.options or {}))
                         or None) if spec.is_attention else spec for spec in config.schedule)


# The TrainConfig fields a token model's ModelConfig has too, under the same name and meaning: a setting
# declared in both reaches the model with no line here.
SHARED_WITH_MODEL = tuple(sorted({item.name for item in fields(TrainConfig)}
                                 & {item.name for item in fields(ModelConfig) if item.init}))


def model_config(config: TrainConfig, task: Task) -> ModelConfig:
    """The :class:`ModelConfig` of ``config``'s model for ``task``: the shared fields as they are, the task's
    vocabulary and length, and the mechanism in every self-attention slot (a gated or Mamba-2 block has its
    own attention: block options instead of mechanism options)."""
    shared = {name: getattr(config, name) for name in SHARED_WITH_MODEL}
    attention = config.block == "attention"
    shared.update(block_options=None if attention else dict(config.block_options),
                  layers=model_schedule(config, task))
    return ModelConfig(vocab_size=task.vocab_size, max_length=task.seq_len, self_attention=config.mechanism,
                       self_attention_options=mechanism_options_for(config, task) if attention and config.layers is None
                       else None, **shared)


def _copy_map(config: TrainConfig, task: Task) -> Optional[torch.Tensor]:
    """The pointer-generator's source -> target token map (None without copy_mechanism), or why the task and
    the copy setting do not go together."""
    if getattr(task, "extended_tokens", ()) and not config.copy_mechanism:
        raise ValueError(f"copy_mechanism is needed: {task.name}'s answers (with these options) hold tokens "
                         "outside its target vocabulary, which only a copy mechanism can produce")
    copy_map = task.copy_map() if config.copy_mechanism else None
    if copy_map is not None and not bool((copy_map >= 0).any()):
        raise UnsupportedOptionError(f"copy_mechanism needs a task whose source and target share tokens; "
                                     f"{task.name}'s vocabularies share none, so there is nothing to copy")
    return copy_map


def build_model(config: TrainConfig, task: Task) -> nn.Module:
    """The model for ``task``: a :class:`SequenceClassifier` (kind "classify"), a :class:`SequenceTagger`
    ("tag"), a :class:`LanguageModel` ("lm") or a :class:`Seq2SeqTransformer` ("seq2seq", ``depth`` layers
    on each side), every self-attention slot using ``config.mechanism``, or every layer a gated unit of
    ``config.block`` (not for seq2seq), or each layer what the schedule ``config.layers`` says.

    The tagger is causal when the task's options ask for it (:attr:`~attnzoo.tasks.Task.needs_causal_model`):
    ``attnzoo eval`` and ``--resume`` rebuild the task from the options the run recorded, so they rebuild
    the same model.

    Raises :class:`~attnzoo.UnsupportedOptionError` when the mechanism cannot serve the task."""
    refused = task_refusal(config, task)  # each setting declares the tasks it fits (TrainConfig's fields)
    if refused is not None:
        raise ValueError(refused)
    copy_map = _copy_map(config, task)
    refused = packing_refusal(config, task)
    if refused is not None:
        raise UnsupportedOptionError(f"pack is refused: {refused}")
    reasons = unsupported_reasons(config, task)
    if reasons:
        who = "layers" if config.layers is not None else config.mechanism
        raise UnsupportedOptionError(f"{who} cannot train on {task.name}: " + "; ".join(reasons))
    if task.kind == "classify":
        return SequenceClassifier(model_config(config, task), task.num_classes, pooling=config.pooling)
    if task.kind == "tag":
        return SequenceTagger(model_config(config, task), task.num_classes, causal=task.needs_causal_model)
    if task.kind == "lm":
        return LanguageModel(model_config(config, task))
    if task.kind == "seq2seq":
        # The mechanism (or the schedule) serves both self-attention slots; cross-attention stays exact softmax
        # (grouped by kv_heads too).
        common: Dict[str, Any] = dict(dim=config.dim, heads=config.heads, kv_heads=config.kv_heads,
                                      output_gate=config.output_gate,
                                      ff_dim=config.ff_dim, dropout=config.dropout, positional=config.positional,
                                      max_length=max(task.seq_len, task.target_len))
        if config.decoding != "autoregressive":  # the widest decoded row is the task's widest target
            common.update(decoding=config.decoding, length=config.length_mode, max_target_length=task.target_len)
        if config.layers is not None:
            schedule = model_schedule(config, task)
            common.update(encoder_layers=schedule, decoder_layers=schedule)
        else:
            options = mechanism_options_for(config, task)
            common.update(encoder_self_attention=config.mechanism, encoder_self_attention_options=options,
                          decoder_self_attention=config.mechanism, decoder_self_attention_options=options)
        return Seq2SeqTransformer(task.vocab_size, task.num_classes, encoder_depth=config.depth,
                                  decoder_depth=config.depth, copy_mechanism=config.copy_mechanism,
                                  copy_map=copy_map, **common)
    raise ValueError(f"task {task.name} has an unknown kind {task.kind!r}")

"""One declaration per training setting: a :class:`~attnzoo.training.TrainConfig` field made by :func:`setting`
carries, beside its default, everything else that is said about it.

* ``help``: what it means; ``attnzoo train --help`` shows it with the default.
* ``check``: how its value alone is checked (e.g. :func:`positive_int`); ``choices`` for a field with a fixed
  set of values (checked too, and the flag's choices).
* ``agrees``: a check of the whole config, for a rule between this field and others (``kv_heads`` must divide
  ``heads``); it raises, naming the field.
* ``fits_task``: why a value other than the field's default cannot train a given task (None when it can),
  asked when the model is built (``scheduled_sampling`` needs a seq2seq task).
* ``flag``: whether ``attnzoo train`` takes it as ``--name-with-dashes`` (False for the fields whose command-line
  form is written by hand: the task, the mechanism and the option dicts); ``commands``: the commands that do.

The command line (:mod:`attnzoo.cli.train`), ``TrainConfig.__post_init__`` and :func:`~attnzoo.training.build_model`
read these declarations, so a new setting is one field here plus its use; a field that a token model's
:class:`~attnzoo.models.ModelConfig` has under the same name reaches the model by itself.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

from .._validation import check_bool, check_choice, check_number, check_positive_int, check_probability

SETTING = "attnzoo.setting"  # the key of a field's Setting in its dataclasses metadata

ValueCheck = Callable[[str, Any], Any]  # (field name, value): raises naming the field
TaskCheck = Callable[[str, Any, Any], Optional[str]]  # (field name, value, task): why it does not fit, or None


@dataclass(frozen=True)
class Setting:
    """What a field declares about itself (see the module's docstring)."""

    help: str
    check: Optional[ValueCheck] = None
    choices: Optional[Tuple[str, ...]] = None
    agrees: Optional[Callable[[Any], None]] = None
    fits_task: Optional[TaskCheck] = None
    flag: bool = True
    commands: Tuple[str, ...] = ("train",)


def setting(default: Any = MISSING, *, help: str, check: Optional[ValueCheck] = None,  # noqa: A002 - argparse's word
            choices: Optional[Tuple[str, ...]] = None, agrees: Optional[Callable[[Any], None]] = None,
            fits_task: Optional[TaskCheck] = None, flag: bool = True, commands: Tuple[str, ...] = ("train",),
            default_factory: Any = MISSING) -> Any:
    """A dataclass field with its :class:`Setting` in the metadata."""
    declared = Setting(help, check, tuple(choices) if choices is not None else None, agrees, fits_task, flag,
                       tuple(commands))
    return dataclasses.field(default=default, default_factory=default_factory, metadata={SETTING: declared})


def declared(item: dataclasses.Field) -> Optional[Setting]:
    """The Setting a field declares, or None for a field not made by :func:`setting`."""
    return item.metadata.get(SETTING)


def settings_of(cls: type) -> Iterator[Tuple[dataclasses.Field, Setting]]:
    """(field, its Setting) for every declared field of the dataclass ``cls``, in declaration order."""
    for item in dataclasses.fields(cls):
        if declared(item) is not None:
            yield item, declared(item)


def default_of(item: dataclasses.Field) -> Any:
    return item.default_factory() if item.default_factory is not MISSING else item.default


def flag_of(name: str) -> str:
    """The command-line spelling of a field: ``group_by_length`` -> ``--group-by-length``."""
    return "--" + name.replace("_", "-")


def value_type(cls: type, item: dataclasses.Field) -> type:
    """The type of a field's values, None stripped: ``Optional[int]`` -> int (what its flag parses)."""
    hint = typing.get_type_hints(cls)[item.name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(kind for kind in typing.get_args(hint) if kind is not type(None))
    return typing.get_origin(hint) or hint


def check_declared(config: Any) -> None:
    """Check every declared field of a config: each value alone (in field order), then each rule between
    fields, so that a rule reads values already checked."""
    items = list(settings_of(type(config)))
    for item, declaration in items:
        value = getattr(config, item.name)
        if declaration.check is not None:
            declaration.check(item.name, value)
        if declaration.choices is not None and not (value is None and default_of(item) is None):
            check_choice(item.name, value, declaration.choices)
    for _, declaration in items:
        if declaration.agrees is not None:
            declaration.agrees(config)


def task_refusal(config: Any, task: Any) -> Optional[str]:
    """Why a setting of ``config`` that is not at its default cannot train ``task``, or None."""
    for item, declaration in settings_of(type(config)):
        value = getattr(config, item.name)
        if declaration.fits_task is not None and value != default_of(item):
            reason = declaration.fits_task(item.name, value, task)
            if reason is not None:
                return reason
    return None


# -- the checks a field names: of its value alone --------------------------------------------------------------
def positive_int(name: str, value: Any) -> Any:
    return check_positive_int(name, value)


def probability(name: str, value: Any) -> Any:
    return check_probability(name, value)


def boolean(name: str, value: Any) -> Any:
    return check_bool(name, value)


def number(**bounds: Any) -> ValueCheck:
    """A check by :func:`~attnzoo._validation.check_number` with these bounds (``integer``, ``minimum``, ...)."""
    def check(name: str, value: Any) -> Any:
        return check_number(name, value, **bounds)

    return check


def nonempty_name(what: str) -> ValueCheck:
    """A non-empty string, naming what it names (``task must be a task name``)."""
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be {what}, got {value!r}")

    return check


def option_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise TypeError(f"{name} must be a dict of option names to values, got {value!r}")


# -- the checks a field names: whether it fits a task ----------------------------------------------------------
def _shown(name: str, value: Any) -> str:
    """How a message names a setting: ``guide_loss 0.5``, or ``copy_mechanism`` for a switch."""
    return name if isinstance(value, bool) else f"{name} {value!r}"


def needs_seq2seq(why: str = "") -> TaskCheck:
    """A setting of the encoder-decoder model: refused on other tasks (``why``: what it needs there)."""
    def fits(name: str, value: Any, task: Any) -> Optional[str]:
        if task.kind == "seq2seq":
            return None
        return f"{_shown(name, value)} needs a seq2seq task{why}; {task.name} is {task.kind!r}"

    return fits


def not_seq2seq(missing: str) -> TaskCheck:
    """A setting of the token models: refused on seq2seq tasks, whose Seq2SeqTransformer has no ``missing``."""
    def fits(name: str, value: Any, task: Any) -> Optional[str]:
        if task.kind != "seq2seq":
            return None
        return f"{_shown(name, value)} cannot train on {task.name}: its model, a Seq2SeqTransformer, has no {missing}"

    return fits


def needs_padding(name: str, value: Any, task: Any) -> Optional[str]:
    """A setting about padding: refused on a task whose examples all have the same length."""
    if task.pad_id is not None:
        return None
    return f"{name} needs a task whose examples are padded; every {task.name} example is {task.seq_len} tokens long"


"""One declaration per setting: a config dataclass's field made by :func:`setting` carries, beside its default,
everything else that is said about it. The token models' :class:`~attnzoo.models.ModelConfig`, monotonic
inference's :class:`~attnzoo.models.monotonic.MonotonicInference`, and, above, the training run's
:class:`~attnzoo.training.TrainConfig` and the decoder's :class:`~attnzoo.training.DecoderSettings` declare their
fields so.

* ``help``: what it means; a command that takes it as a flag shows it in ``--help`` with the default.
* ``check``: how its value alone is checked (e.g. :func:`positive_int`); ``choices`` for a field with a fixed
  set of values (checked too, and the flag's choices).
* ``agrees``: a check of the whole config, for a rule between this field and others (``kv_heads`` must divide
  ``heads``); it raises, naming the field.
* ``fits_task``: why a value other than the field's default cannot train a given task (None when it can),
  asked when a training run's model is built (``scheduled_sampling`` needs a seq2seq task).
* ``owner``: the choice the field is an option of, for a config whose one field chooses between kinds of
  settings (a decoder's ``beam_size`` is an option of ``decoder="beam"``); :func:`check_owners` refuses it under
  another choice, and the command line chooses by the options given.
* ``commands``: the ``attnzoo`` commands that take it as a flag (none by default); ``flag``: False for a field
  whose command-line form is written by hand, True for ``--name-with-dashes``, or the flag's own spelling
  (``"--sampling-seed"``); ``metavar``: the name of its value in ``--help`` (``N``).

:func:`check_declared` (called by a config's ``__post_init__``) and the command line
(:func:`attnzoo.cli.common.add_declared_flags`) read these declarations, so a new setting is one field plus its
use. :mod:`attnzoo.training.settings` adds the checks of a field against a task.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator, Optional, Tuple, Union

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
    flag: Union[bool, str] = True
    commands: Tuple[str, ...] = ()
    metavar: Optional[str] = None
    owner: Optional[str] = None


def setting(default: Any = MISSING, *, help: str, check: Optional[ValueCheck] = None,  # noqa: A002 - argparse's word
            choices: Optional[Tuple[str, ...]] = None, agrees: Optional[Callable[[Any], None]] = None,
            fits_task: Optional[TaskCheck] = None, flag: Union[bool, str] = True, commands: Tuple[str, ...] = (),
            metavar: Optional[str] = None, owner: Optional[str] = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field with its :class:`Setting` in the metadata."""
    declared = Setting(help, check, tuple(choices) if choices is not None else None, agrees, fits_task, flag,
                       tuple(commands), metavar, owner)
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


def flag_spelling(item: dataclasses.Field) -> str:
    """How the command line spells a declared field: the flag it declares, else :func:`flag_of` its name."""
    flag = declared(item).flag
    return flag if isinstance(flag, str) else flag_of(item.name)


def flags(cls: type, command: str) -> Iterator[Tuple[dataclasses.Field, Setting]]:
    """(field, its Setting) for every field of ``cls`` that ``command`` takes as a flag."""
    for item, declaration in settings_of(cls):
        if declaration.flag is not False and command in declaration.commands:
            yield item, declaration


def value_type(cls: type, item: dataclasses.Field) -> type:
    """The type of a field's values, None stripped: ``Optional[int]`` -> int (what its flag parses)."""
    hint = typing.get_type_hints(cls)[item.name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(kind for kind in typing.get_args(hint) if kind is not type(None))
    return typing.get_origin(hint) or hint


def check_declared(config: Any) -> None:
    """Check every declared field of a config: each value alone (in field order), then each rule between
    fields, so that a rule reads values already checked."""
    check_values(config)
    check_rules(config)


def check_values(config: Any) -> None:
    """The first half of :func:`check_declared`: each declared field's value alone, in field order."""
    for item, declaration in settings_of(type(config)):
        value = getattr(config, item.name)
        if declaration.check is not None:
            declaration.check(item.name, value)
        if declaration.choices is not None and not (value is None and default_of(item) is None):
            check_choice(item.name, value, declaration.choices)


def check_rules(config: Any) -> None:
    """The second half of :func:`check_declared`: each rule between fields (``agrees``), in field order; a
    config that works out fields of its own from the checked values (a model's layers) does so in between."""
    for _, declaration in settings_of(type(config)):
        if declaration.agrees is not None:
            declaration.agrees(config)


def check_owners(config: Any, chooser: str) -> None:
    """Refuse a field given (not None) that is an option of another choice than the config's ``chooser``
    field's value: ``beam_size is an option of decoder 'beam', not of 'greedy'``."""
    chosen = getattr(config, chooser)
    for item, declaration in settings_of(type(config)):
        if declaration.owner is not None and getattr(config, item.name) is not None and chosen != declaration.owner:
            raise ValueError(f"{item.name} is an option of {chooser} {declaration.owner!r}, not of {chosen!r}")


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


def optional_instance(cls: type) -> ValueCheck:
    """None or an instance of ``cls`` (``monotonic must be None or a MonotonicInference, got dict``)."""
    def check(name: str, value: Any) -> None:
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be None or a {cls.__name__}, got {type(value).__name__}")

    return check

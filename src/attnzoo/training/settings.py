"""One declaration per training setting: a :class:`~attnzoo.training.TrainConfig` field made by :func:`setting`
carries, beside its default, everything else that is said about it (the machinery, shared with the models'
configs, is :mod:`attnzoo.models.settings`).

* ``help``: what it means; ``attnzoo train --help`` shows it with the default.
* ``check``: how its value alone is checked (e.g. :func:`positive_int`); ``choices`` for a field with a fixed
  set of values (checked too, and the flag's choices).
* ``agrees``: a check of the whole config, for a rule between this field and others (``kv_heads`` must divide
  ``heads``); it raises, naming the field.
* ``fits_task``: why a value other than the field's default cannot train a given task (None when it can),
  asked when the model is built (``scheduled_sampling`` needs a seq2seq task).
* ``flag``: whether ``attnzoo train`` takes it as ``--name-with-dashes`` (False for the fields whose command-line
  form is written by hand: the task, the mechanism and the option dicts); ``commands``: the commands that do
  (``train`` unless said otherwise).

The command line (:mod:`attnzoo.cli.train`), ``TrainConfig.__post_init__`` and :func:`~attnzoo.training.build_model`
read these declarations, so a new setting is one field here plus its use; a field that a token model's
:class:`~attnzoo.models.ModelConfig` has under the same name reaches the model by itself.
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any, Optional, Tuple

from ..models.settings import (  # noqa: F401 - the names a setting is declared and read with, all here
    SETTING,
    Setting,
    TaskCheck,
    ValueCheck,
    boolean,
    check_declared,
    check_owners,
    declared,
    default_of,
    flag_of,
    flag_spelling,
    flags,
    nonempty_name,
    number,
    option_dict,
    optional_instance,
    positive_int,
    probability,
    settings_of,
    value_type,
)
from ..models.settings import setting as declare


def setting(default: Any = MISSING, *, commands: Tuple[str, ...] = ("train",), **declaration: Any) -> Any:
    """A training setting: :func:`attnzoo.models.settings.setting`, a flag of ``attnzoo train`` unless its
    ``commands`` (or ``flag=False``) say otherwise."""
    return declare(default, commands=commands, **declaration)


def task_refusal(config: Any, task: Any) -> Optional[str]:
    """Why a setting of ``config`` that is not at its default cannot train ``task``, or None."""
    for item, declaration in settings_of(type(config)):
        value = getattr(config, item.name)
        if declaration.fits_task is not None and value != default_of(item):
            reason = declaration.fits_task(item.name, value, task)
            if reason is not None:
                return reason
    return None


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


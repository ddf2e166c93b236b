"""The checks of a mechanism's per-call inputs (:attr:`Mechanism.call_inputs
<attnzoo.mechanisms.base.Mechanism.call_inputs>`, each a :class:`~.capabilities.CallInput`), run once by the
base class for :meth:`~attnzoo.mechanisms.base.Mechanism.forward` and ``reference`` and by
``MultiHeadAttention`` before it projects anything."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from .._validation import check_position_mask
from .capabilities import CallInput, UnsupportedOptionError
from .catalog import REGISTERED


def declared_call_inputs(name: str, declared: Tuple[CallInput, ...], given: Dict[str, Any]) -> Dict[str, Any]:
    """Every input ``declared`` by mechanism ``name``, the value ``given`` or None, after refusing any name it
    does not declare: an :class:`UnsupportedOptionError` naming it and the mechanisms that take it, or a
    TypeError for a name no registered mechanism takes (a misspelt argument)."""
    names = {spec.name for spec in declared}
    for unknown in sorted(set(given) - names):
        takes = sorted(n for n, cls in REGISTERED.items() if unknown in {spec.name for spec in cls.call_inputs})
        if not takes:
            raise TypeError(f"{name}: unexpected argument {unknown!r}: not an argument of the contract, nor a "
                            f"per-call input of any registered mechanism")
        raise UnsupportedOptionError(
            f"{unknown}=...: mechanism {name!r} does not take {unknown} (mechanisms that do: {', '.join(takes)})"
        )
    return {spec.name: given.get(spec.name) for spec in declared}


def check_call_input_values(name: str, declared: Tuple[CallInput, ...], inputs: Dict[str, Any], q: Tensor) -> None:
    """Each given input a (batch, seq) bool mask over q's positions on q's device, errors naming it; refused
    under ``torch.jit.trace`` for an input a trace cannot take."""
    for spec in declared:
        value = inputs.get(spec.name)
        check_position_mask(spec.name, value, q.shape[0], q.shape[2], q.device)
        if value is not None and spec.untraceable and torch.jit.is_tracing():
            raise UnsupportedOptionError(f"{name}: {spec.name} cannot be traced: {spec.untraceable}")

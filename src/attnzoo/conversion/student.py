"""The student of a conversion: the teacher's weights with another attention mechanism in chosen layers.

The student is a separate :class:`~attnzoo.pretrained.CausalLM` holding a copy of every teacher weight; only
the converted layers' mechanisms are new, drawn under the conversion's seed (a seeded draw, never the caller's
global random state).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor

from ..pretrained import CausalLM

MECHANISM_PARAMETER = ".attention.mechanism."


def layer_plan(depth: int, converted: Sequence[int], target: str, options: Mapping[str, Any]) -> List[Tuple[str, dict]]:
    """One ``(mechanism, options)`` per layer: the target in the ``converted`` layers, softmax elsewhere."""
    chosen = set(converted)
    return [(target, dict(options)) if index in chosen else ("softmax", {}) for index in range(depth)]


def build_student(teacher: CausalLM, plan: Sequence[Tuple[str, Mapping[str, Any]]], seed: int) -> CausalLM:
    """A model with the teacher's weights and the attention of ``plan`` (see :func:`layer_plan`), in eval mode;
    the new mechanisms' parameters are drawn with ``torch.manual_seed(seed)`` inside a forked random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = CausalLM(teacher.config, layer_mechanisms=plan)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    strays = [name for name in missing if MECHANISM_PARAMETER not in name] + list(unexpected)
    if strays:  # the teacher must be a softmax CausalLM of the same shape
        raise ValueError(f"the teacher's weights do not fit the student: {', '.join(strays[:5])}")
    return student.to(teacher.head.weight.dtype).eval()


def mechanism_state(model: CausalLM) -> Dict[str, Tensor]:
    """The tensors of every layer's attention mechanism (what attention transfer trains), by parameter name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if MECHANISM_PARAMETER in name}


def load_tensors(model: CausalLM, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the model's parameters of the same names; every name must exist with its shape."""
    parameters = dict(model.named_parameters())
    for name, value in tensors.items():
        if name not in parameters or parameters[name].shape != value.shape:
            raise ValueError(f"saved tensor {name} {tuple(value.shape)} does not fit the model")
        with torch.no_grad():
            parameters[name].copy_(value)


def trainable_only(model: CausalLM, names: Sequence[str]) -> List[torch.nn.Parameter]:
    """Freeze every parameter of ``model`` but ``names``; returns those, in that order."""
    parameters = dict(model.named_parameters())
    model.requires_grad_(False)
    chosen = [parameters[name] for name in names]
    for parameter in chosen:
        parameter.requires_grad_(True)
    return chosen

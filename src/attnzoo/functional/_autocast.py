"""Hand-written autograd Functions, and cores that choose their own precision, under ``torch.autocast``.

A hand-written forward and backward choose their precision themselves: their callers cast q, k, v to the
working dtype of :mod:`attnzoo._dtypes` (float32 for half-precision inputs, so that long sums keep their small
terms). Autocast inside them would undo that choice one op at a time: a matmul would give bfloat16 where the
``out=`` buffer, the in-place accumulation or the saved tensor it meets is float32, and the backward, which
autograd runs outside autocast, would multiply a bfloat16 gradient by float32 tensors. So a Function's forward
and backward run with autocast off, on inputs cast to one dtype (autocast may hand them over mixed: a bfloat16
projection beside a float32 feature map); autograd casts each gradient the backward returns to the dtype of
its input.

The kernelized (linear) attention core is in the same position as a whole: it promises float32 sums for
half-precision inputs, and under autocast its matmuls would take the normaliser's sums to bfloat16, which with
few or weak keys (a ReLU feature map, a short padded context) costs a third of the gradients' accuracy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple, TypeVar

import torch
from torch import Tensor

Method = TypeVar("Method", bound=Callable[..., Any])


def _autocast_device(args: Tuple[Any, ...]) -> Optional[str]:
    """The device type of the first tensor argument if autocast is on for it, else None."""
    for arg in args:
        if isinstance(arg, Tensor):
            device = arg.device.type
            if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                return device
            return None
    return None


def _one_dtype(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """Floating tensor arguments cast to the dtype they promote to together; everything else unchanged."""
    floats = [arg for arg in args if isinstance(arg, Tensor) and arg.is_floating_point()]
    if not floats:
        return args
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in floats))
    return tuple(arg.to(dtype) if isinstance(arg, Tensor) and arg.is_floating_point() else arg for arg in args)


def without_autocast(function: Method) -> Method:
    """Runs ``function`` with autocast off for the device of its first tensor argument: for a core whose
    precision is its own choice (its working dtype), on inputs of whatever dtypes it is given. Without autocast
    it is a plain call."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        device = _autocast_device(args)
        if device is None:
            return function(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def outside_autocast(method: Method) -> Method:
    """Runs a Function's ``forward`` or ``backward`` (``method(ctx, *args)``) with autocast off for the device
    of its tensors, its floating tensor arguments cast to one dtype. Without autocast it is a plain call."""

    @functools.wraps(method)
    def run(ctx: Any, *args: Any) -> Any:
        device = _autocast_device(args)
        if device is None:
            return method(ctx, *args)
        with torch.autocast(device, enabled=False):
            return method(ctx, *_one_dtype(args))

    return run  # type: ignore[return-value]

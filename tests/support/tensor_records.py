"""One recorder of the tensors an operation returns, for the tests that check what a computation never
materialises (N x N score matrices, keys repeated to every query head)."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorRecorder(TorchDispatchMode):
    """Records the op, shape and floating-ness of every tensor an operation returns (views included), while
    active (``with TensorRecorder() as recorded: ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: List[Tuple[str, Tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.created.append((str(func), tuple(tensor.shape), tensor.is_floating_point()))
        return out

    def at_least(self, elements: float) -> List[Tuple[str, Tuple[int, ...]]]:
        """(op, shape) of every tensor with at least ``elements`` elements."""
        return [(op, shape) for op, shape, _ in self.created if torch.Size(shape).numel() >= elements]

    @property
    def largest(self) -> int:
        """The most elements of any recorded tensor (0 when none)."""
        return max((torch.Size(shape).numel() for _, shape, _ in self.created), default=0)

    @property
    def largest_floating(self) -> int:
        """The most elements of any recorded floating tensor (bool and integer masks left out)."""
        return max((torch.Size(shape).numel() for _, shape, floating in self.created if floating), default=0)

"""Attention and training across processes over ``torch.distributed``; the module names say which is which.

* :mod:`~attnzoo.parallel.sequence`: sequence parallelism, one sequence split across ranks, for the causal
  kernelized mechanisms (a scan of per-rank states; docs/scaling.md).
* :mod:`~attnzoo.parallel.data`: data parallelism, every rank holds the whole model and trains on its share of
  each batch, gradients averaged by DDP (``attnzoo train`` under torchrun).
"""

from .data import DataParallel, launched_by_torchrun, mechanism_reasons, start_from_environment, stop
from .sequence import (
    assert_replicated,
    sequence_parallel_attention,
    sequence_parallel_mechanisms,
    sequence_parallel_reasons,
    sequence_parallel_self_attention,
)

__all__ = [
    "DataParallel",
    "assert_replicated",
    "launched_by_torchrun",
    "mechanism_reasons",
    "sequence_parallel_attention",
    "sequence_parallel_mechanisms",
    "sequence_parallel_reasons",
    "sequence_parallel_self_attention",
    "start_from_environment",
    "stop",
]

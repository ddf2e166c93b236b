"""Running attention across processes over ``torch.distributed``.

* :mod:`~attnzoo.parallel.sequence`: sequence parallelism, one sequence split across ranks, for the causal
  kernelized mechanisms (a scan of per-rank states; docs/scaling.md).
"""

from .sequence import (
    assert_replicated,
    sequence_parallel_attention,
    sequence_parallel_mechanisms,
    sequence_parallel_reasons,
    sequence_parallel_self_attention,
)

__all__ = [
    "assert_replicated",
    "sequence_parallel_attention",
    "sequence_parallel_mechanisms",
    "sequence_parallel_reasons",
    "sequence_parallel_self_attention",
]

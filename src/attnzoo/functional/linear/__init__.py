"""Kernelized (linear) attention, ``phi(q) (phi(k)^T v)`` with its normaliser, optionally with a decay: one
family, one module per form.

* :mod:`.chunk`: the parallel form, :func:`kernel_attention` on features and :func:`linear_attention` on q, k, v
  (non-causal, and causal in chunks with a carried state), with the paths and their costs in its docstring;
  :mod:`.causal_chunks`: its hand-written autograd for the causal form without decay.
* :mod:`.recurrent`: :func:`kernel_attention_prefill` and :func:`kernel_attention_step`, O(m d) per token.
* :mod:`.packed`: the causal chunked form over a packed row of documents, its state reset at each start;
  :mod:`.packed_chunks`: the segmented scan of the states between its chunks, and its hand-written autograd
  without decay.
* :mod:`.reference`: the float64 quadratic forms every fast path is tested against.
* :mod:`.checks`, :mod:`.inputs`, :mod:`.normalize`, :mod:`.protocol`: what the forms share (argument checks;
  masking and the ones column of the values; the normaliser and its guards; what a feature map provides).

Decays and gates (RetNet, GLA, RFA) are in :mod:`attnzoo.functional.gated`; the same recurrence split along
the sequence for sequence parallelism in :mod:`attnzoo.functional.state_scan`.
"""

from .chunk import DEFAULT_CHUNK_SIZE, kernel_attention, kernel_attention_unchecked, linear_attention
from .causal_chunks import GROUP_ROWS, GroupTerms
from .packed import packed_causal_kernel_attention_unchecked
from .normalize import NORMALIZERS, SIGNED_DENOMINATOR_EPS, denominator_floor, normalize_output
from .protocol import FeatureMapArg, FeatureMapLike
from .recurrent import (
    KernelState,
    kernel_attention_prefill,
    kernel_attention_prefill_unchecked,
    kernel_attention_step,
    kernel_attention_step_unchecked,
)
from .reference import kernel_attention_reference, linear_attention_reference

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "GROUP_ROWS",
    "GroupTerms",
    "NORMALIZERS",
    "SIGNED_DENOMINATOR_EPS",
    "FeatureMapArg",
    "FeatureMapLike",
    "KernelState",
    "denominator_floor",
    "kernel_attention",
    "kernel_attention_prefill",
    "kernel_attention_prefill_unchecked",
    "kernel_attention_reference",
    "kernel_attention_step",
    "kernel_attention_step_unchecked",
    "kernel_attention_unchecked",
    "linear_attention",
    "linear_attention_reference",
    "normalize_output",
    "packed_causal_kernel_attention_unchecked",
]

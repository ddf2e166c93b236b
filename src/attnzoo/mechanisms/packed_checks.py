"""The length checks of a packed row (``cu_seqlens``): each document is what runs alone, so every rule a
mechanism's ``check_inputs`` enforces on a sequence's length binds each document, not the row (see
:meth:`~attnzoo.mechanisms.base.Mechanism.check_packed_inputs`)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from torch import Tensor

CheckInputs = Callable[[Tensor, Tensor, Tensor, bool, Optional[Tensor], bool], None]
"""A mechanism's bound ``check_inputs(q, k, v, causal, key_padding_mask, cross)``."""


def check_document_lengths(
    check_inputs: CheckInputs, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]
) -> None:
    """Run ``check_inputs`` on the first ``length`` positions of q, k, v (1, heads, N, dim) for every distinct
    document length of ``spans``, longest first: a maximum (``max_length``), a minimum, a multiple or any other
    rule on a length is checked for every document, short ones included. Only shapes are read, one call per
    distinct length. An error is raised again, of its type, with its message followed by the first document of
    that length, as ``(in document [start, end) of cu_seqlens)``."""
    first_of_length: Dict[int, Tuple[int, int]] = {}
    for start, end in spans:
        first_of_length.setdefault(end - start, (start, end))
    for length in sorted(first_of_length, reverse=True):
        try:
            check_inputs(q[:, :, :length], k[:, :, :length], v[:, :, :length], causal, None, False)
        except (TypeError, ValueError) as error:
            start, end = first_of_length[length]
            raise type(error)(f"{error} (in document [{start}, {end}) of cu_seqlens)") from None

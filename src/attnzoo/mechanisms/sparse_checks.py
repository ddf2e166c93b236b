"""Checks shared by the fixed sparse patterns (:mod:`.sparse`, :mod:`.longformer`): the ``block_size`` option.
(A packed call is checked by :meth:`~attnzoo.mechanisms.base.Mechanism.check_packed_inputs`, as for every
mechanism: ``max_length`` binds each document, not the row.)"""

from __future__ import annotations

from typing import Optional

from .._validation import check_number


def check_block_size(block_size: Optional[int]) -> Optional[int]:
    """The ``block_size`` option of the fixed patterns: an int >= 1, or None for the default."""
    return check_number("block_size", block_size, integer=True, minimum=1, optional=True)

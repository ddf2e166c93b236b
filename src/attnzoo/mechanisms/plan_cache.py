"""The one plan cache of the blockwise mechanisms: a mechanism keeps the plan of its last call (block indices
and masks, made from the length, causality and device alone) and makes it again only when that key changes.
One entry per slot, so the memory kept is that of one plan."""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

from torch import nn

Plan = TypeVar("Plan")


def last_plan(owner: nn.Module, slot: str, key: Hashable, make: Callable[[], Plan]) -> Plan:
    """The plan kept in ``owner``'s ``slot`` if it was made for ``key``, else ``make()``, kept there for next
    time. Kept outside the module's parameters and buffers: not saved, not moved, remade on another device."""
    cached = owner.__dict__.get(slot)
    if cached is None or cached[0] != key:
        cached = (key, make())
        owner.__dict__[slot] = cached
    return cached[1]

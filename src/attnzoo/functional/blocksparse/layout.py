"""What a fixed block-sparse pattern is: its block layout for a length (:class:`BlockLayout`), the
:class:`BlockPattern` interface, and the index-table helpers the patterns build their layouts with."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor


class BlockLayout(NamedTuple):
    """Where a pattern's blocks come from, for one sequence length (positions are original positions).

    Attributes:
        block_size: positions per block (queries and keys alike).
        query_positions: (n_query_blocks, block_size) long, the position processed in each query slot (-1 for
            padding); every position 0..N-1 exactly once. None: the natural order, padded at the end.
        key_positions: (n_key_blocks, block_size) long, the key sequence's positions (-1 for padding); may
            repeat a position in several views. None: the natural order, padded at the end.
        key_tags: (n_key_blocks, block_size) long view ids handed to the pattern's rule, or None (all 0).
        table: (n_query_blocks, blocks_per_row) long key-block indices, -1 for an unused slot; no key block
            twice in a row.
        band: when not None, ``table[i, r] == i + band + r`` wherever it is in range (and -1 elsewhere) with
            natural key order: the core then slices the blocks out of a padded view instead of gathering.
        global_queries: the first ``global_queries`` positions (natural order) attend to every key (causal
            and padding aside); computed as a dense (global_queries x N) pass beside the blocks.
    """

    block_size: int
    query_positions: Optional[Tensor]
    key_positions: Optional[Tensor]
    key_tags: Optional[Tensor]
    table: Tensor
    band: Optional[int] = None
    global_queries: int = 0


class BlockPattern:
    """A fixed sparsity pattern: its block layout for a length, its element rule, and its dense mask.

    Subclasses implement :meth:`layout` (the block index table and orders), :meth:`rule` (which gathered
    key slots a query may see; causality, key padding and slot validity are the core's business) and
    :meth:`dense` (the pattern's (N, N) allowed mask written from its definition, for the reference and
    tests)."""

    def layout(self, length: int, causal: bool, device: torch.device) -> BlockLayout:
        raise NotImplementedError

    def rule(self, query: Tensor, key: Tensor, tag: Tensor) -> Tensor:
        """Bool, broadcast over ``query`` (..., bs, 1) / ``key`` (..., 1, S) positions and key ``tag``s."""
        raise NotImplementedError

    def dense(self, length: int, device: Optional[torch.device] = None) -> Tensor:
        """(length, length) bool: query i may attend to key j (before causality and padding)."""
        raise NotImplementedError

    def parts(self) -> Tuple["BlockPattern", ...]:
        """Patterns with disjoint masks whose union is this one, each laid out on its own (its own query
        order, keys and table); the core runs each blockwise and merges their softmaxes. Empty (the default):
        the pattern is laid out whole by :meth:`layout`."""
        return ()


# -- table helpers ------------------------------------------------------------------------------------------
def _blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _band_table(n_query_blocks: int, n_key_blocks: int, first: int, last: int, device: torch.device) -> Tensor:
    """Row i lists key blocks i+first .. i+last (-1 where out of range)."""
    rows = torch.arange(n_query_blocks, device=device).unsqueeze(1)
    table = rows + torch.arange(first, last + 1, device=device)
    return torch.where((table >= 0) & (table < n_key_blocks), table, torch.full_like(table, -1))


def _dedupe_rows(table: Tensor) -> Tensor:
    """Each row's distinct valid entries (sorted), -1 elsewhere, trimmed to the widest row."""
    big = torch.iinfo(table.dtype).max
    ordered = torch.sort(torch.where(table >= 0, table, torch.full_like(table, big)), dim=1).values
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.where(repeat | (ordered == big), torch.full_like(ordered, big), ordered)
    ordered = torch.sort(ordered, dim=1).values
    if not torch.compiler.is_compiling():
        # The trimmed width depends on the values, which a compiled graph cannot size a tensor by; there the
        # rows keep their -1 tail, masked out like any unused slot.
        ordered = ordered[:, :max(1, int((ordered != big).sum(1).max()))]
    return torch.where(ordered == big, torch.full_like(ordered, -1), ordered)


def _natural_positions(length: int, block_size: int, device: torch.device) -> Tensor:
    """(n_blocks, block_size) positions 0..length-1 in order, -1 padding."""
    slots = torch.arange(_blocks(length, block_size) * block_size, device=device)
    return torch.where(slots < length, slots, torch.full_like(slots, -1)).view(-1, block_size)

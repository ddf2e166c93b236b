"""Packed variable-length batches: documents concatenated into one row, described by ``cu_seqlens``.

A packed batch is one row (batch 1) of ``N`` positions holding documents back to back, with no padding, as
flash-attention and flash-linear-attention describe it: ``cu_seqlens`` is an int64 tensor
``[0, end_1, end_2, ..., N]`` of document offsets, document ``d`` being positions ``cu_seqlens[d]`` up to (not
including) ``cu_seqlens[d + 1]``. Every document attends only within itself.

:func:`attend_per_document` runs any batched attention on each document alone, batching documents of equal
length together: one call per distinct length, never an (N, N) mask.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor

from .grouped import per_query_group

PerDocument = Callable[[Tensor, Tensor, Tensor], Tensor]
"""An attention on a batch of whole documents: q, k, v (docs, heads, length, dim) -> (docs, heads, length,
dim_v), each batch element attending only within itself."""


def check_cu_seqlens(cu_seqlens: object, batch: int, length: int, device: torch.device) -> List[Tuple[int, int]]:
    """Check ``cu_seqlens`` describes a packed batch of one row of ``length`` positions on ``device``; return
    each document's (start, end). Every error names ``cu_seqlens``.

    Reads the offsets' values (one transfer to the host): the documents decide which positions meet."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be an int64 tensor of document offsets, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int64:
        raise TypeError(f"cu_seqlens must be int64 (document offsets), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least two offsets [0, ..., seq_len], got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, the inputs on {device}")
    if batch != 1:
        raise ValueError(
            f"cu_seqlens describes the documents of one packed row: the batch must be 1, got batch {batch} "
            f"(concatenate the rows into one and offset their cu_seqlens)"
        )
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    steps = [end - start for start, end in zip(offsets, offsets[1:])]
    if min(steps) <= 0:
        at = steps.index(min(steps))
        raise ValueError(
            f"cu_seqlens must be strictly increasing (every document at least one position), got "
            f"{offsets[at]} then {offsets[at + 1]} at index {at}"
        )
    if offsets[-1] != length:
        raise ValueError(f"cu_seqlens must end at the row length {length}, got {offsets[-1]}")
    return list(zip(offsets, offsets[1:]))


def spans_by_length(spans: List[Tuple[int, int]]) -> Dict[int, List[int]]:
    """Document length -> the starts of the documents of that length, in row order."""
    groups: Dict[int, List[int]] = {}
    for start, end in spans:
        groups.setdefault(end - start, []).append(start)
    return groups


def attend_per_document(attend: PerDocument, q: Tensor, k: Tensor, v: Tensor, spans: List[Tuple[int, int]], *,
                        takes_grouped: bool = False) -> Tensor:
    """``attend`` run on each document of a packed row alone, documents of equal length batched together.

    Args:
        attend: the attention on whole documents (see :data:`PerDocument`).
        q: (1, heads, N, head_dim); k: (1, kv_heads, N, head_dim); v: (1, kv_heads, N, head_dim_v), one packed
            row; ``kv_heads`` divides ``heads`` (grouped-query attention, :mod:`.grouped`).
        spans: each document's (start, end), covering the row in order (from :func:`check_cu_seqlens`).
        takes_grouped: ``attend`` itself takes keys and values of fewer heads than the queries. Otherwise, with
            fewer, it runs once per member of each query group on the same keys and values
            (:func:`.grouped.per_query_group`): they are never repeated to every query head.

    Returns:
        (1, heads, N, head_dim_v): row i of a document is row i of ``attend`` on that document alone.
    """
    heads, kv_heads, device = q.shape[1], k.shape[1], q.device
    outputs, positions = [], []
    for length, starts in spans_by_length(spans).items():
        index = torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)  # (docs, L)
        # (heads, docs, L, dim) -> (docs, heads, L, dim): each document a batch element.
        queries, keys, values = (x[0][:, index].transpose(0, 1) for x in (q, k, v))
        if takes_grouped or kv_heads == heads:
            out = attend(queries, keys, values)
        else:
            out = per_query_group(lambda member: attend(member, keys, values), queries, kv_heads)
        outputs.append(out.transpose(0, 1).reshape(heads, index.numel(), out.shape[-1]))
        positions.append(index.reshape(-1))
    order = torch.argsort(torch.cat(positions))  # back from grouped order to row order
    return torch.cat(outputs, dim=1)[:, order].unsqueeze(0)

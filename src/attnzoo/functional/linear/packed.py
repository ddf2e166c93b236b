"""Causal kernelized attention over a packed row of documents: the chunked path of :mod:`.chunk` with its
state reset at every document start, so each document gets exactly what it gets alone.

The recurrence ``S_t = exp(log_decay_t) S_{t-1} + phi_k_t v_t^T`` becomes ``S_t = phi_k_t v_t^T`` at a document
start. In the chunked form (``chunk_size`` positions at a time, a carried (m, d + 1) state between chunks):

* within a chunk, query i sees key j <= i only if both lie in one document;
* the state after a chunk holds only the keys of the chunk's last document, and carries the previous state
  (decayed) only if no document starts inside the chunk;
* query i reads the carried state only if no document starts between the chunk's start and i.

The states between chunks are a segmented scan (:func:`.packed_chunks.segmented_scan`): ``log2`` of the
longest document's chunk count vectorised steps, never a loop over chunks, each adding states of one document
only. Never the prefix of the whole row minus the prefix at a document start, whose difference would lose a
short document after long ones to rounding. Without a decay (``linear``, ``rfa`` ungated) no decay factor is
computed at all, and :class:`.packed_chunks._PackedChunks` (a hand-written backward) goes a group of chunks at
a time as the unpacked path does, fixing its products only in the chunks where a document starts.

Memory: without a decay as the unpacked path (:mod:`.causal_chunks`: a group of chunks at a time) plus the
states before each chunk, O(N (m + d) + (N / chunk_size) m d); with one as the decayed chunked path, the same
plus the chunk scores of the whole row, O(N chunk_size). Never an (N, N) mask.

Grouped keys and values (fewer heads than the queries) are read by each member of a query group in turn
(:func:`attnzoo.functional.grouped.per_query_group`), never repeated.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._autocast import without_autocast
from ..._dtypes import working_dtype
from ..grouped import per_query_group
from .inputs import _pad_seq, _with_ones
from .normalize import normalize_output
from .packed_chunks import PackedMasks, _PackedChunks, scan_steps, states_before


def document_ids(spans: List[Tuple[int, int]], device: torch.device) -> Tensor:
    """(N,) int64: the index of the document each position of a packed row belongs to."""
    lengths = torch.tensor([end - start for start, end in spans], device=device)
    return torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)


def packed_masks(spans: List[Tuple[int, int]], n_chunks: int, chunk: int, device: torch.device) -> PackedMasks:
    """Which positions of each chunk of a packed row meet, the tail padding counted in the last document.

    Returns (hidden (C, chunk, chunk): the future and other documents' keys of each query; reaches_end
    (C, chunk): keys of the chunk's last document, the only ones it passes on; carries (C, chunk): queries still
    in the document of the position before the chunk, the only ones that read the state carried into it).
    """
    documents = document_ids(spans, device)
    doc = torch.cat([documents, documents[-1:].expand(n_chunks * chunk - documents.numel())]).view(n_chunks, chunk)
    before = torch.cat([documents[:1], doc[:-1, -1]])  # the document of the position before each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    hidden = ~(lower & (doc[:, :, None] == doc[:, None, :]))
    return hidden, doc == doc[:, -1:], doc == before[:, None]


def packed_causal_unnormalised(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_decay: Optional[Tensor], spans: List[Tuple[int, int]],
    chunk_size: int,
) -> Tensor:
    """(B, H, N, d + 1) causal numerator/normaliser of a packed row, the state reset at document starts.

    Args:
        phi_q, phi_k: (B, H, N, m); v: (B, H, N, d) without the ones column; log_decay: (B, H, N) or None.
        spans: each document's (start, end), covering the row in order.
        chunk_size: positions per chunk.
    """
    n = phi_q.shape[2]
    chunk = min(chunk_size, n)
    masks = packed_masks(spans, math.ceil(n / chunk), chunk, phi_q.device)
    steps = scan_steps(spans, chunk)
    if log_decay is None and not torch.compiler.is_compiling():
        start_chunks = sorted({start // chunk for start, _ in spans})
        return _PackedChunks.apply(phi_q, phi_k, v, *masks, start_chunks, steps)
    # Under torch.compile (which plans the memory of plain operations itself), and with a decay.
    return _packed_autograd(phi_q, phi_k, v, log_decay, masks, steps)


def _packed_autograd(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_decay: Optional[Tensor], masks: PackedMasks, steps: int
) -> Tensor:
    """:func:`packed_causal_unnormalised` in plain differentiable operations; arguments as there, ``masks`` from
    :func:`packed_masks` and ``steps`` from :func:`.packed_chunks.scan_steps`."""
    hidden, reaches_end, carries = masks
    batch, heads, n, m = phi_q.shape
    n_chunks, chunk = carries.shape
    pad = n_chunks * chunk - n
    d1 = v.shape[-1] + 1
    # Tail padding: zero keys in the last document, outputs cut off below.
    q = _pad_seq(phi_q, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    k = _pad_seq(phi_k, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    values = _pad_seq(_with_ones(v), pad, 2).reshape(batch, heads, n_chunks, chunk, d1)
    # Future and other documents' keys set to zero, never multiplied by zero (a non-finite key stays out);
    # in place on the product, which matmul's backward does not read.
    scores = q @ k.transpose(-1, -2)
    if log_decay is None:
        scores = scores.masked_fill_(hidden, 0.0)
        local = k.masked_fill(~reaches_end[..., None], 0.0).transpose(-1, -2) @ values
        chunk_decay, queries = None, q.masked_fill(~carries[..., None], 0.0)
    else:
        within = _pad_seq(log_decay, pad, 1).view(batch, heads, n_chunks, chunk).cumsum(-1)
        decay = (within.unsqueeze(-1) - within.unsqueeze(-2)).masked_fill(hidden, -math.inf).exp()
        scores = (scores * decay).masked_fill_(hidden, 0.0)
        # The state after a chunk: the keys of its last document, decayed to the chunk's end.
        last = within[..., -1:]
        key_weight = (last - within).masked_fill(~reaches_end, -math.inf).exp()
        keys = k.masked_fill(~reaches_end[..., None], 0.0)  # a non-finite key of an earlier document stays out
        local = (keys * key_weight.unsqueeze(-1)).transpose(-1, -2) @ values
        chunk_decay = torch.exp(last).unsqueeze(-1)  # (B, H, C, 1, 1)
        queries = q * within.exp().masked_fill(~carries, 0.0).unsqueeze(-1)
    previous = states_before(local, carries[:, -1], chunk_decay, steps)
    out = scores @ values + queries @ previous
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n]


@without_autocast
def packed_causal_kernel_attention_unchecked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, spans: List[Tuple[int, int]], log_decay: Optional[Tensor],
    normalizer: str, chunk_size: int, denominator_eps: float,
) -> Tensor:
    """Causal kernelized attention of a checked packed row (1, H, N, .), each document (start, end) of
    ``spans`` alone: :func:`.chunk.kernel_attention_unchecked`'s causal form with the state reset at every
    document start. phi_k, v (and log_decay) may have fewer heads than phi_q (grouped-query attention, kv_heads
    dividing H): each member of a query group reads them in turn, never repeated. Returns (1, H, N, d_v) in the
    dtype of ``v``."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    keys, values = phi_k.to(dtype), v.to(dtype)

    def attend(queries: Tensor) -> Tensor:
        num_den = packed_causal_unnormalised(queries, keys, values, log_decay, spans, chunk_size)
        return normalize_output(num_den, normalizer, denominator_eps)

    queries = phi_q.to(dtype)
    out = attend(queries) if keys.shape[1] == queries.shape[1] else per_query_group(attend, queries, keys.shape[1])
    return out.to(out_dtype)

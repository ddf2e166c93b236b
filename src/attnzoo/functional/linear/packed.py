"""Causal kernelized attention over a packed row of documents: the chunked path of :mod:`.chunk` with its
state reset at every document start, so each document gets exactly what it gets alone.

The recurrence ``S_t = exp(log_decay_t) S_{t-1} + phi_k_t v_t^T`` becomes ``S_t = phi_k_t v_t^T`` at a document
start. In the chunked form (``chunk_size`` positions at a time, a carried (m, d + 1) state between chunks):

* within a chunk, query i sees key j <= i only if both lie in one document;
* the state after a chunk holds only the keys of the chunk's last document, and carries the previous state
  (decayed) only if no document starts inside the chunk;
* query i reads the carried state only if no document starts between the chunk's start and i.

Memory as the decayed chunked path: O(N (m + d) + (N / chunk_size) m d), no (N, N) mask.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._autocast import without_autocast
from ..._dtypes import working_dtype
from .inputs import _pad_seq, _with_ones
from .normalize import normalize_output


def document_ids(spans: List[Tuple[int, int]], device: torch.device) -> Tensor:
    """(N,) int64: the index of the document each position of a packed row belongs to."""
    lengths = torch.tensor([end - start for start, end in spans], device=device)
    return torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)


def packed_causal_unnormalised(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_decay: Optional[Tensor], documents: Tensor, chunk_size: int
) -> Tensor:
    """(B, H, N, d + 1) causal numerator/normaliser of a packed row, the state reset at document starts.

    Args:
        phi_q, phi_k: (B, H, N, m); v: (B, H, N, d) without the ones column; log_decay: (B, H, N) or None.
        documents: (N,) int64 document index of each position (non-decreasing, see :func:`document_ids`).
        chunk_size: positions per chunk.
    """
    batch, heads, n, m = phi_q.shape
    chunk = min(chunk_size, n)
    n_chunks = math.ceil(n / chunk)
    pad = n_chunks * chunk - n
    d1 = v.shape[-1] + 1
    # Tail padding: zero keys in the last document, outputs cut off below.
    q = _pad_seq(phi_q, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    k = _pad_seq(phi_k, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    values = _pad_seq(_with_ones(v), pad, 2).reshape(batch, heads, n_chunks, chunk, d1)
    decays = phi_q.new_zeros(batch, heads, n) if log_decay is None else log_decay
    within = _pad_seq(decays, pad, 1).view(batch, heads, n_chunks, chunk).cumsum(-1)
    doc = torch.cat([documents, documents[-1:].expand(pad)]).view(n_chunks, chunk)
    before = torch.cat([documents[:1], doc[:-1, -1]])  # the document of the position before each chunk

    # Within a chunk: key j <= i of the query's own document, weighted by the decays between them.
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).tril()
    allowed = lower & (doc[:, :, None] == doc[:, None, :])  # (C, chunk, chunk)
    decay = (within.unsqueeze(-1) - within.unsqueeze(-2)).masked_fill(~allowed, -math.inf).exp()
    scores = (q @ k.transpose(-1, -2) * decay).masked_fill(~allowed, 0.0)
    # The state after a chunk: the keys of its last document, decayed to the chunk's end.
    last = within[..., -1:]
    reaches_end = doc == doc[:, -1:]
    key_weight = (last - within).masked_fill(~reaches_end, -math.inf).exp()
    local = (k * key_weight.unsqueeze(-1)).transpose(-1, -2) @ values
    # Queries still in the document the chunk started in read the carried state; a chunk whose end is in
    # another document passes on none of it.
    carries = doc == before[:, None]  # (C, chunk)
    chunk_decay = torch.exp(last).masked_fill(~carries[:, -1:], 0.0).unsqueeze(-1)  # (B, H, C, 1, 1)
    state = phi_q.new_zeros(batch, heads, m, d1)
    previous_states = []
    for decay_c, local_c in zip(chunk_decay.unbind(2), local.unbind(2)):
        previous_states.append(state)
        state = decay_c * state + local_c
    previous = torch.stack(previous_states, dim=2)
    query_weight = within.exp().masked_fill(~carries, 0.0)
    out = scores @ values + (q * query_weight.unsqueeze(-1)) @ previous
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n]


@without_autocast
def packed_causal_kernel_attention_unchecked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, spans: List[Tuple[int, int]], log_decay: Optional[Tensor],
    normalizer: str, chunk_size: int, denominator_eps: float,
) -> Tensor:
    """Causal kernelized attention of a checked packed row (1, H, N, .), each document (start, end) of
    ``spans`` alone: :func:`.chunk.kernel_attention_unchecked`'s causal form with the state reset at every
    document start. Returns (1, H, N, d_v) in the dtype of ``v``."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    documents = document_ids(spans, phi_q.device)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    num_den = packed_causal_unnormalised(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), log_decay, documents,
                                         chunk_size)
    return normalize_output(num_den, normalizer, denominator_eps).to(out_dtype)

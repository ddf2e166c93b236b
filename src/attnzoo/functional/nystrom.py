"""Nyström attention (Xiong et al. 2021, "Nyströmformer"): softmax attention through m landmarks.

The queries and keys are cut into m contiguous segments and each segment's mean is a landmark, ``Q~`` and
``K~`` (m, d). Three small softmax kernels stand in for the (N, N) attention matrix S:

    F = softmax(Q K~^T / sqrt d)     (N_q, m)
    A = softmax(Q~ K~^T / sqrt d)    (m, m)
    B = softmax(Q~ K^T / sqrt d)     (m, N_kv)
    out = F A^+ (B V)

where ``A^+`` is the Moore-Penrose pseudo-inverse, computed by the paper's iteration (:func:`iterative_pinv`).
With one landmark per position (m >= N), F = A = B = S and ``S S^+ S = S``: the output is exact softmax
attention up to the iteration's error. Cost: O(N m d) for the two outer kernels (both through
``scaled_dot_product_attention``) plus O(m^3) per pseudo-inverse iteration; nothing of size (N, N).

Segments: N positions in m segments, the first ``N mod m`` of them one position longer (sizes differ by at
most one), so every landmark covers real positions whatever the length. With m >= N each position is its own
landmark (m is taken as N).

Padding: a padded key is left out of its segment's mean (a segment of nothing but padding gives an empty
landmark, which no kernel attends to and whose row and column of A are zero, so its pseudo-inverse row and
column are zero too), and B attends over unpadded keys only. Padded keys and values are zeroed before use, so
whatever they hold (NaN, inf) changes nothing. ``query_padding_mask`` does the same for the query landmarks;
in self-attention it is the key padding mask, so a padded query changes no output but its own row. A batch
element whose keys are all padded gives zeros.

Precision: the landmarks, A, its pseudo-inverse and the final product ``F (A^+ B V)`` run in float32 for
float16/bfloat16 inputs (in float64 for float64); ``B V`` runs in the input dtype.

Optional residual (``conv_weight``): a depthwise convolution over the sequence of each head's (zeroed)
values, added to the output, as in the paper's implementation. It needs the queries and values of one
sequence.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_floating, check_key_padding_mask, check_positive_int, check_qkv
from .masks import zero_padded

DEFAULT_LANDMARKS = 64
DEFAULT_PINV_ITERATIONS = 6


# -- the pseudo-inverse ---------------------------------------------------------------------------------------
def iterative_pinv(a: Tensor, iterations: int = DEFAULT_PINV_ITERATIONS) -> Tensor:
    """Moore-Penrose pseudo-inverse of ``a`` (..., m, n) by the iteration of the Nyströmformer paper.

    ``Z_0 = a^T / (||a||_1 ||a||_inf)`` (max column sum times max row sum of ``|a|``), then
    ``Z_{j+1} = Z_j (13 I - a Z_j (15 I - a Z_j (7 I - a Z_j))) / 4``. Every singular value sigma of ``a`` is
    fitted as ``sigma^2 ||a||_1^-1 ||a||_inf^-1`` rises towards 1 (about 3.25 times per iteration while small,
    then very fast), so well-conditioned matrices converge in a few iterations and the directions of tiny
    singular values stay damped, which is what keeps the Nyström product bounded. A zero matrix gives zeros.
    Batched over the leading dims; computed in the input dtype (pass float32 or float64).

    Returns (..., n, m).
    """
    check_floating("a", a)
    if a.dim() < 2:
        raise ValueError(f"a must have at least 2 dims (..., m, n), got shape {tuple(a.shape)}")
    check_positive_int("iterations", iterations)
    return iterative_pinv_unchecked(a, iterations)


def iterative_pinv_unchecked(a: Tensor, iterations: int, rhs: Optional[Tensor] = None) -> Tensor:
    """:func:`iterative_pinv` for callers that have checked ``a`` and ``iterations``. With ``rhs`` (..., m, c)
    it returns ``pinv(a) @ rhs``, applying the last iteration's factor to ``rhs`` instead of to Z (an
    (m, m, c) product in place of an (n, m, m) one)."""
    *batch, rows, columns = a.shape
    magnitude = a.abs()
    max_column_sum = magnitude.sum(-2).amax(-1)
    max_row_sum = magnitude.sum(-1).amax(-1)
    norms = max_column_sum * max_row_sum
    # A zero matrix (every landmark empty) keeps Z = 0; where() rather than a clamp keeps the gradient finite.
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))
    a = a.reshape(-1, rows, columns)
    z = a.transpose(-1, -2) / norms.reshape(-1, 1, 1)
    eye = torch.eye(rows, dtype=a.dtype, device=a.device)
    eye7, eye15, eye13_4 = 7 * eye, 15 * eye, 3.25 * eye
    for step in range(iterations):
        az = torch.bmm(a, z)
        t = eye7 - az
        t = torch.baddbmm(eye15, az, t, alpha=-1.0)  # 15 I - az t, one fused op
        t = torch.baddbmm(eye13_4, az, t, alpha=-0.25)  # (13 I - az t) / 4
        if rhs is not None and step == iterations - 1:
            return torch.bmm(z, torch.bmm(t, rhs.reshape(-1, rows, rhs.shape[-1]))).reshape(
                *batch, columns, rhs.shape[-1]
            )
        z = torch.bmm(z, t)
    z = z.reshape(*batch, columns, rows)
    return z if rhs is None else z @ rhs


# -- landmarks ------------------------------------------------------------------------------------------------
def landmark_count(length: int, landmarks: int) -> int:
    """How many landmarks a sequence of ``length`` positions gets: ``landmarks``, or one per position when
    the sequence is shorter."""
    return min(landmarks, length)


def segment_sizes(length: int, landmarks: int) -> List[int]:
    """Sizes of the contiguous segments whose means are the landmarks: ``landmark_count`` segments, the first
    ``length mod count`` one position longer than the rest."""
    count = landmark_count(length, landmarks)
    size, longer = divmod(length, count)
    return [size + 1] * longer + [size] * (count - longer)


def _segment_sums(x: Tensor, count: int) -> Tensor:
    """Sums of ``x`` (..., N, c) over the segments of :func:`segment_sizes`: (..., count, c). Two reshapes,
    no gather: the longer segments come first."""
    length = int(x.shape[-2])  # an int even while tracing (the graph is specialised to the shape anyway)
    size, longer = divmod(length, count)
    split = longer * (size + 1)
    tail = x[..., split:, :].unflatten(-2, (count - longer, size)).sum(-2)
    if not longer:
        return tail
    head = x[..., :split, :].unflatten(-2, (longer, size + 1)).sum(-2)
    return torch.cat([head, tail], dim=-2)


def _landmarks(x: Tensor, padding_mask: Optional[Tensor], count: int, dtype: torch.dtype) -> Tuple[Tensor, Optional[Tensor]]:
    """Segment means of ``x`` (B, H, N, d) in ``dtype`` over unpadded positions, and which landmarks cover at
    least one such position ((B, count) bool; None when nothing is padded)."""
    x = x.to(dtype)
    if padding_mask is None:
        size, longer = divmod(int(x.shape[-2]), count)
        if not longer:  # equal segments (a length that is a multiple of the count): a plain mean
            return x.unflatten(-2, (count, size)).mean(-2), None
        sizes = torch.tensor(segment_sizes(int(x.shape[-2]), count), dtype=dtype, device=x.device)
        return _segment_sums(x, count) / sizes[:, None], None
    x = zero_padded(x, padding_mask)
    counts = _segment_sums((~padding_mask).to(dtype)[..., None], count)  # (B, count, 1)
    means = _segment_sums(x, count) / counts.clamp_min(1.0)[:, None]  # an empty segment: 0 / 1, no NaN
    return means, counts[..., 0] > 0


# -- attention ------------------------------------------------------------------------------------------------
def _check_sequence_mask(name: str, mask: Optional[Tensor], batch: int, length: int, device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = padding), got {mask.dtype}")
    if mask.shape != (batch, length):
        raise ValueError(f"{name} must have shape (batch, seq_q) = ({batch}, {length}), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} must be on {device}, got {mask.device}")


def _check_conv_weight(conv_weight: Optional[Tensor], q: Tensor, k: Tensor) -> None:
    if conv_weight is None:
        return
    check_floating("conv_weight", conv_weight)
    heads = q.shape[1]
    if conv_weight.dim() != 2 or conv_weight.shape[0] != heads or conv_weight.shape[1] % 2 == 0:
        raise ValueError(
            f"conv_weight must have shape (heads, kernel) = ({heads}, odd kernel), got {tuple(conv_weight.shape)}"
        )
    if conv_weight.device != q.device:
        raise ValueError(f"conv_weight must be on {q.device}, got {conv_weight.device}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"conv_weight: the convolution residual adds the values to the queries' outputs, so it needs queries "
            f"and values of one sequence; got seq_q={q.shape[2]}, seq_kv={k.shape[2]}"
        )


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    landmarks: int = DEFAULT_LANDMARKS,
    pinv_iterations: int = DEFAULT_PINV_ITERATIONS,
    query_padding_mask: Optional[Tensor] = None,
    conv_weight: Optional[Tensor] = None,
) -> Tensor:
    """Nyström approximation of (non-causal) softmax attention; see the module docstring for the maths.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys: left out of the key landmarks and of
            the keys B attends over.
        landmarks: m, the number of segment-mean landmarks (one per position when the sequence is shorter).
        pinv_iterations: iterations of :func:`iterative_pinv`.
        query_padding_mask: (batch, seq_q) bool, True marks queries left out of the query landmarks (their own
            output rows are still computed). For self-attention pass the key padding mask.
        conv_weight: (heads, kernel) with an odd kernel: adds a depthwise convolution over the sequence of each
            head's values to the output (needs seq_q == seq_kv).

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``v``.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    _check_sequence_mask("query_padding_mask", query_padding_mask, q.shape[0], q.shape[2], q.device)
    check_positive_int("landmarks", landmarks)
    check_positive_int("pinv_iterations", pinv_iterations)
    _check_conv_weight(conv_weight, q, k)
    return nystrom_attention_unchecked(
        q, k, v, key_padding_mask, query_padding_mask, landmarks, pinv_iterations, conv_weight
    )


def nystrom_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    query_padding_mask: Optional[Tensor],
    landmarks: int,
    pinv_iterations: int,
    conv_weight: Optional[Tensor],
) -> Tensor:
    """:func:`nystrom_attention` for callers that have validated every argument themselves (the mechanism,
    after :meth:`~attnzoo.mechanisms.base.Mechanism.check_inputs`): inputs are checked once."""
    dtype = v.dtype
    work = working_dtype(dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    m_q, m_k = landmark_count(int(q.shape[2]), landmarks), landmark_count(int(k.shape[2]), landmarks)
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)

    q_land, q_land_valid = _landmarks(q, query_padding_mask, m_q, work)
    k_land, k_land_valid = _landmarks(k, key_padding_mask, m_k, work)

    # B V: the query landmarks attend over the unpadded keys. A batch element with every key padded lets its
    # rows see all (zeroed) keys, which keeps the softmax finite; its output is zero anyway (A = 0 below).
    key_allowed = None
    if key_padding_mask is not None:
        keep = ~key_padding_mask
        key_allowed = (keep | ~keep.any(-1, keepdim=True))[:, None, None, :]
    bv = F.scaled_dot_product_attention(q_land.to(dtype), k, v, attn_mask=key_allowed).to(work)

    # A and its pseudo-inverse, in the working dtype. Empty key landmarks are masked out as columns; rows of
    # empty query landmarks are zeroed (their pseudo-inverse columns are then zero, so B's rows for them drop
    # out), and so is all of A for an element with no key landmark at all.
    logits = (q_land @ k_land.transpose(-1, -2)) * scale
    land_allowed = None
    if k_land_valid is not None:
        any_key = k_land_valid.any(-1, keepdim=True)
        land_allowed = (k_land_valid | ~any_key)[:, None, None, :]  # (B, 1, 1, m_k)
        logits = logits.masked_fill(~land_allowed, -math.inf)
    a = torch.softmax(logits, dim=-1)
    if k_land_valid is not None or q_land_valid is not None:
        rows = torch.ones(a.shape[0], m_q, dtype=torch.bool, device=a.device)
        if q_land_valid is not None:
            rows = rows & q_land_valid
        if k_land_valid is not None:
            rows = rows & any_key
        a = a * rows[:, None, :, None].to(work)
    w = iterative_pinv_unchecked(a, pinv_iterations, bv)  # pinv(A) B V: (B, H, m_k, d_v)

    # F W: every query attends over the key landmarks, then reads W instead of their values.
    out = F.scaled_dot_product_attention(q.to(work), k_land, w, attn_mask=land_allowed)
    if conv_weight is not None:
        out = out + _depthwise_conv(v.to(work), conv_weight.to(work))
    return out.to(dtype)


def _depthwise_conv(v: Tensor, weight: Tensor) -> Tensor:
    """Each head's values (B, H, N, d) convolved over the sequence with its own kernel ``weight[h]`` (odd
    length, zero padding, the same kernel for every channel of the head)."""
    heads, kernel = weight.shape
    return F.conv2d(v, weight.view(heads, 1, kernel, 1), padding=(kernel // 2, 0), groups=heads)


# -- reference ------------------------------------------------------------------------------------------------
def pinv_iterations_reference(a: Tensor, iterations: int) -> Tensor:
    """The paper's iteration for one matrix ``a`` (m, n), written out in float64 with the matrix norms of
    ``torch.linalg``: ``Z_0 = a^T / (||a||_1 ||a||_inf)``, ``Z <- Z (13 I - aZ (15 I - aZ (7 I - aZ))) / 4``."""
    a = a.double()
    identity = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
    norm = torch.linalg.matrix_norm(a, ord=1) * torch.linalg.matrix_norm(a, ord=math.inf)
    z = a.T / norm
    for _ in range(iterations):
        az = a @ z
        z = z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az))) / 4
    return z


def nystrom_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    landmarks: int = DEFAULT_LANDMARKS,
    pinv_iterations: Optional[int] = None,
    query_padding_mask: Optional[Tensor] = None,
    conv_weight: Optional[Tensor] = None,
) -> Tensor:
    """Obviously-correct float64 Nyström attention, one (batch, head) at a time with dense matrices.

    Same arguments as :func:`nystrom_attention`, except ``pinv_iterations``: None (the default) takes the exact
    pseudo-inverse (``torch.linalg.pinv``); a count runs the paper's iteration that many times
    (:func:`pinv_iterations_reference`), which is what the fast path computes. Empty landmarks are removed
    (not masked), padded keys are removed from B, and the landmark means come from an explicit averaging
    matrix. Returns float64 (batch, heads, seq_q, head_dim_v).
    """
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    device = q.device
    no_keys = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
    no_queries = torch.zeros(batch, q_len, dtype=torch.bool, device=device)
    key_padded = no_keys if key_padding_mask is None else key_padding_mask
    query_padded = no_queries if query_padding_mask is None else query_padding_mask
    k = k.masked_fill(key_padded[:, None, :, None], 0.0)
    v = v.masked_fill(key_padded[:, None, :, None], 0.0)
    q_masked = q.masked_fill(query_padded[:, None, :, None], 0.0)

    def averaging(length: int, padded: Tensor) -> Tensor:
        """(landmarks, length): row j averages the unpadded positions of segment j (all zero if none); empty
        rows are dropped."""
        rows = []
        start = 0
        for size in segment_sizes(length, landmarks):
            row = torch.zeros(length, dtype=torch.float64, device=device)
            members = [i for i in range(start, start + size) if not bool(padded[i])]
            for i in members:
                row[i] = 1.0 / len(members)
            if members:
                rows.append(row)
            start += size
        return torch.stack(rows) if rows else torch.zeros(0, length, dtype=torch.float64, device=device)

    def softmax_rows(logits: Tensor) -> Tensor:
        weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
        return weights / weights.sum(dim=-1, keepdim=True)

    out = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float64, device=device)
    for b in range(batch):
        keep = ~key_padded[b]
        query_average = averaging(q_len, query_padded[b])
        key_average = averaging(k_len, key_padded[b])
        if not bool(keep.any()) or query_average.shape[0] == 0:
            continue  # nothing to attend to (or no query landmark): zeros
        for h in range(heads):
            q_landmarks = query_average @ q_masked[b, h]
            k_landmarks = key_average @ k[b, h]
            kernel_f = softmax_rows(q[b, h] @ k_landmarks.T * scale)
            kernel_a = softmax_rows(q_landmarks @ k_landmarks.T * scale)
            kernel_b = softmax_rows(q_landmarks @ k[b, h][keep].T * scale)
            if pinv_iterations is None:
                inverse = torch.linalg.pinv(kernel_a)
            else:
                inverse = pinv_iterations_reference(kernel_a, pinv_iterations)
            out[b, h] = kernel_f @ inverse @ kernel_b @ v[b, h][keep]
    if conv_weight is not None:
        weight = conv_weight.double()
        kernel = weight.shape[1]
        for offset in range(-(kernel // 2), kernel // 2 + 1):
            tap = weight[:, offset + kernel // 2][None, :, None, None]  # (1, heads, 1, 1)
            for i in range(q_len):
                if 0 <= i + offset < k_len:
                    out[:, :, i] = out[:, :, i] + tap[:, :, 0] * v[:, :, i + offset]
    return out

"""Synthesized attention (Tay et al. 2021, "Synthesizer: Rethinking Self-Attention in Transformer Models"):
the (N, N) attention logits are produced from one position at a time, or learned outright, instead of from
query-key dot products.

Logit builders (building blocks on parameter tensors of the documented shapes; no checks, like the feature
functions: the mechanism holds well-formed parameters). ``L`` is the longest sequence the parameters cover,
``N <= L`` the sequence at hand, of which the first N rows/columns are used:

* dense: row i from its own query, ``relu(q_i W1 + b1) W2 + b2`` (head_dim -> hidden -> L).
* factorized dense: the same two layers give ``A_i`` (``a`` values) and ``B_i`` (``b = ceil(L / a)``
  values); logit ``(i, j) = A_i[j // b] * B_i[j % b]`` (the paper's elementwise product of the two vectors,
  each repeated to length ``a b >= L``; this repeating pattern makes it the flattened outer product).
* random: a learned (or fixed) (L, L) table per head, the same for every input.
* factorized random: ``R1 R2^T`` with ``R1, R2`` of shape (L, k) per head, rank k.

Attention: ``softmax(logits) v``, or for the paper's mixture ``softmax(w_s * logits + w_d * q k^T / sqrt(d)) v``
with per-head weights ``w_s + w_d = 1``. Two paths:

* :func:`factored_synthesizer_attention`, for logits that are a product ``left @ right^T`` of (N, r) factors
  (dense: ``[relu(q W1 + b1), 1] @ [W2, b2]^T``; factorized random: ``R1 R2^T``; the mixture appends
  ``q / sqrt(d)`` and ``k`` as further columns): one fused ``scaled_dot_product_attention`` call with the
  factors as queries and keys. The (N, N) logits are never materialised: memory O(N (r + d)).
* :func:`synthesizer_attention`, for materialised logits (random table, factorized dense): an explicit
  softmax; causal rows go in blocks, each against the keys up to its last row only (half the work).

Causal masking and key padding act on the logits (masked logits are -inf); padded keys and values are zeroed
first, so whatever they hold changes nothing, and a row that sees no key outputs zeros. The logits are indexed
by the positions of ONE sequence, so there is no cross-attention. Computed in float32 for half-precision
input.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int, check_qkv
from .masks import allowed_mask, causal_allowed, zero_padded
from .softmax import masked_sdpa, masked_softmax_reference

MODES = ("dense", "random", "factorized_dense", "factorized_random")
"""How the logits are synthesised (see the module docstring)."""

DEFAULT_CHUNK_SIZE = 256
"""Rows per block of the causal path of materialised logits: each block meets only the keys up to its last
row, so the work is about half the square's (N^2 / 2 + N chunk / 2)."""


# -- logit builders ------------------------------------------------------------------------------------------
def _hidden(q: Tensor, w1: Tensor, b1: Tensor) -> Tensor:
    """relu(q W1 + b1): (B, H, N, hidden) from q (B, H, N, head_dim), W1 (H, head_dim, hidden), b1 (H, hidden)."""
    return torch.relu(torch.matmul(q, w1) + b1.unsqueeze(1))


def dense_synthesizer_factors(q: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tuple[Tensor, Tensor]:
    """Dense synthesised logits as a product ``left @ right^T``, never materialised: ``left = [relu(q W1 + b1),
    1]`` (B, H, N, hidden + 1) and ``right = [W2[:, :N]^T, b2[:N]]`` (H, N, hidden + 1), so that row i of the
    product is ``relu(q_i W1 + b1) W2 + b2`` over the first N columns, from q_i alone.

    Args:
        q: (B, H, N, head_dim); w1: (H, head_dim, hidden); b1: (H, hidden); w2: (H, hidden, L); b2: (H, L),
        with N <= L.
    """
    n = q.shape[2]
    hidden = _hidden(q, w1, b1)
    left = torch.cat([hidden, hidden.new_ones(*hidden.shape[:-1], 1)], dim=-1)
    right = torch.cat([w2[:, :, :n].transpose(1, 2), b2[:, :n, None]], dim=-1)
    return left, right


def factorized_split(length: int, factor: int) -> int:
    """``b = ceil(length / factor)``, the second factor of the factorized dense logits (``a = factor``), so
    that ``a * b >= length``."""
    return -(-length // factor)


def factorized_dense_synthesizer_logits(
    q: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, factor: int
) -> Tensor:
    """Factorized dense logits: (B, H, N, N), logit (i, j) = ``A_i[j // b] * B_i[j % b]``.

    Args:
        q: (B, H, N, head_dim); w1: (H, head_dim, hidden); b1: (H, hidden); w2: (H, hidden, a + b);
        b2: (H, a + b), where ``a = factor`` and ``b = w2.shape[2] - a``. N <= a * b.
    """
    n = q.shape[2]
    both = torch.matmul(_hidden(q, w1, b1), w2) + b2.unsqueeze(1)
    first, second = both[..., :factor], both[..., factor:]
    # Column j = (j // b) * b + j % b: the flattened outer product of the two vectors.
    return (first.unsqueeze(-1) * second.unsqueeze(-2)).flatten(-2)[..., :n]


def random_synthesizer_logits(table: Tensor, n: int) -> Tensor:
    """The learned logits of the first ``n`` positions: (H, n, n) from a table (H, L, L), n <= L."""
    return table[:, :n, :n]


def factorized_random_synthesizer_factors(left: Tensor, right: Tensor, n: int) -> Tuple[Tensor, Tensor]:
    """The factors ``R1, R2`` over the first ``n`` positions, (H, n, k) each, whose product ``R1 R2^T`` is the
    factorized random logits; from R1, R2 of shape (H, L, k), n <= L."""
    return left[:, :n], right[:, :n]


# -- attention -----------------------------------------------------------------------------------------------
def _check_logits(logits: Tensor, v: Tensor) -> None:
    check_floating("logits", logits)
    batch, heads, n = v.shape[0], v.shape[1], v.shape[2]
    leading = tuple(logits.shape[:-2])
    if logits.dim() not in (3, 4) or tuple(logits.shape[-2:]) != (n, n) or leading not in (
        (heads,), (1, heads), (batch, heads)
    ):
        raise ValueError(
            f"logits must have shape (heads, seq, seq) or (batch or 1, heads, seq, seq) = ({heads}, {n}, {n}) or "
            f"({batch} or 1, {heads}, {n}, {n}) for v of shape {tuple(v.shape)}, got {tuple(logits.shape)}"
        )
    if logits.dtype != v.dtype or logits.device != v.device:
        raise TypeError(f"logits must share v's dtype and device ({v.dtype}, {v.device}), got {logits.dtype}, "
                        f"{logits.device}")


def _check_mix(mix: Tensor, heads: int, q: Tensor) -> None:
    check_floating("mix", mix)
    if mix.shape != (heads, 2):
        raise ValueError(f"mix must have shape (heads, 2) = ({heads}, 2), got {tuple(mix.shape)}")
    if mix.dtype != q.dtype or mix.device != q.device:
        raise TypeError(f"mix must share q's dtype and device ({q.dtype}, {q.device}), got {mix.dtype}, {mix.device}")


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], mix: Optional[Tensor]
) -> None:
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"synthesized attention is self-attention: its logits index the positions of one sequence, got "
            f"q seq={q.shape[2]} and k seq={k.shape[2]}"
        )
    check_key_padding_mask(key_padding_mask, v.shape[0], v.shape[2], v.device)
    check_bool("causal", causal)
    if mix is not None:
        _check_mix(mix, q.shape[1], q)


def _check_factors(left: Tensor, right: Tensor, v: Tensor) -> None:
    batch, heads, n = v.shape[0], v.shape[1], v.shape[2]
    leading = ((heads,), (1, heads), (batch, heads))
    for name, x in (("left", left), ("right", right)):
        check_floating(name, x)
        if x.dim() not in (3, 4) or x.shape[-2] != n or tuple(x.shape[:-2]) not in leading:
            raise ValueError(
                f"{name} must have shape (heads, seq, rank) or (batch or 1, heads, seq, rank) with heads={heads}, "
                f"seq={n}, batch={batch} (from v), got {tuple(x.shape)}"
            )
        if x.dtype != v.dtype or x.device != v.device:
            raise TypeError(f"{name} must share v's dtype and device ({v.dtype}, {v.device}), got {x.dtype}, "
                            f"{x.device}")
    if left.shape[-1] != right.shape[-1]:
        raise ValueError(f"left and right must share their last dim (the rank), got {left.shape[-1]} and "
                         f"{right.shape[-1]}")


def synthesizer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logits: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    mix: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Self-attention with synthesised logits: ``softmax(logits) v``, optionally mixed with dot products.

    Args:
        q, k: (batch, heads, seq, head_dim); used only with ``mix`` (the dot-product logits).
        v: (batch, heads, seq, head_dim_v)
        logits: the synthesised logits, (heads, seq, seq) shared by the batch, or (batch or 1, heads, seq, seq).
        causal: key j is visible to query i only if j <= i (the logits of later keys are masked).
        key_padding_mask: (batch, seq) bool, True marks padding: those keys are masked and their keys and
            values zeroed first.
        mix: (heads, 2) weights ``(w_s, w_d)`` of the synthesised and the ``q k^T / sqrt(head_dim)`` logits (the
            mechanism passes a softmax, so ``w_s + w_d = 1``); None for synthesised logits alone.
        chunk_size: rows per block of the causal path (the result does not depend on it).

    Returns:
        (batch, heads, seq, head_dim_v) in v's dtype; zeros for a query that sees no key.
    """
    _check_inputs(q, k, v, causal, key_padding_mask, mix)
    _check_logits(logits, v)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    return synthesizer_attention_unchecked(q, k, v, logits, causal, key_padding_mask, mix, chunk_size)


def synthesizer_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logits: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    mix: Optional[Tensor],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """:func:`synthesizer_attention` on validated arguments (the mechanism calls it after its own checks)."""
    dtype = v.dtype
    work = working_dtype(dtype)
    batch, heads, n, _ = v.shape
    scores = logits.to(work)
    if scores.dim() == 3:
        scores = scores.unsqueeze(0)  # one (heads, N, N) for the whole batch: broadcast, never copied
    values = zero_padded(v, key_padding_mask).to(work)
    if mix is not None:
        weights = mix.to(work)
        synthesized = weights[:, 0].view(1, heads, 1, 1)
        # w_d / sqrt(d) folded into q: one (N, d) scaling instead of one over the (N, N) product.
        queries = q.to(work) * (weights[:, 1] / math.sqrt(q.shape[3])).view(1, heads, 1, 1)
        keys = zero_padded(k, key_padding_mask).to(work)
    # Causal: rows in blocks, each against the keys up to its last row only (about half the work and memory of
    # the whole square). torch.split, not slicing, so the backward assembles the logits' gradient once.
    blocks = torch.split(scores, chunk_size, dim=-2) if causal else (scores,)
    outputs = []
    start = 0
    for block in blocks:
        stop = start + block.shape[-2]
        width = stop if causal else n
        block_scores = block[..., :width]
        if mix is not None:
            dots = torch.matmul(queries[..., start:stop, :], keys[..., :width, :].transpose(-1, -2))
            block_scores = dots + block_scores * synthesized
        block_values = values[..., :width, :]
        allowed = _visible(batch, start, stop, width, causal, key_padding_mask, v.device)
        if allowed is None:
            out = torch.matmul(torch.softmax(block_scores, dim=-1), block_values)
        else:
            # Rows with no visible key would be 0/0: let them see every key (finite softmax and gradient),
            # then zero their output. For every row, with no branch on whether any is empty (traced graphs
            # stay correct).
            empty = ~allowed.any(dim=-1, keepdim=True)
            block_scores = block_scores.masked_fill(~(allowed | empty), -math.inf)
            out = torch.matmul(torch.softmax(block_scores, dim=-1), block_values).masked_fill(empty, 0.0)
        outputs.append(out)
        start = stop
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)
    return out.to(dtype)


def _visible(
    batch: int, start: int, stop: int, width: int, causal: bool, key_padding_mask: Optional[Tensor],
    device: torch.device,
) -> Optional[Tensor]:
    """Which of the first ``width`` keys rows ``start .. stop - 1`` may see, broadcastable to (batch, heads,
    rows, width); None when all."""
    allowed = None
    if causal:
        # Bottom-right alignment of (rows, width) with width = stop: row start + r sees keys <= start + r.
        allowed = causal_allowed(stop - start, width, device).view(1, 1, stop - start, width)
    if key_padding_mask is not None:
        keep = (~key_padding_mask[:, :width]).view(batch, 1, 1, width)
        allowed = keep if allowed is None else allowed & keep
    return allowed


def factored_synthesizer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    left: Tensor,
    right: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    mix: Optional[Tensor] = None,
) -> Tensor:
    """:func:`synthesizer_attention` with logits given as a product ``left @ right^T`` (the dense and the
    factorized random logits), which is never materialised: one fused ``scaled_dot_product_attention`` call
    with ``left`` as queries and ``right`` as keys, so time O(N^2 rank) and memory O(N (rank + d)).

    Args:
        left, right: (heads, seq, rank) shared by the batch, or (batch or 1, heads, seq, rank).
        Others as for :func:`synthesizer_attention`; with ``mix`` the dot-product logits are appended as
        further columns, ``[w_s left, w_d q / sqrt(d)] @ [right, k]^T``.
    """
    _check_inputs(q, k, v, causal, key_padding_mask, mix)
    _check_factors(left, right, v)
    return factored_synthesizer_attention_unchecked(q, k, v, left, right, causal, key_padding_mask, mix)


def factored_synthesizer_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    left: Tensor,
    right: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    mix: Optional[Tensor],
) -> Tensor:
    """:func:`factored_synthesizer_attention` on validated arguments."""
    dtype = v.dtype
    work = working_dtype(dtype)
    batch, heads, n, width_v = v.shape
    left, right = left.to(work), right.to(work)
    if left.dim() == 3:
        left = left.unsqueeze(0)
    if right.dim() == 3:
        right = right.unsqueeze(0)
    values = zero_padded(v, key_padding_mask).to(work)
    if mix is not None:
        weights = mix.to(work)
        synthesized = weights[:, 0].view(1, heads, 1, 1)
        dot = (weights[:, 1] / math.sqrt(q.shape[3])).view(1, heads, 1, 1)
        keys = zero_padded(k, key_padding_mask).to(work)
        left = torch.cat([(left * synthesized).expand(batch, -1, -1, -1), q.to(work) * dot], dim=-1)
        right = torch.cat([right.expand(batch, -1, -1, -1), keys], dim=-1)
    left, right = left.expand(batch, -1, -1, -1), right.expand(batch, -1, -1, -1)
    # The fused CPU kernel wants one width for queries, keys and values: zero columns change no logit and no
    # output (the extra output columns are dropped).
    width = max(left.shape[-1], width_v)
    if left.shape[-1] < width:
        left, right = F.pad(left, (0, width - left.shape[-1])), F.pad(right, (0, width - right.shape[-1]))
    if width_v < width:
        values = F.pad(values, (0, width - width_v))
    if key_padding_mask is None:
        out = F.scaled_dot_product_attention(left, right, values, is_causal=causal, scale=1.0)
    else:
        # A row with no visible key (see synthesizer_attention_unchecked): sees everything, output zeroed.
        allowed = allowed_mask(batch, n, n, causal, key_padding_mask, v.device)
        out = masked_sdpa(left, right, values, allowed, scale=1.0)
    return out[..., :width_v].to(dtype)


# -- float64 references --------------------------------------------------------------------------------------
def synthesized_logits_reference(
    mode: str,
    q: Tensor,
    *,
    w1: Optional[Tensor] = None,
    b1: Optional[Tensor] = None,
    w2: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    table: Optional[Tensor] = None,
    left: Optional[Tensor] = None,
    right: Optional[Tensor] = None,
    factor: int = 1,
) -> Tensor:
    """The logits of ``mode`` over the N positions of ``q`` from their definitions, in float64, with the
    parameters of that mode (shapes as for the builders above): (B, H, N, N) for the dense modes, (H, N, N)
    for the random ones. Written from the per-element formulas, not with the builders' reshapes."""
    n = q.shape[2]
    q = q.double()
    if mode in ("dense", "factorized_dense"):
        hidden = torch.einsum("bhid,hde->bhie", q, w1.double()) + b1.double()[None, :, None, :]
        hidden = torch.where(hidden > 0, hidden, torch.zeros_like(hidden))
        out = torch.einsum("bhie,hec->bhic", hidden, w2.double()) + b2.double()[None, :, None, :]
        if mode == "dense":
            return out[..., :n]
        b = w2.shape[2] - factor
        columns = torch.arange(n, device=q.device)
        return out[..., columns // b] * out[..., factor + columns % b]
    if mode == "random":
        return table.double()[:, :n, :n]
    if mode == "factorized_random":
        r1, r2 = left.double()[:, :n], right.double()[:, :n]
        return (r1[:, :, None, :] * r2[:, None, :, :]).sum(-1)
    raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")


def synthesizer_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logits: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    mix: Optional[Tensor] = None,
) -> Tensor:
    """:func:`synthesizer_attention` by explicit float64 maths: masked logits set to -inf, a max-shifted
    exponential normalised by its sum, and a row with nothing visible set to zero. Returns float64."""
    q, k, v = q.double(), zero_padded(k.double(), key_padding_mask), zero_padded(v.double(), key_padding_mask)
    batch, heads, n, head_dim = q.shape
    scores = logits.double().expand(batch, heads, n, n)
    if mix is not None:
        w = mix.double()
        dots = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(head_dim)
        scores = w[None, :, 0, None, None] * scores + w[None, :, 1, None, None] * dots
    visible = torch.ones(batch, 1, n, n, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask[:, None, None, :]
    return masked_softmax_reference(scores, visible) @ v


def factored_synthesizer_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    left: Tensor,
    right: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    mix: Optional[Tensor] = None,
) -> Tensor:
    """:func:`factored_synthesizer_attention` in float64: the logits ``left @ right^T`` materialised, then
    :func:`synthesizer_attention_reference`."""
    logits = torch.einsum("...ir,...jr->...ij", left.double(), right.double())
    return synthesizer_attention_reference(q, k, v, logits, causal, key_padding_mask, mix=mix)

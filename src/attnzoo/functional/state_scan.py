"""Causal kernelized attention split along the sequence into parts: each part's state, combined by a prefix scan.

Causal kernelized attention (:mod:`attnzoo.functional.linear`) is a linear recurrence over positions,

    S_t = a_t S_{t-1} + phi_k_t [v_t, 1]^T,        o_t = phi_q_t S_t   (numerator and normaliser),

with ``a_t = 1`` for plain linear attention (``linear``, ``performer``, ``rfa``), a constant per head for
``retention`` and a learned gate for ``gla``. A part of the sequence, positions ``s..e``, acts on the state before
it as an affine map

    S_e = A S_{s-1} + U,      A = a_s a_{s+1} ... a_e  (one number per batch and head),
                              U = the part's own state, from a zero state,

and two consecutive parts ``(A1, U1)`` then ``(A2, U2)`` compose to ``(A2 A1, A2 U1 + U2)``. The operator is
associative, so the states before all parts are an exclusive prefix scan of the parts' ``(A, U)`` pairs, which
each part can compute on its own (on its own device, :mod:`attnzoo.distributed`). A part's outputs are then
its causal outputs from a zero state plus what the state ``P`` before it adds:

    o_t = local_t + (a_s ... a_t) phi_q_t P.

Decays are kept as logs (``log A <= 0``): products of many decays stay exact, and ``exp`` of a sum of
non-positive logs never overflows. Without decays ``A = 1`` and the scan is an exclusive sum. Each part costs
one extra ``(n, m) x (m, d + 1)`` product (the prefix term) beside the single-process work, and the scan moves
one ``(m, d + 1)`` state per batch and head per part.

Key padding is applied where the single-sequence path applies it: padded keys leave the features, values and
normaliser, and a padded position is an identity step (log decay 0). Feature maps whose key features carry a
shared scale (FAVOR+ stabilises keys by their maximum) must use one scale for every part: the caller agrees on
it first (the largest of the parts' scales) and rescales each part's keys, which :func:`rescale_keys` does.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_floating, check_key_padding_mask, check_positive_int
from .linear.checks import _check_features, _check_log_decay, _check_options
from .linear.chunk import _chunked_causal
from .linear.inputs import _masked_keys, _masked_log_decay, _with_ones
from .linear.normalize import normalize_output


class LinearTerms(NamedTuple):
    """A causal linear-attention recurrence as a mechanism defines it (:meth:`attnzoo.Mechanism.linear_terms`):
    what :func:`part_terms` and :func:`finish_part` need to run it on a part of a sequence."""

    phi_q: Tensor
    """(B, H, N, m) query features."""
    phi_k: Tensor
    """(B, H, N, m) key features (gated keys included)."""
    key_log_scale: Optional[Tensor]
    """(B, H, 1, 1) log of the shift the key features were divided by (stabilised features), or None."""
    log_decay: Optional[Tensor]
    """(B, H, N) per-position log decay, or None for undecayed linear attention."""
    normalizer: str
    chunk_size: int
    denominator_eps: float


class PartTerms(NamedTuple):
    """What one part of the sequence computes before the scan (all in the working dtype).

    Attributes:
        num_den: (batch, heads, n, d_v + 1) causal numerators and normalisers from a zero state.
        state: (batch, heads, m, d_v + 1) the part's own state ``U``.
        log_decay_total: (batch, heads) ``log A``, the part's total log decay, or None without decays.
        query_log_decay: (batch, heads, n) ``log(a_s ... a_t)`` at each position, or None without decays.
    """

    num_den: Tensor
    state: Tensor
    log_decay_total: Optional[Tensor]
    query_log_decay: Optional[Tensor]


def part_terms(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
    *,
    chunk_size: int = 64,
) -> PartTerms:
    """One part's causal outputs from a zero state, its own state and its decays.

    Args:
        phi_q, phi_k: (batch, heads, n, m) features of the part's queries and keys (one scale for every part).
        v: (batch, heads, n, d_v)
        key_padding_mask: (batch, n) bool, True marks padding.
        log_decay: (batch, heads, n) per-position log decay (<= 0), or None.
        chunk_size: chunk length of the causal path inside the part.
    """
    _check_features(phi_q, phi_k, v)
    batch, heads, n, _ = phi_q.shape
    if phi_k.shape[2] != n:
        raise ValueError(f"a part's queries and keys are one stretch of the sequence, got {n} and {phi_k.shape[2]}")
    check_key_padding_mask(key_padding_mask, batch, n, phi_q.device)
    _check_log_decay(log_decay, batch, heads, n)
    check_positive_int("chunk_size", chunk_size)
    dtype = working_dtype(v.dtype)
    phi_k, v = _masked_keys(phi_k, v, key_padding_mask, dtype)
    log_decay = _masked_log_decay(log_decay, key_padding_mask, dtype)
    num_den, state = _chunked_causal(phi_q.to(dtype), phi_k, v, log_decay, chunk_size, None)
    if log_decay is None:
        return PartTerms(num_den, state, None, None)
    cumulative = log_decay.cumsum(-1)
    return PartTerms(num_den, state, cumulative[..., -1], cumulative)


Summary = Tuple[Optional[Tensor], Tensor]
"""A part's (log A (batch, heads) or None, U (batch, heads, m, d + 1))."""


def combine(earlier: Summary, later: Summary) -> Summary:
    """The scan's operator: part ``earlier`` = (log A1 (batch, heads) or None, U1 (batch, heads, m, d + 1)) followed
    by ``later`` = (log A2, U2) acts as (log A1 + log A2, A2 U1 + U2). Associative."""
    log_a1, u1 = earlier
    log_a2, u2 = later
    if log_a2 is None:
        return log_a1, u1 + u2
    log_a = log_a2 if log_a1 is None else log_a1 + log_a2
    return log_a, torch.exp(log_a2)[..., None, None] * u1 + u2


def exclusive_state_scan(states: Tensor, log_decay_totals: Optional[Tensor] = None) -> Tensor:
    """The state before each part: ``P_0 = 0``, ``P_r = A_{r-1} P_{r-1} + U_{r-1}``.

    Args:
        states: (parts, batch, heads, m, d + 1), each part's own state ``U_r``.
        log_decay_totals: (parts, batch, heads), each part's ``log A_r``, or None (no decays: an exclusive sum).

    Returns:
        (parts, batch, heads, m, d + 1). A sequential loop over the parts: there are as many as devices.
    """
    check_floating("states", states)
    if states.dim() != 5 or states.shape[0] < 1:
        raise ValueError(f"states must have shape (parts, batch, heads, m, d + 1), got {tuple(states.shape)}")
    if log_decay_totals is not None:
        check_floating("log_decay_totals", log_decay_totals)
        if log_decay_totals.shape != states.shape[:3]:
            raise ValueError(
                f"log_decay_totals must have shape (parts, batch, heads) = {tuple(states.shape[:3])}, got "
                f"{tuple(log_decay_totals.shape)}"
            )
    prefixes: List[Tensor] = [torch.zeros_like(states[0])]
    carried: Summary = (None, prefixes[0])
    for r in range(states.shape[0] - 1):
        log_a = None if log_decay_totals is None else log_decay_totals[r]
        carried = combine(carried, (log_a, states[r]))
        prefixes.append(carried[1])
    return torch.stack(prefixes)


def finish_part(
    terms: PartTerms,
    phi_q: Tensor,
    prefix: Tensor,
    *,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """A part's outputs (batch, heads, n, d_v): its own terms plus the prefix state ``prefix`` (batch, heads, m,
    d_v + 1), normalised as :func:`attnzoo.functional.normalize_output` does; in ``out_dtype`` (the working
    dtype by default)."""
    _check_options(normalizer, 1, denominator_eps)
    if prefix.shape != terms.state.shape:
        raise ValueError(f"prefix must have the part's state shape {tuple(terms.state.shape)}, got {tuple(prefix.shape)}")
    dtype = terms.num_den.dtype
    queries = phi_q.to(dtype)
    if terms.query_log_decay is not None:
        queries = queries * torch.exp(terms.query_log_decay).unsqueeze(-1)
    num_den = terms.num_den + queries @ prefix.to(dtype)
    out = normalize_output(num_den, normalizer, denominator_eps)
    return out if out_dtype is None else out.to(out_dtype)


def rescale_keys(phi_k: Tensor, key_log_scale: Tensor, shared_log_scale: Tensor) -> Tensor:
    """Keys whose true features are ``phi_k * exp(key_log_scale)`` expressed at the ``shared_log_scale`` every part
    uses (both (batch, heads, 1, 1); shared >= own, so the factor is at most 1 and nothing overflows)."""
    return phi_k * torch.exp(key_log_scale - shared_log_scale).to(phi_k.dtype)


def split_causal_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    lengths: Sequence[int],
    key_padding_mask: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
    *,
    normalizer: str = "sum",
    chunk_size: int = 64,
    denominator_eps: float = 0.0,
) -> Tensor:
    """Causal :func:`attnzoo.functional.kernel_attention` computed part by part, in one process: the sequence cut
    into parts of ``lengths`` positions, each part's terms, the scan, each part finished. What
    :mod:`attnzoo.distributed` does with one part per rank; equal to the single-sequence result.

    Shapes as :func:`attnzoo.functional.kernel_attention` (seq_q == seq_kv); returns (batch, heads, seq, d_v)
    in the dtype of ``v``.
    """
    n = phi_q.shape[2]
    lengths = [check_positive_int(f"lengths[{i}]", length) for i, length in enumerate(lengths)]
    if sum(lengths) != n:
        raise ValueError(f"lengths must add up to the sequence length {n}, got {lengths} (sum {sum(lengths)})")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    pieces = [slice(start, start + length) for start, length in zip(starts, lengths)]
    terms = [
        part_terms(
            phi_q[:, :, piece], phi_k[:, :, piece], v[:, :, piece],
            None if key_padding_mask is None else key_padding_mask[:, piece],
            None if log_decay is None else log_decay[..., piece],
            chunk_size=chunk_size,
        )
        for piece in pieces
    ]
    totals = None if log_decay is None else torch.stack([t.log_decay_total for t in terms])
    prefixes = exclusive_state_scan(torch.stack([t.state for t in terms]), totals)
    outputs = [
        finish_part(t, phi_q[:, :, piece], prefix, normalizer=normalizer, denominator_eps=denominator_eps,
                    out_dtype=v.dtype)
        for t, piece, prefix in zip(terms, pieces, prefixes)
    ]
    return torch.cat(outputs, dim=2)


def prefix_states_reference(
    phi_k: Tensor,
    v: Tensor,
    starts: Sequence[int],
    key_padding_mask: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
) -> Tensor:
    """The state before each position in ``starts`` from its definition, in float64: ``P = sum_{j < s}
    exp(L_{s-1} - L_j) phi_k_j [v_j, 1]^T`` with ``L`` the cumulative log decay, padded keys left out (and their
    decays taken as 0). Returns (len(starts), batch, heads, m, d_v + 1)."""
    phi_k, v = phi_k.double(), v.double()
    values = _with_ones(v)
    if key_padding_mask is not None:
        keep = (~key_padding_mask)[:, None, :, None].double()
        phi_k, values = phi_k * keep, values * keep
    batch, heads, n, _ = phi_k.shape
    if log_decay is None:
        cumulative = torch.zeros(batch, heads, n, dtype=torch.float64, device=phi_k.device)
    else:
        log_decay = log_decay.double()
        if key_padding_mask is not None:
            log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
        cumulative = log_decay.cumsum(-1)
    states = []
    for start in starts:
        if start == 0:
            states.append(torch.zeros(batch, heads, phi_k.shape[-1], values.shape[-1], dtype=torch.float64,
                                      device=phi_k.device))
            continue
        weights = torch.exp(cumulative[..., start - 1 : start] - cumulative[..., :start])  # (B, H, start)
        states.append(torch.einsum("bhj,bhjm,bhjd->bhmd", weights, phi_k[:, :, :start], values[:, :, :start]))
    return torch.stack(states)


__all__ = [
    "PartTerms",
    "combine",
    "exclusive_state_scan",
    "finish_part",
    "part_terms",
    "prefix_states_reference",
    "rescale_keys",
    "split_causal_attention",
]

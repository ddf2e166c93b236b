"""Kernelized (linear) attention: ``phi(q) (phi(k)^T v)`` with its normaliser, optionally with a decay.

Everything works on features ``phi_q`` (batch, heads, seq_q, m) and ``phi_k`` (batch, heads, seq_kv, m) and
values ``v`` (batch, heads, seq_kv, d_v). With a per-position log decay ``log_decay`` (batch, heads, seq) the
causal output is

    o_i = sum_{j <= i} exp(L_i - L_j) (phi_q_i . phi_k_j) v_j,   L_t = sum_{s <= t} log_decay_s,

i.e. the recurrence ``S_t = exp(log_decay_t) S_{t-1} + phi_k_t v_t^T``, ``o_t = phi_q_t S_t``; without decay
it is plain causal linear attention. The normaliser is the same sum with ``v_j`` replaced by 1; the values
get an extra column of ones so one matmul yields numerator and normaliser together.

Paths:

* non-causal: ``phi_q @ (phi_k^T @ [v, 1])``, O(N m d) time, O(N (m + d) + m d) memory.
* causal, chunked: within chunks of ``chunk_size`` positions the exact quadratic form, between chunks a
  carried (m, d + 1) state; never an (N, m, d) prefix tensor. Without decay (:class:`_CausalChunks`) the
  chunks go a group of :data:`GROUP_ROWS` rows at a time (batched matmuls over the group's chunks), forward
  in order and backward in reverse, and the backward recomputes a group's chunk scores and states from q, k,
  v and the one state kept per group: training memory is the features, values, outputs and gradients plus
  one group's working set, O(N (m + d) + GROUP_ROWS (chunk_size + m d / chunk_size)). With a decay, chunk
  scores (batched over all chunks at once) and states (a short loop over chunks) cover the whole sequence,
  O(N (m + d) + (N / chunk_size) m d); the states take no more memory than the features once
  ``chunk_size >= d``.
* recurrent: :func:`kernel_attention_step`, O(m d) per token whatever the context length.

Non-finite inputs, causal: a NaN or inf in ``phi_q``, ``phi_k`` or ``log_decay`` at position p reaches no
output before p (future keys' weights are set to zero, never multiplied by zero). A non-finite entry of
``v`` at position p does reach the outputs at the earlier positions of its own chunk, ``p - p % chunk_size``
to ``p - 1``, in the columns where it is non-finite: the intra-chunk product ``tril(Q K^T) V`` multiplies
its zero weight by it, and ``0 * NaN = 0 * inf = NaN``. Earlier chunks, the other columns and the
normaliser keep their values, and incremental decoding (:func:`kernel_attention_step`) never sees the future
value, so there the parallel form and decoding disagree. ``chunk_size=1`` has no future position inside a
chunk, at a large cost in speed. Keeping the value out in general would take a second intra-chunk product or
a data-dependent branch per group of chunks (a host synchronisation on GPU), for an input that makes every
later output non-finite anyway. For comparison, PyTorch's ``scaled_dot_product_attention`` (exact softmax,
torch 2.13 on CPU) spreads a non-finite future value into the outputs at every earlier position.

Sums run in float32 for float16/bfloat16 inputs (half-precision sums over long sequences overflow), in float64
for float64 inputs; the output is cast back to the dtype of ``v``. Padded keys are removed from the features,
so they leave both the numerator and the normaliser; with a decay, a padded position is also an identity step
(log decay 0), as if it were absent from the sequence.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int, check_qkv
from .features import NAMED_FEATURES
from .masks import allowed_mask

DEFAULT_CHUNK_SIZE = 64
"""Chunk length of the causal path; 64 balances the quadratic intra-chunk work (N * chunk * (m + d)) against
the per-chunk states (N / chunk * m * d) for head dims around 64 on CPU. A non-finite value reaches the
earlier outputs of its chunk (see the module docstring)."""

SIGNED_DENOMINATOR_EPS = 1e-6
"""Smallest normaliser magnitude allowed for feature maps with negative features (trigonometric ones), whose
normaliser can cross zero; positive feature maps get no such guard."""

NORMALIZERS = ("sum", "max_abs", "none")

KernelState = Dict[str, Tensor]
"""Recurrent state: ``{"kv": (batch, heads, m, d_v + 1), "log_scale": (batch, heads, 1, 1)}``. The true state
``exp(log_scale) * kv`` holds ``sum_j decay * phi_k_j [v_j, 1]^T``; the separate scale lets feature maps whose
keys are stabilised by a shift (FAVOR+) merge new keys exactly."""



def _check_features(phi_q: Tensor, phi_k: Tensor, v: Tensor) -> None:
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, dim), got {tuple(x.shape)}")
    if phi_q.shape[:2] != phi_k.shape[:2] or phi_k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"phi_q, phi_k and v must share (batch, heads), got {tuple(phi_q.shape[:2])}, {tuple(phi_k.shape[:2])}, "
            f"{tuple(v.shape[:2])}"
        )
    if phi_q.shape[3] != phi_k.shape[3]:
        raise ValueError(
            f"phi_q and phi_k must have the same number of features, got {phi_q.shape[3]} and {phi_k.shape[3]}"
        )
    if phi_k.shape[2] != v.shape[2]:
        raise ValueError(f"phi_k and v must share the sequence length, got {phi_k.shape[2]} and {v.shape[2]}")
    if phi_q.shape[2] == 0 or phi_k.shape[2] == 0:
        raise ValueError("sequence lengths must be at least 1")


def _check_options(normalizer: str, chunk_size: int, denominator_eps: float) -> None:
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r}")
    check_positive_int("chunk_size", chunk_size)
    if not denominator_eps >= 0.0:
        raise ValueError(f"denominator_eps must be >= 0, got {denominator_eps!r}")


def _check_log_decay(log_decay: Optional[Tensor], batch: int, heads: int, seq: int, name: str = "log_decay") -> None:
    if log_decay is None:
        return
    check_floating(name, log_decay)
    if log_decay.shape != (batch, heads, seq):
        raise ValueError(
            f"{name} must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}), got {tuple(log_decay.shape)}"
        )


def normalize_output(num_den: Tensor, normalizer: str, denominator_eps: float = 0.0) -> Tensor:
    """Split (..., d_v + 1) into numerator and normaliser and combine them.

    ``"sum"``: ``num / den`` (softmax-like; a row with a zero normaliser, e.g. whose keys are all padding,
    outputs zeros); with ``denominator_eps > 0`` the normaliser's magnitude is kept >= eps, sign preserved.
    ``"max_abs"``: ``num / max(|den|, 1)`` (RetNet), for features of either sign. ``"none"``: ``num``.
    """
    if normalizer == "sum":
        return _SumNormalise.apply(num_den, denominator_eps)
    num, den = num_den[..., :-1], num_den[..., -1:]
    if normalizer == "none":
        return num
    return num / den.abs().clamp_min(1.0)


def denominator_floor(dtype: torch.dtype) -> float:
    """sqrt of the smallest normal number (1e-19 in float32): the smallest divisor a backward pass divides by.

    A normaliser can be far smaller and still exact (its numerator is as small; FAVOR+ at logit standard
    deviations of 30 and more gets there), so the forward divides by it as it is; but the backward's
    ``grad / den``, multiplied on by features near 1, would overflow into inf and then inf * 0 = NaN."""
    return math.sqrt(torch.finfo(dtype).tiny)


def _at_least(den: Tensor, floor: float) -> Tensor:
    """``den`` with magnitudes below ``floor`` raised to it, sign kept."""
    return torch.where(den.abs() < floor, torch.copysign(torch.full_like(den, floor), den), den)


def _guarded_denominator(den: Tensor, denominator_eps: float) -> Tensor:
    if denominator_eps > 0.0:
        return _at_least(den, denominator_eps)
    return torch.where(den == 0, torch.ones_like(den), den)


class _SumNormalise(torch.autograd.Function):
    """``num / den`` from the packed (..., d + 1) tensor, with the guard of :func:`normalize_output`.

    Hand-written so that the backward writes the packed gradient once, instead of two zero-filled slice
    gradients, their sum, and the five passes of a broadcast division's backward. The backward divides by
    the normaliser raised to :func:`denominator_floor`: rows whose normaliser is below it (an estimate that
    sees almost nothing of its keys) get their gradient scaled down by ``den / floor`` instead of overflowing.
    """

    @staticmethod
    def forward(ctx, num_den: Tensor, denominator_eps: float) -> Tensor:  # type: ignore[override]
        den = num_den[..., -1:]
        safe = _guarded_denominator(den, denominator_eps)
        # Divide rather than multiply by a reciprocal: a tiny (even subnormal) normaliser comes with an
        # equally tiny numerator, and only the reciprocal alone would overflow.
        out = num_den[..., :-1] / safe
        ctx.save_for_backward(out, safe, safe == den)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        out, safe, live = ctx.saved_tensors
        safe = _at_least(safe, denominator_floor(safe.dtype))
        grad_num_den = grad.new_empty(*grad.shape[:-1], grad.shape[-1] + 1)
        torch.div(grad, safe, out=grad_num_den[..., :-1])
        # d(num / den) / d den = -out / den; a guarded (constant) denominator gets no gradient.
        grad_den = (grad * out).sum(-1, keepdim=True).div_(safe).neg_()
        grad_num_den[..., -1:] = grad_den * live
        return grad_num_den, None


def _masked_keys(
    phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """Cast, and zero padded keys (features and values, so that neither an infinite feature nor an infinite
    padded value can turn into NaN). Copies nothing that needs no change: in float32 without padding the
    causal path keeps the caller's v instead of a copy."""
    phi_k, v = phi_k.to(dtype), v.to(dtype)
    if key_padding_mask is not None:
        padded = key_padding_mask[:, None, :, None]
        phi_k = phi_k.masked_fill(padded, 0.0)
        v = v.masked_fill(padded, 0.0)
    return phi_k, v


def _with_ones(v: Tensor) -> Tensor:
    """(..., d) -> (..., d + 1): the values with the ones column that carries the normaliser."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _prepare_keys(
    phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """:func:`_masked_keys`, with the ones column appended to v: (phi_k, (..., d_v + 1)). The ones column is
    zero at padded keys too, so that it counts the unpadded keys (:mod:`attnzoo.functional.shrinkage`
    averages the values with it)."""
    phi_k, v = _masked_keys(phi_k, v, key_padding_mask, dtype)
    v1 = _with_ones(v)
    if key_padding_mask is not None:
        v1[..., -1:].masked_fill_(key_padding_mask[:, None, :, None], 0.0)
    return phi_k, v1


def _pad_seq(x: Tensor, pad: int, dim_from_end: int) -> Tensor:
    return F.pad(x, (0, 0) * (dim_from_end - 1) + (0, pad)) if pad else x


def _flat(x: Tensor) -> Tensor:
    """(..., r, c) -> (prod(...), r, c) view for bmm (leading dims of our chunked tensors are contiguous)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


GROUP_ROWS = 8192
"""Rows (positions times batch-heads) the undecayed causal path handles at a time: a span of whole chunks of
one (batch, head), or whole sequences of several. Only one group's chunk scores and chunk states exist at
once, each about as large as its slice of the features (2 MiB at head dim 64 in float32), where
whole-sequence ones would each be as large as the features. A group's temporaries are reused from group to
group and mostly stay in cache, and its slices of q, k, the outputs and the gradients are views, not copies.
Fewer rows save a little memory but make more, smaller operations, which lose most when other processes
keep the cores busy; more rows cost memory and, from 16384 on, cache (docs/benchmarks.md)."""


def _groups(batch_heads: int, n: int, chunk: int) -> List[Tuple[int, int, int, int, int]]:
    """The groups as (first head, end head, span index, first row, end row), in sequence order per head."""
    span = max(chunk, GROUP_ROWS // chunk * chunk)
    if n > span:
        return [
            (h, h + 1, i, start, min(start + span, n))
            for h in range(batch_heads)
            for i, start in enumerate(range(0, n, span))
        ]
    heads = max(1, GROUP_ROWS // (n + (-n % chunk)))
    return [(h, min(h + heads, batch_heads), 0, 0, n) for h in range(0, batch_heads, heads)]


def _group_rows(x: Tensor, heads: slice, rows: slice, chunk: int) -> Tensor:
    """Rows of x (B * H, N, c) as (G, chunk, c) chunks, the last chunk zero-padded (a zero key or value
    changes no sum, a zero query's row is discarded): a view of x unless padding is needed."""
    part = x[heads, rows]
    pad = -part.shape[1] % chunk
    if pad:
        part = F.pad(part, (0, 0, 0, pad))
    return part.reshape(-1, chunk, x.shape[-1])


class _GroupOutput:
    """Where a group's (G, chunk, c) result goes in a (B * H, N, c) tensor: straight into it when that slice
    is whole contiguous chunks, else into a buffer copied over by :meth:`finish`."""

    def __init__(self, dest: Tensor, heads: slice, rows: slice, chunk: int) -> None:
        self.target = dest[heads, rows]
        if self.target.shape[1] % chunk == 0 and self.target.is_contiguous():
            self.buffer, self.direct = self.target.view(-1, chunk, dest.shape[-1]), True
        else:
            n_heads, n_rows, c = self.target.shape
            self.buffer, self.direct = dest.new_empty(n_heads * -(-n_rows // chunk), chunk, c), False

    def finish(self) -> None:
        if not self.direct:
            n_heads, n_rows, c = self.target.shape
            self.target.copy_(self.buffer.view(n_heads, -1, c)[:, :n_rows])


def _values_with_ones(v: Tensor, heads: slice, rows: slice, chunk: int) -> Tensor:
    """``[v, 1]`` for a group of v (B * H, N, d), as (G, chunk, d + 1) zero-padded like :func:`_group_rows`:
    the ones column makes every matmul yield the normaliser beside the numerator, built a group at a time
    instead of as a whole-sequence copy of v."""
    part = v[heads, rows]
    n_heads, n_rows, d = part.shape
    values = v.new_empty(n_heads, n_rows + (-n_rows % chunk), d + 1)
    values[:, :n_rows, :d] = part
    values[:, :n_rows, d] = 1.0
    if values.shape[1] > n_rows:
        values[:, n_rows:] = 0.0
    return values.view(-1, chunk, d + 1)


def _chunk_terms(q: Tensor, k: Tensor, values: Tensor, state: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """One group's intra-chunk scores and chunk states.

    Args:
        q, k: (G_h * C, chunk, m); values: (G_h * C, chunk, d + 1); state: (G_h, m, d + 1) before the group's
            first chunk, for each of its G_h heads.

    Returns:
        (scores ``tril(Q_c K_c^T)`` (G_h * C, chunk, chunk), states before each chunk
        ``P_c = state + sum_{c' < c} K_c'^T V_c'`` (G_h, C, m, d + 1), state after the group (G_h, m, d + 1)).

    ``P_c`` is an exclusive sum proper, never ``inclusive - own term``: with features spanning many orders of
    magnitude, a chunk's own large term would wipe out the small prefix in rounding.
    """
    n_heads, m, d1 = state.shape
    scores = torch.bmm(q, k.transpose(1, 2)).tril_()
    local = torch.bmm(k.transpose(1, 2), values).view(n_heads, -1, m, d1)  # each chunk's own contribution
    previous = torch.empty_like(local)
    previous[:, 0] = state
    # The state joins the first chunk's term, so that one cumulative sum gives every P_c.
    local[:, 0] += state
    if local.shape[1] > 1:
        torch.cumsum(local[:, :-1], dim=1, out=previous[:, 1:])
        return scores, previous, previous[:, -1] + local[:, -1]
    return scores, previous, local[:, 0]


GroupTerms = Tuple[Tensor, Tensor, Tensor]
"""A group's ``[v, 1]`` chunks, chunk scores and chunk states, as :func:`_values_with_ones` and
:func:`_chunk_terms` give them."""


def _forward_group(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, state: Tensor, heads: slice, rows: slice, chunk: int
) -> GroupTerms:
    """Outputs of one group into ``out`` (B * H, N, d + 1); ``state`` (G_h, m, d + 1), the state before the
    group, becomes the state after it. q, k (B * H, N, m), v (B * H, N, d). Returns the group's terms. A
    function of its own so that the group's temporaries are freed before the next group's are made."""
    q_g, k_g, values = _group_rows(q, heads, rows, chunk), _group_rows(k, heads, rows, chunk), _values_with_ones(
        v, heads, rows, chunk
    )
    scores, previous, next_state = _chunk_terms(q_g, k_g, values, state)
    state.copy_(next_state)
    target = _GroupOutput(out, heads, rows, chunk)
    torch.bmm(q_g, _flat(previous), out=target.buffer).baddbmm_(scores, values)
    target.finish()
    return values, scores, previous


def _backward_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Optional[Tensor],
    state: Tensor,
    carry: Tensor,
    grads: Tuple[Tensor, Tensor, Tensor],
    heads: slice,
    rows: slice,
    chunk: int,
    terms: Optional[GroupTerms] = None,
) -> None:
    """Gradients of one group, written into ``grads`` (of q, k, v; (B * H, N, m), (B * H, N, m),
    (B * H, N, d)); ``carry`` (G_h, m, d + 1), the gradient that reaches the group's chunk states from
    everything after the group, gets the group's own part added. ``state``: (G_h, m, d + 1) before the group;
    grad_out: (B * H, N, d + 1) or None; terms: the group's terms if the forward kept them, else recomputed."""
    d = v.shape[-1]
    q_g, k_g = _group_rows(q, heads, rows, chunk), _group_rows(k, heads, rows, chunk)
    if terms is None:
        values = _values_with_ones(v, heads, rows, chunk)
        scores, previous, _ = _chunk_terms(q_g, k_g, values, state)
    else:
        values, scores, previous = terms
    grad_g = torch.zeros_like(values) if grad_out is None else _group_rows(grad_out, heads, rows, chunk)
    grad_scores = torch.bmm(grad_g, values.transpose(1, 2)).tril_()
    target = _GroupOutput(grads[0], heads, rows, chunk)
    torch.bmm(grad_g, _flat(previous).transpose(1, 2), out=target.buffer).baddbmm_(grad_scores, k_g)
    target.finish()
    grad_previous = torch.bmm(q_g.transpose(1, 2), grad_g).view_as(previous)
    # Chunk c's own contribution reaches every later chunk of the group (a reversed exclusive sum, from the
    # reversed inclusive ones) and, through the carry, every chunk after the group.
    after = grad_previous.flip(1).cumsum(1).flip(1)  # after[:, c] = sum_{c' >= c} grad_previous[:, c']
    grad_local = torch.empty_like(previous)
    grad_local[:, -1] = carry
    if previous.shape[1] > 1:
        torch.add(after[:, 1:], carry.unsqueeze(1), out=grad_local[:, :-1])
    carry += after[:, 0]
    grad_local = _flat(grad_local)
    target = _GroupOutput(grads[1], heads, rows, chunk)
    torch.bmm(grad_scores.transpose(1, 2), q_g, out=target.buffer).baddbmm_(values, grad_local.transpose(1, 2))
    target.finish()
    # v's gradient leaves out the ones column's: strided views, which the matmuls read in place.
    target = _GroupOutput(grads[2], heads, rows, chunk)
    torch.bmm(scores.transpose(1, 2), grad_g[..., :d], out=target.buffer).baddbmm_(k_g, grad_local[..., :d])
    target.finish()


class _CausalChunks(torch.autograd.Function):
    """Causal linear attention without decay, a group of chunks at a time, with a hand-written backward.

    Per chunk c (all chunks of a group in one batched matmul), with V = [v, 1]:
        S_c = tril(Q_c K_c^T),  L_c = K_c^T V_c,  P_c = S0 + sum_{c' < c} L_c',  O_c = S_c V_c + Q_c P_c,
    and the final state S0 + sum_c L_c. The forward walks the groups (:data:`GROUP_ROWS`) in sequence order,
    carrying the state; it keeps the state at the start of each group and the last group's S_c, P_c and V_c.
    The backward walks the groups in reverse. It recomputes every other group's S_c and P_c from q, k, v and
    the group's state (two more batched matmuls beside its eight) rather than keeping them for the whole
    sequence (each as large as the features); a sequence of one group recomputes nothing. It carries the
    gradient that reaches L_c from the outputs of every later chunk and from the final state (a reversed
    exclusive sum). Every matmul writes into its destination or accumulates into it (baddbmm) instead of
    allocating a sum; the gradient of v goes straight into one (B, H, N, d) buffer that autograd adopts as
    ``v.grad``.

    Both prefix sums are exclusive sums proper, never ``inclusive - own term``: with features spanning many
    orders of magnitude, a chunk's own large term would wipe out the small prefix in rounding.

    Shapes: q, k (B, H, N, m); v (B, H, N, d), without the ones column; initial (B, H, m, d + 1); chunks of
    ``min(chunk_size, N)`` positions. Returns ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state
    after position N - 1).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, initial: Tensor, chunk_size: int
    ) -> Tuple[Tensor, Tensor]:
        batch, heads, n, m = q.shape
        d1 = v.shape[-1] + 1
        chunk = min(chunk_size, n)
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        groups = _groups(batch * heads, n, chunk)
        out3 = q.new_empty(batch * heads, n, d1)
        final3 = initial.reshape(batch * heads, m, d1).clone()
        # The state at the start of each span of each head: what the backward recomputes a group from.
        span_states = q.new_empty(batch * heads, groups[-1][2] + 1, m, d1)
        for h0, h1, span, r0, r1 in groups:
            span_states[h0:h1, span] = final3[h0:h1]
            last = _forward_group(q3, k3, v3, out3, final3[h0:h1], slice(h0, h1), slice(r0, r1), chunk)
        # The backward starts with the last group: its terms are at hand.
        ctx.save_for_backward(q, k, v, span_states, *last)
        ctx.chunk = chunk
        # An unused output (the state, or the outputs when only the state is used) gets no zero-filled
        # gradient of its full size.
        ctx.set_materialize_grads(False)
        return out3.view(batch, heads, n, d1), final3.view(batch, heads, m, d1)

    @staticmethod
    def backward(ctx, grad_out: Optional[Tensor], grad_final: Optional[Tensor]):  # type: ignore[override]
        q, k, v, span_states, *last = ctx.saved_tensors
        batch, heads, n, m = q.shape
        d1 = v.shape[-1] + 1
        q3, k3, v3 = (x.reshape(batch * heads, n, x.shape[-1]) for x in (q, k, v))
        grad_out3 = None if grad_out is None else grad_out.reshape(batch * heads, n, d1)
        grads = (q3.new_empty(q3.shape), k3.new_empty(k3.shape), v3.new_empty(v3.shape))
        # The gradient reaching a chunk's own contribution L_c from every later chunk's outputs and from the
        # final state, carried from group to group; once every group is done, the initial state's gradient.
        if grad_final is None:
            carry = q.new_zeros(batch * heads, m, d1)
        else:
            carry = grad_final.reshape(batch * heads, m, d1).clone()
        terms: Optional[GroupTerms] = (last[0], last[1], last[2])
        for h0, h1, span, r0, r1 in reversed(_groups(batch * heads, n, ctx.chunk)):
            _backward_group(
                q3, k3, v3, grad_out3, span_states[h0:h1, span], carry[h0:h1], grads, slice(h0, h1), slice(r0, r1),
                ctx.chunk, terms,
            )
            terms = None
        grad_q, grad_k, grad_v = grads
        return grad_q.view_as(q), grad_k.view_as(k), grad_v.view_as(v), carry.view(batch, heads, m, d1), None


def _chunked_causal(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_decay: Optional[Tensor],
    chunk_size: int,
    initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """Causal numerator/normaliser for equal lengths.

    Args:
        phi_q, phi_k: (B, H, N, m); v: (B, H, N, d), without the ones column; log_decay: (B, H, N) or None;
        initial_state: (B, H, m, d + 1) state before position 0, or None.

    Returns:
        ((B, H, N, d + 1) unnormalised outputs, (B, H, m, d + 1) state after position N - 1).
    """
    batch, heads, n, m = phi_q.shape
    d1 = v.shape[-1] + 1
    if initial_state is None:
        initial_state = phi_q.new_zeros(batch, heads, m, d1)
    if log_decay is None:
        # chunk_size, not a length derived from a shape: under torch.jit.trace shapes are tensors, which
        # autograd.Function would take for inputs.
        return _CausalChunks.apply(phi_q, phi_k, v, initial_state, chunk_size)
    chunk = min(chunk_size, n)

    n_chunks = math.ceil(n / chunk)
    pad = n_chunks * chunk - n
    # Padded tail positions have zero keys and log decay 0: they change no state.
    q = _pad_seq(phi_q, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    k = _pad_seq(phi_k, pad, 2).reshape(batch, heads, n_chunks, chunk, m)
    values = _pad_seq(_with_ones(v), pad, 2).reshape(batch, heads, n_chunks, chunk, d1)
    within = F.pad(log_decay, (0, pad)).view(batch, heads, n_chunks, chunk).cumsum(-1)
    # exp(L_i - L_j) only for j <= i: the masked differences are <= 0, so exp never overflows. In place on
    # fresh tensors whose producers' backwards do not read them (exp's reads its own result): two fewer
    # (B, H, N, chunk) allocations, which pay for the masking of the product below.
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).triu(1)
    decay = (within.unsqueeze(-1) - within.unsqueeze(-2)).masked_fill_(upper, -math.inf).exp_()
    # The future-key weights are set to zero, not multiplied by exp(-inf) = 0: a NaN or inf key (or log
    # decay) after the query would otherwise reach it as 0 * NaN. In place on the product, which mul's
    # backward does not read.
    scores = (q @ k.transpose(-1, -2) * decay).masked_fill_(upper, 0.0)
    last = within[..., -1:]  # total log decay of each chunk, (B, H, C, 1)
    local = (k * torch.exp(last - within).unsqueeze(-1)).transpose(-1, -2) @ values
    chunk_decay = torch.exp(last).unsqueeze(-1)  # (B, H, C, 1, 1)
    state = initial_state
    # A scan over chunks: N / chunk_size small steps on (m, d + 1) states, stable for any decay. unbind
    # (not indexing in the loop) keeps the backward pass linear: one gradient buffer, not one per chunk.
    previous_states = []
    for decay_c, local_c in zip(chunk_decay.unbind(2), local.unbind(2)):
        previous_states.append(state)
        state = decay_c * state + local_c
    previous = torch.stack(previous_states, dim=2)
    out = scores @ values + (q * torch.exp(within).unsqueeze(-1)) @ previous
    return out.reshape(batch, heads, n_chunks * chunk, d1)[:, :, :n], state


def _unnormalised(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool,
    log_decay: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """(B, H, N_q, d + 1) numerator/normaliser for any lengths, from v (B, H, N_k, d) without the ones
    column; causal is bottom-right aligned."""
    q_len, k_len = phi_q.shape[2], phi_k.shape[2]
    if not causal:
        return phi_q @ (phi_k.transpose(-1, -2) @ _with_ones(v))
    if q_len == k_len:
        return _chunked_causal(phi_q, phi_k, v, log_decay, chunk_size, None)[0]
    if k_len > q_len:
        # Bottom-right alignment: the first k_len - q_len keys are seen by every query, an initial state.
        offset = k_len - q_len
        initial = phi_k[:, :, :offset].transpose(-1, -2) @ _with_ones(v[:, :, :offset])
        return _chunked_causal(phi_q, phi_k[:, :, offset:], v[:, :, offset:], None, chunk_size, initial)[0]
    # More queries than keys: the first q_len - k_len queries see no key and output zeros.
    offset = q_len - k_len
    out = _chunked_causal(phi_q[:, :, offset:], phi_k, v, None, chunk_size, None)[0]
    return F.pad(out, (0, 0, offset, 0))


def _masked_log_decay(
    log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype: torch.dtype
) -> Optional[Tensor]:
    if log_decay is None:
        return None
    log_decay = log_decay.to(dtype)
    if key_padding_mask is not None:
        log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
    return log_decay


def _backward_log_decay(log_decay: Tensor) -> Tensor:
    """Log decays for the reversed sequence: key j reaches query i < j through decays i+1..j, which after
    reversal must sit at the positions the reversed recurrence applies them."""
    shifted = F.pad(log_decay[..., 1:], (0, 1))
    return shifted.flip(-1)


def kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    denominator_eps: float = 0.0,
) -> Tensor:
    """Kernelized attention on precomputed features.

    Args:
        phi_q: (batch, heads, seq_q, m) query features.
        phi_k: (batch, heads, seq_kv, m) key features.
        v: (batch, heads, seq_kv, d_v)
        causal: autoregressive, bottom-right aligned when ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding.
        log_decay: (batch, heads, seq) per-position log decay (<= 0), needs ``seq_q == seq_kv``. Causal: the
            recurrence described in the module docstring. Non-causal: the bidirectional form, key j weighted
            by the decays between it and the query on either side (``gamma^|i - j|`` for a constant decay).
        normalizer: ``"sum"``, ``"max_abs"`` or ``"none"`` (see :func:`normalize_output`).
        chunk_size: chunk length of the causal path. Causal: a NaN or inf in the features or log decay
            reaches no earlier output; one in ``v`` reaches the earlier outputs of its chunk (module
            docstring, "Non-finite inputs").
        denominator_eps: normaliser guard for feature maps with negative features (``"sum"`` only).

    Returns:
        (batch, heads, seq_q, d_v) in the dtype of ``v``.
    """
    check_bool("causal", causal)
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    check_key_padding_mask(key_padding_mask, batch, k_len, phi_q.device)
    if log_decay is not None and q_len != k_len:
        raise ValueError(f"log_decay needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={k_len}")
    _check_log_decay(log_decay, batch, heads, k_len)
    return kernel_attention_unchecked(
        phi_q, phi_k, v, causal, key_padding_mask, log_decay, normalizer, chunk_size, denominator_eps
    )


def kernel_attention_unchecked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    log_decay: Optional[Tensor],
    normalizer: str,
    chunk_size: int,
    denominator_eps: float,
) -> Tensor:
    """:func:`kernel_attention` for callers that validated its arguments themselves (the mechanisms check
    their inputs and options once, and compute the features and decays from them)."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    phi_q = phi_q.to(dtype)
    phi_k, v = _masked_keys(phi_k, v, key_padding_mask, dtype)
    log_decay = _masked_log_decay(log_decay, key_padding_mask, dtype)

    if log_decay is None or causal:
        num_den = _unnormalised(phi_q, phi_k, v, causal, log_decay, chunk_size)
    else:
        forward = _chunked_causal(phi_q, phi_k, v, log_decay, chunk_size, None)[0]
        backward = _chunked_causal(
            phi_q.flip(2), phi_k.flip(2), v.flip(2), _backward_log_decay(log_decay), chunk_size, None
        )[0].flip(2)
        # Both directions include the key at the query's own position (weight 1): count it once.
        diagonal = (phi_q * phi_k).sum(-1, keepdim=True) * _with_ones(v)
        num_den = forward + backward - diagonal
    return normalize_output(num_den, normalizer, denominator_eps).to(out_dtype)


def kernel_attention_prefill(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """Causal :func:`kernel_attention` over a prompt (seq_q == seq_kv) that also returns the recurrent state.

    ``key_log_scale`` (batch, heads, 1, 1): the true key features are ``phi_k * exp(key_log_scale)`` (see
    :meth:`attnzoo.feature_maps.FeatureMap.key_features`); None means 0.
    """
    _check_features(phi_q, phi_k, v)
    _check_options(normalizer, chunk_size, denominator_eps)
    batch, heads, q_len, _ = phi_q.shape
    if phi_k.shape[2] != q_len:
        raise ValueError(
            f"prefill needs queries and keys of one sequence, got seq_q={q_len} and seq_kv={phi_k.shape[2]}"
        )
    _check_log_decay(log_decay, batch, heads, q_len)
    return kernel_attention_prefill_unchecked(
        phi_q, phi_k, v, key_log_scale, log_decay, normalizer, chunk_size, denominator_eps
    )


def kernel_attention_prefill_unchecked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    key_log_scale: Optional[Tensor],
    log_decay: Optional[Tensor],
    normalizer: str,
    chunk_size: int,
    denominator_eps: float,
) -> Tuple[Tensor, KernelState]:
    """:func:`kernel_attention_prefill` for callers that validated its arguments themselves."""
    batch, heads = phi_q.shape[:2]
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    phi_k, v = _masked_keys(phi_k, v, None, dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    num_den, kv = _chunked_causal(phi_q.to(dtype), phi_k, v, log_decay, chunk_size, None)
    log_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q.device)
    return normalize_output(num_den, normalizer, denominator_eps).to(out_dtype), {"kv": kv, "log_scale": log_scale}


def _log_scale_or_zero(
    key_log_scale: Optional[Tensor], batch: int, heads: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    if key_log_scale is None:
        return torch.zeros(batch, heads, 1, 1, dtype=dtype, device=device)
    if key_log_scale.shape != (batch, heads, 1, 1):
        raise ValueError(f"key_log_scale must have shape (batch, heads, 1, 1), got {tuple(key_log_scale.shape)}")
    return key_log_scale.to(dtype)


def kernel_attention_step(
    phi_q_t: Tensor,
    phi_k_t: Tensor,
    v_t: Tensor,
    state: Optional[KernelState],
    *,
    key_log_scale: Optional[Tensor] = None,
    log_decay_t: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tuple[Tensor, KernelState]:
    """One recurrent step, O(m d) whatever the context length.

    Args:
        phi_q_t, phi_k_t: (batch, heads, 1, m); v_t: (batch, heads, 1, d_v).
        state: from :func:`kernel_attention_prefill` or a previous step, or None at the start.
        key_log_scale: (batch, heads, 1, 1) scale of this key's features, or None for 0.
        log_decay_t: (batch, heads, 1) log decay applied to the state before adding this key.

    Returns:
        ((batch, heads, 1, d_v), new state); equals the last row of the causal parallel form.
    """
    _check_features(phi_q_t, phi_k_t, v_t)
    _check_options(normalizer, 1, denominator_eps)
    batch, heads = phi_q_t.shape[:2]
    if phi_q_t.shape[2] != 1 or phi_k_t.shape[2] != 1:
        raise ValueError("kernel_attention_step takes one position: phi_q_t and phi_k_t of shape (batch, heads, 1, m)")
    _check_log_decay(log_decay_t, batch, heads, 1, "log_decay_t")
    return kernel_attention_step_unchecked(
        phi_q_t, phi_k_t, v_t, state, key_log_scale, log_decay_t, normalizer, denominator_eps
    )


def kernel_attention_step_unchecked(
    phi_q_t: Tensor,
    phi_k_t: Tensor,
    v_t: Tensor,
    state: Optional[KernelState],
    key_log_scale: Optional[Tensor],
    log_decay_t: Optional[Tensor],
    normalizer: str,
    denominator_eps: float,
) -> Tuple[Tensor, KernelState]:
    """:func:`kernel_attention_step` for callers that validated its arguments themselves (the mechanisms,
    whose decoding states are checked against their declared layout)."""
    batch, heads = phi_q_t.shape[:2]
    dtype = working_dtype(v_t.dtype)
    phi_k_t, v1 = _prepare_keys(phi_k_t, v_t, None, dtype)
    token_kv = phi_k_t.transpose(-1, -2) @ v1
    token_scale = _log_scale_or_zero(key_log_scale, batch, heads, dtype, phi_q_t.device)
    if state is None:
        kv, log_scale = token_kv, token_scale
    else:
        old_scale = state["log_scale"]
        log_scale = torch.maximum(old_scale, token_scale)
        carry = old_scale - log_scale
        if log_decay_t is not None:
            carry = carry + log_decay_t.to(dtype).unsqueeze(-1)
        kv = torch.exp(carry) * state["kv"] + torch.exp(token_scale - log_scale) * token_kv
    out = normalize_output(phi_q_t.to(dtype) @ kv, normalizer, denominator_eps)
    return out.to(v_t.dtype), {"kv": kv, "log_scale": log_scale}


def kernel_attention_reference(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    log_decay: Optional[Tensor] = None,
    normalizer: str = "sum",
    denominator_eps: float = 0.0,
) -> Tensor:
    """Obviously-correct quadratic form of :func:`kernel_attention` in float64: the (seq_q, seq_kv) weight
    matrix ``(phi_q phi_k^T) * decay`` with masked entries zeroed. Returns float64."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    batch, _, q_len, _ = phi_q.shape
    k_len = phi_k.shape[2]
    weights = phi_q @ phi_k.transpose(-1, -2)
    if log_decay is not None:
        log_decay = log_decay.double()
        if key_padding_mask is not None:
            log_decay = log_decay.masked_fill(key_padding_mask[:, None, :], 0.0)
        cumulative = log_decay.cumsum(-1)
        later = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)  # L_i - L_j: decays j+1..i, for j <= i
        rows = torch.arange(q_len, device=phi_q.device).unsqueeze(1)
        cols = torch.arange(k_len, device=phi_q.device).unsqueeze(0)
        # A key after the query (non-causal) is reached through the decays i+1..j, i.e. L_j - L_i.
        weights = weights * torch.exp(torch.where(cols <= rows, later, -later))
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, phi_q.device)
    if allowed is not None:
        weights = weights.masked_fill(~allowed, 0.0)
    num_den = torch.cat([weights @ v, weights.sum(-1, keepdim=True)], dim=-1)
    return normalize_output(num_den, normalizer, denominator_eps)


class FeatureMapLike(Protocol):
    """What :func:`linear_attention` needs of a feature map; every :class:`attnzoo.feature_maps.FeatureMap`
    has it. ``__call__`` gives the unstabilised features (for the reference), the other two the stabilised
    ones described in :mod:`attnzoo.feature_maps`."""

    positive: bool

    def __call__(self, x: Tensor) -> Tensor: ...

    def query_features(self, x: Tensor) -> Tensor: ...

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]: ...


class _Pointwise:
    """A named feature function of :mod:`attnzoo.functional.features` seen as a :class:`FeatureMapLike`."""

    positive = True

    def __init__(self, function: Callable[[Tensor], Tensor]) -> None:
        self.function = function

    def __call__(self, x: Tensor) -> Tensor:
        return self.function(x)

    def query_features(self, x: Tensor) -> Tensor:
        return self.function(x)

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        return self.function(x), None


FeatureMapArg = Union[str, FeatureMapLike]


def _resolve_features(feature_map: FeatureMapArg) -> FeatureMapLike:
    if isinstance(feature_map, str) and feature_map in NAMED_FEATURES:
        return _Pointwise(NAMED_FEATURES[feature_map])
    if not isinstance(feature_map, str) and all(
        hasattr(feature_map, name) for name in ("positive", "query_features", "key_features")
    ):
        return feature_map
    raise ValueError(
        f"feature_map must be one of {', '.join(repr(n) for n in NAMED_FEATURES)} or a FeatureMap instance, "
        f"got {feature_map!r}"
    )


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMapArg = "elu",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Linear attention ``phi(q) (phi(k)^T v) / phi(q) . sum_j phi(k_j)``.

    Args:
        q: (batch, heads, seq_q, head_dim)
        k: (batch, heads, seq_kv, head_dim)
        v: (batch, heads, seq_kv, head_dim_v)
        feature_map: ``"elu"`` (elu + 1), ``"relu"``, or a :class:`attnzoo.feature_maps.FeatureMap`.
        causal: autoregressive (chunked algorithm), bottom-right aligned when ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys, removed from numerator and normaliser.
        chunk_size: chunk length of the causal path. Causal: a NaN or inf in q or k reaches no earlier
            output (the named maps act on each position alone); one in ``v`` reaches the earlier outputs of
            its chunk (module docstring, "Non-finite inputs").

    Returns:
        (batch, heads, seq_q, head_dim_v) in the dtype of ``v``.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    phi_map = _resolve_features(feature_map)
    phi_q = phi_map.query_features(q)
    phi_k, _ = phi_map.key_features(k, key_padding_mask)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention(phi_q, phi_k, v, causal, key_padding_mask, chunk_size=chunk_size, denominator_eps=eps)


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMapArg = "elu",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Quadratic float64 reference of :func:`linear_attention`, on the map's unstabilised features
    (``feature_map(x)``), so it also checks that the stabilisers cancel. Returns float64."""
    phi_map = _resolve_features(feature_map)
    eps = 0.0 if phi_map.positive else SIGNED_DENOMINATOR_EPS
    return kernel_attention_reference(
        phi_map(q.double()), phi_map(k.double()), v, causal, key_padding_mask, denominator_eps=eps
    )

"""Efficient attention (Shen et al. 2021, "Efficient Attention: Attention with Linear Complexities").

For queries ``q`` (batch, heads, seq_q, d), keys ``k`` (batch, heads, seq_kv, d) and values ``v``
(batch, heads, seq_kv, d_v):

    out = rho_q(q) (rho_k(k)^T v)

``rho_q`` is the softmax of each query over its d features, ``rho_k`` the softmax of each key feature (each
column of k) over the positions. ``rho_k(k)^T v`` is formed first: d "global context" vectors, one per
feature, which each query mixes with its own weights. Time O(N d d_v), memory O(N (d + d_v) + d d_v), never an
N x N matrix. Not an approximation of softmax attention but an attention of its own.

Causal form: the softmax over positions runs over the prefix. For query i and feature j,

    c_ij = sum_{t <= i} exp(k_tj) v_t / sum_{t <= i} exp(k_tj),     out_i = sum_j rho_q(q_i)_j c_ij,

bottom-right aligned when ``seq_q != seq_kv`` (the last query sees every key). Computed in chunks of
``chunk_size`` positions: within a chunk the quadratic form ``tril(phi E^T) V`` (phi the query weights divided
by their prefix normalisers, E the key exponentials), between chunks a carried state of the numerators (d, d_v)
and normalisers (d). No (N, d, d_v) tensor of prefix states is ever formed; one state per chunk is. The
backward is written by hand (:class:`_CausalChunks`): about half the passes over (N, d) tensors of autograd's.

Stabiliser: every exponential is shifted by a running maximum. Each chunk uses, per feature, the maximum of
the keys up to its last position; the state carried into it is rescaled from the previous chunk's shift by
``exp(previous max - max) <= 1``, so nothing overflows, and the shift cancels in ``c_ij``. Within a chunk
the shift can lie above what an early query has seen: a query followed, in its own chunk, by a key that raises
the running maximum of a feature by more than ~80 (float32; ~700 in float64) sees its prefix of that feature
underflow, and loses that feature's context (its contribution becomes zero or too small, never NaN). The
recurrent step shifts by the exact running maximum at each position and has no such limit.

Shared with :mod:`attnzoo.functional.aft`, whose causal AFT-simple is the same prefix softmax taken feature by
feature: :func:`prefix_chunks` (the chunk layout, running maxima and rescaling factors),
:func:`scan_chunk_states` (the states carried between chunks), :func:`whole_sequence_weights` (the
non-causal exponentials), :func:`bottom_right_causal` (unequal lengths) and :func:`prefix_step_weights`
(the recurrent update).

Key padding: padded keys and values are zeroed, then their exponentials set to zero, so they leave numerators
and normalisers alike; a query that sees no unpadded key outputs zeros. Causal, non-finite input: a NaN or inf
in an unpadded key or value at position p reaches the outputs at the earlier positions of its own chunk (the
chunk's maximum, and ``0 * NaN`` in the intra-chunk product), as in :mod:`attnzoo.functional.linear`.

Sums run in float32 for float16/bfloat16 inputs, in float64 for float64 inputs; the output has the dtype of v.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._autocast import outside_autocast
from .._dtypes import working_dtype
from .._validation import check_bool, check_key_padding_mask, check_positive_int, check_qkv
from .linear.inputs import _pad_seq, _with_ones
from .linear.normalize import denominator_floor
from .masks import allowed_mask, zero_padded

DEFAULT_CHUNK_SIZE = 64
"""Chunk length of the causal path: the intra-chunk product costs N * chunk * (d + d_v), the carried states
N / chunk * d * d_v, balanced near head dims of 64."""

EfficientState = Dict[str, Tensor]
"""Recurrent state: ``{"num": (batch, heads, d, d_v), "den": (batch, heads, d), "max": (batch, heads, d)}``,
the numerators ``sum_t exp(k_tj - max_j) v_t`` and normalisers ``sum_t exp(k_tj - max_j)`` of each feature j
over the positions so far, and the running maximum ``max_j`` they are shifted by."""

Summary = Tuple[Tensor, Tensor]
"""What a stretch of keys leaves for the positions after it: (running max (B, H, d), possibly -inf where no
key was seen; state (B, H, d, w) shifted by it)."""


# -- shared helpers (also used by attnzoo.functional.aft) -------------------------------------------------------
def _hidden_positions(
    key_padding_mask: Optional[Tensor], length: int, padded_length: int, device: torch.device
) -> Optional[Tensor]:
    """(B or 1, padded_length) True at padded keys and at the tail added to fill the last chunk; None if none."""
    tail = padded_length - length
    if key_padding_mask is None:
        if not tail:
            return None
        return (torch.arange(padded_length, device=device) >= length).unsqueeze(0)
    return F.pad(key_padding_mask, (0, tail), value=True) if tail else key_padding_mask


def finite_or_zero(shift: Tensor) -> Tensor:
    """A running maximum made usable as a shift: -inf (no key seen yet) becomes 0."""
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))


def whole_sequence_weights(
    k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor]:
    """The exponentials of every key feature shifted by its maximum over the unpadded positions.

    Args:
        k: (B, H, N, d); v: (B, H, N, d_v), both of the working dtype.

    Returns:
        (weights ``exp(k - max)`` (B, H, N, d), zero at padded positions; v with padded values zeroed; the
        maximum (B, H, d), -inf where every key is padded). The maximum is detached: a shift shared by a
        numerator and its normaliser cancels, and has no gradient.
    """
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    hidden = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    with torch.no_grad():
        visible = k if hidden is None else k.masked_fill(hidden, -math.inf)
        maximum = visible.amax(dim=2)
    weights = torch.exp(k - finite_or_zero(maximum).unsqueeze(2))
    if hidden is not None:
        weights = weights.masked_fill(hidden, 0.0)
    return weights, v, maximum


class PrefixChunks(NamedTuple):
    """A sequence cut into chunks for a causal prefix softmax over positions, per feature.

    Attributes:
        keys: (B, H, C, chunk, d), zero at padded positions and at the tail that fills the last chunk.
        values: (B, H, C, chunk, d_v), zero there too.
        hidden: (B, 1, C, chunk, 1) True at those positions, or None when there are none.
        shift: (B, H, C, d) each chunk's shift: the running maximum of the visible keys up to its last
            position (0 where no key has been seen yet). Detached.
        decay: (B, H, C, d) ``exp(shift before the chunk - shift)`` <= 1, which rescales the state carried into
            a chunk to its shift; 0 where nothing came before. Detached.
        last_max: (B, H, d) the running maximum after the last chunk (-inf where no key was seen).
    """

    keys: Tensor
    values: Tensor
    hidden: Optional[Tensor]
    shift: Tensor
    decay: Tensor
    last_max: Tensor

    def weights(self) -> Tensor:
        """(B, H, C, chunk, d) ``exp(keys - shift)``, zero at hidden positions: every entry <= 1."""
        weights = torch.exp(self.keys - self.shift.unsqueeze(3))
        return weights if self.hidden is None else weights.masked_fill(self.hidden, 0.0)

    def chunked(self, x: Tensor) -> Tensor:
        """(B, H, N, c) queries (or anything laid out like the keys) as (B, H, C, chunk, c)."""
        batch, heads, n, width = x.shape
        chunks, chunk = self.keys.shape[2:4]
        return _pad_seq(x, chunks * chunk - n, 2).reshape(batch, heads, chunks, chunk, width)


def prefix_chunks(
    k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], chunk_size: int, initial_max: Optional[Tensor]
) -> PrefixChunks:
    """Cut k (B, H, N, d) and v (B, H, N, d_v) into chunks of ``min(chunk_size, N)`` positions and find each
    chunk's running-maximum shift. ``initial_max`` (B, H, d): the running maximum of keys before position 0
    (-inf where none), or None."""
    batch, heads, n, d = k.shape
    chunk = min(chunk_size, n)
    chunks = math.ceil(n / chunk)
    hidden = _hidden_positions(key_padding_mask, n, chunks * chunk, k.device)
    keys = _pad_seq(k, chunks * chunk - n, 2).reshape(batch, heads, chunks, chunk, d)
    values = _pad_seq(v, chunks * chunk - n, 2).reshape(batch, heads, chunks, chunk, v.shape[-1])
    if hidden is not None:
        hidden = hidden.view(hidden.shape[0], 1, chunks, chunk, 1)
        # Zeroed, not only weighted by zero: a NaN or inf key or value must not reach any sum (0 * inf = NaN).
        keys, values = keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)
    with torch.no_grad():
        visible = keys if hidden is None else keys.masked_fill(hidden, -math.inf)
        maxima = visible.amax(dim=3)  # (B, H, C, d), -inf for a chunk of hidden positions only
        if initial_max is not None:
            maxima = torch.cat([initial_max.unsqueeze(2).to(maxima.dtype), maxima], dim=2)
        running = torch.cummax(maxima, dim=2).values
        if initial_max is None:
            before = F.pad(running[:, :, :-1], (0, 0, 1, 0), value=-math.inf)
        else:
            before, running = running[:, :, :-1], running[:, :, 1:]
        # Both -inf (nothing seen yet) gives NaN in the unselected branch; nothing to carry there.
        decay = torch.where(torch.isfinite(before), torch.exp(before - running), torch.zeros_like(running))
        shift = finite_or_zero(running)
    # Detached as well: torch.jit.trace records the operations above but not no_grad, and a traced graph would
    # differentiate through the shifts, which are constants for the gradient.
    return PrefixChunks(keys, values, hidden, shift.detach(), decay.detach(), running[:, :, -1].detach())


def scan_chunk_states(decay: Tensor, local: Tensor, initial: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The states carried between chunks: ``S_c = decay_c * S_{c-1} + local_c``, row j of every state scaled by
    ``decay[..., j]``.

    Args:
        decay: (B, H, C, d) from :class:`PrefixChunks`.
        local: (B, H, C, d, w) each chunk's own sums, in its shift.
        initial: (B, H, d, w) the state before the first chunk (in the shift ``initial_max`` that
            :func:`prefix_chunks` was given), or None for nothing.

    Returns:
        (the state before each chunk, rescaled to its shift, (B, H, C, d, w); the state after the last chunk,
        in its shift, (B, H, d, w)). A loop over chunks of O(d w) steps: N / chunk of them, and no rescaling
        factor above 1, whatever the keys.
    """
    state = local.new_zeros(local.shape[:2] + local.shape[3:]) if initial is None else initial
    previous = []
    # unbind (not indexing in the loop) keeps the backward linear: one gradient buffer, not one per chunk.
    for decay_c, local_c in zip(decay.unbind(2), local.unbind(2)):
        state = decay_c.unsqueeze(-1) * state
        previous.append(state)
        state = state + local_c
    return torch.stack(previous, dim=2), state


def unchunked(out: Tensor, length: int) -> Tensor:
    """(B, H, C, chunk, c) back to (B, H, length, c), dropping the tail that filled the last chunk."""
    batch, heads, chunks, chunk, width = out.shape
    out = out.reshape(batch, heads, chunks * chunk, width)
    # A slice's backward zero-fills a gradient of the whole size: none when there is no tail to drop.
    return out if chunks * chunk == length else out[:, :, :length]


def safe_denominator(den: Tensor) -> Tensor:
    """A normaliser (a sum of non-negative exponentials) raised to :func:`denominator_floor`: where nothing is
    visible it is zero and the numerator with it, and the output is zero, never NaN; a backward dividing by
    it twice stays finite."""
    return den.clamp_min(denominator_floor(den.dtype))


def bottom_right_causal(
    run: Callable[[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Summary]], Tensor],
    summarise: Callable[[Tensor, Tensor, Optional[Tensor]], Summary],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
) -> Tensor:
    """Causal attention for any lengths, aligned bottom-right, from a causal ``run(q, k, v, mask, initial)``
    of equal lengths: with more keys than queries, the first ``seq_kv - seq_q`` keys are seen by every query
    and enter as the initial state ``summarise(k, v, mask)``; with more queries, the first ``seq_q - seq_kv``
    queries see no key and output zeros."""
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len == k_len:
        return run(q, k, v, key_padding_mask, None)
    if k_len > q_len:
        offset = k_len - q_len
        head = None if key_padding_mask is None else key_padding_mask[:, :offset]
        tail = None if key_padding_mask is None else key_padding_mask[:, offset:]
        initial = summarise(k[:, :, :offset], v[:, :, :offset], head)
        return run(q, k[:, :, offset:], v[:, :, offset:], tail, initial)
    offset = q_len - k_len
    return F.pad(run(q[:, :, offset:], k, v, key_padding_mask, None), (0, 0, offset, 0))


def prefix_step_weights(k_t: Tensor, previous_max: Optional[Tensor]) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """One position of a running prefix softmax over positions, per feature.

    Args:
        k_t: (B, H, d) the new key; previous_max: (B, H, d) the state's running maximum, or None at the start.

    Returns:
        (``exp(previous_max - new_max)``, the factor that rescales the state (None at the start);
        ``exp(k_t - new_max)``, the new key's weight; ``new_max``). The shift is the exact running maximum.
    """
    if previous_max is None:
        return None, torch.ones_like(k_t), k_t
    new_max = torch.maximum(previous_max, k_t)
    return torch.exp(previous_max - new_max), torch.exp(k_t - new_max), new_max


# -- efficient attention ----------------------------------------------------------------------------------------
def _context_summary(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Summary:
    """Keys seen by every query of a bottom-right aligned causal call: (max, ``E^T [v, 1]``)."""
    weights, v, maximum = whole_sequence_weights(k, v, key_padding_mask)
    return maximum, weights.transpose(-1, -2) @ _with_ones(v)


class _CausalChunks(torch.autograd.Function):
    """Causal efficient attention over chunks, with a hand-written backward.

    Per chunk c (all chunks batched), with E_c the key exponentials in the chunk's shift, P_c = [N_c, z_c] the
    state carried into it (numerators (d, d_v) and normalisers (d), rescaled to its shift) and Q'_c the
    queries' feature softmaxes:

        D_c = z_c + cumsum(E_c),  phi_c = Q'_c / D_c,  S_c = tril(phi_c E_c^T),  O_c = phi_c N_c + S_c V_c,
        P_{c+1} = decay_{c+1} * (P_c + [E_c^T V_c, sum_t E_c]).

    The backward runs the same terms in reverse: the gradient reaching each chunk's own sums from the outputs
    of every later chunk is carried by a reverse scan with the same factors (<= 1), and the normaliser's
    gradient by a reversed cumulative sum within the chunk. Autograd through the forward would take about
    twice the passes over (N, d) tensors, most of them zero-filled slice gradients and broadcast divisions.

    Shapes: queries, weights (B, H, C, chunk, d); values (B, H, C, chunk, d_v); decay (B, H, C, d), no
    gradient; initial (B, H, d, d_v + 1) in the first chunk's previous shift. Returns ((B, H, C, chunk, d_v)
    outputs, (B, H, d, d_v + 1) state after the last chunk).
    """

    @staticmethod
    @outside_autocast
    def forward(  # type: ignore[override]
        ctx, queries: Tensor, weights: Tensor, values: Tensor, decay: Tensor, initial: Tensor
    ) -> Tuple[Tensor, Tensor]:
        batch, heads, chunks, chunk, d = weights.shape
        d_v = values.shape[-1]
        w3, v3 = weights.reshape(-1, chunk, d), values.reshape(-1, chunk, d_v)
        # Each chunk's own sums [E^T V, sum_t E] (batched matmuls write contiguous results; into a strided
        # slice of a wider buffer they fall back to one matmul at a time).
        own = torch.cat([torch.bmm(w3.transpose(1, 2), v3).view(batch, heads, chunks, d, d_v),
                         weights.sum(3).unsqueeze(-1)], dim=-1)
        # The scan over chunks: previous[c] = decay_c * state[c - 1], state[c] = previous[c] + own[c], the
        # states written over the chunks' own sums, which nothing needs afterwards. In-place operations only:
        # a step is a few microseconds of arithmetic, and allocation or out= arguments would take longer.
        # One select() view per chunk, not unbind(): torch.jit.trace replays these ops with grad mode on, where
        # the views unbind returns together may not be modified in place.
        previous = own.new_empty(own.shape)
        state = initial
        factors = decay.unsqueeze(-1)
        for c in range(chunks):
            previous_c = previous.select(2, c).copy_(state).mul_(factors.select(2, c))
            state = own.select(2, c).add_(previous_c)
        floor = denominator_floor(weights.dtype)
        # A normaliser is zero only where nothing is visible, and the numerator with it: the floor keeps those
        # outputs zero instead of NaN (and the backward's divisions finite).
        den = weights.cumsum(3).add_(previous[..., d_v].unsqueeze(3)).clamp_min_(floor)
        phi = queries / den
        p3, d3 = phi.reshape(-1, chunk, d), previous.view(-1, d, d_v + 1)
        scores = torch.bmm(p3, w3.transpose(1, 2)).tril_()
        out = torch.bmm(p3, d3[..., :d_v]).baddbmm_(scores, v3)
        ctx.save_for_backward(weights, values, decay, previous, den, phi, scores)
        ctx.set_materialize_grads(False)
        # A copy: the last state is a slice of a buffer of every chunk's, which a decoding state would keep.
        return out.view(batch, heads, chunks, chunk, d_v), state.clone()

    @staticmethod
    @outside_autocast
    def backward(ctx, grad_out: Optional[Tensor], grad_final: Optional[Tensor]):  # type: ignore[override]
        weights, values, decay, previous, den, phi, scores = ctx.saved_tensors
        batch, heads, chunks, chunk, d = weights.shape
        d_v = values.shape[-1]
        w3, v3, p3 = weights.reshape(-1, chunk, d), values.reshape(-1, chunk, d_v), phi.reshape(-1, chunk, d)
        if grad_out is None:
            grad_out = values.new_zeros(values.shape)
        g3 = grad_out.reshape(-1, chunk, d_v)
        numerators = previous.view(-1, d, d_v + 1)[..., :d_v]
        grad_scores = torch.bmm(g3, v3.transpose(1, 2)).tril_()
        grad_phi = torch.bmm(g3, numerators.transpose(1, 2)).baddbmm_(grad_scores, w3)
        grad_values = torch.bmm(scores.transpose(1, 2), g3)
        grad_queries = grad_phi.view(weights.shape) / den
        # phi = Q' / D: dD = -dphi Q' / D^2 = -dQ' phi. Where the floor replaced a zero normaliser nothing
        # is visible, and dphi is exactly zero.
        minus_grad_den = grad_queries * phi
        # D = z + cumsum(E): each key's weight gets the normaliser gradient of itself and the rows after it,
        # a reversed cumulative sum, taken as a product with the upper triangle of ones in the same batched
        # matmul pass as the scores' part (three passes fewer than flip, cumsum, flip).
        suffix = torch.ones(chunk, chunk, dtype=weights.dtype, device=weights.device).triu_()
        suffix = suffix.expand(w3.shape[0], -1, -1)
        grad_weights = torch.bmm(grad_scores.transpose(1, 2), p3).baddbmm_(
            suffix, minus_grad_den.view(-1, chunk, d), alpha=-1.0
        )
        # The gradient of the state carried into each chunk: numerators', then normalisers'.
        grad_previous = torch.cat([torch.bmm(p3.transpose(1, 2), g3).view(batch, heads, chunks, d, d_v),
                                   minus_grad_den.sum(3).neg_().unsqueeze(-1)], dim=-1)
        # Reverse scan: the gradient reaching each chunk's own sums (that of the state after it) from everything
        # after it, written straight into place: grad_own[c - 1] = decay_c * (grad_previous[c] + grad_own[c]).
        grad_own = torch.empty_like(previous)
        grad_initial = previous.new_empty(previous.shape[:2] + previous.shape[3:])
        targets = [grad_initial, *(grad_own.select(2, c) for c in range(chunks))]
        if grad_final is None:
            targets[-1].zero_()
        else:
            targets[-1].copy_(grad_final)
        steps = zip(decay.unsqueeze(-1).unbind(2), grad_previous.unbind(2), targets[1:], targets[:-1])
        for decay_c, grad_previous_c, after, before in reversed(list(steps)):
            before.copy_(after).add_(grad_previous_c).mul_(decay_c)
        # own = [E^T V, sum_t E]
        own3 = grad_own.view(-1, d, d_v + 1)
        grad_weights.baddbmm_(v3, own3[..., :d_v].transpose(1, 2))
        grad_weights = grad_weights.view(weights.shape).add_(grad_own[..., d_v].unsqueeze(3))
        grad_values = grad_values.baddbmm_(w3, own3[..., :d_v]).view(values.shape)
        return grad_queries, grad_weights, grad_values, None, grad_initial


def _causal_equal_lengths(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    initial: Optional[Summary],
    chunk_size: int,
) -> Tuple[Tensor, Summary]:
    """Causal efficient attention for q (softmaxed over features), k, v of one length N, after the keys of
    ``initial``. Returns ((B, H, N, d_v), the summary after position N - 1)."""
    batch, heads, _, d = k.shape
    chunks = prefix_chunks(k, v, key_padding_mask, chunk_size, None if initial is None else initial[0])
    state = k.new_zeros(batch, heads, d, v.shape[-1] + 1) if initial is None else initial[1]
    out, final = _CausalChunks.apply(chunks.chunked(q), chunks.weights(), chunks.values, chunks.decay, state)
    return unchunked(out, q.shape[2]), (chunks.last_max, final)


def efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Efficient attention ``softmax_features(q) (softmax_positions(k)^T v)``.

    Args:
        q: (batch, heads, seq_q, d)
        k: (batch, heads, seq_kv, d)
        v: (batch, heads, seq_kv, d_v)
        causal: each key feature's softmax over the prefix (module docstring), bottom-right aligned when
            ``seq_q != seq_kv``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding keys, left out of every softmax.
        chunk_size: chunk length of the causal path.

    Returns:
        (batch, heads, seq_q, d_v) in the dtype of v; zeros for a query that sees no unpadded key.
    """
    check_bool("causal", causal)
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_positive_int("chunk_size", chunk_size)
    return efficient_attention_unchecked(q, k, v, causal, key_padding_mask, chunk_size)


def efficient_attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], chunk_size: int
) -> Tensor:
    """:func:`efficient_attention` for callers that validated its arguments themselves (the mechanism)."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rho_q = torch.softmax(q, dim=-1)
    if causal:

        def run(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], initial: Optional[Summary]) -> Tensor:
            return _causal_equal_lengths(q, k, v, mask, initial, chunk_size)[0]

        return bottom_right_causal(run, _context_summary, rho_q, k, v, key_padding_mask).to(out_dtype)
    weights, v, _ = whole_sequence_weights(k, v, key_padding_mask)
    num_den = weights.transpose(-1, -2) @ _with_ones(v)  # (B, H, d, d_v + 1)
    context = num_den[..., :-1] / safe_denominator(num_den[..., -1:])  # rho_k(k)^T v
    return (rho_q @ context).to(out_dtype)


def efficient_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None
) -> Tensor:
    """Obviously-correct dense form of :func:`efficient_attention` in float64.

    Every query row gets its own softmax of each key feature over the keys it may see, a (seq_q, seq_kv, d)
    tensor; mixing the features with the query's weights gives the (seq_q, seq_kv) attention matrix
    ``A[i, t] = sum_j rho_q(q_i)_j softmax_t(k_tj)``, and ``out = A v``. Returns float64."""
    q, k, v = q.double(), k.double(), v.double()
    batch, _, q_len, _ = q.shape
    k_len = k.shape[2]
    k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
    logits = k.unsqueeze(2).expand(-1, -1, q_len, -1, -1)  # (B, H, seq_q, seq_kv, d): row i's copy of k
    allowed = allowed_mask(batch, q_len, k_len, causal, key_padding_mask, q.device)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(-1), -math.inf)
    per_feature = _masked_softmax(logits, dim=3)
    attention = torch.einsum("bhij,bhitj->bhit", torch.softmax(q, dim=-1), per_feature)
    return attention @ v


def _masked_softmax(logits: Tensor, dim: int) -> Tensor:
    """Softmax over ``dim`` where -inf marks an excluded entry; all zeros where every entry is excluded."""
    top = logits.detach().amax(dim=dim, keepdim=True)
    exp = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


# -- recurrent form ---------------------------------------------------------------------------------------------
def efficient_attention_prefill(
    q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tuple[Tensor, EfficientState]:
    """Causal :func:`efficient_attention` over a prompt (seq_q == seq_kv) that also returns the recurrent
    state (:data:`EfficientState`)."""
    check_qkv(q, k, v)
    check_positive_int("chunk_size", chunk_size)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"prefill needs queries and keys of one sequence, got seq_q={q.shape[2]} and "
                         f"seq_kv={k.shape[2]}")
    return efficient_attention_prefill_unchecked(q, k, v, chunk_size)


def efficient_attention_prefill_unchecked(
    q: Tensor, k: Tensor, v: Tensor, chunk_size: int
) -> Tuple[Tensor, EfficientState]:
    """:func:`efficient_attention_prefill` for callers that validated its arguments themselves."""
    out_dtype, dtype = v.dtype, working_dtype(v.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, (maximum, final) = _causal_equal_lengths(torch.softmax(q, dim=-1), k, v, None, None, chunk_size)
    d_v = v.shape[-1]
    return out.to(out_dtype), {"num": final[..., :d_v], "den": final[..., d_v], "max": maximum}


def efficient_attention_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[EfficientState]
) -> Tuple[Tensor, EfficientState]:
    """One causal position, O(d d_v) whatever the context length.

    Args:
        q_t, k_t: (batch, heads, 1, d); v_t: (batch, heads, 1, d_v).
        state: from :func:`efficient_attention_prefill` or a previous step, or None at the start.

    Returns:
        ((batch, heads, 1, d_v), new state); equals the last row of the causal parallel form.
    """
    check_qkv(q_t, k_t, v_t)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError("efficient_attention_step takes one position: q_t, k_t, v_t of shape (batch, heads, 1, dim)")
    return efficient_attention_step_unchecked(q_t, k_t, v_t, state)


def efficient_attention_step_unchecked(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[EfficientState]
) -> Tuple[Tensor, EfficientState]:
    """:func:`efficient_attention_step` for callers that validated its arguments themselves (the mechanism,
    whose decoding states are checked against its declared layout)."""
    dtype = working_dtype(v_t.dtype)
    q, k, v = q_t[:, :, 0].to(dtype), k_t[:, :, 0].to(dtype), v_t[:, :, 0].to(dtype)
    decay, weight, maximum = prefix_step_weights(k, None if state is None else state["max"])
    term = weight.unsqueeze(-1) * v.unsqueeze(-2)  # (B, H, d, d_v): the new key's part of each feature's sum
    if state is None or decay is None:
        num, den = term, weight
    else:
        num = decay.unsqueeze(-1) * state["num"] + term
        den = decay * state["den"] + weight
    # den >= 1: the feature's running maximum contributes exp(0).
    out = ((torch.softmax(q, dim=-1) / den).unsqueeze(-2) @ num).to(v_t.dtype)
    return out, {"num": num, "den": den, "max": maximum}

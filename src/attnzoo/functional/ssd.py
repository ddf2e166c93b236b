"""Mamba-2's state-space duality (SSD, Dao & Gu 2024, "Transformers are SSMs"): a selective state-space model
with a scalar decay per head and token, computed as linear attention with that decay.

The recurrence of one head, state ``h_t`` (state_dim x head_dim)::

    h_t = exp(dt_t A) h_{t-1} + (dt_t B_t) x_t^T,    y_t = C_t^T h_t + D x_t

is causal linear attention with queries ``C``, keys ``dt B`` (Euler's discretisation of B, the paper's and
mamba_ssm's ``dt * B``), values ``x``, the log decay ``dt A`` and no normaliser:
``y_i = sum_{j <= i} exp(sum_{s=j+1..i} dt_s A) (C_i . B_j) dt_j x_j + D x_i``. So the parallel form here is the
chunked decayed path of :func:`attnzoo.functional.linear.kernel_attention` (the one ``retention`` and ``gla``
run: exact quadratic form inside chunks, a carried state between them, every decay in log space), called with
``normalizer="none"``; packed rows use its packed form (the state reset at every document start). Nothing of
that path is copied here: this module maps Mamba-2's names and shapes onto it, adds the skip ``D x``, and
holds the recurrent step and the float64 per-token reference that the chunked form is tested against.

Layout (attnzoo's, heads before the sequence; mamba_ssm puts the sequence first):

* ``x`` (batch, heads, seq, head_dim): the values (mamba_ssm's ``x``, (batch, seq, heads, headdim));
* ``dt`` (batch, heads, seq): the step sizes, already positive (softplus of the projection plus ``dt_bias``);
* ``A`` (heads,): the per-head rate, <= 0 (``-exp(A_log)``);
* ``B``, ``C`` (batch, groups, seq, state_dim): shared by the ``heads // groups`` consecutive heads of each
  group (mamba_ssm's ``ngroups``; head h reads group ``h // (heads // groups)``);
* ``D`` (heads,) or None: the skip.

``causal=False`` gives the bidirectional form of the same path (key j weighted by the decays between it and
the query, on either side); Mamba-2 itself is causal.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int
from .linear import (
    DEFAULT_CHUNK_SIZE,
    kernel_attention_prefill_unchecked,
    kernel_attention_unchecked,
    packed_causal_kernel_attention_unchecked,
)
from .packing import check_cu_seqlens


# -- checks ------------------------------------------------------------------------------------------------------
def _check_shapes(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor]) -> None:
    """Shapes, dtypes and devices of one call (x may be one position)."""
    for name, tensor in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)) + ((("D", D),) if D is not None else ()):
        check_floating(name, tensor)
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on {x.device} with x, got {tensor.device}")
    if x.dim() != 4 or 0 in x.shape:
        raise ValueError(f"x must have shape (batch, heads, seq, head_dim), none of them 0, got {tuple(x.shape)}")
    batch, heads, seq, _ = x.shape
    if dt.shape != (batch, heads, seq):
        raise ValueError(f"dt must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}), got {tuple(dt.shape)}")
    if A.shape != (heads,):
        raise ValueError(f"A must have shape (heads,) = ({heads},), got {tuple(A.shape)}")
    if D is not None and D.shape != (heads,):
        raise ValueError(f"D must have shape (heads,) = ({heads},) or be None, got {tuple(D.shape)}")
    if B.dim() != 4 or B.shape[0] != batch or B.shape[2] != seq or B.shape[3] == 0:
        raise ValueError(f"B must have shape (batch, groups, seq, state_dim) = ({batch}, groups, {seq}, state_dim), "
                         f"got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")
    if B.shape[1] == 0 or heads % B.shape[1]:
        raise ValueError(f"the groups of B and C ({B.shape[1]}) must divide the heads of x ({heads})")


def _check_values(dt: Tensor, A: Tensor, D: Optional[Tensor], key_padding_mask: Optional[Tensor]) -> None:
    """``A`` finite and <= 0, ``D`` finite, ``dt`` finite and >= 0 wherever the padding mask keeps it (reads the
    values: one transfer to the host). Together they make every decay ``exp(dt A)`` lie in (0, 1]."""
    if not bool(torch.isfinite(A).all()) or bool((A > 0).any()):
        raise ValueError("A must be finite and <= 0 (the decay exp(dt A) must not grow the state); "
                         "Mamba-2 uses A = -exp(A_log)")
    if D is not None and not bool(torch.isfinite(D).all()):
        raise ValueError("D must be finite")
    kept = dt if key_padding_mask is None else dt.masked_fill(key_padding_mask[:, None, :], 0.0)
    if not bool(torch.isfinite(kept).all()) or bool((kept < 0).any()):
        raise ValueError("dt must be finite and >= 0 at every unpadded position (a step size, e.g. softplus of a "
                         "projection)")


def check_ssd_call(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    key_padding_mask: Optional[Tensor], chunk_size: int,
) -> None:
    """Every check of :func:`ssd` and :func:`ssd_prefill` but those of ``causal`` and ``cu_seqlens``."""
    _check_shapes(x, dt, A, B, C, D)
    check_key_padding_mask(key_padding_mask, x.shape[0], x.shape[2], x.device)
    check_positive_int("chunk_size", chunk_size)
    _check_values(dt, A, D, key_padding_mask)


# -- the mapping onto linear attention ---------------------------------------------------------------------------
def per_head(groups_tensor: Tensor, heads: int) -> Tensor:
    """(batch, groups, seq, n) -> (batch, heads, seq, n): each group's rows for its ``heads // groups``
    consecutive heads (a broadcast view, copied only if a later reshape needs it)."""
    batch, groups, seq, n = groups_tensor.shape
    if groups == heads:
        return groups_tensor
    return groups_tensor[:, :, None].expand(batch, groups, heads // groups, seq, n).reshape(batch, heads, seq, n)


def ssd_as_linear_attention(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """SSD's inputs as linear attention's, in the working dtype: (queries ``C``, keys ``dt B``, values ``x``,
    log decay ``dt A``), each per head: (batch, heads, seq, state_dim) twice, x, (batch, heads, seq)."""
    dtype = working_dtype(x.dtype)
    heads = x.shape[1]
    dt = dt.to(dtype)
    queries = per_head(C.to(dtype), heads)
    keys = per_head(B.to(dtype), heads) * dt.unsqueeze(-1)
    return queries, keys, x.to(dtype), dt * A.to(dtype).view(1, -1, 1)


def _with_skip(y: Tensor, x: Tensor, D: Optional[Tensor]) -> Tensor:
    """``y + D x`` (D per head), or y without D; in the dtype of x."""
    if D is not None:
        y = y + D.to(y.dtype).view(1, -1, 1, 1) * x.to(y.dtype)
    return y.to(x.dtype)


# -- the parallel form -------------------------------------------------------------------------------------------
def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Optional[Tensor] = None,
    causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mamba-2's SSD layer (module docstring): ``y_t = C_t^T h_t + D x_t``, ``h_t = exp(dt_t A) h_{t-1} +
    dt_t B_t x_t^T``, chunked, in O(N (c + n) p) time for chunks of c positions.

    Args:
        x: (batch, heads, seq, head_dim); dt: (batch, heads, seq), >= 0; A: (heads,), <= 0;
        B, C: (batch, groups, seq, state_dim), groups dividing heads; D: (heads,) or None.
        causal: the recurrence (True, Mamba-2) or its bidirectional form.
        key_padding_mask: (batch, seq) bool, True marks padding: a padded position writes nothing to the state
            and does not decay it, whatever x, dt, B hold there (its own output row is meaningless).
        cu_seqlens: int64 document offsets of a packed row (batch 1), causal only: the state starts empty at
            every document start, so each document gets what it gets alone.
        chunk_size: chunk length of the parallel form.

    Returns:
        (batch, heads, seq, head_dim) in the dtype of x (sums in float32 for half-precision inputs).
    """
    check_bool("causal", causal)
    check_ssd_call(x, dt, A, B, C, D, key_padding_mask, chunk_size)
    spans = None
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens needs causal=True: the packed form carries the recurrent state forward")
        if key_padding_mask is not None:
            raise ValueError("cu_seqlens and key_padding_mask cannot be combined: a packed row has no padding")
        spans = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[2], x.device)
    return ssd_unchecked(x, dt, A, B, C, D, causal, key_padding_mask, spans, chunk_size)


def ssd_unchecked(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], causal: bool,
    key_padding_mask: Optional[Tensor], spans: Optional[List[Tuple[int, int]]], chunk_size: int,
) -> Tensor:
    """:func:`ssd` on checked arguments; ``spans`` the packed row's documents (start, end) or None."""
    queries, keys, values, log_decay = ssd_as_linear_attention(x, dt, A, B, C)
    if spans is not None:
        y = packed_causal_kernel_attention_unchecked(queries, keys, values, spans, log_decay, "none", chunk_size, 0.0)
    else:
        y = kernel_attention_unchecked(queries, keys, values, causal, key_padding_mask, log_decay, "none",
                                       chunk_size, 0.0)
    return _with_skip(y, x, D)


# -- the recurrent form ------------------------------------------------------------------------------------------
def ssd_prefill(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tuple[Tensor, Tensor]:
    """Causal :func:`ssd` over a prompt that also returns the state after it, (batch, heads, state_dim,
    head_dim) in the working dtype, for :func:`ssd_step`."""
    check_ssd_call(x, dt, A, B, C, D, None, chunk_size)
    return ssd_prefill_unchecked(x, dt, A, B, C, D, chunk_size)


def ssd_prefill_unchecked(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], chunk_size: int
) -> Tuple[Tensor, Tensor]:
    """:func:`ssd_prefill` on checked arguments."""
    queries, keys, values, log_decay = ssd_as_linear_attention(x, dt, A, B, C)
    y, state = kernel_attention_prefill_unchecked(queries, keys, values, None, log_decay, "none", chunk_size, 0.0)
    # The linear-attention state carries a column for the normaliser, which SSD does not use.
    return _with_skip(y, x, D), state["kv"][..., :-1]


def ssd_step(
    x_t: Tensor, dt_t: Tensor, A: Tensor, B_t: Tensor, C_t: Tensor, state: Optional[Tensor], *,
    D: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """One position of the recurrence, O(state_dim head_dim) per head whatever the context length.

    Args:
        x_t: (batch, heads, 1, head_dim); dt_t: (batch, heads, 1); A: (heads,); B_t, C_t: (batch, groups, 1,
            state_dim); state: (batch, heads, state_dim, head_dim) from :func:`ssd_prefill` or a previous step,
            or None at the start; D: (heads,) or None.

    Returns:
        ((batch, heads, 1, head_dim) in the dtype of x_t, the new state in the working dtype).
    """
    _check_shapes(x_t, dt_t, A, B_t, C_t, D)
    if x_t.shape[2] != 1:
        raise ValueError(f"ssd_step takes one position: x_t of shape (batch, heads, 1, head_dim), got "
                         f"{tuple(x_t.shape)}")
    if state is not None:
        expected = (x_t.shape[0], x_t.shape[1], B_t.shape[3], x_t.shape[3])
        check_floating("state", state)
        if tuple(state.shape) != expected:
            raise ValueError(f"state must have shape (batch, heads, state_dim, head_dim) = {expected}, got "
                             f"{tuple(state.shape)}")
    _check_values(dt_t, A, D, None)
    return ssd_step_unchecked(x_t, dt_t, A, B_t, C_t, state, D)


def ssd_step_unchecked(
    x_t: Tensor, dt_t: Tensor, A: Tensor, B_t: Tensor, C_t: Tensor, state: Optional[Tensor], D: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """:func:`ssd_step` on checked arguments."""
    queries, keys, values, log_decay = ssd_as_linear_attention(x_t, dt_t, A, B_t, C_t)
    written = keys.transpose(-1, -2) @ values  # (batch, heads, state_dim, head_dim)
    if state is not None:
        written = written + torch.exp(log_decay).unsqueeze(-1) * state.to(written.dtype)
    return _with_skip(queries @ written, x_t, D), written


# -- Mamba-2's parametrisation ------------------------------------------------------------------------------
def mamba2_step_bias(heads: int, low: float = 0.001, high: float = 0.1) -> Tensor:
    """Mamba-2's ``dt_bias`` initialisation, deterministic: the inverse softplus of step sizes from ``low`` to
    ``high``, geometric over the heads (mamba_ssm draws them log-uniformly in the same range). (heads,)."""
    steps = torch.logspace(math.log10(low), math.log10(high), heads) if heads > 1 else torch.tensor([low])
    return steps + torch.log(-torch.expm1(-steps))  # softplus(bias) = steps


def mamba2_log_rates(heads: int) -> Tensor:
    """Mamba-2's ``A_log`` initialisation, deterministic: ``log(A)`` for rates from 1 to 16 over the heads
    (mamba_ssm draws them uniformly in [1, 16]). (heads,)."""
    return torch.linspace(1.0, 16.0, heads).log()


def step_sizes(logits: Tensor) -> Tensor:
    """``softplus(logits)``, written as ``-logsigmoid(-logits)`` (the same numbers): softplus's backward fails
    under torch.compile's AOTAutograd for gates computed from permuted keys."""
    return -F.logsigmoid(-logits)


# -- the float64 reference ---------------------------------------------------------------------------------------
def ssd_reference(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Optional[Tensor] = None, causal: bool = True,
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """The recurrence itself, one position at a time, in float64: the definition every fast form is tested
    against. Padded positions leave the state untouched. ``causal=False``: the same recurrence run backwards
    too (key j reaches query i < j through the decays i+1..j), the position's own term counted once.
    Returns float64 (batch, heads, seq, head_dim)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    heads, seq = x.shape[1], x.shape[2]
    B, C = per_head(B, heads), per_head(C, heads)
    kept = torch.ones_like(dt) if key_padding_mask is None else (~key_padding_mask[:, None, :]).double()
    # Padded positions: decay 1 and no write; where() keeps a NaN they hold out of the products.
    decay = torch.where(kept > 0, torch.exp(dt * A.view(1, -1, 1)), 1.0)
    writes = torch.where(kept[..., None, None] > 0, (B * dt.unsqueeze(-1)).unsqueeze(-1) * x.unsqueeze(-2), 0.0)

    def run(order: range, decay_at) -> List[Tensor]:
        state, outputs = torch.zeros_like(writes[:, :, 0]), [None] * seq
        for t in order:
            state = decay_at(t)[..., None, None] * state + writes[:, :, t]
            outputs[t] = (C[:, :, t].unsqueeze(-2) @ state).squeeze(-2)
        return outputs

    forward = torch.stack(run(range(seq), lambda t: decay[:, :, t]), dim=2)
    if not causal:
        ones = torch.ones_like(decay[:, :, 0])
        backward = run(range(seq - 1, -1, -1), lambda t: decay[:, :, t + 1] if t + 1 < seq else ones)
        own = (C.unsqueeze(-2) @ writes).squeeze(-2)
        forward = forward + torch.stack(backward, dim=2) - own
    if D is not None:
        forward = forward + D.double().view(1, -1, 1, 1) * x
    return forward


__all__ = [
    "check_ssd_call",
    "mamba2_log_rates",
    "mamba2_step_bias",
    "per_head",
    "ssd",
    "ssd_as_linear_attention",
    "ssd_prefill",
    "ssd_prefill_unchecked",
    "ssd_reference",
    "ssd_step",
    "ssd_step_unchecked",
    "ssd_unchecked",
    "step_sizes",
]

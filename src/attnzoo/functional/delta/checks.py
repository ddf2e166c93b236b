"""Argument checks and input preparation shared by every form of the delta rule (:mod:`attnzoo.functional.delta`)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._dtypes import working_dtype
from ..._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int, check_qkv


def check_gates(
    k: Tensor, beta: Optional[Tensor], log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor]
) -> None:
    """``beta`` shaped (batch, heads, seq) like the keys and ``log_decay`` the same or (batch, heads, seq, d_k)
    (a decay per key channel), where given, both finite, ``beta`` in [0, 2] and ``log_decay <= 0``, at every
    position the padding mask keeps (a padded position may hold anything)."""
    batch, heads, seq = k.shape[:3]
    for name, gate in (("beta", beta), ("log_decay", log_decay)):
        if gate is None:
            continue
        check_floating(name, gate)
        per_channel = name == "log_decay" and gate.dim() == 4
        if gate.shape != (batch, heads, seq) and not (per_channel and gate.shape == k.shape):
            allowed = " or (batch, heads, seq, d_k) = " + str(tuple(k.shape)) if name == "log_decay" else ""
            raise ValueError(f"{name} must have shape (batch, heads, seq) = ({batch}, {heads}, {seq}){allowed}, "
                             f"got {tuple(gate.shape)}")
        if gate.device != k.device:
            raise ValueError(f"{name} must be on {k.device} with the keys, got {gate.device}")
        kept = gate if key_padding_mask is None else gate.masked_fill(_padded(key_padding_mask, gate), 0.0)
        if not bool(torch.isfinite(kept).all()):
            raise ValueError(f"{name} must be finite at every unpadded position (it holds NaN or inf)")
        if name == "beta" and bool(((kept < 0) | (kept > 2)).any()):
            raise ValueError("beta must be in [0, 2] (a write strength; I - beta k k^T stays a contraction for unit "
                             "keys), got a value outside it")
        if name == "log_decay" and bool((kept > 0).any()):
            raise ValueError("log_decay must be <= 0 (a decay a_t = exp(log_decay_t) in (0, 1]), got a positive value")


def _padded(key_padding_mask: Tensor, gate: Tensor) -> Tensor:
    """The (batch, seq) mask laid out against a (batch, heads, seq) or (batch, heads, seq, d_k) gate."""
    padded = key_padding_mask[:, None, :]
    return padded if gate.dim() == 3 else padded[..., None]


def check_state(name: str, state: Optional[Tensor], k: Tensor, v: Tensor) -> None:
    """A state (batch, heads, d_k, d_v) for these keys and values, or None."""
    if state is None:
        return
    check_floating(name, state)
    expected = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
    if tuple(state.shape) != expected:
        raise ValueError(f"{name} must have shape (batch, heads, d_k, d_v) = {expected}, got {tuple(state.shape)}")
    if state.device != k.device:
        raise ValueError(f"{name} must be on {k.device} with the keys, got {state.device}")


def check_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    initial_state: Optional[Tensor],
    causal: bool,
    scale: Optional[float],
) -> None:
    """Every check of a self-attention call of the delta rule (queries and keys from one sequence)."""
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share the sequence length (the delta rule is self-attention), got "
                         f"{q.shape[2]} and {k.shape[2]}")
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_gates(k, beta, log_decay, key_padding_mask)
    check_state("initial_state", initial_state, k, v)
    check_bool("causal", causal)
    resolve_scale(scale, q.shape[3])


def resolve_scale(scale: Optional[float], head_dim: int) -> float:
    """The query scale: ``head_dim ** -0.5`` when None; otherwise a finite real number."""
    if scale is None:
        # math.sqrt makes a Python constant of it even where torch.jit.trace records sizes as tensors (a traced
        # ``** -0.5`` on a size becomes a float32 tensor op, which a float64 call would feel).
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    return float(scale)


def prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    scale: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Cast to the working dtype, scale the queries, and make padded positions inert whatever they hold: their
    keys, values and beta zeroed (they write nothing), their log decay zeroed (they do not decay the state).
    ``masked_fill``, not a product, so that a NaN or inf there cannot leak."""
    dtype = working_dtype(q.dtype)
    q, k, v, beta = q.to(dtype) * scale, k.to(dtype), v.to(dtype), beta.to(dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)
    if key_padding_mask is not None:
        padded = key_padding_mask[:, None, :]
        k = k.masked_fill(padded[..., None], 0.0)
        v = v.masked_fill(padded[..., None], 0.0)
        beta = beta.masked_fill(padded, 0.0)
        log_decay = None if log_decay is None else log_decay.masked_fill(_padded(key_padding_mask, log_decay), 0.0)
    return q, k, v, beta, log_decay


def check_chunk_size(chunk_size: int) -> int:
    return check_positive_int("chunk_size", chunk_size)


def _check_steps(q: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> None:
    """Ranks and the number of steps n_h of Gated DeltaProduct's per-step keys, values and betas."""
    for name, x, rank, layout in (("k", k, 5, "(batch, heads, seq, n_h, d_k)"),
                                  ("v", v, 5, "(batch, heads, seq, n_h, d_v)"),
                                  ("beta", beta, 4, "(batch, heads, seq, n_h)")):
        check_floating(name, x)
        if x.dim() != rank:
            raise ValueError(f"{name} must have shape {layout}, n_h steps per position, got {x.dim()} dims: "
                             f"{tuple(x.shape)}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape (batch, heads, seq, d_k), got {q.dim()} dims: {tuple(q.shape)}")
    steps = k.shape[3]
    if steps < 1 or v.shape[3] != steps or beta.shape[3] != steps:
        raise ValueError(f"k, v and beta must hold the same number n_h >= 1 of steps per position (dim 3), got "
                         f"{k.shape[3]}, {v.shape[3]} and {beta.shape[3]}")


def check_product_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    initial_state: Optional[Tensor],
    causal: bool,
    scale: Optional[float],
) -> None:
    """Every check of a Gated DeltaProduct call: q (batch, heads, seq, d_k); k (batch, heads, seq, n_h, d_k),
    v (batch, heads, seq, n_h, d_v) and beta (batch, heads, seq, n_h), n_h steps per position; beta in [0, 2]
    (``I - beta k k^T`` a contraction for unit keys; (0, 1] from a sigmoid, up to 2 for negative eigenvalues)
    and log_decay (batch, heads, seq), or (batch, heads, seq, d_k) per key channel, finite and <= 0 at every
    unpadded position."""
    _check_steps(q, k, v, beta)
    if beta.shape != k.shape[:4]:
        raise ValueError(f"beta must have shape (batch, heads, seq, n_h) = {tuple(k.shape[:4])} like k, got "
                         f"{tuple(beta.shape)}")
    # The checks of one step's k, v and beta are the delta rule's; the other steps share their shapes, and
    # every step's beta is checked as the delta rule's on the interleaved steps.
    check_call(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], log_decay, key_padding_mask, initial_state, causal,
               scale)
    k_steps, _, beta_steps, _, mask_steps = interleaved(k, v, beta, None, key_padding_mask)
    check_gates(k_steps, beta_steps, None, mask_steps)


def interleaved(
    k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor], key_padding_mask: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gated DeltaProduct's n_h steps per position as one sequence n_h times longer, the steps of a position in
    order: k (B, H, N n_h, d_k), v (B, H, N n_h, d_v), beta (B, H, N n_h); log_decay (B, H, N n_h), or
    (B, H, N n_h, d_k) per key channel, with the position's decay on its first step and 0 (no decay) on the
    others; the mask repeated over the steps."""
    batch, heads, length, steps = k.shape[:4]
    k_steps, v_steps = k.reshape(batch, heads, length * steps, -1), v.reshape(batch, heads, length * steps, -1)
    beta_steps = beta.reshape(batch, heads, length * steps)
    decay_steps = None
    if log_decay is not None:  # a steps axis after seq, padded with zeros past the first step
        decay = log_decay.unsqueeze(3)
        decay_steps = F.pad(decay, (0, 0) * (decay.dim() - 4) + (0, steps - 1)).flatten(2, 3)
    mask_steps = None if key_padding_mask is None else key_padding_mask.repeat_interleave(steps, dim=1)
    return k_steps, v_steps, beta_steps, decay_steps, mask_steps

"""The short causal depthwise convolution over the sequence that DeltaNet, Gated DeltaNet and Mamba-2 put after
their input projections (fla's ``ShortConvolution``, mamba_ssm's ``conv1d``): each channel is mixed with its own
last ``kernel`` positions, one weight per channel and tap, optionally followed by SiLU::

    y[t, c] = act(bias[c] + sum_{j=0}^{kernel-1} weight[c, kernel-1-j] * x[t-j, c])

with ``x`` zero before the start of the sequence (so ``weight[c, kernel - 1]`` multiplies the current position,
as ``torch.nn.Conv1d`` on a sequence left-padded with ``kernel - 1`` zeros has it).

Layout: ``x`` is (batch, seq, *channels): one or more channel dims after the sequence, e.g. (batch, seq, width)
for a block's projection or (batch, seq, heads, head_dim) for per-head tensors (a free transpose of attnzoo's
(batch, heads, seq, head_dim)); ``weight`` is (*channels, kernel), ``bias`` (*channels).

* Padding: a padded position (``key_padding_mask`` True) enters the convolution as zero (``masked_fill``, so a
  NaN or inf it holds reaches nothing); a sequence padded at its start gives what it gives alone.
* Packed rows (``cu_seqlens``): the window restarts at each document's start, exactly as if each document ran
  alone: nothing crosses a document boundary.
* Decoding: :func:`short_conv_state` is the state after a prefix (its last ``kernel - 1`` inputs) and
  :func:`short_conv_step` advances it one position; steps equal the parallel form.

The parallel form is ``kernel`` shifted multiply-adds (no ``conv1d``): it reads a strided view as it is, and
autocast leaves elementwise products in the inputs' dtype. :func:`short_conv_reference` is the float64 loop
over positions and taps that every form is tested against.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_bool, check_floating, check_key_padding_mask, check_positive_int
from .packing import check_cu_seqlens


def _check_device(name: str, tensor: Tensor, x: Tensor) -> None:
    if tensor.device != x.device:
        raise ValueError(f"{name} is on {tensor.device} but the inputs are on {x.device}: put them on one device")


def _check_weights(x: Tensor, weight: object, bias: object, where: str) -> None:
    """``weight`` (*channels, kernel) and ``bias`` (*channels) or None, on x's device, for inputs x whose
    channel dims are ``x.shape[2:]``; errors name the argument."""
    x_shape = tuple(x.shape[2:])
    check_floating("weight", weight)
    assert isinstance(weight, Tensor)
    _check_device("weight", weight, x)
    if weight.dim() != len(x_shape) + 1 or tuple(weight.shape[:-1]) != x_shape or weight.shape[-1] < 1:
        raise ValueError(f"weight must be (*channels, kernel) = ({', '.join(map(str, x_shape))}, kernel >= 1) for "
                         f"{where}, got {tuple(weight.shape)}")
    if bias is not None:
        check_floating("bias", bias)
        assert isinstance(bias, Tensor)
        _check_device("bias", bias, x)
        if tuple(bias.shape) != x_shape:
            raise ValueError(f"bias must be (*channels) = {x_shape} like {where}, got {tuple(bias.shape)}")


def _check_sequence(x: object) -> Tensor:
    check_floating("x", x)
    assert isinstance(x, Tensor)
    if x.dim() < 3 or x.shape[1] < 1:
        raise ValueError(f"x must be (batch, seq >= 1, *channels) with at least one channel dim, got {tuple(x.shape)}")
    return x


def _broadcast_over_channels(mask: Tensor, x: Tensor) -> Tensor:
    """A (batch, seq) or (seq,) mask shaped to broadcast against x (batch, seq, *channels)."""
    return mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))


def document_positions(cu_seqlens: Tensor, length: int) -> Tensor:
    """(length,) int64: each position's offset from the start of its document in a packed row (``cu_seqlens``
    as :func:`attnzoo.functional.packing.check_cu_seqlens` checks it)."""
    starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1], output_size=length)
    return torch.arange(length, device=cu_seqlens.device) - starts


def short_conv_unchecked(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    silu: bool,
    key_padding_mask: Optional[Tensor],
    positions: Optional[Tensor],
) -> Tensor:
    """:func:`short_conv` on checked arguments; ``positions`` is :func:`document_positions` of a packed row (the
    window restarts where it is 0), None for one sequence per row. Computes in x's dtype."""
    kernel = weight.shape[-1]
    if key_padding_mask is not None:
        x = x.masked_fill(_broadcast_over_channels(key_padding_mask, x), 0.0)
    weight = weight.to(x.dtype)
    out = x * weight[..., kernel - 1]
    if kernel > 1:
        zeros = x.new_zeros(x.shape[0], kernel - 1, *x.shape[2:])
        padded = torch.cat([zeros, x], dim=1)
        length = x.shape[1]
        for shift in range(1, kernel):
            tap = padded[:, kernel - 1 - shift : kernel - 1 - shift + length]  # x[t - shift], zeros before the start
            if positions is not None:  # a position reads no further back than its document's start
                tap = tap.masked_fill(_broadcast_over_channels(positions < shift, x), 0.0)
            out = torch.addcmul(out, tap, weight[..., kernel - 1 - shift])
    if bias is not None:
        out = out + bias.to(x.dtype)
    return F.silu(out) if silu else out


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    silu: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """Causal depthwise convolution over the sequence (see the module docstring).

    Args:
        x: (batch, seq, *channels).
        weight: (*channels, kernel): ``weight[..., -1]`` multiplies the current position, ``weight[..., -1 - j]``
            the position ``j`` before it.
        bias: (*channels) or None.
        silu: apply SiLU to the result (DeltaNet's and Mamba-2's activation).
        key_padding_mask: (batch, seq) bool, True = padding: those positions enter as zeros.
        cu_seqlens: a packed row (batch 1): int64 document offsets ``[0, ..., seq]``; the window restarts at
            each document's start.

    Returns:
        (batch, seq, *channels), x's dtype (the weights are cast to it).
    """
    x = _check_sequence(x)
    _check_weights(x, weight, bias, "x's channels")
    check_bool("silu", silu)
    check_key_padding_mask(key_padding_mask, x.shape[0], x.shape[1], x.device)
    positions = None
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], x.device)
        positions = document_positions(cu_seqlens, x.shape[1])
    return short_conv_unchecked(x, weight, bias, silu, key_padding_mask, positions)


def short_conv_state_unchecked(x: Tensor, kernel: int, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """:func:`short_conv_state` on checked arguments."""
    if key_padding_mask is not None:
        x = x.masked_fill(_broadcast_over_channels(key_padding_mask, x), 0.0)
    keep = kernel - 1
    tail = x[:, max(0, x.shape[1] - keep):]
    missing = keep - tail.shape[1]
    if missing:
        tail = torch.cat([tail.new_zeros(x.shape[0], missing, *x.shape[2:]), tail], dim=1)
    return tail


def short_conv_state(x: Tensor, kernel: int, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The decoding state after the prefix x (batch, seq, *channels): its last ``kernel - 1`` inputs
    (batch, kernel - 1, *channels), zeros where the prefix is shorter and at padded positions (so a padded
    value reaches no later step). What :func:`short_conv_step` continues from."""
    x = _check_sequence(x)
    kernel = check_positive_int("kernel", kernel)
    check_key_padding_mask(key_padding_mask, x.shape[0], x.shape[1], x.device)
    return short_conv_state_unchecked(x, kernel, key_padding_mask)


def short_conv_step_unchecked(
    x_t: Tensor, state: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], silu: bool
) -> Tuple[Tensor, Tensor]:
    """:func:`short_conv_step` on checked arguments."""
    kernel = weight.shape[-1]
    if state is None:
        state = x_t.new_zeros(x_t.shape[0], kernel - 1, *x_t.shape[2:])
    window = torch.cat([state.to(x_t.dtype), x_t], dim=1)  # (batch, kernel, *channels), oldest first
    out = (window * weight.to(x_t.dtype).movedim(-1, 0)).sum(1, keepdim=True)
    if bias is not None:
        out = out + bias.to(x_t.dtype)
    return (F.silu(out) if silu else out), window[:, 1:]


def short_conv_step(
    x_t: Tensor, state: Optional[Tensor], weight: Tensor, bias: Optional[Tensor] = None, *, silu: bool = False
) -> Tuple[Tensor, Tensor]:
    """One position of :func:`short_conv`: x_t (batch, 1, *channels) after ``state`` (batch, kernel - 1,
    *channels), the previous inputs oldest first (from :func:`short_conv_state` or the previous step; None: the
    start, zeros). Returns (y_t (batch, 1, *channels), the new state). O(kernel) per channel."""
    x_t = _check_sequence(x_t)
    if x_t.shape[1] != 1:
        raise ValueError(f"x_t must be one position (batch, 1, *channels), got {tuple(x_t.shape)}")
    _check_weights(x_t, weight, bias, "x_t's channels")
    check_bool("silu", silu)
    expected = (x_t.shape[0], weight.shape[-1] - 1, *x_t.shape[2:])
    if state is not None and (not isinstance(state, Tensor) or tuple(state.shape) != expected):
        got = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise ValueError(f"state must be None or (batch, kernel - 1, *channels) = {expected}, got {got}")
    if state is not None:
        check_floating("state", state)
        _check_device("state", state, x_t)
    return short_conv_step_unchecked(x_t, state, weight, bias, silu)


def short_conv_reference(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    silu: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """:func:`short_conv` in float64 as the formula reads: a loop over positions and taps, a tap before the
    sequence's (or its document's) start or at a padded position skipped."""
    check_bool("silu", silu)
    x, weight = x.double(), weight.double()
    starts = [0] * x.shape[1]
    if cu_seqlens is not None:
        offsets = cu_seqlens.tolist()
        for start, end in zip(offsets, offsets[1:]):
            starts[start:end] = [start] * (end - start)
    kernel = weight.shape[-1]
    rows = []
    for t in range(x.shape[1]):
        total = torch.zeros_like(x[:, t]) if bias is None else bias.double().expand_as(x[:, t]).clone()
        for shift in range(kernel):
            source = t - shift
            if source < starts[t]:
                break
            value = x[:, source]
            if key_padding_mask is not None:
                padded = key_padding_mask[:, source].reshape(-1, *([1] * (value.dim() - 1)))
                value = torch.where(padded, 0.0, value)
            total = total + weight[..., kernel - 1 - shift] * value
        rows.append(F.silu(total) if silu else total)
    return torch.stack(rows, dim=1)


__all__ = [
    "document_positions",
    "short_conv",
    "short_conv_reference",
    "short_conv_state",
    "short_conv_step",
    "short_conv_unchecked",
]

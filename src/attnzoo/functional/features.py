"""Pure feature functions of kernelized attention: the maths the modules of :mod:`attnzoo.feature_maps` wrap.

Nothing here holds state: projections are passed in or sampled from an explicit generator.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import working_dtype
from .._validation import check_floating, check_positive_int
from ._autocast import outside_autocast, without_autocast


# -- projection samplers -------------------------------------------------------------------------------------
def gaussian_projection(
    nb_rows: int, dim: int, *, generator: Optional[torch.Generator] = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(nb_rows, dim) matrix of iid N(0, 1) entries: the plain random features of Rahimi & Recht."""
    check_positive_int("nb_rows", nb_rows)
    check_positive_int("dim", dim)
    return torch.randn(nb_rows, dim, generator=generator, dtype=dtype)


def orthogonal_projection(
    nb_rows: int, dim: int, *, generator: Optional[torch.Generator] = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(nb_rows, dim) block-orthogonal random matrix (Performer, Choromanski et al. 2021).

    Rows come in blocks of ``dim`` exactly orthogonal directions (the last block truncated); each row is then
    given the norm of an independent ``dim``-dimensional Gaussian vector (chi-distributed), so every row has
    the same marginal law as an iid Gaussian row, which keeps the kernel estimate unbiased, while rows within
    a block are orthogonal, which lowers its variance.
    """
    check_positive_int("nb_rows", nb_rows)
    check_positive_int("dim", dim)
    blocks = []
    for _ in range(math.ceil(nb_rows / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Sign fix makes Q Haar-distributed (QR alone is biased by its sign convention).
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)
    directions = torch.cat(blocks, dim=0)[:nb_rows]
    norms = torch.randn(nb_rows, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (directions * norms).to(dtype)


# -- fused exponential features ------------------------------------------------------------------------------
class _ExpFeatures(torch.autograd.Function):
    """``exp(p + b - offset)``, or ``exp([p + b, -p + b] - offset)`` when symmetric, written into one buffer.

    The (seq, nb_features) feature tensor is the largest in FAVOR+, so forward and backward each make two
    passes over it instead of the five or six that neg, cat, sub and exp with their own backwards take.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, projected: Tensor, offset: Tensor, symmetric: bool, bias: Optional[Tensor]
    ) -> Tensor:
        m = projected.shape[-1]
        if symmetric and torch.compiler.is_compiling():
            # The same sums without out= into slices, which dynamo does not trace; the graph fuses them anyway.
            if bias is None:
                out = torch.cat([projected - offset, -offset - projected], dim=-1)
            else:
                out = torch.cat([(projected + bias) - offset, (bias - projected) - offset], dim=-1)
        elif symmetric:
            out = projected.new_empty(*projected.shape[:-1], 2 * m)
            if bias is None:
                torch.sub(projected, offset, out=out[..., :m])
                torch.sub(-offset, projected, out=out[..., m:])
            else:
                torch.add(projected, bias, out=out[..., :m]).sub_(offset)
                torch.sub(bias, projected, out=out[..., m:]).sub_(offset)
        else:
            out = projected - offset if bias is None else (projected + bias).sub_(offset)
        out.exp_()
        ctx.save_for_backward(out)
        ctx.symmetric = symmetric
        ctx.offset_shape = offset.shape
        ctx.bias_shape = None if bias is None else bias.shape
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad: Tensor
    ) -> Tuple[Optional[Tensor], Optional[Tensor], None, Optional[Tensor]]:
        (features,) = ctx.saved_tensors
        weighted = grad * features
        grad_projected = grad_offset = None
        if ctx.needs_input_grad[0]:
            if ctx.symmetric:
                m = features.shape[-1] // 2
                grad_projected = weighted[..., :m] - weighted[..., m:]
            else:
                grad_projected = weighted
        if ctx.needs_input_grad[1]:
            grad_offset = -weighted.sum(-1, keepdim=True)
            grad_offset = grad_offset.sum_to_size(ctx.offset_shape)
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = weighted
            if ctx.symmetric:
                m = features.shape[-1] // 2
                grad_bias = weighted[..., :m] + weighted[..., m:]
            grad_bias = grad_bias.sum_to_size(ctx.bias_shape)
        return grad_projected, grad_offset, None, grad_bias


def exp_features(projected: Tensor, offset: Tensor, symmetric: bool = False, bias: Optional[Tensor] = None) -> Tensor:
    """``exp(p + b - offset)`` (or ``exp([p + b, -p + b] - offset)`` when ``symmetric``), differentiable in
    all three.

    Args:
        projected: (..., m) logits p.
        offset: broadcastable to (..., 1), e.g. one value per row.
        symmetric: also the mirrored logits -p, giving (..., 2 m).
        bias: optional, broadcastable to (..., m) and added to both p and -p, e.g. one value per feature.
    """
    if bias is not None:
        if torch.broadcast_shapes(projected.shape, bias.shape) != projected.shape:
            raise ValueError(
                f"exp_features: bias of shape {tuple(bias.shape)} must broadcast to the logits' shape "
                f"{tuple(projected.shape)} without widening them"
            )
        bias = bias.to(projected.dtype)
    return _ExpFeatures.apply(projected, offset, symmetric, bias)


class _EluPlusOne(torch.autograd.Function):
    """``elu(x) + 1`` whose backward reads the saved output: the derivative is 1 where x > 0 and
    ``exp(x) = elu(x) + 1`` elsewhere, i.e. ``min(out, 1)`` everywhere. Autograd's elu backward recomputes
    ``exp`` from the input instead, which makes it the slowest step of non-causal linear attention on CPU."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        out = F.elu(x).add_(1.0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return out.clamp(max=1.0).mul_(grad)


def elu_plus_one(x: Tensor) -> Tensor:
    """``elu(x) + 1`` elementwise (Katharopoulos et al. 2020): positive, with a backward that reads the output."""
    check_floating("x", x)
    return _EluPlusOne.apply(x)


def relu_features(x: Tensor) -> Tensor:
    """``relu(x)`` elementwise: non-negative features."""
    check_floating("x", x)
    return F.relu(x)


# -- Hedgehog: learned softmax features -----------------------------------------------------------------------
def _softmax_pair(y: Tensor) -> Tensor:
    """``cat[softmax(y), softmax(-y)]`` over the last dim: :class:`_SoftmaxPair`'s forward (both callers run
    with autocast off)."""
    return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


class _SoftmaxPair(torch.autograd.Function):
    """``cat[softmax(y), softmax(-y)]`` over the last dim, whose backward reads only the output: with
    ``s = softmax(y)``, ``t = softmax(-y)`` and the gradient ``[g, h]``, the gradient of y is
    ``s * (g - <g, s>) - t * (h - <h, t>)``. Autograd's two softmaxes, their negation and concatenation would
    keep both halves and the concatenation, and make three more passes backward."""

    @staticmethod
    @outside_autocast
    def forward(ctx, y: Tensor) -> Tensor:  # type: ignore[override]
        out = _softmax_pair(y)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @outside_autocast
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        m = out.shape[-1] // 2
        weighted = grad * out
        pos, neg = weighted[..., :m], weighted[..., m:]
        grad_pos = pos - out[..., :m] * pos.sum(-1, keepdim=True)
        return grad_pos.sub_(neg).add_(out[..., m:] * neg.sum(-1, keepdim=True))


def hedgehog_features(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Hedgehog's feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine"): per head h,
    ``y = x W_h + b_h`` and ``phi(x) = [softmax(y), softmax(-y)]`` over the features.

    Positive (each half sums to 1), and safe: softmax subtracts its row maximum, so nothing overflows and no
    rescaling is needed (the kernel ``phi(q) . phi(k)`` lies in (0, 2]).

    Args:
        x: (batch, heads, seq, head_dim).
        weight: (heads, head_dim, feature_dim), one map per head.
        bias: (heads, feature_dim) or None.

    Returns:
        (batch, heads, seq, 2 * feature_dim) in the working dtype of x (float32 for half precision).
    """
    check_floating("x", x)
    check_floating("weight", weight)
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, heads, seq, head_dim), got {tuple(x.shape)}")
    heads, head_dim = x.shape[1], x.shape[3]
    if weight.dim() != 3 or weight.shape[:2] != (heads, head_dim):
        raise ValueError(f"weight must have shape (heads, head_dim, feature_dim) = ({heads}, {head_dim}, m) for x of "
                         f"shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if bias is not None:
        check_floating("bias", bias)
        if bias.shape != (heads, weight.shape[2]):
            raise ValueError(f"bias must have shape (heads, feature_dim) = ({heads}, {weight.shape[2]}), got "
                             f"{tuple(bias.shape)}")
    return hedgehog_features_unchecked(x, weight, bias)


@without_autocast
def hedgehog_features_unchecked(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """:func:`hedgehog_features` on checked arguments (in the working dtype under autocast too)."""
    dtype = working_dtype(x.dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    # (batch, heads, seq, d) @ (heads, d, m), one map per head. With one row the batched product is taken
    # directly: the same products, without the broadcasting matmul's cost (half a decoding step's features).
    y = (x[0] @ weight).unsqueeze(0) if x.shape[0] == 1 else x @ weight
    if bias is not None:
        y = y + bias.to(dtype).unsqueeze(-2)
    if torch.is_grad_enabled() and y.requires_grad:
        return _SoftmaxPair.apply(y)
    # No gradient: the same forward without an autograd Function's overhead (tens of microseconds a call,
    # most of a decoding step's feature map).
    return _softmax_pair(y)


def hedgehog_decoding_weights(weight: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """A Hedgehog map as :func:`hedgehog_features_decoding` takes it: the weight (heads, head_dim,
    feature_dim) and the bias shaped (heads, 1, feature_dim), zeros for None, both in ``dtype``."""
    weight = weight.to(dtype)
    bias = weight.new_zeros(weight.shape[0], weight.shape[2]) if bias is None else bias.to(dtype)
    return weight, bias.unsqueeze(1)


def hedgehog_features_decoding(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """:func:`hedgehog_features` of x (batch, heads, seq, head_dim), already in the weights' dtype, with the
    map of :func:`hedgehog_decoding_weights`: one batched product per head (taken directly for one row), the
    logits and their negation stacked and one softmax over both, and no autograd Function (autograd
    differentiates it as written). For decoding, where a step's few rows make the op count, not the
    arithmetic, its cost. Returns (batch, heads, seq, 2 * feature_dim)."""
    batch, heads, seq, _ = x.shape
    rows = x[0] if batch == 1 else x.transpose(0, 1).reshape(heads, batch * seq, -1)  # one map per head
    y = torch.bmm(rows, weight).add_(bias)
    features = torch.stack([y, -y], -2).softmax(-1).view(heads, batch * seq, -1)
    return features.unsqueeze(0) if batch == 1 else features.view(heads, batch, seq, -1).transpose(0, 1)


# Feature functions by the names :func:`attnzoo.functional.linear_attention` accepts.
NAMED_FEATURES = {"elu": elu_plus_one, "relu": relu_features}

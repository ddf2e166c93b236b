"""Sequence parallelism for causal kernelized attention over ``torch.distributed``.

The sequence is split across the ranks of a process group in rank order: rank r holds positions
``[start_r, start_r + n_r)`` of every input (parts may differ in length). Each rank computes, on its own part,
the causal outputs from a zero state and the part's own state (one ``(m, d + 1)`` matrix per batch and head,
with the part's total decay for ``retention`` and ``gla``); one ``all_gather`` of those states gives every rank
the states of the parts before it, whose exclusive prefix scan (:mod:`attnzoo.functional.state_scan`) is the
state its part starts from; one more ``(n_r, m) x (m, d + 1)`` product adds that state's contribution. Outputs
and gradients equal the single-process ones (the gradient of the gather is one ``all_reduce`` of the gathered
states' gradients in the backward pass, so every rank must run the backward).

Feature maps that stabilise keys by a shared shift (``performer``'s FAVOR+ and ``rfa``'s trigonometric features)
first agree on the largest shift across ranks (one ``all_reduce`` of one number per batch and head), so every
rank's keys carry the single-process scale. Random projections must be identical on every rank: build the
mechanism with a ``seed`` (:func:`assert_replicated` checks a module's parameters and buffers across ranks).

Works on any backend (``gloo`` on CPU, ``nccl`` on GPU). docs/scaling.md has the communication per layer and
measured figures.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention import MultiHeadAttention
from ..functional.state_scan import exclusive_state_scan, finish_part, part_terms, rescale_keys
from ..mechanisms.base import Mechanism, UnsupportedOptionError
from ..mechanisms.registry import available, mechanism_class


def _require_group(group: Optional[dist.ProcessGroup]) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "sequence parallelism needs torch.distributed initialised (torch.distributed.init_process_group, e.g. "
            "under torchrun)"
        )


def _prefix(gathered: Tensor, m: int, d1: int, decayed: bool) -> Tensor:
    """The state before the last of the parts in ``gathered`` (parts, batch, heads, m * d1 [+ 1]): each part's
    state flattened, followed by its total log decay when ``decayed``."""
    parts, batch, heads, _ = gathered.shape
    states = gathered[..., : m * d1].reshape(parts, batch, heads, m, d1)
    totals = gathered[..., m * d1] if decayed else None
    return exclusive_state_scan(states, totals)[-1]


class _PrefixAcrossRanks(torch.autograd.Function):
    """The state this rank's part starts from, from every rank's packed state (one ``all_gather``).

    Backward: the gradient of every earlier rank's state, recomputed from the gathered states, summed across ranks
    (one ``all_reduce`` of the whole gathered size; gloo has no reduce-scatter), each rank keeping its own. A
    single function so that every rank runs the backward's collective, the first rank included (its prefix is
    zero and depends on nothing, which would otherwise leave it out of the backward and the ranks out of step).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, packed: Tensor, m: int, d1: int, decayed: bool, group: Optional[dist.ProcessGroup]
    ) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        packed = packed.contiguous()
        gathered = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered, packed, group=group)
        earlier = torch.stack(gathered[: rank + 1])  # the parts after this one change nothing here
        ctx.save_for_backward(earlier)
        ctx.shape, ctx.group, ctx.world, ctx.layout = packed.shape, group, world, (m, d1, decayed)
        return _prefix(earlier, m, d1, decayed)

    @staticmethod
    def backward(ctx, grad_prefix: Tensor):  # type: ignore[override]
        (earlier,) = ctx.saved_tensors
        grads = grad_prefix.new_zeros(ctx.world, *ctx.shape)
        with torch.enable_grad():
            leaf = earlier.detach().requires_grad_()
            prefix = _prefix(leaf, *ctx.layout)
            if prefix.requires_grad:  # the first rank's prefix is zero, whatever the states
                grads[: earlier.shape[0]] = torch.autograd.grad(prefix, leaf, grad_prefix)[0]
        dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=ctx.group)
        return grads[earlier.shape[0] - 1], None, None, None, None


def sequence_parallel_mechanisms() -> List[str]:
    """The registered mechanisms that can run sequence-parallel (with their default options): the causal ones
    whose causal form is a linear-attention recurrence (capability ``linear_recurrence``)."""
    return [name for name in available()
            if mechanism_class(name).capabilities.linear_recurrence and mechanism_class(name).capabilities.causal]


def sequence_parallel_reasons(mechanism: Mechanism) -> List[str]:
    """Why ``mechanism`` cannot run sequence-parallel (empty when it can): its causal form must be a recurrence
    with a constant-size state whose terms it exposes (capability ``linear_recurrence``: ``linear``,
    ``performer``, ``rfa``, ``retention``, ``gla``, ...)."""
    if not mechanism.capabilities.linear_recurrence:
        return [f"{mechanism.name} has no constant-size causal state to pass between ranks: sequence parallelism "
                f"covers the causal kernelized mechanisms ({', '.join(sequence_parallel_mechanisms())})"]
    if not mechanism.capabilities.causal:
        return [f"{mechanism.name} with {mechanism.capabilities.limited_by} is non-causal: sequence parallelism "
                f"splits the causal recurrence"]
    return []


def sequence_parallel_attention(
    mechanism: Mechanism,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """Causal attention over a sequence split across the ranks of ``group``, this rank holding one part.

    Args:
        mechanism: a causal kernelized mechanism (:func:`sequence_parallel_reasons`), identical on every rank.
        q, k, v: (batch, heads, n_r, head_dim), this rank's part of the sequence (rank order = sequence order).
        key_padding_mask: (batch, n_r) bool for this rank's part, True marks padding.
        group: the process group (the default group when None).

    Returns:
        (batch, heads, n_r, head_dim): this part's rows of the causal attention over the whole sequence.
        Every rank must call it (and run the backward) together: it communicates.
    """
    _require_group(group)
    reasons = sequence_parallel_reasons(mechanism)
    if reasons:
        raise UnsupportedOptionError("; ".join(reasons))
    mechanism.check_inputs(q, k, v, True, key_padding_mask)
    # On inputs checked above (v too), with linear_recurrence known: linear_terms would check q and k again.
    phi_q, phi_k, key_log_scale, log_decay, normalizer, chunk_size, denominator_eps = mechanism.attend_linear_terms(
        q, k, key_padding_mask)
    if key_log_scale is not None:
        # The single-process keys share the largest shift of the whole sequence; agree on it first. A part
        # whose keys are all padding has no shift of its own (its features are zero).
        shared = key_log_scale.detach().clone()
        if key_padding_mask is not None:
            empty = key_padding_mask.all(dim=1).view(-1, 1, 1, 1)
            shared = shared.masked_fill(empty, float("-inf"))
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
        shared = torch.where(torch.isfinite(shared), shared, key_log_scale.detach())
        phi_k = rescale_keys(phi_k, key_log_scale.detach(), shared)
    terms = part_terms(phi_q, phi_k, v, key_padding_mask, log_decay, chunk_size=chunk_size)
    state = terms.state
    batch, heads, m, d1 = state.shape
    packed = state.reshape(batch, heads, m * d1)
    if terms.log_decay_total is not None:
        packed = torch.cat([packed, terms.log_decay_total.unsqueeze(-1)], dim=-1)
    prefix = _PrefixAcrossRanks.apply(packed, m, d1, terms.log_decay_total is not None, group)
    return finish_part(terms, phi_q, prefix, normalizer=normalizer, denominator_eps=denominator_eps,
                       out_dtype=v.dtype)


def sequence_parallel_self_attention(
    attention: MultiHeadAttention,
    x: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """Causal self-attention of a :class:`~attnzoo.MultiHeadAttention` over a sequence split across ranks: x
    (batch, n_r, dim) is this rank's part; returns its (batch, n_r, dim) rows of ``attention(x_whole,
    causal=True)``. The projections are per position, so they run on each part as they are; gradients of the
    module's parameters on each rank are that part's share (summed across ranks, e.g. by
    ``DistributedDataParallel`` or an ``all_reduce``, they are the single-process gradients)."""
    if not isinstance(attention, MultiHeadAttention):
        raise TypeError(f"attention must be an attnzoo MultiHeadAttention, got {type(attention).__name__}")
    if attention.rotary is not None:
        raise UnsupportedOptionError(
            "rotary=True: sequence-parallel attention does not offset each part's rotary positions; apply rotary "
            "embeddings to the whole sequence's positions before splitting, or build the module without rotary"
        )
    attention._check_input("x", x, attention.dim)

    def split(t: Tensor) -> Tensor:
        return t.view(t.shape[0], t.shape[1], attention.heads, attention.head_dim).transpose(1, 2)

    q, k, v = (split(projection(x)) for projection in (attention.q_proj, attention.k_proj, attention.v_proj))
    out = sequence_parallel_attention(attention.mechanism, q, k, v, key_padding_mask, group=group)
    return attention._output(out, x)  # the output gate (if any) is per position too


def assert_replicated(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise naming every parameter and buffer of ``module`` that differs between the ranks of ``group`` (random
    projections drawn without a seed, say). Compares three float64 checksums per tensor: a cheap check, one
    ``all_reduce`` each of their maximum and minimum."""
    _require_group(group)
    names, sums = [], []
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        values = tensor.detach().double().flatten()
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device) / max(values.numel(), 1)
        names.append(name)
        sums.append(torch.stack([values.sum(), values.square().sum(), (values * weights).sum()]))
    if not sums:
        return
    local = torch.stack(sums)
    high, low = local.clone(), local.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    differ = [name for name, row_high, row_low in zip(names, high, low) if not torch.equal(row_high, row_low)]
    if differ:
        raise ValueError(
            f"these tensors differ between ranks: {', '.join(differ)} (build random features with a seed, or "
            f"broadcast the module's state from one rank)"
        )


__all__ = [
    "assert_replicated",
    "sequence_parallel_attention",
    "sequence_parallel_mechanisms",
    "sequence_parallel_reasons",
    "sequence_parallel_self_attention",
]

"""Reversible layer stacks (Kitaev et al. 2020, "Reformer"; Gomez et al. 2017, "RevNet"), for any mechanism.

A reversible stack keeps two streams of width ``dim``. The input x is duplicated, (x1, x2) = (x, x), and every
residual branch f of every layer (self-attention, cross-attention, feed-forward; each one
``dropout(f(norm(.)))`` as in a pre-norm layer) adds itself to one stream, reading the other:

    y1 = x1 + Attention(x2)        y2 = x2 + FeedForward(y1)

(and with cross-attention, three such couplings per layer, the streams alternating). The stack returns the
final norm of the average of the two streams, (y1 + y2) / 2, so it maps (batch, seq, dim) -> (batch, seq, dim)
like :class:`~attnzoo.models.Encoder` and :class:`~attnzoo.models.Decoder`, with the same layers and parameters.

Each coupling can be undone from its output: x2 = y2 - FeedForward(y1), x1 = y1 - Attention(x2). So the
training pass keeps no activation of any layer: a custom autograd function runs the stack without recording,
keeps only its two output streams, and its backward pass walks the layers from the last, rebuilding each
layer's input from its output and recomputing the branch with autograd on, one branch at a time. Activation
memory is then that of one branch, whatever the depth. Dropout sees the same randomness when recomputed: the
random number generator's state is saved before each branch and restored (in a fork, so the global stream is
left as it was) when the branch is recomputed. The feed-forward branch is position-wise, so with
``ff_chunks`` > 1 it is run, recomputed and differentiated slice by slice of the sequence.

A post-norm residual ``norm(x + f(x))`` cannot be undone, so reversible stacks need ``norm_first=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor, nn

from .._validation import check_bool
from .config import BlockConfig, check_reversible
from .layers import DecoderLayer, LayerState, _Sublayer
from .stacks import Decoder, DecoderState, Encoder

# A branch of a coupling: the stream it reads (batch, seq, dim) and the extra tensor inputs of the stack (the
# memory of cross-attention, or nothing) -> what it adds to the other stream (batch, seq, dim).
BranchFn = Callable[[Tensor, Sequence[Tensor]], Tensor]


@dataclass
class Coupling:
    """One additive coupling (a, b) -> (b, a + fn(b)) of a reversible stack.

    ``modules`` hold the parameters ``fn`` uses; ``chunks`` > 1 says that ``fn`` is position-wise and is to be
    run on that many slices of the sequence, one after the other (forward, recomputation and backward alike).
    """

    fn: BranchFn
    modules: Tuple[nn.Module, ...]
    chunks: int = 1

    def __call__(self, b: Tensor, context: Sequence[Tensor]) -> Tensor:
        if self.chunks == 1:
            return self.fn(b, context)
        return torch.cat([self.fn(part, context) for part in b.chunk(self.chunks, dim=1)], dim=1)


def _branch(sublayer: _Sublayer, fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The residual branch of a pre-norm sublayer, ``dropout(fn(norm(x)))``, without the residual."""
    return lambda x: sublayer.dropout(fn(sublayer.norm(x)))


def _feed_forward_coupling(layer: nn.Module) -> Coupling:
    block, feed_forward = layer.feed_forward_block, layer.feed_forward
    branch = _branch(block, feed_forward.transform)
    return Coupling(lambda b, context: branch(b), (block, feed_forward), layer.config.ff_chunks)


# -- the stack without storing activations -------------------------------------------------------------------
def _rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _run(couplings: Sequence[Coupling], x1: Tensor, x2: Tensor, context: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    a, b = x1, x2
    for coupling in couplings:
        a, b = b, a + coupling(b, context)
    return a, b


class _ReversibleFunction(torch.autograd.Function):
    """(x1, x2) -> the two output streams of ``couplings``, keeping only the outputs for the backward pass.

    Inputs after ``couplings``: the ``context`` tensors the branches read (count ``n_context``), then the
    parameters; the backward pass returns their gradients, so ``torch.autograd.grad`` and hooks see them as
    with any other operation.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, couplings: Sequence[Coupling], n_context: int, x1: Tensor, x2: Tensor, *tensors: Tensor
    ) -> Tuple[Tensor, Tensor]:
        context = tensors[:n_context]
        ctx.couplings, ctx.n_context = couplings, n_context
        # Parameters are found again by identity: they live on their modules, so nothing is saved for them.
        ctx.parameter_slot = {id(p): i for i, p in enumerate(tensors[n_context:], start=n_context)}
        ctx.n_tensors = len(tensors)
        # The recomputation runs under the forward's autocast, so that it computes in the same precisions.
        device_type = x2.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                        torch.is_autocast_cache_enabled())
        ctx.rng_states = []
        a, b = x1, x2
        for coupling in couplings:
            ctx.rng_states.append(_rng_state(b.device))
            a, b = b, a + coupling(b, context)
        ctx.save_for_backward(a, b, *context)
        return a, b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_a: Optional[Tensor], grad_b: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        c, d, *saved_context = ctx.saved_tensors
        context = [t.detach().requires_grad_(t.requires_grad) for t in saved_context]
        # Where each tensor a branch may differentiate by sits among the inputs after (x1, x2).
        slot = dict(ctx.parameter_slot)
        slot.update({id(t): i for i, t in enumerate(context) if t.requires_grad})
        grads: List[Optional[Tensor]] = [None] * ctx.n_tensors
        grad_c = torch.zeros_like(c) if grad_a is None else grad_a
        grad_d = torch.zeros_like(d) if grad_b is None else grad_b
        devices = [c.device] if c.device.type == "cuda" else []
        device_type, autocast_enabled, autocast_dtype, autocast_cache = ctx.autocast
        for coupling, (cpu_state, cuda_state) in zip(reversed(ctx.couplings), reversed(ctx.rng_states)):
            # This coupling made (c, d) = (b, a + f(b)) from (a, b): b = c and a = d - f(b); the gradients of
            # (a, b) are grad_d and grad_c + grad_d · df/db.
            wrt = [t for t in context if t.requires_grad]
            taken = {id(t) for t in wrt}
            for module in coupling.modules:
                for p in module.parameters():
                    if id(p) in slot and id(p) not in taken:
                        taken.add(id(p))
                        wrt.append(p)
            slices = c.chunk(coupling.chunks, dim=1)
            a_parts, grad_b_parts = [], []
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, c.device)
                start = 0
                for part in slices:
                    stop = start + part.shape[1]
                    b = part.detach().requires_grad_(True)
                    with torch.enable_grad(), torch.autocast(
                        device_type, dtype=autocast_dtype, enabled=autocast_enabled, cache_enabled=autocast_cache
                    ):
                        out = coupling.fn(b, context)
                    found = torch.autograd.grad(out, [b] + wrt, grad_d[:, start:stop], allow_unused=True)
                    a_parts.append(d[:, start:stop] - out.detach())
                    grad_b_parts.append(torch.zeros_like(b) if found[0] is None else found[0])
                    for tensor, grad in zip(wrt, found[1:]):
                        if grad is not None:
                            i = slot[id(tensor)]
                            grads[i] = grad if grads[i] is None else grads[i] + grad
                    start = stop
            a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)
            grad_db = grad_b_parts[0] if len(grad_b_parts) == 1 else torch.cat(grad_b_parts, dim=1)
            c, d = a, c
            grad_c, grad_d = grad_d, grad_c + grad_db
        return (None, None, grad_c, grad_d, *grads)


def reversible_streams(
    couplings: Sequence[Coupling],
    x: Tensor,
    context: Sequence[Tensor] = (),
    *,
    memory_saving: bool = True,
) -> Tensor:
    """Run ``couplings`` on the duplicated input (x, x), x (batch, seq, dim); returns the average of the two
    output streams (batch, seq, dim).

    With ``memory_saving`` and autograd recording, through :class:`_ReversibleFunction` (no activation kept);
    otherwise with ordinary autograd, which gives the same values and gradients and keeps every activation.
    """
    parameters = []
    seen = set()
    for coupling in couplings:
        for module in coupling.modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    parameters.append(p)
    recording = torch.is_grad_enabled() and (
        x.requires_grad or any(t.requires_grad for t in context) or bool(parameters)
    )
    if memory_saving and recording:
        y1, y2 = _ReversibleFunction.apply(couplings, len(context), x, x, *context, *parameters)
    else:
        y1, y2 = _run(couplings, x, x, context)
    return (y1 + y2) / 2


# -- stacks --------------------------------------------------------------------------------------------------
class ReversibleEncoder(Encoder):
    """A reversible stack of :class:`EncoderLayer` (see the module docstring), (batch, seq, dim) -> (batch, seq, dim).

    Built like :class:`Encoder` (same arguments, same layers and parameter names, ``from_config`` too), pre-norm
    only. Each layer adds ``dropout(self_attention(norm(x2)))`` to x1 and then ``dropout(feed_forward(norm(x1)))``
    to x2. Training keeps the activations of one branch at a time instead of all layers'.

    ``memory_saving`` (True): set it to False to run the same stack with ordinary autograd, which keeps every
    activation (for checking; the values and gradients are the same).
    """

    memory_saving: bool = True

    @classmethod
    def _check_config(cls, config: BlockConfig) -> None:
        check_reversible(config)

    def couplings(
        self, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> List[Coupling]:
        """The couplings of the stack's forward pass, two per layer."""
        result = []
        for layer in self.layers:
            attention = _branch(
                layer.attention_block,
                lambda h, layer=layer: layer.self_attention(h, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens),
            )
            result.append(Coupling(lambda b, context, f=attention: f(b), (layer.attention_block, layer.self_attention)))
            result.append(_feed_forward_coupling(layer))
        return result

    def forward(
        self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
    ) -> Tensor:
        """x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True = padding; cu_seqlens: the document
        offsets of a packed row (batch 1)."""
        couplings = self.couplings(key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        return self.norm(reversible_streams(couplings, x, memory_saving=self.memory_saving))


class ReversibleDecoder(Decoder):
    """A reversible stack of :class:`DecoderLayer`, (batch, seq, dim) -> (batch, seq, dim); causal.

    Built like :class:`Decoder` (same arguments, layers and parameter names), pre-norm only. Each layer adds its
    causal self-attention branch to one stream, then (with ``cross_attention``) its cross-attention branch to the
    other, then its feed-forward branch to the first: three couplings, the streams alternating. Gradients reach
    the memory as well as the parameters.

    Incremental decoding (:meth:`prefill`, :meth:`step`) runs the same couplings with ordinary tensors: the
    output at a position is a function of the positions up to it, so a step carries only each self-attention's
    decoding state, as :class:`Decoder` does (its :class:`DecoderState`).

    ``memory_saving``: as for :class:`ReversibleEncoder`.
    """

    memory_saving: bool = True

    @classmethod
    def _check_config(cls, config: BlockConfig) -> None:
        check_reversible(config)

    @staticmethod
    def _layer_couplings(
        layer: DecoderLayer,
        self_branch: Callable[[Tensor], Tensor],
        cross: Callable[[Tensor, Sequence[Tensor]], Tensor],
    ) -> List[Coupling]:
        """A layer's couplings: its self-attention branch, its cross-attention branch (``cross(h, context)`` on
        the normed stream) where it has one, its feed-forward branch."""
        result = [Coupling(lambda b, context: self_branch(b), (layer.attention_block, layer.self_attention))]
        if layer.cross_attention is not None:
            block = layer.cross_attention_block
            result.append(Coupling(lambda b, context: block.dropout(cross(block.norm(b), context)),
                                   (block, layer.cross_attention)))
        result.append(_feed_forward_coupling(layer))
        return result

    def couplings(
        self, *, padding_mask: Optional[Tensor] = None, memory_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> List[Coupling]:
        """The couplings of the stack's forward pass; the cross-attention ones read the memory as ``context[0]``."""
        result = []
        for layer in self.layers:
            self_branch = _branch(
                layer.attention_block,
                lambda h, layer=layer: layer.self_attention(h, causal=True, key_padding_mask=padding_mask,
                                                            cu_seqlens=cu_seqlens),
            )

            def cross(h: Tensor, context: Sequence[Tensor], layer: DecoderLayer = layer) -> Tensor:
                return layer.cross_attention(h, context[0], key_padding_mask=memory_padding_mask)

            result.extend(self._layer_couplings(layer, self_branch, cross))
        return result

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        memory_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """x: (batch, seq, dim); memory: (batch, seq_mem, memory_dim) or None without cross-attention;
        padding_mask (batch, seq), memory_padding_mask (batch, seq_mem): bool, True = padding; cu_seqlens: the
        document offsets of a packed row (batch 1)."""
        self.layers[0]._check_memory(memory)
        couplings = self.couplings(padding_mask=padding_mask, memory_padding_mask=memory_padding_mask,
                                   cu_seqlens=cu_seqlens)
        context = () if memory is None else (memory,)
        return self.norm(reversible_streams(couplings, x, context, memory_saving=self.memory_saving))

    # -- incremental decoding ------------------------------------------------------------------------------
    def _decode(
        self,
        x: Tensor,
        layer_states: List[LayerState],
        attend: Callable[[DecoderLayer, Tensor, LayerState], Tuple[Tensor, Any]],
        memory_padding_mask: Optional[Tensor],
    ) -> Tuple[Tensor, List[LayerState]]:
        """The couplings over x with each self-attention run by ``attend(layer, h, state) -> (out, new state)``;
        returns the stack's output and the new layer states (which carry the projected memory along)."""
        new_states: List[LayerState] = []
        couplings = []
        for layer, state in zip(self.layers, layer_states):
            def self_branch(b: Tensor, layer: DecoderLayer = layer, state: LayerState = state) -> Tensor:
                out, attention_state = attend(layer, layer.attention_block.norm(b), state)
                new_states.append(LayerState(attention_state, state.memory_k, state.memory_v))
                return layer.attention_block.dropout(out)

            def cross(
                h: Tensor, context: Sequence[Tensor], layer: DecoderLayer = layer, state: LayerState = state
            ) -> Tensor:
                return layer.cross_attention.attend_projected(
                    h, state.memory_k, state.memory_v, key_padding_mask=memory_padding_mask
                )

            couplings.extend(self._layer_couplings(layer, self_branch, cross))
        # The cross-attention branches read the memory's keys and values from the states, not from a context.
        y1, y2 = _run(couplings, x, x, ())
        return self.norm((y1 + y2) / 2), new_states

    def prefill(
        self, x: Tensor, memory: Optional[Tensor] = None, *, memory_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, DecoderState]:
        """Causal pass over a prefix x (batch, seq, dim), projecting the memory once for the later steps.

        Returns the output (batch, seq, dim) and the :class:`DecoderState` after the prefix.
        """
        empty = [LayerState(None, *layer.project_memory(memory)) for layer in self.layers]  # type: ignore[arg-type]
        out, states = self._decode(
            x, empty, lambda layer, h, state: layer.self_attention.prefill(h), memory_padding_mask
        )
        return out, DecoderState(states, x.shape[1], memory_padding_mask)

    def step(self, x_t: Tensor, state: DecoderState) -> Tuple[Tensor, DecoderState]:
        """One position: x_t (batch, 1, dim) -> (batch, 1, dim) and the new state."""
        if not isinstance(state, DecoderState):
            raise TypeError(f"state must be the DecoderState returned by prefill or step, got {type(state).__name__}")
        out, states = self._decode(
            x_t, state.layers, lambda layer, h, layer_state: layer.self_attention.step(h, layer_state.self_attention),
            state.memory_padding_mask,
        )
        return out, DecoderState(states, state.position + 1, state.memory_padding_mask)


# -- the choice of a model's stacks ------------------------------------------------------------------------
def encoder_class(reversible: bool) -> Type[Encoder]:
    """The encoder stack of a model built with this ``reversible`` option: :class:`ReversibleEncoder` or
    :class:`~attnzoo.models.Encoder`."""
    return ReversibleEncoder if check_bool("reversible", reversible) else Encoder


def decoder_class(reversible: bool) -> Type[Decoder]:
    """The decoder stack of a model built with this ``reversible`` option: :class:`ReversibleDecoder` or
    :class:`~attnzoo.models.Decoder`."""
    return ReversibleDecoder if check_bool("reversible", reversible) else Decoder


__all__ = ["Coupling", "ReversibleDecoder", "ReversibleEncoder", "decoder_class", "encoder_class", "reversible_streams"]

"""What a Transformer block is made of, checked once.

:class:`BlockConfig` holds the options that every encoder and decoder layer shares (width, heads, feed-forward,
norm placement, dropout, rotary positions) and one :class:`AttentionSpec` per attention slot. The layers take a
config; the stacks and models keep their keyword arguments and turn them into one config, so each option is
checked here, by the shared helpers of :mod:`attnzoo._validation`, whichever constructor it was given to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .._validation import check_bool, check_choice, check_number, check_positive_int, check_probability
from ..mechanisms import available

ACTIVATIONS = ("relu", "gelu", "swiglu")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention slot: a mechanism name (see :func:`attnzoo.available`) and that mechanism's options.

    ``options`` (None: none) are passed to the mechanism when a layer is built; the mechanism checks their
    names and values. The name and the kind of ``options`` are checked by the :class:`BlockConfig` holding
    the spec, so that an error names the slot (``self_attention``, ``cross_attention_options``, ...).
    """

    mechanism: str = "softmax"
    options: Optional[Mapping[str, Any]] = None


def attention_slot(
    slot: str, mechanism: Optional[str], options: Optional[Mapping[str, Any]]
) -> Optional[AttentionSpec]:
    """The spec of an optional slot from a constructor's ``<slot>`` and ``<slot>_options`` arguments.

    ``mechanism=None`` means the layer has no such slot; options for it are then a mistake, not ignored.
    """
    if mechanism is None:
        if options:
            raise ValueError(f"{slot}_options given but {slot}=None: the layers have no {slot} to pass them to")
        return None
    return AttentionSpec(mechanism, options)


def _check_attention(slot: str, spec: object) -> None:
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"{slot} must be an AttentionSpec, got {spec!r} ({type(spec).__name__})")
    check_choice(slot, spec.mechanism, available())
    options = spec.options
    if options is not None and not (isinstance(options, Mapping) and all(isinstance(key, str) for key in options)):
        raise TypeError(
            f"{slot}_options must be a dict of mechanism options (names to values) or None, "
            f"got {type(options).__name__}"
        )


@dataclass(frozen=True)
class BlockConfig:
    """The options shared by every layer of an encoder or decoder stack.

    Args:
        dim: model width; layers map (batch, seq, dim) -> (batch, seq, dim).
        heads: attention heads; ``dim`` must be divisible by it (head width ``dim // heads``).
        ff_dim: hidden width of the feed-forward network, ``4 * dim`` when None (see :attr:`feed_forward_dim`).
        activation: of the feed-forward network, "relu", "gelu" or "swiglu".
        norm_first: pre-norm (``x + f(norm(x))``, True) or post-norm (``norm(x + f(x))``, False).
        dropout: on each residual branch and inside the feed-forward network, a probability in [0, 1).
        layer_norm_eps: epsilon of the layer norms, a finite number > 0.
        rotary: rotary position embedding on the self-attention queries and keys.
        self_attention: mechanism and options of the self-attention.
        cross_attention: mechanism and options of the cross-attention to an encoder memory (decoder layers);
            None for layers without one (encoder layers, decoder-only models).
        memory_dim: width of that memory (batch, seq_mem, memory_dim), ``dim`` when None; only with
            ``cross_attention``.
        ff_chunks: run the feed-forward network on this many slices of the sequence, one after the other
            (Kitaev et al. 2020), so its hidden activation is (batch, seq / ff_chunks, ff_dim) at a time instead
            of (batch, seq, ff_dim); the outputs are those of one pass. 1: one pass over the whole sequence.
            In training, the slices of a plain stack keep their activations for the backward pass; reversible
            stacks (``reversible=True``) also recompute and differentiate slice by slice.

    Every option is checked when the config is made: a yes/no option must be a bool (``norm_first="False"`` is
    a TypeError, not a truthy yes), numbers are checked for type, finiteness and range, and each error names
    the option.
    """

    dim: int
    heads: int
    ff_dim: Optional[int] = None
    activation: str = "gelu"
    norm_first: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    rotary: bool = False
    self_attention: AttentionSpec = field(default_factory=AttentionSpec)
    cross_attention: Optional[AttentionSpec] = None
    memory_dim: Optional[int] = None
    ff_chunks: int = 1

    def __post_init__(self) -> None:
        check_positive_int("dim", self.dim)
        check_positive_int("heads", self.heads)
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        check_number("ff_dim", self.ff_dim, integer=True, minimum=1, optional=True)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_bool("norm_first", self.norm_first)
        check_probability("dropout", self.dropout)
        check_number("layer_norm_eps", self.layer_norm_eps, minimum=0.0, exclusive_minimum=True)
        check_bool("rotary", self.rotary)
        _check_attention("self_attention", self.self_attention)
        if self.cross_attention is not None:
            _check_attention("cross_attention", self.cross_attention)
        check_number("memory_dim", self.memory_dim, integer=True, minimum=1, optional=True)
        if self.memory_dim is not None and self.cross_attention is None:
            raise ValueError("memory_dim given but cross_attention=None (no memory to attend to)")
        check_positive_int("ff_chunks", self.ff_chunks)

    @property
    def feed_forward_dim(self) -> int:
        """The feed-forward hidden width: ``ff_dim``, or ``4 * dim`` when it is None.

        Worked out on each read rather than stored, so that ``dataclasses.replace(config, dim=...)`` follows
        the new width."""
        return 4 * self.dim if self.ff_dim is None else self.ff_dim

"""What a Transformer block and a token model are made of, checked once.

:class:`BlockConfig` holds the options that every encoder and decoder layer shares (width, heads, feed-forward,
norm placement, dropout, rotary positions) and one :class:`AttentionSpec` per attention slot. The layers take a
config; the stacks and models keep their keyword arguments and turn them into one config, so each option is
checked here, by the shared helpers of :mod:`attnzoo._validation`, whichever constructor it was given to.
:class:`ModelConfig` holds the options of a token model (:class:`~attnzoo.models.LanguageModel`,
:class:`~attnzoo.models.SequenceClassifier`, :class:`~attnzoo.models.SequenceTagger`): its vocabulary,
depth, positions and embedding, and the options of its layers, from which it makes their :class:`BlockConfig`.

``block`` chooses what a layer is: attention + feed-forward (``"attention"``, the default), or one gated
attention unit (Hua et al. 2022) in their place, with quadratic attention (``"gau"``) or FLASH's mixed chunk
attention (``"flash_gau"``); see :mod:`attnzoo.models.gau` and :func:`gated_unit_options`; or a Mamba-2 block
(``"mamba2"``, :mod:`attnzoo.models.mamba2`, options checked by :func:`attnzoo.models.mamba2_options.mamba2_options`);
or attention + feed-forward whose attention is multi-head latent attention (``"mla"``,
:mod:`attnzoo.models.latent_attention`, options checked by :func:`~attnzoo.models.latent_attention.latent_block_options`).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from .._validation import check_bool, check_choice, check_number, check_positive_int, check_probability
from ..mechanisms import NO_GROUPED_KV, UnsupportedOptionError, available, capabilities
from .latent_attention import latent_block_options
from .mamba2_options import mamba2_options
from .schedule import LAYER_OPTION, LayerSpec, format_item, repeat_to_depth, schedule_of
from .settings import boolean, check_rules, check_values, number, positive_int, probability, setting

ACTIVATIONS = ("relu", "gelu", "swiglu")
POSITIONAL_KINDS = ("sinusoidal", "learned", "rotary", "none")
BLOCKS = ("attention", "gau", "flash_gau", "mamba2", "mla")
"""What a layer is: attention + feed-forward, one gated attention unit with quadratic ("gau") or mixed chunk
("flash_gau", FLASH) attention, one Mamba-2 block ("mamba2"), or attention + feed-forward whose attention is
multi-head latent attention ("mla", DeepSeek-V2's, :class:`~attnzoo.models.latent_attention.MultiHeadLatentAttention`)."""
LATENT_BLOCK = "mla"
"""The block whose layers are attention + feed-forward, the attention MLA instead of a mechanism."""
GATED_UNIT_BLOCKS = ("gau", "flash_gau")

RENAMED_BLOCKS = {"flash": "flash_gau"}
"""Old block names and their new ones: "flash" read as Dao et al.'s FlashAttention, which FLASH is not."""

GATED_UNIT_OPTIONS = {"shared_dim": None, "expansion_dim": None, "scores": "relu2", "chunk_size": 256}
"""The options of a gated attention unit (``block_options``) with their defaults; ``chunk_size`` is FLASH's."""


def check_block(block: object, choices: Sequence[str] = BLOCKS) -> str:
    """``block`` if it is one of ``choices``; an old name is refused with its new one, anything else with the
    valid names."""
    if isinstance(block, str) and block in RENAMED_BLOCKS:
        new = RENAMED_BLOCKS[block]
        raise ValueError(f"block {block!r} was renamed {new!r} (FLASH's mixed chunk attention, Hua et al. 2022, "
                         f"not FlashAttention): pass block={new!r}")
    return check_choice("block", block, tuple(choices))


def gated_unit_options(block: str, dim: int, rotary: bool, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The checked options of a gated attention unit of width ``dim``, defaults filled in.

    Args:
        block: "gau" or "flash_gau".
        options: any of

            * ``shared_dim``: s, the width of the shared projection Z the query and key forms are made from;
              ``min(128, dim)`` by default (the paper's 128), at most ``dim``.
            * ``expansion_dim``: e, the width of the gate U and the values V; ``2 * dim`` by default.
            * ``scores``: "relu2" (squared ReLU, the paper's) or "softmax".
            * ``chunk_size``: FLASH's chunk length c (256 by default); ``block="flash_gau"`` only.

    Returns:
        All four options, ``shared_dim`` and ``expansion_dim`` resolved (``chunk_size`` None for "gau").
    """
    check_block(block, GATED_UNIT_BLOCKS)
    given = dict(options or {})
    unknown = sorted(set(given) - set(GATED_UNIT_OPTIONS))
    if unknown:
        raise TypeError(
            f"block_options: unknown option(s) {', '.join(unknown)} for block={block!r}; valid options: "
            f"{', '.join(GATED_UNIT_OPTIONS)}"
        )
    if block == "gau" and "chunk_size" in given:
        raise ValueError("block_options: chunk_size is an option of block='flash_gau' (mixed chunk attention); "
                         "block='gau' attends over the whole sequence")
    resolved = {**GATED_UNIT_OPTIONS, **given}
    shared = check_number("shared_dim", resolved["shared_dim"], integer=True, minimum=1, optional=True)
    shared = min(128, dim) if shared is None else shared
    if shared > dim:
        raise ValueError(f"shared_dim={shared} is larger than the model dimension dim={dim}: the shared "
                         f"projection Z is meant to be small (s=128 in the paper)")
    if rotary and shared % 2:
        raise ValueError(f"shared_dim={shared} must be even with rotary positions (they rotate pairs of dimensions)")
    expansion = check_number("expansion_dim", resolved["expansion_dim"], integer=True, minimum=1, optional=True)
    resolved["shared_dim"] = shared
    resolved["expansion_dim"] = 2 * dim if expansion is None else expansion
    check_choice("scores", resolved["scores"], ("relu2", "softmax"))
    if block == "flash_gau":
        check_positive_int("chunk_size", resolved["chunk_size"])
    else:
        resolved["chunk_size"] = None
    return resolved


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
        kv_heads: key/value heads of the self-attention, dividing ``heads`` (grouped-query attention; 1 is
            multi-query attention); ``heads`` when None. A mechanism declaring ``grouped_kv="none"`` refuses
            fewer, naming kv_heads; so does a gated block (single-head).
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
        block: "attention" (attention + feed-forward), or one gated attention unit in their place: "gau"
            (quadratic attention) or "flash_gau" (mixed chunk attention). A gated unit is single-head and has its
            own attention and gating, so ``self_attention`` (other than the default), ``self_attention_options``,
            ``cross_attention``, ``ff_dim``, ``activation`` (other than the default) and ``ff_chunks`` are refused
            with it, naming the option; ``heads`` only has to divide ``dim``. ``rotary`` rotates its query and
            key forms. "mamba2": one Mamba-2 block (:mod:`attnzoo.models.mamba2`) in their place, ``heads`` SSM
            heads; the same options are refused with it, and ``rotary`` too (an SSM has no queries and keys).
            "mla": attention + feed-forward whose self-attention is multi-head latent attention
            (:class:`~attnzoo.models.latent_attention.MultiHeadLatentAttention`, ``heads`` heads) instead of a
            mechanism: the feed-forward options apply; ``self_attention`` (other than the default), its options,
            ``cross_attention`` and ``kv_heads`` are refused (its heads share one latent); its decoupled rotary
            part rotates whatever ``rotary`` says (``rope_dim=0`` leaves it out).
        block_options: the gated unit's options (see :func:`gated_unit_options`), the Mamba-2 block's (see
            :func:`attnzoo.models.mamba2_options.mamba2_options`) or the MLA block's (see
            :func:`attnzoo.models.latent_attention.latent_block_options`); only with such a block.
        output_gate: gated attention on the self-attention (``MultiHeadAttention(output_gate=True)``: a sigmoid
            gate from the layer input on each head's output, Qiu et al. 2025); attention and MLA layers only.

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
    block: str = "attention"
    block_options: Optional[Mapping[str, Any]] = None
    kv_heads: Optional[int] = None
    output_gate: bool = False

    def __post_init__(self) -> None:
        check_positive_int("dim", self.dim)
        check_positive_int("heads", self.heads)
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        check_number("kv_heads", self.kv_heads, integer=True, minimum=1, optional=True)
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (grouped-query attention)")
        check_number("ff_dim", self.ff_dim, integer=True, minimum=1, optional=True)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_bool("norm_first", self.norm_first)
        check_probability("dropout", self.dropout)
        check_number("layer_norm_eps", self.layer_norm_eps, minimum=0.0, exclusive_minimum=True)
        check_bool("rotary", self.rotary)
        check_bool("output_gate", self.output_gate)
        _check_attention("self_attention", self.self_attention)
        if self.cross_attention is not None:
            _check_attention("cross_attention", self.cross_attention)
        check_number("memory_dim", self.memory_dim, integer=True, minimum=1, optional=True)
        if self.memory_dim is not None and self.cross_attention is None:
            raise ValueError("memory_dim given but cross_attention=None (no memory to attend to)")
        check_positive_int("ff_chunks", self.ff_chunks)
        check_block(self.block)
        options = self.block_options
        if options is not None and not (isinstance(options, Mapping) and all(isinstance(key, str) for key in options)):
            raise TypeError(f"block_options must be a dict of options (names to values) or None, got "
                            f"{type(options).__name__}")
        grouped = self.kv_heads is not None and self.kv_heads != self.heads
        if grouped and self.block != "attention":
            unit = {"mamba2": "a Mamba-2 block shares B and C by block_options['groups']",
                    LATENT_BLOCK: "an MLA block's heads share one latent, which is all its cache holds"}.get(
                        self.block, "a gated attention unit is single-head")
            raise ValueError(f"kv_heads={self.kv_heads} cannot be used with block={self.block!r}: {unit}; leave "
                             f"kv_heads at None")
        if self.output_gate and self.block not in ("attention", LATENT_BLOCK):
            raise ValueError(f"output_gate=True cannot be used with block={self.block!r}: it gates an attention "
                             f"layer's heads, and this block has its own gating")
        if self.block == "attention":
            if grouped and capabilities(self.self_attention.mechanism).grouped_kv == NO_GROUPED_KV:
                raise UnsupportedOptionError(
                    f"kv_heads={self.kv_heads}: self_attention={self.self_attention.mechanism!r} does not support "
                    f"grouped-query attention (capability grouped_kv='none'); leave kv_heads at None"
                )
            if options:
                raise ValueError("block_options given but block='attention': they are options of a gated attention "
                                 "unit (block='gau' or block='flash_gau'), a Mamba-2 block (block='mamba2') or an "
                                 "MLA block (block='mla')")
            return
        if self.block == LATENT_BLOCK:
            self._check_latent_block()
            return
        self._check_gated_unit()

    def _check_latent_block(self) -> None:
        """Refuse, naming them, the options an MLA layer has no use for; check its own options."""
        why = "block='mla' is attention + feed-forward whose attention is multi-head latent attention"
        if self.self_attention.mechanism != "softmax" or self.self_attention.options:
            option = "self_attention_options" if self.self_attention.mechanism == "softmax" else \
                f"self_attention={self.self_attention.mechanism!r}"
            raise ValueError(f"{option} cannot be used: {why}, exact softmax over its own projections; give its "
                             f"options as block_options")
        if self.cross_attention is not None:
            raise ValueError(f"cross_attention cannot be used: {why}, self-attention only; pass cross_attention=None")
        latent_block_options(self.dim, self.heads, self.block_options)

    def _check_gated_unit(self) -> None:
        """Refuse, naming them, the options a gated attention unit has no use for; check its own options."""
        why = (f"block={self.block!r} replaces attention + feed-forward by one gated attention unit with its own "
               f"single-head attention and gate")
        if self.block == "mamba2":
            why = "block='mamba2' replaces attention + feed-forward by one Mamba-2 block (an SSM, no attention)"
        if self.self_attention.mechanism != "softmax":
            raise ValueError(f"self_attention={self.self_attention.mechanism!r} cannot be used: {why}; leave "
                             f"self_attention at its default")
        if self.self_attention.options:
            raise ValueError(f"self_attention_options cannot be used: {why}; give its options as block_options")
        if self.cross_attention is not None:
            raise ValueError(f"cross_attention cannot be used: {why} and no cross-attention; pass "
                             f"cross_attention=None")
        for option, value, default in (("ff_dim", self.ff_dim, None), ("activation", self.activation, "gelu"),
                                       ("ff_chunks", self.ff_chunks, 1)):
            if value != default:
                width = "expansion" if self.block == "mamba2" else "expansion_dim"
                hint = f" (its expansion width is block_options['{width}'])" if option == "ff_dim" else ""
                raise ValueError(f"{option}={value!r} cannot be used: {why}, no feed-forward network{hint}")
        if self.block != "mamba2":
            gated_unit_options(self.block, self.dim, self.rotary, self.block_options)
            return
        if self.rotary:
            raise ValueError(f"rotary=True (positional='rotary') cannot be used: {why}, no queries and keys to rotate; "
                             f"use positional='none' or 'sinusoidal'")
        mamba2_options(self.dim, self.heads, self.block_options)

    @property
    def feed_forward_dim(self) -> int:
        """The feed-forward hidden width: ``ff_dim``, or ``4 * dim`` when it is None.

        Worked out on each read rather than stored, so that ``dataclasses.replace(config, dim=...)`` follows
        the new width."""
        return 4 * self.dim if self.ff_dim is None else self.ff_dim


def check_reversible(config: BlockConfig) -> None:
    """Refuse, naming the option, a config whose layers a reversible stack cannot couple."""
    if config.block != "attention":
        raise ValueError(
            f"reversible=True needs block='attention': its couplings pair each layer's attention and feed-forward "
            f"branches, and a block={config.block!r} unit is one branch"
        )
    if not config.norm_first:
        raise ValueError(
            "reversible=True needs norm_first=True: a post-norm residual norm(x + f(x)) cannot be undone from its "
            "output, which the reversible backward pass relies on"
        )


# -- per-layer schedules (attnzoo.models.schedule) ---------------------------------------------------------------
def _scheduled_layer(base: BlockConfig, spec: LayerSpec, has_attention: bool) -> BlockConfig:
    """The config of one layer of a schedule: ``base`` with the item's mechanism, or its block.

    In a stack that also has attention layers, a block layer leaves out what only attention layers use
    (kv_heads, the feed-forward options, and rotary positions for a Mamba-2 block); a stack of blocks alone
    refuses them, as ``block=`` does. An MLA layer is attention + feed-forward: it keeps the feed-forward
    options and, like an attention item, takes ``output_gate`` as the layer's own option."""
    if spec.is_attention:
        # The one option of the layer rather than of the mechanism: an item may gate its attention or not.
        output_gate = (spec.options or {}).get(LAYER_OPTION, base.output_gate)
        return replace(base, self_attention=AttentionSpec(spec.mechanism, spec.mechanism_options or None),
                       block="attention", block_options=None, output_gate=output_gate)
    if base.cross_attention is not None:
        raise ValueError(f"block {spec.block!r} has no cross-attention, and every layer of this stack attends to a "
                         f"memory: give mechanisms only")
    if spec.block == LATENT_BLOCK:
        output_gate = (spec.options or {}).get(LAYER_OPTION, base.output_gate)
        return replace(base, self_attention=AttentionSpec(), block=spec.block,
                       block_options=spec.mechanism_options or None, output_gate=output_gate,
                       kv_heads=None if has_attention else base.kv_heads)
    shared: Dict[str, Any] = {}
    if has_attention:
        shared = dict(ff_dim=None, activation="gelu", ff_chunks=1, kv_heads=None, output_gate=False,
                      rotary=base.rotary and spec.block != "mamba2")
    return replace(base, self_attention=AttentionSpec(), block=spec.block, block_options=spec.options, **shared)


def layer_spec(config: BlockConfig) -> LayerSpec:
    """The schedule item a layer's config is: its mechanism and options, or its block and block options."""
    if config.block in ("attention", LATENT_BLOCK):
        options = dict((config.self_attention.options if config.block == "attention" else config.block_options) or {})
        if config.output_gate:
            options[LAYER_OPTION] = True
        if config.block == LATENT_BLOCK:
            return LayerSpec(options=options or None, block=config.block)
        return LayerSpec(config.self_attention.mechanism, options or None)
    return LayerSpec(options=config.block_options, block=config.block)


def scheduled_configs(
    base: BlockConfig, specs: Sequence[LayerSpec], depth: int, name: str = "layers"
) -> Tuple[BlockConfig, ...]:
    """One checked :class:`BlockConfig` per layer of a ``depth``-layer stack from the schedule ``specs`` (its
    length dividing ``depth``): ``base`` with each item's mechanism and options, or its block and block options.
    Errors name the schedule and the item."""
    pattern = repeat_to_depth(specs, depth, name)[: len(specs)]
    has_attention = any(spec.is_attention for spec in pattern)
    made: Dict[str, BlockConfig] = {}
    for spec in pattern:
        if repr(spec) in made:  # an item repeated: one config (options of any type told apart by their repr)
            continue
        try:
            made[repr(spec)] = _scheduled_layer(base, spec, has_attention)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{name} item {format_item(spec)!r}: {error}") from None
    return tuple(made[repr(pattern[index % len(pattern)])] for index in range(depth))


def _schedule_replaces_the_layer_fields(config: "ModelConfig") -> None:
    """With ``layers``, the fields that say what every layer is stay at their defaults."""
    if config.layers is None:
        return
    for option in ("self_attention", "self_attention_options", "block", "block_options"):
        value = getattr(config, option)
        if value != _DEFAULTS[option]:
            raise ValueError(f"layers gives each layer's mechanism or block, so {option}={value!r} cannot be used "
                             f"with it: put it in the schedule's items (e.g. 'local(window=64),softmax')")


# -- the rules between a token model's fields, each declared by the field it concerns (``agrees``) -------------
def _token_shift_needs_two_features(config: "ModelConfig") -> None:
    if config.token_shift and config.dim < 2:
        raise ValueError(f"token_shift needs dim >= 2 (half the features are shifted), got dim={config.dim}")


def _learned_positions_need_max_length(config: "ModelConfig") -> None:
    if config.positional == "learned" and config.max_length is None:
        raise ValueError("positional='learned' needs max_length (the longest sequence), got None")


def _reversible_layers_couple(config: "ModelConfig") -> None:
    if config.reversible:
        for layer in config.layer_configs or (config.block_config,):
            check_reversible(layer)


_LAYERS = "; checked by the layers' BlockConfig"  # the help of a field passed to the layers as it is


@dataclass(frozen=True)
class ModelConfig:
    """The options of a token model: :class:`~attnzoo.models.LanguageModel`,
    :class:`~attnzoo.models.SequenceClassifier` and :class:`~attnzoo.models.SequenceTagger` (each has
    ``from_config(config, ...)``; their keyword constructors make one of these).

    Each field is declared once, by :func:`~attnzoo.models.settings.setting`: its default, its meaning
    (``help``), the check of its value and the rule it has with other fields (``agrees``). Making the config
    checks each field alone, then makes :attr:`block_config`, the checked :class:`BlockConfig` of the model's
    layers (``rotary`` when ``positional="rotary"``), which checks the options passed to the layers and their
    rules, then checks the rules between fields; each error names the option.
    """

    vocab_size: int = setting(check=positive_int, help="the vocabulary: token ids are in [0, vocab_size)")
    dim: int = setting(128, check=positive_int, help="the model width")
    heads: int = setting(4, help="attention heads per layer, dividing dim" + _LAYERS)
    depth: int = setting(2, check=positive_int, help="layers (gated units with a gated block)")
    ff_dim: Optional[int] = setting(None, help="the feed-forward hidden width; None: 4 * dim" + _LAYERS)
    activation: str = setting("gelu", help="of the feed-forward network: relu, gelu or swiglu" + _LAYERS)
    norm_first: bool = setting(True, help="pre-norm (True) or post-norm (False) residuals" + _LAYERS)
    dropout: float = setting(0.0, check=probability,
                             help="dropout on each residual branch and in the feed-forward network, in [0, 1)")
    positional: str = setting(
        "sinusoidal", choices=POSITIONAL_KINDS, agrees=_learned_positions_need_max_length,
        help="sinusoidal, learned (needs max_length), rotary (rotates queries and keys in every self-attention) "
             "or none")
    max_length: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True),
        help="the longest sequence, required by positional='learned'; None: no limit")
    self_attention: str = setting("softmax", help="the mechanism of every self-attention" + _LAYERS)
    self_attention_options: Optional[Mapping[str, Any]] = setting(
        None, help="the options of that mechanism; None: none" + _LAYERS)
    layer_norm_eps: float = setting(1e-5, help="epsilon of the layer norms, a finite number > 0" + _LAYERS)
    ff_chunks: int = setting(1, help="run the feed-forward network on this many slices of the sequence" + _LAYERS)
    reversible: bool = setting(
        False, check=boolean, agrees=_reversible_layers_couple,
        help="reversible stacks (attnzoo.models.reversible): pre-norm attention layers only")
    block: str = setting(
        "attention", help="what a layer is: attention + feed-forward, or a gated attention unit (gau, flash_gau) "
                          "or a Mamba-2 block (mamba2) in their place; depth then counts them" + _LAYERS)
    block_options: Optional[Mapping[str, Any]] = setting(
        None, help="the options of a gated unit or Mamba-2 block (gated_unit_options, mamba2_options)" + _LAYERS)
    token_shift: bool = setting(
        False, check=boolean, agrees=_token_shift_needs_two_features,
        help="half of each position's embedding features come from the token before it (TokenEmbedding); "
             "needs dim >= 2")
    kv_heads: Optional[int] = setting(
        None, help="key/value heads of every self-attention, dividing heads (grouped-query attention); None: "
                   "heads" + _LAYERS)
    output_gate: bool = setting(
        False, check=boolean,
        help="gated attention: a sigmoid gate from the layer input on each head's output, before the output "
             "projection (Qiu et al. 2025, as in Qwen3-Next), on every attention layer; a schedule's item may set "
             "its own (softmax(output_gate=true))" + _LAYERS)
    layers: Optional[Tuple[LayerSpec, ...]] = setting(
        None,
        help="a per-layer schedule (attnzoo.models.schedule): a pattern of items repeated to depth (its length "
             "dividing depth), each a mechanism with its options or a block kind with the block's, as LayerSpec "
             "items or text ('gated_delta*3,softmax', 'local(window=64),block:mamba2'); None: every layer is "
             "self_attention or block. kv_heads and the feed-forward options apply to its attention layers")
    block_config: BlockConfig = field(init=False, repr=False, compare=False)
    layer_configs: Optional[Tuple[BlockConfig, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The schedule as a tuple of checked items, read from its text (a frozen dataclass sets it so).
        object.__setattr__(self, "layers", schedule_of(self.layers, BLOCKS))
        check_values(self)
        _schedule_replaces_the_layer_fields(self)
        layers = BlockConfig(
            self.dim, self.heads, ff_dim=self.ff_dim, activation=self.activation, norm_first=self.norm_first,
            dropout=self.dropout, layer_norm_eps=self.layer_norm_eps, rotary=self.positional == "rotary",
            self_attention=AttentionSpec(self.self_attention, self.self_attention_options),
            ff_chunks=self.ff_chunks, block=self.block, block_options=self.block_options, kv_heads=self.kv_heads,
            output_gate=self.output_gate,
        )
        # A field worked out from the others (a frozen dataclass sets it through object.__setattr__).
        object.__setattr__(self, "block_config", layers)
        scheduled = None if self.layers is None else scheduled_configs(layers, self.layers, self.depth)
        object.__setattr__(self, "layer_configs", scheduled)
        check_rules(self)

    @property
    def layer_kinds(self) -> Tuple[str, ...]:
        """Each layer's block (``"attention"``, ``"mamba2"``, ...), first layer first."""
        return tuple(layer.block for layer in self.layer_configs or (self.block_config,) * self.depth)


_DEFAULTS = {item.name: item.default for item in dataclass_fields(ModelConfig) if item.init}


def check_model_config(config: object) -> ModelConfig:
    """``config`` if it is a :class:`ModelConfig` (what ``from_config`` of a token model takes)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, e.g. ModelConfig(vocab_size=256), got "
                        f"{type(config).__name__}")
    return config


# -- the token models' constructors ----------------------------------------------------------------------------
BY_POSITION = ("vocab_size", "dim", "heads", "depth")
"""The ModelConfig fields a token model's constructor also takes by position (every other one by name)."""


def takes_model_config(init: Callable[..., None]) -> Any:
    """Make a token model's ``__init__(self, config, <its own arguments>)`` take a :class:`ModelConfig`, or that
    config's fields as arguments: ``Model(config, ...)`` or ``Model(vocab_size, ..., dim=64, kv_heads=1)``.

    The fields are not listed again in the model: the signature (what ``help`` and ``inspect`` show, and what
    a call is bound against) is made from the config's fields and defaults and the model's own arguments:
    ``(vocab_size, <own positional>, dim, heads, depth, *, <every other field>, <own keyword-only>)``. An
    unknown, missing or repeated argument is Python's own TypeError; a ModelConfig given with fields beside it
    is refused, naming them.
    """
    parameter = inspect.Parameter
    own = list(inspect.signature(init).parameters.values())[2:]  # after self and config
    own_positional = [item for item in own if item.kind is parameter.POSITIONAL_OR_KEYWORD]
    own_keywords = [item for item in own if item.kind is parameter.KEYWORD_ONLY]
    defaults = {item.name: item.default for item in dataclass_fields(ModelConfig) if item.init}

    def made(name: str, kind: Any) -> inspect.Parameter:
        default = defaults[name]
        return parameter(name, kind, default=parameter.empty if default is MISSING else default)

    positional = parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [parameter("self", positional), made("vocab_size", positional), *own_positional]
        + [made(name, positional) for name in BY_POSITION[1:]]
        + [made(name, parameter.KEYWORD_ONLY) for name in defaults if name not in BY_POSITION]
        + own_keywords)
    own_names = [item.name for item in own]

    def constructor(self: Any, *arguments: Any, **keywords: Any) -> None:
        try:
            given = signature.bind(self, *arguments, **keywords).arguments
        except TypeError as error:  # an unknown, missing or repeated argument, said as Python says it
            raise TypeError(f"{type(self).__name__}(): {error}") from None
        given.pop("self")
        own_given = {name: given.pop(name) for name in own_names if name in given}
        config = given.pop("vocab_size")
        if not isinstance(config, ModelConfig):
            config = ModelConfig(config, **given)
        elif given:
            raise TypeError(f"{type(self).__name__}: give a ModelConfig or its fields, not both (got "
                            f"{', '.join(given)} beside the config)")
        init(self, config, **own_given)

    constructor.__signature__ = signature  # type: ignore[attr-defined]
    constructor.__doc__, constructor.__qualname__ = init.__doc__, init.__qualname__
    return constructor

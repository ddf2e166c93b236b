"""Drop-in swapping: replace every ``torch.nn.MultiheadAttention`` inside a model by attnzoo's
:class:`~attnzoo.MultiHeadAttention` of a chosen mechanism, keeping its weights and its call semantics.

``swap_attention(model, "performer", nb_features=64)`` walks the model, checks everything first (every module it
would replace, every option, every slot whose role the mechanism cannot fill), and only then replaces each
``nn.MultiheadAttention`` by a :class:`~attnzoo.dropin.swapped.SwappedAttention`: a module with
``nn.MultiheadAttention``'s call signature (``query, key, value, key_padding_mask, need_weights, attn_mask,
average_attn_weights, is_causal``) around an attnzoo ``MultiHeadAttention`` (its ``attention`` attribute) holding
the same query, key, value and output weights and biases. A failed check raises before anything changes, so a
model is either swapped entirely or left exactly as it was.

Masks are translated per call (:func:`~attnzoo.dropin.masks.translate_masks`): padding masks and the causal
mask become attnzoo's ``key_padding_mask`` and ``causal=True`` for every mechanism. Any other mask needs an
exact mechanism (``Capabilities.kind == "exact"``), which adds it to the logits as torch does, and so does
``need_weights=True`` (torch's default) to return the weights. The other mechanisms form neither logits nor
weights: they refuse such a mask, and refuse ``need_weights=True`` unless the swap was made with
``attention_weights="none"``, which returns None in place of the weights (for models that call
``attn(x, x, x)[0]`` and drop them).

A slot known to be cross-attention (``nn.TransformerDecoderLayer.multihead_attn``, or a module with
``kdim``/``vdim`` other than ``embed_dim``) is refused at swap time for a mechanism without it; any other slot's
role is read from each call.

PyTorch's encoder fast path (``nn.TransformerEncoderLayer`` in eval mode calling
``torch._transformer_encoder_layer_fwd`` with the packed projection weights, and ``nn.TransformerEncoder``
turning padded batches into nested tensors) bypasses the attention module's forward. A swapped module has no
packed projection (its ``in_proj_weight`` and ``in_proj_bias`` are None, which makes the layer take its
ordinary path), and the swap sets ``use_nested_tensor = False`` on every ``nn.TransformerEncoder`` it touches;
the report lists both.

Differences from ``nn.MultiheadAttention`` that the report states: its ``dropout`` drops attention weights,
which only exact attention forms; a swapped module applies it to the attention output instead (attnzoo's
``MultiHeadAttention(dropout=...)``; identical in eval mode). Parameters of the mechanism itself (gates,
temperatures) are new and initialised as the mechanism initialises them. New parameter objects replace the old
ones: build the optimiser after swapping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_choice
from ..attention import MultiHeadAttention
from ..mechanisms.base import UnsupportedOptionError, shapes_only
from ..mechanisms.registry import available, capabilities, mechanism_class
from .masks import TranslatedMasks, translate_masks
from .swapped import CROSS, EITHER, SELF, WEIGHTS_CHOICES, SwappedAttention


# -- the report ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SwappedModule:
    """One replaced module: where it was, what it does, and what the swap changed beyond the mechanism."""

    path: str
    role: str
    embed_dim: int
    num_heads: int
    batch_first: bool
    notes: Tuple[str, ...] = ()


@dataclass(frozen=True)
class SwapReport:
    """What :func:`swap_attention` did.

    Attributes:
        mechanism: the mechanism every replaced module now runs; options: its options.
        replaced: every replaced module (a module shared by several parents appears once per path).
        fast_path_disabled: (path, what) for every PyTorch fast path the swap switched off.
    """

    mechanism: str
    options: Dict[str, Any]
    replaced: Tuple[SwappedModule, ...]
    fast_path_disabled: Tuple[Tuple[str, str], ...]

    @property
    def paths(self) -> List[str]:
        return [module.path for module in self.replaced]

    def __str__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        lines = [f"swapped {len(self.replaced)} attention module(s) to {self.mechanism!r}"
                 + (f" ({options})" if options else "") + ":"]
        for module in self.replaced:
            lines.append(f"  {module.path}: {module.role}, embed_dim={module.embed_dim}, num_heads={module.num_heads}, "
                         f"batch_first={module.batch_first}")
            lines += [f"    note: {note}" for note in module.notes]
        for path, what in self.fast_path_disabled:
            lines.append(f"  fast path off at {path}: {what}")
        return "\n".join(lines)


# -- the swap ------------------------------------------------------------------------------------------------
_SOURCES = (nn.MultiheadAttention, SwappedAttention)


@dataclass
class _Slot:
    parent: nn.Module
    name: str
    path: str
    module: nn.Module


def _slots(model: nn.Module) -> List[_Slot]:
    """Every (parent, attribute) holding an attention module, shared modules once per parent."""
    slots = []
    for parent_path, parent in model.named_modules(remove_duplicate=True):
        if isinstance(parent, _SOURCES):
            continue  # nothing inside an attention module is swapped on its own
        for name, child in parent._modules.items():
            if isinstance(child, _SOURCES):
                slots.append(_Slot(parent, name, f"{parent_path}.{name}" if parent_path else name, child))
    return slots


def _role(slot: _Slot) -> str:
    module = slot.module
    if isinstance(module, SwappedAttention):
        return module.role
    if isinstance(slot.parent, nn.TransformerDecoderLayer) and slot.name == "multihead_attn":
        return CROSS
    if isinstance(slot.parent, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and slot.name == "self_attn":
        return SELF
    if module.kdim != module.embed_dim:  # keys of another width cannot come from the queries
        return CROSS
    return EITHER


def _torch_weights(module: nn.MultiheadAttention) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
    """(q, k, v, out) weights and biases of a torch module."""
    if module._qkv_same_embed_dim:
        weights = list(module.in_proj_weight.chunk(3))
    else:
        weights = [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
    biases: List[Optional[Tensor]] = [None, None, None]
    if module.in_proj_bias is not None:
        biases = list(module.in_proj_bias.chunk(3))
    return weights + [module.out_proj.weight], biases + [module.out_proj.bias]


def _zero_attention_hint() -> str:
    """What comes closest to ``add_zero_attn``: a mechanism declaring a ``quiet_option`` (one added to the
    softmax denominator, which is attention to one extra zero key and value)."""
    quiet = [(name, caps.quiet_option) for name in available() for caps in [capabilities(name)] if caps.quiet_option]
    if not quiet:
        return ""
    name, option = quiet[0]
    return f"; mechanism={name!r} with {option}=True is the closest (a zero key, without its batch of zeros)"


def _refusals(module: nn.Module, path: str) -> List[str]:
    """What of a torch module attnzoo's MultiHeadAttention cannot take over, each naming the option."""
    if isinstance(module, SwappedAttention):
        return []
    reasons = []
    if module.bias_k is not None:
        reasons.append(f"{path}: add_bias_kv=True (learned extra key and value) has no counterpart in attnzoo")
    if module.add_zero_attn:
        reasons.append(f"{path}: add_zero_attn=True (an extra zero key and value) has no counterpart in attnzoo"
                       + _zero_attention_hint())
    if module.kdim != module.vdim:
        reasons.append(f"{path}: kdim={module.kdim} differs from vdim={module.vdim}; attnzoo's MultiHeadAttention "
                       f"takes keys and values of one width (context_dim)")
    if module.embed_dim % module.num_heads:
        reasons.append(f"{path}: embed_dim={module.embed_dim} is not divisible by num_heads={module.num_heads}")
    has_in_bias = module.in_proj_bias is not None
    has_out_bias = module.out_proj.bias is not None
    if has_in_bias != has_out_bias:
        reasons.append(f"{path}: biases on the {'input' if has_in_bias else 'output'} projections only; attnzoo's "
                       f"bias option covers all four")
    return reasons


def _build(
    slot: _Slot, mechanism: str, options: Dict[str, Any], attention_weights: str
) -> Tuple[SwappedAttention, SwappedModule]:
    """The replacement of one module, with its weights copied; raises (the model untouched) if it cannot be
    made."""
    old = slot.module
    role = _role(slot)
    notes: List[str] = []
    if isinstance(old, SwappedAttention):
        source = old.attention
        weights = [source.q_proj.weight, source.k_proj.weight, source.v_proj.weight, source.out_proj.weight]
        biases = [source.q_proj.bias, source.k_proj.bias, source.v_proj.bias, source.out_proj.bias]
        dim, heads, head_dim, context_dim = source.dim, source.heads, source.head_dim, source.context_dim
        dropout, batch_first = source.dropout.p, old.batch_first
    else:
        weights, biases = _torch_weights(old)
        dim, heads, context_dim = old.embed_dim, old.num_heads, old.kdim
        head_dim = dim // heads
        dropout, batch_first = float(old.dropout), old.batch_first
        if dropout > 0:
            notes.append(f"dropout={dropout:g} now drops attention outputs, not attention weights (identical in eval)")
    attention = MultiHeadAttention(
        dim, heads, mechanism, head_dim=head_dim, context_dim=context_dim, bias=biases[0] is not None,
        dropout=dropout, **options,
    )
    new_parameters = [name for name, _ in attention.mechanism.named_parameters()]
    if new_parameters:
        notes.append(f"the mechanism's own parameters are newly initialised: {', '.join(new_parameters)}")
    if role in (CROSS,) and not attention.mechanism.capabilities.cross:
        raise UnsupportedOptionError(
            f"{slot.path} is cross-attention and "
            + "; ".join(attention.mechanism.unsupported_reasons(*shapes_only(1, heads, 1, 2, head_dim), cross=True))
        )
    reference = weights[0]
    attention = attention.to(device=reference.device, dtype=reference.dtype)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj)
    with torch.no_grad():
        for projection, weight, bias in zip(projections, weights, biases):
            projection.weight.copy_(weight)
            projection.weight.requires_grad_(weight.requires_grad)
            if bias is not None:
                projection.bias.copy_(bias)
                projection.bias.requires_grad_(bias.requires_grad)
    swapped = SwappedAttention(attention, batch_first=batch_first, role=role, attention_weights=attention_weights)
    swapped.train(old.training)
    return swapped, SwappedModule(slot.path, role, dim, heads, batch_first, tuple(notes))


def _chosen_slots(model: nn.Module, select: Optional[Callable[[str], bool]]) -> List[_Slot]:
    """The slots to swap: every one, or those ``select`` returns True for; raises if there are none."""
    slots = _slots(model)
    if select is not None:
        chosen = []
        for slot in slots:
            keep = select(slot.path)
            if not isinstance(keep, bool):
                raise TypeError(f"select must return True or False, got {keep!r} for {slot.path!r}")
            if keep:
                chosen.append(slot)
        slots = chosen
    if not slots:
        found = "none selected" if select is not None and _slots(model) else "none found"
        raise ValueError(f"no torch.nn.MultiheadAttention to swap in {type(model).__name__} ({found})")
    return slots


def _fast_paths(
    model: nn.Module, slots: List[_Slot]
) -> Tuple[List[Tuple[str, str]], List[nn.TransformerEncoder]]:
    """(path, what) of every PyTorch fast path swapping ``slots`` switches off, and the encoders whose nested
    tensors must be switched off for it (their ``use_nested_tensor``)."""
    fast_paths: List[Tuple[str, str]] = []
    nested: List[nn.TransformerEncoder] = []
    swapped_parents = {id(slot.parent) for slot in slots}
    for path, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer) and id(module) in swapped_parents:
            fast_paths.append((path or "<model>", "nn.TransformerEncoderLayer's fused kernel "
                               "(torch._transformer_encoder_layer_fwd reads the packed projection weights; the "
                               "swapped module has none, so the layer runs its ordinary forward)"))
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            if any(id(layer) in swapped_parents for layer in module.layers):
                nested.append(module)
                fast_paths.append((path or "<model>", "nn.TransformerEncoder's nested-tensor path for padded "
                                   "batches (use_nested_tensor set to False)"))
    return fast_paths, nested


def swap_attention(
    model: nn.Module,
    mechanism: str,
    *,
    select: Optional[Callable[[str], bool]] = None,
    attention_weights: str = "error",
    **options: Any,
) -> SwapReport:
    """Replace every ``torch.nn.MultiheadAttention`` inside ``model`` (in place) by attnzoo's attention with
    ``mechanism``, keeping the weights, biases, ``batch_first`` and the mask semantics (module docstring).

    Args:
        model: any ``nn.Module``: ``nn.TransformerEncoder``, ``nn.TransformerDecoder``, ``nn.Transformer``, a
            model of your own. Modules swapped before (:class:`SwappedAttention`) are swapped again, keeping their
            projections, so one model can try several mechanisms.
        mechanism: a name from :func:`attnzoo.available`.
        select: called with each module's path (e.g. ``"layers.0.self_attn"``); only modules for which it returns
            True are swapped. All of them by default.
        attention_weights: ``"error"`` (default): ``need_weights=True`` raises for mechanisms that form no
            weight matrix; ``"none"``: returns None in place of the weights.
        **options: the mechanism's options (:func:`attnzoo.mechanism_options`); an unknown one raises a TypeError
            listing the valid ones.

    Returns:
        A :class:`SwapReport` of every replaced module and every PyTorch fast path switched off.

    Raises (with the model exactly as it was): ValueError if there is nothing to swap (or ``model`` is itself an
    attention module) or a module has a feature attnzoo cannot take over (``add_bias_kv``, ``add_zero_attn``,
    ``kdim != vdim``); TypeError / ValueError for an unknown mechanism or a bad option;
    :class:`~attnzoo.UnsupportedOptionError` for a cross-attention slot and a mechanism without cross-attention.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, _SOURCES):
        raise ValueError(
            "model is itself an attention module and cannot be replaced in place: swap it inside its parent, or build "
            "attnzoo.MultiHeadAttention directly"
        )
    mechanism_class(mechanism)  # an unknown name fails here, listing the valid ones
    check_choice("attention_weights", attention_weights, WEIGHTS_CHOICES)
    if select is not None and not callable(select):
        raise TypeError(f"select must be a callable taking a module path, or None, got {type(select).__name__}")
    slots = _chosen_slots(model, select)
    reasons = [reason for slot in slots for reason in _refusals(slot.module, slot.path)]
    if reasons:
        raise ValueError("cannot swap: " + "; ".join(reasons))

    # Everything is built (and so validated) before anything is replaced.
    built: Dict[int, Tuple[SwappedAttention, SwappedModule]] = {}
    summaries = []
    for slot in slots:
        if id(slot.module) not in built:
            built[id(slot.module)] = _build(slot, mechanism, options, attention_weights)
        # A module shared by several parents stays shared, and is reported at each of its paths.
        summaries.append(replace(built[id(slot.module)][1], path=slot.path))

    fast_paths, nested = _fast_paths(model, slots)
    for slot in slots:
        setattr(slot.parent, slot.name, built[id(slot.module)][0])
    for encoder in nested:
        encoder.use_nested_tensor = False
    return SwapReport(mechanism, dict(options), tuple(summaries), tuple(fast_paths))


# SwappedAttention, TranslatedMasks and translate_masks live beside this module and are exported here too: the
# names users of this module have always imported from it.
__all__ = ["SwapReport", "SwappedAttention", "SwappedModule", "TranslatedMasks", "swap_attention", "translate_masks"]

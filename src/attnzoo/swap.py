"""Drop-in swapping: replace every ``torch.nn.MultiheadAttention`` inside a model by attnzoo's
:class:`~attnzoo.MultiHeadAttention` of a chosen mechanism, keeping its weights and its call semantics.

``swap_attention(model, "performer", nb_features=64)`` walks the model, checks everything first (every module it
would replace, every option, every slot whose role the mechanism cannot fill), and only then replaces each
``nn.MultiheadAttention`` by a :class:`SwappedAttention`: a module with ``nn.MultiheadAttention``'s call
signature (``query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal``)
around an attnzoo ``MultiHeadAttention`` (its ``attention`` attribute) holding the same query, key, value and
output weights and biases. A failed check raises before anything changes, so a model is either swapped
entirely or left exactly as it was.

Masks, translated per call (:func:`translate_masks`):

* ``key_padding_mask``: bool (True = padding), or float as ``nn.TransformerEncoder`` passes it (0 kept, -inf
  padding), becomes attnzoo's bool ``key_padding_mask``. A float mask with other values (a soft bias on keys)
  is an arbitrary mask (below).
* ``attn_mask``: the square causal mask (bool ``True`` above the diagonal, or float ``-inf`` above it and 0
  elsewhere, as ``nn.Transformer.generate_square_subsequent_mask`` makes it), or ``is_causal=True``, becomes
  ``causal=True`` for every mechanism that has a causal form. A mask that masks nothing is dropped. Any other
  mask is arbitrary.
* An arbitrary mask is honoured by ``softmax`` (exact attention adds it to the logits, as torch does) and
  refused by every other mechanism with an :class:`~attnzoo.UnsupportedOptionError` naming ``attn_mask`` (or
  ``key_padding_mask``): their maths has no logits matrix to add it to.

``need_weights=True`` (torch's default) returns the attention weights with ``softmax``; other mechanisms form no
weight matrix, so it is refused unless the swap was made with ``attention_weights="none"``, which returns None
in its place (for models that call ``attn(x, x, x)[0]`` and drop the weights).

Self- or cross-attention is read from the call, as torch's own modules call attention: ``attn(x, x, x)`` (the
same tensor three times) is self-attention, anything else cross-attention (keys and values from ``key`` and
``value``), which needs a mechanism with cross-attention. A slot known to be cross-attention
(``nn.TransformerDecoderLayer.multihead_attn``, or a module with ``kdim``/``vdim`` other than ``embed_dim``) is
refused at swap time for a mechanism without it.

PyTorch's encoder fast path (``nn.TransformerEncoderLayer`` in eval mode calling
``torch._transformer_encoder_layer_fwd`` with the packed projection weights, and ``nn.TransformerEncoder``
turning padded batches into nested tensors) bypasses the attention module's forward. A swapped module has no
packed projection (its ``in_proj_weight`` and ``in_proj_bias`` are None, which makes the layer take its
ordinary path), and the swap sets ``use_nested_tensor = False`` on every ``nn.TransformerEncoder`` it touches;
the report lists both.

Differences from ``nn.MultiheadAttention`` that the report states: its ``dropout`` drops attention weights,
which only softmax forms; a swapped module applies it to the attention output instead (attnzoo's
``MultiHeadAttention(dropout=...)``; identical in eval mode). Parameters of the mechanism itself (gates,
temperatures) are new and initialised as the mechanism initialises them. New parameter objects replace the old
ones: build the optimiser after swapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validation import check_bool, check_choice
from .attention import MultiHeadAttention
from .functional.masks import zero_padded
from .mechanisms.base import UnsupportedOptionError, mechanism_class, shapes_only
from .mechanisms.softmax import SoftmaxAttention

SELF = "self-attention"
CROSS = "cross-attention"
EITHER = "self- or cross-attention, read from each call"
ROLES = (SELF, CROSS, EITHER)

WEIGHTS_CHOICES = ("error", "none")
"""``attention_weights``: what ``need_weights=True`` does with a mechanism that forms no weight matrix."""


# -- masks ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TranslatedMasks:
    """torch's masks in attnzoo's terms.

    Attributes:
        causal: the square causal mask (or the ``is_causal`` hint): attnzoo's ``causal=True``.
        key_padding_mask: (batch, seq_kv) bool, True marks padding, or None.
        additive: what is left, as a float bias added to the logits, broadcastable to
            (batch, heads, seq_q, seq_kv) (-inf where masked), or None. Only exact softmax can honour it.
        arbitrary: the names of the arguments that contributed to ``additive`` (for error messages).
    """

    causal: bool
    key_padding_mask: Optional[Tensor]
    additive: Optional[Tensor]
    arbitrary: Tuple[str, ...]


def _causal_reference(length: int, mask: Tensor) -> Tensor:
    """The square causal mask in ``mask``'s convention: bool True above the diagonal, float -inf there."""
    above = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        return above
    return torch.zeros(length, length, dtype=mask.dtype, device=mask.device).masked_fill_(above, -math.inf)


def _as_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A torch mask as an additive float bias: bool True -> -inf, float as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -math.inf)
    return mask.to(dtype)


def translate_masks(
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
) -> TranslatedMasks:
    """Translate ``nn.MultiheadAttention``'s masks (batched form) into attnzoo's.

    Args:
        attn_mask: None, (q_len, k_len) or (batch * heads, q_len, k_len); bool (True = masked) or float
            (added to the logits).
        key_padding_mask: None or (batch, k_len); bool (True = padding) or float (added to the logits).
        is_causal: torch's hint that ``attn_mask`` is the causal mask; trusted, as torch trusts it, when the
            lengths are equal.
        dtype: the dtype an arbitrary mask's bias takes (the inputs').

    Reading the masks' values (is this the causal mask, are these only 0 and -inf) synchronises with the
    device; it is what lets every mechanism take the masks ``nn.TransformerEncoder`` makes.
    """
    check_bool("is_causal", is_causal)
    for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if mask is not None and not isinstance(mask, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"{name} must be a bool or floating tensor, got {mask.dtype}")
    arbitrary: List[str] = []
    additive: Optional[Tensor] = None

    padding: Optional[Tensor] = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, k_len):
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_kv) = ({batch}, {k_len}), got "
                f"{tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype == torch.bool:
            padding = key_padding_mask
        elif bool(((key_padding_mask == 0) | (key_padding_mask == -math.inf)).all()):
            padding = key_padding_mask == -math.inf  # the bool mask nn.TransformerEncoder turned into floats
        else:
            additive = key_padding_mask.to(dtype).view(batch, 1, 1, k_len)
            arbitrary.append("key_padding_mask")

    causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            expected = (q_len, k_len)
        elif attn_mask.dim() == 3:
            expected = (batch * heads, q_len, k_len)
        else:
            expected = None
        if expected is None or attn_mask.shape != expected:
            raise ValueError(
                f"attn_mask must have shape (seq_q, seq_kv) = ({q_len}, {k_len}) or (batch * heads, seq_q, seq_kv) "
                f"= ({batch * heads}, {q_len}, {k_len}), got {tuple(attn_mask.shape)}"
            )
        masks_nothing = not bool(attn_mask.any()) if attn_mask.dtype == torch.bool else not bool((attn_mask != 0).any())
        square = q_len == k_len
        if square and (is_causal or bool((attn_mask == _causal_reference(q_len, attn_mask)).all())):
            causal = True
        elif not masks_nothing:
            bias = _as_bias(attn_mask, dtype)
            bias = bias.view(1, 1, q_len, k_len) if bias.dim() == 2 else bias.view(batch, heads, q_len, k_len)
            additive = bias if additive is None else additive + bias
            arbitrary.append("attn_mask")
    elif is_causal:
        if q_len != k_len:
            # torch aligns a causal mask of unequal lengths top-left, attnzoo bottom-right: no silent guess.
            raise ValueError(
                f"is_causal=True without attn_mask needs queries and keys of one length, got {q_len} and {k_len}; "
                f"pass the mask itself"
            )
        causal = True
    return TranslatedMasks(causal, padding, additive, tuple(arbitrary))


# -- the swapped module --------------------------------------------------------------------------------------
class SwappedAttention(nn.Module):
    """``nn.MultiheadAttention``'s interface around an attnzoo :class:`~attnzoo.MultiHeadAttention`.

    Made by :func:`swap_attention`; ``attention`` holds the projections (copied from the module it replaced) and
    the mechanism. Called as ``nn.MultiheadAttention`` is: ``(query, key, value, key_padding_mask=None,
    need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)`` with inputs (batch, seq,
    embed_dim) when ``batch_first`` (else (seq, batch, embed_dim), or unbatched (seq, embed_dim)); returns
    ``(output, weights or None)`` shaped as torch returns them. The module docstring lists how masks and
    ``need_weights`` are translated.
    """

    # No packed input projection exists here: these None values are what torch's encoder layer reads to decide
    # against its fast path (torch._transformer_encoder_layer_fwd reads the packed weights and would bypass
    # this module's forward).
    in_proj_weight: Optional[Tensor] = None
    in_proj_bias: Optional[Tensor] = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        attention: MultiHeadAttention,
        *,
        batch_first: bool,
        role: str = EITHER,
        attention_weights: str = "error",
    ) -> None:
        super().__init__()
        if not isinstance(attention, MultiHeadAttention):
            raise TypeError(f"attention must be an attnzoo MultiHeadAttention, got {type(attention).__name__}")
        self.attention = attention
        self.batch_first = check_bool("batch_first", batch_first)
        self.role = check_choice("role", role, ROLES)
        self.attention_weights = check_choice("attention_weights", attention_weights, WEIGHTS_CHOICES)
        self.embed_dim = attention.dim
        self.num_heads = attention.heads
        self.kdim = self.vdim = attention.context_dim
        self.head_dim = attention.head_dim

    @property
    def mechanism_name(self) -> str:
        return self.attention.mechanism_name

    def _exact_softmax(self) -> Optional[SoftmaxAttention]:
        """The mechanism if it is plain exact softmax (which can take any mask and give weights), else None."""
        mechanism = self.attention.mechanism
        if isinstance(mechanism, SoftmaxAttention) and not mechanism.quiet:
            return mechanism
        return None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """As ``nn.MultiheadAttention.forward``. Output: (batch, seq_q, embed_dim) when ``batch_first`` (else
        (seq_q, batch, embed_dim); unbatched (seq_q, embed_dim)), and the weights (batch, seq_q, seq_kv), or
        (batch, heads, seq_q, seq_kv) with ``average_attn_weights=False``, or None."""
        check_bool("need_weights", need_weights)
        check_bool("average_attn_weights", average_attn_weights)
        check_bool("is_causal", is_causal)
        # The call says which attention it is, as torch's layers make it: attn(x, x, x) is self-attention.
        self_attention = key is query and value is query
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        batched = query.dim() == 3
        if not batched and query.dim() != 2:
            raise ValueError(f"query must have 3 dims (batched) or 2 (unbatched), got shape {tuple(query.shape)}")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must all be batched or all unbatched, got shapes {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        if batched:
            if not self.batch_first:
                query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        else:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0).flatten(0, 1)  # (heads, L, S) of the one batch entry
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must share (batch, seq), got {tuple(key.shape)} and {tuple(value.shape)}")
        if key.shape[0] != query.shape[0]:
            raise ValueError(f"key batch {key.shape[0]} does not match query batch {query.shape[0]}")
        batch, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
        masks = translate_masks(
            attn_mask, key_padding_mask, is_causal, batch=batch, heads=self.num_heads, q_len=q_len, k_len=k_len,
            dtype=query.dtype,
        )
        softmax = self._exact_softmax()
        # Exact softmax forms the weights whenever asked; the others refuse, or give None if swapped to.
        weights_wanted = need_weights and softmax is not None
        if softmax is None:
            if masks.additive is not None:
                raise UnsupportedOptionError(
                    f"{self.mechanism_name} cannot honour an arbitrary {' or '.join(masks.arbitrary)}: it maps only "
                    f"the causal mask (or is_causal=True) and a padding key_padding_mask (bool, or float 0 / -inf); "
                    f"mechanism='softmax' takes any mask"
                )
            if need_weights and self.attention_weights == "error":
                raise UnsupportedOptionError(
                    f"need_weights=True: {self.mechanism_name} forms no attention weight matrix; call with "
                    f"need_weights=False, or swap with attention_weights='none' to return None in its place"
                )

        attention = self.attention
        if softmax is None or (masks.additive is None and not weights_wanted):
            if self_attention:
                out = attention(query, causal=masks.causal, key_padding_mask=masks.key_padding_mask)
            elif key is value:
                out = attention(query, key, causal=masks.causal, key_padding_mask=masks.key_padding_mask)
            else:
                out = self._cross_attention(query, key, value, masks)
            weights = None
        else:
            out, weights = self._softmax_with_bias(query, key, value, masks, softmax, weights_wanted)
            if weights is not None and average_attn_weights:
                weights = weights.mean(dim=1)
        if batched and not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Per-head q (batch, heads, seq_q, head_dim), k and v (batch, heads, seq_kv, head_dim)."""
        attention = self.attention
        attention._check_input("query", query, attention.dim)
        for name, x in (("key", key), ("value", value)):
            attention._check_input(name, x, attention.context_dim)

        def split(x: Tensor) -> Tensor:
            return x.view(x.shape[0], x.shape[1], attention.heads, attention.head_dim).transpose(1, 2)

        return split(attention.q_proj(query)), split(attention.k_proj(key)), split(attention.v_proj(value))

    def _output(self, out: Tensor) -> Tensor:
        """(batch, heads, seq_q, head_dim) -> (batch, seq_q, embed_dim) through dropout and the output projection."""
        merged = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.attention.out_proj(self.attention.dropout(merged))

    def _cross_attention(self, query: Tensor, key: Tensor, value: Tensor, masks: TranslatedMasks) -> Tensor:
        """Keys and values from two different tensors (attnzoo's ``context`` is one): projected here."""
        self.attention._require_cross(query.shape[1], key.shape[1])
        q, k, v = self._project(query, key, value)
        out = self.attention.mechanism(q, k, v, masks.causal, masks.key_padding_mask, cross=True)
        return self._output(out)

    def _softmax_with_bias(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        masks: TranslatedMasks,
        softmax: SoftmaxAttention,
        need_weights: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Exact attention under every mask at once as one additive bias, as torch computes it (a row whose
        keys are all masked is NaN there, as in torch); the weights (batch, heads, seq_q, seq_kv) too when
        asked for."""
        if not (key is query and value is query):
            self.attention._require_cross(query.shape[1], key.shape[1])
        q, k, v = self._project(query, key, value)
        k_len = k.shape[2]
        bias = torch.zeros(1, 1, q.shape[2], k_len, dtype=q.dtype, device=q.device)
        if masks.causal:
            bias = bias.masked_fill(~torch.ones(q.shape[2], k_len, dtype=torch.bool, device=q.device).tril(), -math.inf)
        if masks.key_padding_mask is not None:
            # Zeroed as well as masked, so that whatever a padded position holds reaches no output.
            k, v = zero_padded(k, masks.key_padding_mask), zero_padded(v, masks.key_padding_mask)
            bias = bias.masked_fill(masks.key_padding_mask[:, None, None, :], -math.inf)
        if masks.additive is not None:
            bias = bias + masks.additive
        if not need_weights:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=softmax.scale)
            return self._output(out), None
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax.scale is None else softmax.scale
        weights = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
        return self._output(weights @ v), weights

    def extra_repr(self) -> str:
        return f"batch_first={self.batch_first}, role={self.role!r}, attention_weights={self.attention_weights!r}"


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


def _refusals(module: nn.Module, path: str) -> List[str]:
    """What of a torch module attnzoo's MultiHeadAttention cannot take over, each naming the option."""
    if isinstance(module, SwappedAttention):
        return []
    reasons = []
    if module.bias_k is not None:
        reasons.append(f"{path}: add_bias_kv=True (learned extra key and value) has no counterpart in attnzoo")
    if module.add_zero_attn:
        reasons.append(f"{path}: add_zero_attn=True (an extra zero key and value) has no counterpart in attnzoo; "
                       f"mechanism='softmax' with quiet=True is the closest (a zero key, without its batch of zeros)")
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
    for slot in slots:
        setattr(slot.parent, slot.name, built[id(slot.module)][0])
    for encoder in nested:
        encoder.use_nested_tensor = False
    return SwapReport(mechanism, dict(options), tuple(summaries), tuple(fast_paths))


__all__ = ["SwapReport", "SwappedAttention", "SwappedModule", "TranslatedMasks", "swap_attention", "translate_masks"]

"""attnzoo inside Hugging Face ``transformers`` models, through the library's own attention-function registry.

``use_attnzoo(model, "performer", nb_features=64)`` gives every self-attention module of a BERT-style encoder, a
GPT-2 or a Llama-style decoder its own attnzoo mechanism (a submodule named ``attnzoo_mechanism``, so its
parameters train, save and move with the model), registers one attention function and one mask function under
the name ``"attnzoo"`` in ``transformers``' ``AttentionInterface`` and ``AttentionMaskInterface``, and switches the
model to it with ``model.set_attn_implementation("attnzoo")``. The models' own projections, rotary embeddings
and KV cache run as before; the mechanism replaces what happens between them:

* the mask function hands the attention function the 2-D padding mask (True = token) instead of a 4-D bias,
  and the attention function turns it into attnzoo's ``key_padding_mask``; causality comes from the attention
  module (``is_causal``: GPT-2 and Llama yes, a BERT encoder no), aligned bottom-right as the cache needs;
* grouped-query attention (fewer key/value heads, Llama) repeats the key/value heads for the mechanism;
* an exact mechanism (``Capabilities.kind == "exact"``, ``softmax``) with a ``scale`` option takes the module's
  own ``scaling``, so a model on ``softmax`` gives the outputs it gave before;
* ``generate()`` keeps working: each step's queries attend to the keys and values in ``transformers``' KV cache
  (cross-attention in attnzoo's terms, causal and bottom-right aligned). Mechanisms without cross-attention but
  with a causal kernelized recurrence (a ``KernelizedMechanism``, such as ``retention`` and ``gla``) run the step
  as the last rows of a causal pass over the cached keys (zero queries before them, whose rows are dropped):
  exact, O(context) per step. attnzoo's own constant-size recurrent state does not fit ``transformers``' cache of
  keys and values and is not used here.

Dropout: ``transformers`` passes attention-probability dropout in training; attnzoo applies it to the attention
output (only exact attention forms probabilities), as :mod:`attnzoo.dropin.swap` does.

``transformers`` is an optional extra: ``pip install "attnzoo[hf]"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mechanisms.base import Mechanism, UnsupportedOptionError, build_mechanism, mechanism_class, mechanism_options
from ..mechanisms.kernelized import KernelizedMechanism

IMPLEMENTATION = "attnzoo"
"""The name under which the attention and mask functions are registered in ``transformers``."""

MECHANISM_ATTRIBUTE = "attnzoo_mechanism"


def _transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError('attnzoo.dropin.hf needs transformers: pip install "attnzoo[hf]"') from error
    return transformers


def _supported_classes() -> Dict[type, str]:
    """The attention modules (self-attention) attnzoo can serve, by architecture."""
    from transformers.models.bert.modeling_bert import BertSelfAttention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    return {BertSelfAttention: "bert", GPT2Attention: "gpt2", LlamaAttention: "llama"}


def _heads(module: nn.Module, kind: str) -> Tuple[int, int]:
    if kind == "bert":
        return module.num_attention_heads, module.attention_head_size
    if kind == "gpt2":
        return module.num_heads, module.head_dim
    return module.config.num_attention_heads, module.head_dim


# -- the functions registered in transformers -------------------------------------------------------------
def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> Tuple[Tensor, None]:
    """``transformers``' attention-function signature: query (batch, heads, seq_q, head_dim), key and value
    (batch, kv_heads, seq_kv, head_dim) (the cache included), ``attention_mask`` (batch, seq_kv) bool from
    :func:`padding_mask` (True = token) or None. Returns ((batch, seq_q, heads, head_dim), None): no weights."""
    mechanism = getattr(module, MECHANISM_ATTRIBUTE, None)
    if not isinstance(mechanism, Mechanism):
        raise RuntimeError(
            f"{type(module).__name__} has no attnzoo mechanism: call attnzoo.dropin.hf.use_attnzoo(model, mechanism) "
            f"on the model rather than setting attn_implementation={IMPLEMENTATION!r} by hand"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q_len, k_len = query.shape[2], key.shape[2]
    padding = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise UnsupportedOptionError(
                f"attention_mask of shape {tuple(attention_mask.shape)}: attnzoo takes the 2-D padding mask "
                f"(batch, seq); a custom 4-D mask is an arbitrary bias on the logits, which it does not take here"
            )
        padding = ~attention_mask[:, -k_len:].to(torch.bool)
    causal = bool(getattr(module, "is_causal", False))
    if q_len == k_len:
        out = mechanism(query, key, value, causal=causal, key_padding_mask=padding)
    elif mechanism.capabilities.cross:
        # Decoding from the KV cache: the new positions are the last ones, causal bottom-right alignment.
        out = mechanism(query, key, value, causal=causal, key_padding_mask=padding, cross=True)
    elif causal and isinstance(mechanism, KernelizedMechanism) and q_len < k_len:
        # Row i of a causal kernelized attention reads only query i and the keys up to it: the new rows are the
        # last rows of a causal pass in which the earlier (uncached) queries are zeros.
        queries = torch.cat([query.new_zeros(*query.shape[:2], k_len - q_len, query.shape[3]), query], dim=2)
        out = mechanism(queries, key, value, causal=True, key_padding_mask=padding)[:, :, k_len - q_len :]
    else:
        raise UnsupportedOptionError(
            f"{mechanism.name}: {q_len} queries over {k_len} cached keys needs cross-attention or a causal "
            f"kernelized recurrence; generate with use_cache=False, or pick such a mechanism"
        )
    if dropout > 0.0 and module.training:
        out = F.dropout(out, p=dropout)
    return out.transpose(1, 2).contiguous(), None


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Optional[Tensor] = None,
    **kwargs: Any,
) -> Optional[Tensor]:
    """``transformers``' mask-function signature: the 2-D padding mask (batch, kv_length), True = token, or None
    when nothing is padded. Causality is the attention module's (``is_causal``), applied by the mechanism."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(mask.all()) else mask


def register() -> None:
    """Register :func:`attention_forward` and :func:`padding_mask` under :data:`IMPLEMENTATION` (idempotent)."""
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)


# -- the swap --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFSwapReport:
    """What :func:`use_attnzoo` did: the mechanism, its options, and every attention module it now serves
    (path, architecture)."""

    mechanism: str
    options: Dict[str, Any]
    modules: Tuple[Tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"{len(self.modules)} attention module(s) of transformers run attnzoo {self.mechanism!r} "
                 f"(attn_implementation={IMPLEMENTATION!r}):"]
        lines += [f"  {path} ({kind})" for path, kind in self.modules]
        return "\n".join(lines)


def use_attnzoo(model: nn.Module, mechanism: str, **options: Any) -> HFSwapReport:
    """Run every self-attention of a ``transformers`` model (BERT-style encoder, GPT-2, Llama-style decoder)
    through attnzoo ``mechanism``, via the library's attention-function registry (module docstring).

    Args:
        model: a ``transformers.PreTrainedModel`` of a supported architecture.
        mechanism: a name from :func:`attnzoo.available`.
        **options: the mechanism's options. An exact mechanism's ``scale`` defaults to each module's own
            scaling.

    Raises (the model left exactly as it was): TypeError for a model that is not a ``PreTrainedModel``;
    ValueError for an architecture without supported attention modules, or with cross-attention; errors for an
    unknown mechanism or a bad option; :class:`~attnzoo.UnsupportedOptionError` for a decoder and a mechanism
    without a causal form.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    cls = mechanism_class(mechanism)
    supported = _supported_classes()
    found: List[Tuple[str, nn.Module, str]] = []
    for path, module in model.named_modules():
        kind = supported.get(type(module))
        if kind is not None:
            found.append((path, module, kind))
    if not found:
        names = ", ".join(sorted(set(supported.values())))
        raise ValueError(f"{type(model).__name__}: no attention module attnzoo supports (architectures: {names})")
    config = model.config
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__}: cross-attention (add_cross_attention / encoder-decoder) is not "
                         f"supported by attnzoo.dropin.hf; self-attention models only")
    # An exact mechanism's logit scale is the module's own, so that it gives the outputs the model gave before.
    takes_scaling = cls.capabilities.exact and "scale" in mechanism_options(mechanism)
    # Build (and so validate) every mechanism before touching the model.
    built = []
    for path, module, kind in found:
        heads, head_dim = _heads(module, kind)
        module_options = dict(options)
        if takes_scaling and "scale" not in module_options:
            module_options["scale"] = float(module.scaling)
        instance = build_mechanism(mechanism, heads=heads, head_dim=head_dim, **module_options)
        if getattr(module, "is_causal", False) and not instance.capabilities.causal:
            raise UnsupportedOptionError(f"{path} is causal self-attention and {mechanism} has no causal form "
                                         f"(capabilities: {cls.capabilities.summary})")
        reference = next(module.parameters())
        built.append((module, instance.to(device=reference.device, dtype=reference.dtype).train(module.training)))
    register()
    for module, instance in built:
        module.add_module(MECHANISM_ATTRIBUTE, instance)
    model.set_attn_implementation(IMPLEMENTATION)
    return HFSwapReport(mechanism, dict(options), tuple((path, kind) for path, _, kind in found))


__all__ = ["HFSwapReport", "IMPLEMENTATION", "attention_forward", "padding_mask", "register", "use_attnzoo"]

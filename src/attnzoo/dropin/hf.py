"""attnzoo inside Hugging Face ``transformers`` models, through the library's own attention-function registry.

``use_attnzoo(model, "performer", nb_features=64)`` gives every self-attention module of a BERT-style encoder, a
GPT-2, or a Llama-style decoder (Llama, Mistral, Qwen2) its own attnzoo mechanism (a submodule named
``attnzoo_mechanism``, so its parameters train, save and move with the model), registers one attention function
and one mask function under the name ``"attnzoo"`` in ``transformers``' ``AttentionInterface`` and
``AttentionMaskInterface`` (:mod:`attnzoo.dropin.hf_attention`), records the swap in the model's config
(``config.attnzoo``, saved by ``save_pretrained``) and switches the model to it. The models' own projections,
rotary embeddings and KV cache run as before; the mechanism replaces what happens between them.

Checked at swap time, each refusal naming the mechanism and what it cannot honour, with the model left as it
was:

* the model's logit scale (GPT-2's ``scale_attn_weights=False`` and ``scale_attn_by_inverse_layer_idx=True``,
  any ``scaling`` other than ``1/sqrt(head_dim)``): taken by a mechanism's ``scale`` option, or by scaling the
  queries for a mechanism whose logits are ``q . k / sqrt(head_dim)`` (:func:`scaling_route`); refused
  otherwise;
* a sliding window (Mistral's ``sliding_window``, Qwen2's sliding layers): honoured exactly by an exact
  mechanism (it gets ``transformers``' own mask) and by a mechanism declaring a ``window_option`` (the window
  passed to it unless the options set one); refused for any other mechanism;
* causal self-attention for a mechanism without a causal form;
* queries and keys already rotated (Llama, Mistral, Qwen2) for a mechanism that rotates part of its maths itself
  (capability ``own_rotary``).

``generate()`` keeps working from the cache, dynamic or static (:mod:`attnzoo.dropin.hf_attention` says how,
and what is refused). ``save_pretrained`` writes the record and the mechanism's tensors;
:func:`from_pretrained` restores both (a plain ``from_pretrained`` of such a checkpoint raises at the first
forward, saying to call it).

Dropout: an exact mechanism drops attention probabilities as ``sdpa`` does; the others apply the
attention-probability dropout ``transformers`` passes to the attention output (only exact attention forms
probabilities), as :mod:`attnzoo.dropin.swap` does.

``transformers`` is an optional extra: ``pip install "attnzoo[hf]"``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from torch import nn

from ..mechanisms.base import Mechanism, UnsupportedOptionError
from ..mechanisms.registry import available, build_mechanism, mechanism_class
from .hf_attention import (
    IMPLEMENTATION, KEY_MASK_ONLY, MECHANISM_ATTRIBUTE, RECORD_ATTRIBUTE, attention_forward, padding_mask, register,
)
from .hf_save import load_mechanism_tensors

DEFAULT_MECHANISM = "softmax"
"""What the layers a swap of some ``layers`` leaves out run: exact softmax attention, as the model's own."""


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
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    return {BertSelfAttention: "bert", GPT2Attention: "gpt2", LlamaAttention: "llama",
            MistralAttention: "mistral", Qwen2Attention: "qwen2"}


ARCHITECTURES = ("bert", "gpt2", "llama", "mistral", "qwen2")
"""The architectures :func:`use_attnzoo` serves (BERT-style encoders include the models built on BERT)."""
ROTATED = ("llama", "mistral", "qwen2")
"""The architectures whose attention modules rotate queries and keys before the attention function runs."""


def _heads(module: nn.Module, kind: str) -> Tuple[int, int]:
    if kind == "bert":
        return module.num_attention_heads, module.attention_head_size
    if kind == "gpt2":
        return module.num_heads, module.head_dim
    return module.config.num_attention_heads, module.head_dim


def _sliding_window(module: nn.Module, kind: str) -> Optional[int]:
    """The sliding window a module's attention runs under (Mistral: the config's; Qwen2: the module's own,
    set on its sliding layers), or None."""
    if kind == "mistral":
        return getattr(module.config, "sliding_window", None)
    if kind == "qwen2":
        return getattr(module, "sliding_window", None)
    return None


# -- what a mechanism can honour ------------------------------------------------------------------------------
OPTION, QUERIES = "option", "queries"


def scaling_route(mechanism: Mechanism) -> Optional[str]:
    """How a mechanism takes a logit scale other than ``1/sqrt(head_dim)``, as it declares
    (:class:`~attnzoo.Capabilities`): ``"option"`` (the option its ``scale_option`` names), ``"queries"`` (its
    ``dot_product_logits`` are ``q . k / sqrt(head_dim)``, so scaling the queries sets the scale), or None (it
    has no such logit scale and cannot honour one)."""
    caps = mechanism.capabilities
    if caps.scale_option is not None:
        return OPTION
    return QUERIES if caps.dot_product_logits else None


def _windowed() -> List[str]:
    """The registered mechanisms that can run under a sliding window: exact ones (under ``transformers``' mask),
    and those declaring a ``window_option``."""
    return [name for name in available()
            if mechanism_class(name).capabilities.exact or mechanism_class(name).capabilities.window_option]


def _module_options(
    path: str, module: nn.Module, kind: str, mechanism: str, options: Dict[str, Any]
) -> Dict[str, Any]:
    """The options one module's mechanism is built with: the user's, plus the module's logit scale for a
    mechanism declaring a ``scale_option``, plus the model's sliding window for an inexact one declaring a
    ``window_option`` (an exact mechanism gets the window in transformers' mask)."""
    module_options = dict(options)
    caps = mechanism_class(mechanism).capabilities
    if caps.scale_option is not None and caps.scale_option not in module_options:
        module_options[caps.scale_option] = float(module.scaling)
    window = _sliding_window(module, kind)
    if window is not None:
        if caps.exact:
            pass  # transformers' own mask carries the window; a window option would make the mechanism inexact
        elif caps.window_option is not None:
            module_options.setdefault(caps.window_option, int(window))
        else:
            can = ", ".join(_windowed())
            raise UnsupportedOptionError(
                f"{path} attends within a sliding window (sliding_window={window}) and {mechanism} cannot honour "
                f"one; mechanisms that can: {can}; or set model.config.sliding_window = None first to run "
                f"without the window"
            )
    return module_options


def _check_scaling(path: str, module: nn.Module, instance: Mechanism, head_dim: int) -> None:
    """Refuse a module whose logit scale differs from ``1/sqrt(head_dim)`` for a mechanism that cannot take it."""
    scaling = float(module.scaling)
    if math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-12) or scaling_route(instance) is not None:
        return
    raise UnsupportedOptionError(
        f"{path} scales its logits by {scaling:g}, not 1/sqrt(head_dim) = {1 / math.sqrt(head_dim):g} (e.g. "
        f"GPT-2's scale_attn_weights=False or scale_attn_by_inverse_layer_idx=True), and {instance.name} has no "
        f"logit scale to set: pick a softmax-like mechanism (exact, approximate, or a fixed sparse pattern)"
    )


# -- the swap --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFSwapReport:
    """What :func:`use_attnzoo` did: the mechanism, its options, every attention module it now serves with it
    (path, architecture), and, for a swap of some ``layers`` only, the modules kept on softmax attention."""

    mechanism: str
    options: Dict[str, Any]
    modules: Tuple[Tuple[str, str], ...]
    kept: Tuple[Tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"{len(self.modules)} attention module(s) of transformers run attnzoo {self.mechanism!r} "
                 f"(attn_implementation={IMPLEMENTATION!r}):"]
        lines += [f"  {path} ({kind})" for path, kind in self.modules]
        if self.kept:
            lines.append(f"{len(self.kept)} kept on softmax attention (attnzoo's exact softmax):")
            lines += [f"  {path} ({kind})" for path, kind in self.kept]
        return "\n".join(lines)


def check_layers(layers: Any, count: int) -> Optional[Tuple[int, ...]]:
    """The decoder layers to swap, as given to :func:`use_attnzoo` (None: all ``count`` of them): distinct
    integer indices in ``[0, count)``, layer i being the model's i-th attention module."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(f"layers must be a non-empty list of layer indices (e.g. [0, 2]), or None for every layer, "
                        f"got {layers!r}")
    for position, index in enumerate(layers):
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"layers[{position}] must be an integer layer index, got {index!r} "
                            f"({type(index).__name__})")
        if not 0 <= index < count:
            raise ValueError(f"layers[{position}] = {index} is out of range: the model has {count} attention "
                             f"layers, 0 to {count - 1}")
    repeated = sorted({index for index in layers if list(layers).count(index) > 1})
    if repeated:
        raise ValueError(f"layers names layer {repeated[0]} more than once: give each layer once")
    return tuple(layers)


def _found(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """(path, module, architecture) of every attention module attnzoo can serve; raises if there is none."""
    supported = _supported_classes()
    found = [(path, module, supported[type(module)]) for path, module in model.named_modules()
             if type(module) in supported]
    if not found:
        raise ValueError(f"{type(model).__name__}: no attention module attnzoo supports (architectures: "
                         f"{', '.join(ARCHITECTURES)})")
    config = model.config
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__}: cross-attention (add_cross_attention / encoder-decoder) is not "
                         f"supported by attnzoo.dropin.hf; self-attention models only")
    return found


def _record(mechanism: str, options: Dict[str, Any], layers: Optional[Tuple[int, ...]]) -> Dict[str, Any]:
    """The swap as the config records it; its options must be JSON values, since config.json holds them."""
    try:
        json.dumps(options)
    except (TypeError, ValueError) as error:
        raise TypeError(f"options of {mechanism} must be JSON values (numbers, strings, lists) so that the swap "
                        f"can be saved in the model's config: {error}") from error
    record = {"mechanism": mechanism, "options": dict(options)}
    return record if layers is None else {**record, "layers": list(layers)}


def _built_for(path: str, module: nn.Module, kind: str, mechanism: str, options: Dict[str, Any]) -> Mechanism:
    """The mechanism one module runs, built and checked against what the module needs (module docstring)."""
    heads, head_dim = _heads(module, kind)
    instance = build_mechanism(mechanism, heads=heads, head_dim=head_dim,
                               **_module_options(path, module, kind, mechanism, options))
    if getattr(module, "is_causal", False) and not instance.capabilities.causal:
        raise UnsupportedOptionError(f"{path} is causal self-attention and {mechanism} has no causal form "
                                     f"(capabilities: {mechanism_class(mechanism).capabilities.summary})")
    if kind in ROTATED and instance.capabilities.own_rotary:
        raise UnsupportedOptionError(
            f"{path} rotates its queries and keys before attention, and {mechanism} applies the rotary embedding "
            f"itself to part of its maths only (capability own_rotary): use attnzoo.pretrained.CausalLM, whose "
            f"layers give it the unrotated ones")
    _check_scaling(path, module, instance, head_dim)
    reference = next(module.parameters())
    return instance.to(device=reference.device, dtype=reference.dtype).train(module.training)


def _check_kept(kept: List[Tuple[str, nn.Module, str]], exact: bool, mechanism: str) -> None:
    """A kept module under a sliding window needs transformers' own mask, which the model's layers share: it
    is only made for an exact mechanism (:mod:`attnzoo.dropin.hf_attention`); otherwise every layer gets the
    key mask, and a kept module runs causal softmax over it."""
    if exact:
        return
    for path, module, kind in kept:
        window = _sliding_window(module, kind)
        if window is not None:
            raise UnsupportedOptionError(
                f"layers: {path} is kept on softmax attention within a sliding window (sliding_window={window}), "
                f"which comes with the mask transformers makes for exact attention only, and {mechanism} is not "
                f"exact: swap that layer too, or set model.config.sliding_window = None first")


def use_attnzoo(model: nn.Module, mechanism: str, *, layers: Optional[Sequence[int]] = None,
                **options: Any) -> HFSwapReport:
    """Run the self-attention of a ``transformers`` model (BERT-style encoder, GPT-2, Llama, Mistral, Qwen2)
    through attnzoo ``mechanism``, via the library's attention-function registry (module docstring).

    Args:
        model: a ``transformers.PreTrainedModel`` of a supported architecture (:data:`ARCHITECTURES`).
        mechanism: a name from :func:`attnzoo.available`.
        layers: the indices of the layers to swap (layer i: the model's i-th attention module, ``model.layers[i]``
            of a Llama), each once; None: every layer. The other layers keep softmax attention, computed by
            attnzoo's exact softmax (the attention function is one for the whole model), which gives what the
            model's own attention gives; they are recorded in ``model.config.attnzoo`` with the swap.
        **options: the mechanism's options (JSON values: they are recorded in ``model.config.attnzoo``). A
            ``scale`` option defaults to each module's own scaling, a ``window`` option to the model's sliding
            window.

    Raises (the model left exactly as it was): TypeError for a model that is not a ``PreTrainedModel``;
    ValueError for an architecture without supported attention modules, or with cross-attention; errors for an
    unknown mechanism or a bad option, and for ``layers`` out of range or repeated (naming it);
    :class:`~attnzoo.UnsupportedOptionError` for a decoder and a mechanism without a causal form, a logit scale
    or a sliding window the mechanism cannot honour.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    mechanism_class(mechanism)
    found = _found(model)
    chosen = check_layers(layers, len(found))
    record = _record(mechanism, options, chosen)
    swapped = [entry for index, entry in enumerate(found) if chosen is None or index in chosen]
    kept = [entry for index, entry in enumerate(found) if chosen is not None and index not in chosen]
    # Every mechanism built (and so validated) before the model is touched.
    built = [(module, _built_for(path, module, kind, mechanism, options)) for path, module, kind in swapped]
    exact = all(instance.capabilities.exact for _, instance in built)
    _check_kept(kept, exact, mechanism)
    built += [(module, _built_for(path, module, kind, DEFAULT_MECHANISM, {})) for path, module, kind in kept]
    register()
    for index, (module, instance) in enumerate(built):
        module.add_module(MECHANISM_ATTRIBUTE, instance)
        setattr(module, KEY_MASK_ONLY, index >= len(swapped) and not exact)  # a kept module under the key mask
    setattr(model.config, RECORD_ATTRIBUTE, record)
    # Saved with the config, so that a plain from_pretrained of the checkpoint does not run silently on sdpa.
    model.config.attn_implementation = IMPLEMENTATION
    model.set_attn_implementation(IMPLEMENTATION)
    return HFSwapReport(mechanism, dict(options), tuple((path, kind) for path, _, kind in swapped),
                        tuple((path, kind) for path, _, kind in kept))


def from_pretrained(model_class: Type[Any], path: str, **kwargs: Any) -> Any:
    """Load a model saved by ``save_pretrained`` after :func:`use_attnzoo`: ``model_class.from_pretrained(path,
    **kwargs)``, the swap its config records made again, and the mechanism's saved tensors (random projections,
    gates) put back, so that it gives the logits it gave when saved.

    Raises ValueError for a checkpoint whose config records no swap (load it with ``model_class.from_pretrained``),
    and for mechanism tensors missing from the checkpoint or not in the model (naming them).
    """
    _transformers()
    register()  # the saved config names attn_implementation="attnzoo"
    model = model_class.from_pretrained(path, **kwargs)
    record = getattr(model.config, RECORD_ATTRIBUTE, None)
    if not isinstance(record, dict) or "mechanism" not in record:
        raise ValueError(f"{path}: its config records no attnzoo swap ({RECORD_ATTRIBUTE!r}); it was saved without "
                         f"one: load it with {model_class.__name__}.from_pretrained")
    use_attnzoo(model, record["mechanism"], layers=record.get("layers"), **(record.get("options") or {}))
    load_mechanism_tensors(model, path, MECHANISM_ATTRIBUTE)
    return model


__all__ = ["ARCHITECTURES", "HFSwapReport", "IMPLEMENTATION", "MECHANISM_ATTRIBUTE", "attention_forward",
           "check_layers", "from_pretrained", "padding_mask", "register", "scaling_route", "use_attnzoo"]

"""A Hugging Face model directory (what ``save_pretrained`` writes: ``config.json`` and safetensors weights) as
attnzoo's :class:`~attnzoo.pretrained.causal_lm.CausalLM`.

The architectures are those of the GGUF route: Llama (SmolLM and Mistral-style models under it), Mistral and
Qwen2. transformers keeps the query and key rows in the rotary halves layout attnzoo's model turns, so the
tensors are copied as stored (only the feed-forward network's gate and up projections are stacked into one).
Mistral's sliding window becomes the model's (:class:`~attnzoo.pretrained.config.CausalLMConfig`). What the
model would run wrongly is refused by name: rotary scaling, partial rotary dimensions, Qwen2's sliding layers,
biases beyond Qwen2's, another activation. Weights are read with ``safetensors`` (a core dependency),
in float32 whatever their stored dtype; the tokenizer, when asked for, through transformers from the same
directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from .causal_lm import CausalLM
from .config import CausalLMConfig
from .weights import Transform, fill_parameters

# The value of "architectures" in config.json -> attnzoo's architecture (see .architectures).
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
CONFIG_FILE = "config.json"


class HFDirectoryError(ValueError):
    """A Hugging Face directory attnzoo cannot load: not a model directory, or a model it does not run yet."""


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` is a directory holding a ``config.json`` (read as a Hugging Face model directory)."""
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def has_hf_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a saved tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)."""
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def read_hf_config(directory: Path) -> Dict[str, Any]:
    """``config.json`` of ``directory`` as a dict; a one-line error if it is not a JSON object."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HFDirectoryError(f"{directory / CONFIG_FILE} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise HFDirectoryError(f"{directory / CONFIG_FILE} holds a {type(config).__name__}, not a JSON object")
    return config


def hf_architecture(config: Dict[str, Any], directory: Path) -> str:
    """attnzoo's architecture for the model class config.json names; a one-line error naming the supported ones."""
    names = config.get("architectures")
    name = names[0] if isinstance(names, list) and len(names) == 1 else names
    if not isinstance(name, str) or name not in HF_ARCHITECTURES:
        raise HFDirectoryError(f"{directory.name} holds a {name!r} model (config.json: architectures), which attnzoo "
                               f"does not load; supported: {', '.join(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[name]


_ABSENT = object()


def _value(config: Dict[str, Any], key: str, directory: Path, kind: type, default: Any = _ABSENT) -> Any:
    """``config[key]`` as ``kind`` (int, float or bool; JSON's true is not an int, and "false" is not a bool),
    ``default`` where it is absent or null; a one-line error naming the key otherwise."""
    value = config.get(key)
    if value is None:
        if default is _ABSENT:
            raise HFDirectoryError(f"{directory / CONFIG_FILE} lacks {key!r}")
        return default
    numeric = (int, float) if kind is float else int
    if isinstance(value, bool) != (kind is bool) or (kind is not bool and not isinstance(value, numeric)):
        raise HFDirectoryError(f"{directory / CONFIG_FILE}: {key} must be a JSON {kind.__name__}, got {value!r}")
    return kind(value)


def _rope_theta(config: Dict[str, Any], directory: Path) -> float:
    """The rotary base, refusing rotary scaling: transformers 5 keeps both in ``rope_parameters``, earlier
    versions in ``rope_theta`` and ``rope_scaling``."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    flat = isinstance(parameters, dict) and isinstance(scaling, dict)
    if not flat or (parameters and "rope_theta" not in parameters):  # e.g. one set per layer type
        raise HFDirectoryError(f"{directory.name} sets its rotary positions in a form attnzoo does not read "
                               f"(rope_parameters {parameters!r})")
    kind = parameters.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise HFDirectoryError(f"{directory.name} scales its rotary frequencies (rope_type {kind!r}), which attnzoo "
                               f"does not do yet")
    # A config without either key: transformers' default base for these architectures.
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _refuse_unsupported(config: Dict[str, Any], architecture: str, directory: Path) -> None:
    """Refuse, naming the setting, what attnzoo's model would run differently from the checkpoint's."""
    if config.get("use_sliding_window"):  # Qwen2: a window on some layers only (max_window_layers)
        raise HFDirectoryError(f"{directory.name} attends within a sliding window on some of its layers "
                               f"(use_sliding_window), which attnzoo's model does not do yet")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFDirectoryError(f"{directory.name} rotates part of each head (partial_rotary_factor="
                               f"{config['partial_rotary_factor']}); attnzoo rotates it all")
    if config.get("hidden_act", "silu") != "silu":
        raise HFDirectoryError(f"{directory.name} uses hidden_act={config['hidden_act']!r}; attnzoo's feed-forward "
                               f"network is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if architecture == "llama" and config.get(key):
            raise HFDirectoryError(f"{directory.name} has {key}=true, which attnzoo's Llama model does not have")


def config_from_hf(config: Dict[str, Any], directory: Path) -> CausalLMConfig:
    """The :class:`CausalLMConfig` of a Hugging Face config.json (its dict), after the checks above."""
    architecture = hf_architecture(config, directory)
    _refuse_unsupported(config, architecture, directory)
    dim = _value(config, "hidden_size", directory, int)
    heads = _value(config, "num_attention_heads", directory, int)
    if heads < 1:
        raise HFDirectoryError(f"{directory / CONFIG_FILE}: num_attention_heads must be >= 1, got {heads}")
    return CausalLMConfig(
        vocab_size=_value(config, "vocab_size", directory, int),
        dim=dim,
        depth=_value(config, "num_hidden_layers", directory, int),
        heads=heads,
        kv_heads=_value(config, "num_key_value_heads", directory, int, heads),
        head_dim=_value(config, "head_dim", directory, int, dim // heads),
        ff_dim=_value(config, "intermediate_size", directory, int),
        rope_base=_rope_theta(config, directory),
        norm_eps=_value(config, "rms_norm_eps", directory, float),
        context_length=_value(config, "max_position_embeddings", directory, int),
        attention_bias=architecture == "qwen2",
        tied_embeddings=_value(config, "tie_word_embeddings", directory, bool, False),
        sliding_window=_sliding_window(config, directory),
    )


def _sliding_window(config: Dict[str, Any], directory: Path) -> Optional[int]:
    """Mistral's window (every layer attends to its last ``sliding_window`` positions), or None: none, or one
    no shorter than the context, which changes nothing (Qwen2's ``sliding_window`` is used only with
    ``use_sliding_window``, refused above)."""
    if config.get("model_type") != "mistral":
        return None
    window = _value(config, "sliding_window", directory, int, None)
    return None if window is None or window >= _value(config, "max_position_embeddings", directory, int) else window


def weight_files(directory: Path) -> List[Path]:
    """The safetensors files of ``directory`` (one, or the shards its index names); a one-line error if none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise HFDirectoryError(f"{index} is not a safetensors index ({error})") from None
        files = [directory / shard for shard in shards]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            raise HFDirectoryError(f"{directory.name} lacks the shards {', '.join(absent[:4])} its index names")
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    others = sorted(path.name for path in directory.iterdir() if path.suffix in (".bin", ".pt", ".pth"))
    hint = f" (it has {', '.join(others[:3])}: save it with safe_serialization=True)" if others else ""
    raise HFDirectoryError(f"{directory.name} has no model.safetensors nor model.safetensors.index.json{hint}")


def _layer_names(index: int) -> Dict[str, str]:
    """transformers' names -> attnzoo's parameter names for layer ``index`` (gate and up aside)."""
    theirs, ours = f"model.layers.{index}", f"layers.{index}"
    names = {f"{theirs}.input_layernorm.weight": f"{ours}.attention_norm.weight",
             f"{theirs}.self_attn.o_proj.weight": f"{ours}.attention.out_proj.weight",
             f"{theirs}.post_attention_layernorm.weight": f"{ours}.feed_forward_norm.weight",
             f"{theirs}.mlp.down_proj.weight": f"{ours}.feed_forward.out_proj.weight"}
    for projection in "qkv":
        names[f"{theirs}.self_attn.{projection}_proj.weight"] = f"{ours}.attention.{projection}_proj.weight"
        names[f"{theirs}.self_attn.{projection}_proj.bias"] = f"{ours}.attention.{projection}_proj.bias"
    return names


def load_hf_weights(model: CausalLM, directory: Path) -> None:
    """Copy the safetensors weights of ``directory`` into ``model`` (a CausalLM built from its config), each
    tensor once, every parameter filled (:func:`~attnzoo.pretrained.weights.fill_parameters`)."""
    handles = [safe_open(str(file), framework="pt") for file in weight_files(directory)]
    where: Dict[str, Any] = {}
    for handle in handles:
        for name in handle.keys():
            if name in where:
                raise HFDirectoryError(f"{directory.name} stores {name!r} in two files")
            where[name] = handle
    same: Transform = lambda tensor: tensor  # noqa: E731
    names: Dict[str, Tuple[str, Transform]] = {"model.embed_tokens.weight": ("embedding.weight", same),
                                               "model.norm.weight": ("norm.weight", same)}
    if not model.config.tied_embeddings:
        names["lm_head.weight"] = ("head.weight", same)
    parameters = dict(model.named_parameters())
    for index in range(model.config.depth):
        names.update({theirs: (ours, same) for theirs, ours in _layer_names(index).items() if ours in parameters})
    fused = {f"layers.{index}.feed_forward.in_proj.weight": (f"model.layers.{index}.mlp.gate_proj.weight",
                                                              f"model.layers.{index}.mlp.up_proj.weight")
             for index in range(model.config.depth)}
    with torch.no_grad():
        fill_parameters(model, names, fused, list(where), lambda name: where[name].get_tensor(name), directory.name,
                        HFDirectoryError)

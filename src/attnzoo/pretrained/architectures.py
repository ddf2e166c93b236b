"""The architectures a GGUF file may hold that attnzoo runs, and their hyperparameters from its metadata.

``llama`` covers Llama 1 and 2, SmolLM2, Mistral-style models and the many fine-tunes converted under that name;
``qwen2`` is the same network with biases on the query, key and value projections (and its rotary pairs stored
in halves rather than interleaved, see :mod:`attnzoo.pretrained.weights`). What these do not cover (rotary
scaling, partial rotary dimensions, mixtures of experts) is refused by name, not run wrongly.
"""

from __future__ import annotations

from typing import Any

from .config import CausalLMConfig
from .gguf_file import GGUFError, GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
ATTENTION_BIAS = {"llama": False, "qwen2": True}


def check_architecture(file: GGUFFile) -> str:
    """The file's architecture if attnzoo runs it; a one-line error naming it and the supported ones otherwise."""
    if file.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"architecture {file.architecture!r} of {file.path.name} is not supported; supported "
                        f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return file.architecture


def _value(file: GGUFFile, key: str, default: Any = None) -> Any:
    value = file.metadata.get(f"{file.architecture}.{key}", default)
    if value is None:
        raise GGUFError(f"{file.path.name} lacks the metadata key {file.architecture}.{key}")
    return value


def _refuse_unsupported(file: GGUFFile, head_dim: int) -> None:
    """Refuse, naming them, the variants of the architecture that the model would run wrongly."""
    experts = file.metadata.get(f"{file.architecture}.expert_count", 0)
    if experts:
        raise GGUFError(f"{file.path.name} is a mixture of {experts} experts ({file.architecture}.expert_count), "
                        f"which attnzoo does not run yet")
    scaling = file.metadata.get(f"{file.architecture}.rope.scaling.type", "none")
    if scaling != "none" or file.has_tensor("rope_freqs.weight"):
        raise GGUFError(f"{file.path.name} scales its rotary frequencies ({file.architecture}.rope.scaling.type="
                        f"{scaling!r}, rope_freqs.weight), which attnzoo does not do yet")
    rotary_dim = file.metadata.get(f"{file.architecture}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise GGUFError(f"{file.path.name} rotates {rotary_dim} of its {head_dim} head channels "
                        f"({file.architecture}.rope.dimension_count); attnzoo rotates them all")


def config_from_gguf(file: GGUFFile) -> CausalLMConfig:
    """The :class:`CausalLMConfig` of a GGUF file's model, from ``<architecture>.*`` metadata keys: block_count,
    embedding_length, feed_forward_length, attention.head_count, attention.head_count_kv, attention.key_length,
    rope.freq_base, attention.layer_norm_rms_epsilon, context_length, vocab_size (else the embedding's rows)."""
    check_architecture(file)
    dim = int(_value(file, "embedding_length"))
    heads = int(_value(file, "attention.head_count"))
    head_dim = int(_value(file, "attention.key_length", dim // heads))
    _refuse_unsupported(file, head_dim)
    if not file.has_tensor("token_embd.weight"):
        raise GGUFError(f"{file.path.name} has no token_embd.weight (the token embedding)")
    vocab_size = int(_value(file, "vocab_size", file.shape("token_embd.weight")[0]))
    return CausalLMConfig(
        vocab_size=vocab_size,
        dim=dim,
        depth=int(_value(file, "block_count")),
        heads=heads,
        kv_heads=int(_value(file, "attention.head_count_kv", heads)),
        head_dim=head_dim,
        ff_dim=int(_value(file, "feed_forward_length")),
        rope_base=float(_value(file, "rope.freq_base", 10000.0)),
        norm_eps=float(_value(file, "attention.layer_norm_rms_epsilon")),
        context_length=int(_value(file, "context_length")),
        attention_bias=ATTENTION_BIAS[file.architecture],
        tied_embeddings=not file.has_tensor("output.weight"),
    )

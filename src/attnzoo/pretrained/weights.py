"""The weights of a GGUF file put into a :class:`~attnzoo.pretrained.causal_lm.CausalLM`.

GGUF names (llama.cpp's) map one to one onto the model's parameters, except the feed-forward network's gate and
up projections, which attnzoo's SwiGLU keeps fused in one ``in_proj`` (gate rows first).

Rotary layout: llama.cpp's converter stores a ``llama`` model's query and key projections with the rows of
each head permuted (``permute(w, n_head)`` in convert_hf_to_gguf.py) from transformers' halves (channel i
turns with i + head_dim/2) to interleaved pairs (2i, 2i+1), the order its "normal" rotary turns. attnzoo's
:class:`~attnzoo.RotaryEmbedding` turns either; the stored order with ``pairs="interleaved"`` gives the same
query-key products up to rounding, but summed in another channel order, which over 30 layers moved SmolLM2's
logits by 5e-5 from transformers'. So the rows are put back in halves here and the model turns halves: the
computation is then transformers' own, and the logits equal theirs to the bit. A ``qwen2`` file keeps the
halves (llama.cpp turns them "neox" style) and is used as stored.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple, Type

import torch
from torch import Tensor

from .causal_lm import CausalLM
from .gguf_file import GGUFError, GGUFFile

Transform = Callable[[Tensor], Tensor]


def halves_from_interleaved(weight: Tensor, heads: int) -> Tensor:
    """Rows (heads * head_dim, ...) of a query or key projection reordered per head from interleaved pairs
    (2i, 2i + 1) to halves (i, i + head_dim/2): the inverse of llama.cpp's ``permute``."""
    rest = weight.shape[1:]
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _layer_names(model: CausalLM, index: int, architecture: str) -> Dict[str, Tuple[str, Transform]]:
    """GGUF tensor name -> (the model's parameter name, the transform from the stored tensor) for one layer."""
    config = model.config
    gguf, ours = f"blk.{index}", f"layers.{index}"
    same: Transform = lambda tensor: tensor  # noqa: E731
    query, key = same, same
    if architecture == "llama":
        query = lambda tensor: halves_from_interleaved(tensor, config.heads)  # noqa: E731
        key = lambda tensor: halves_from_interleaved(tensor, config.kv_heads)  # noqa: E731
    names = {
        f"{gguf}.attn_norm.weight": (f"{ours}.attention_norm.weight", same),
        f"{gguf}.attn_q.weight": (f"{ours}.attention.q_proj.weight", query),
        f"{gguf}.attn_k.weight": (f"{ours}.attention.k_proj.weight", key),
        f"{gguf}.attn_v.weight": (f"{ours}.attention.v_proj.weight", same),
        f"{gguf}.attn_output.weight": (f"{ours}.attention.out_proj.weight", same),
        f"{gguf}.ffn_norm.weight": (f"{ours}.feed_forward_norm.weight", same),
        f"{gguf}.ffn_down.weight": (f"{ours}.feed_forward.out_proj.weight", same),
    }
    if config.attention_bias:
        names.update({
            f"{gguf}.attn_q.bias": (f"{ours}.attention.q_proj.bias", query),
            f"{gguf}.attn_k.bias": (f"{ours}.attention.k_proj.bias", key),
            f"{gguf}.attn_v.bias": (f"{ours}.attention.v_proj.bias", same),
        })
    return names


def fill_parameters(model: CausalLM, names: Dict[str, Tuple[str, Transform]], fused: Dict[str, Tuple[str, str]],
                    stored: Sequence[str], read: Callable[[str], Tensor], label: str, error: Type[Exception]) -> None:
    """Copy stored tensors into ``model``'s parameters: ``names`` maps a stored name to (the parameter's name, the
    transform from the stored tensor), ``fused`` a parameter to the two stored tensors stacked into it (the
    feed-forward network's gate and up projections). ``stored``: every tensor name of the source, ``read``
    reads one (as float32 or any dtype ``copy_`` takes), ``label`` names the source in errors.

    Every parameter must be filled and every stored tensor used, with the model's shapes; anything else is a
    one-line ``error`` naming the tensors, so that a variant of the architecture is refused rather than run
    half-loaded."""
    parameters = dict(model.named_parameters())
    wanted = set(names) | {name for pair in fused.values() for name in pair}
    present = set(stored)
    unused = [name for name in stored if name not in wanted]
    missing = sorted(name for name in wanted if name not in present)
    if unused or missing:
        problems = ([f"unexpected tensors {', '.join(unused[:4])}"] if unused else []) + \
            ([f"missing tensors {', '.join(missing[:4])}"] if missing else [])
        raise error(f"{label} is not a model attnzoo can load: {'; '.join(problems)}")

    def copy(parameter: Tensor, name: str, value: Tensor) -> None:
        if value.shape != parameter.shape:
            raise error(f"tensor {name!r} of {label} has shape {tuple(value.shape)}, the model expects "
                        f"{tuple(parameter.shape)}")
        parameter.copy_(value)

    filled = set()
    for stored_name, (ours, transform) in names.items():
        copy(parameters[ours], stored_name, transform(read(stored_name)))
        filled.add(ours)
    for ours, (gate, up) in fused.items():
        copy(parameters[ours], f"{gate} + {up}", torch.cat([read(gate), read(up)]))
        filled.add(ours)
    left = sorted(name for name, parameter in parameters.items() if name not in filled and parameter.requires_grad)
    if left:
        raise error(f"{label} leaves parameters {', '.join(left[:4])} of the model unfilled")


@torch.no_grad()
def load_gguf_weights(model: CausalLM, file: GGUFFile) -> None:
    """Copy every weight of ``file`` into ``model`` (built from the file's config), dequantized to float32
    (:func:`fill_parameters` checks that each tensor and each parameter is used once)."""
    same: Transform = lambda tensor: tensor  # noqa: E731
    names: Dict[str, Tuple[str, Transform]] = {"token_embd.weight": ("embedding.weight", same),
                                               "output_norm.weight": ("norm.weight", same)}
    if not model.config.tied_embeddings:
        names["output.weight"] = ("head.weight", same)
    for index in range(model.config.depth):
        names.update(_layer_names(model, index, file.architecture))
    fused = {f"layers.{index}.feed_forward.in_proj.weight": (f"blk.{index}.ffn_gate.weight",
                                                              f"blk.{index}.ffn_up.weight")
             for index in range(model.config.depth)}
    fill_parameters(model, names, fused, file.tensor_names(), file.tensor, f"{file.path.name} ({file.architecture})",
                    GGUFError)

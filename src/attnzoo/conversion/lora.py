"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers: ``W x + (alpha / r) B A x`` with the
pretrained ``W`` frozen and only ``A`` (r, in) and ``B`` (out, r) trained.

``B`` starts at zero, so a model with fresh adapters computes exactly what it computed before; ``A`` starts
from a seeded normal draw, so adding adapters is reproducible.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Sequence

import torch
from torch import Tensor, nn

from .._validation import check_number, check_positive_int

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


class LoRALinear(nn.Module):
    """``base(x) + scale * (x A^T) B^T``, (..., in) -> (..., out), ``scale = alpha / rank``; ``base`` frozen.

    Args:
        base: the pretrained layer (its parameters are set to ``requires_grad=False``).
        rank: r, the adapters' inner width.
        alpha: the numerator of the scale (LoRA's ``alpha``; 2 * rank is common).
        generator: draws ``A`` (normal with std ``1 / sqrt(in)``); ``B`` is zeros.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA adapts an nn.Linear, got {type(base).__name__}")
        self.rank = check_positive_int("rank", rank)
        self.alpha = check_number("alpha", alpha, minimum=0.0, exclusive_minimum=True)
        self.base = base.requires_grad_(False)
        weight = base.weight
        draw = torch.randn(rank, base.in_features, generator=generator, dtype=torch.float64)
        self.lora_a = nn.Parameter((draw / math.sqrt(base.in_features)).to(weight.dtype).to(weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def weight(self) -> Tensor:
        """The frozen base weight (what callers that read ``.weight`` for a dtype or device expect)."""
        return self.base.weight

    @property
    def bias(self) -> Tensor:
        return self.base.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` with ``W + scale * B A`` (equal up to rounding; faster to run)."""
        merged = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None)
        merged = merged.to(self.base.weight.dtype).to(self.base.weight.device)
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + self.scale * (self.lora_b @ self.lora_a))
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def add_lora(
    model: nn.Module, module_names: Sequence[str], rank: int, alpha: float, seed: int
) -> List[str]:
    """Wrap each named ``nn.Linear`` of ``model`` (dotted names, e.g. ``layers.3.attention.q_proj``) in a
    :class:`LoRALinear`, drawing the adapters in the order given from one generator seeded with ``seed``.
    Returns the names of the new trainable parameters."""
    generator = torch.Generator().manual_seed(seed)
    trainable = []
    for name in module_names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        setattr(parent, child, LoRALinear(base, rank, alpha, generator))
        trainable += [f"{name}.lora_a", f"{name}.lora_b"]
    return trainable


def attention_projection_names(layer_indices: Iterable[int]) -> List[str]:
    """The attention projections of the given layers of a :class:`~attnzoo.pretrained.CausalLM`."""
    return [f"layers.{index}.attention.{projection}" for index in layer_indices for projection in ATTENTION_PROJECTIONS]


def merge_lora(model: nn.Module) -> int:
    """Replace every :class:`LoRALinear` in ``model`` by its merged ``nn.Linear``; returns how many."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module.merged())
    return len(found)


def lora_state(model: nn.Module) -> Dict[str, Tensor]:
    """The adapters' tensors by parameter name."""
    return {name: p.detach() for name, p in model.named_parameters() if name.endswith((".lora_a", ".lora_b"))}

"""The hyperparameters of a Llama-type causal language model, checked once.

A :class:`CausalLMConfig` says what the network is (widths, heads, rotary base, norm epsilon); which attention
mechanism fills its attention slot is chosen separately, when the model is built, so one pretrained
checkpoint can be run with any mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._validation import check_bool, check_number, check_positive_int


@dataclass(frozen=True)
class CausalLMConfig:
    """A decoder-only Llama-type model: pre-norm layers of RMSNorm, grouped-query self-attention with rotary
    positions, RMSNorm and a SwiGLU feed-forward network; a final RMSNorm and a bias-free LM head.

    Args:
        vocab_size: tokens of the vocabulary (the embedding's rows and the head's outputs).
        dim: model width.
        depth: decoder layers.
        heads: query heads.
        kv_heads: key/value heads, dividing ``heads`` (grouped-query attention).
        head_dim: width of one head (``dim // heads`` in Llama, SmolLM2 and Mistral).
        ff_dim: hidden width of the SwiGLU feed-forward network.
        rope_base: base of the rotary angles (``llama.rope.freq_base``; 10000 in Llama 2).
        norm_eps: epsilon of every RMSNorm.
        context_length: the longest sequence the model was trained on (kept for reference; not enforced).
        attention_bias: biases on the query, key and value projections (Qwen2); the output projection has none.
        tied_embeddings: the LM head reuses the token embedding's matrix (no separate output weights).
        sliding_window: each query attends to the last ``sliding_window`` positions only, itself included
            (Mistral 7B v0.1's 4,096); None: to every earlier one. The layers' mechanism must honour it: one
            declaring a ``window_option`` (softmax, local) gets it as that option unless its options set one.
    """

    vocab_size: int
    dim: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int
    ff_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context_length: int = 2048
    attention_bias: bool = False
    tied_embeddings: bool = False
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "kv_heads", "head_dim", "ff_dim", "context_length"):
            check_positive_int(name, getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: rotary positions rotate pairs of channels")
        check_number("rope_base", self.rope_base, minimum=1.0, exclusive_minimum=True)
        check_number("norm_eps", self.norm_eps, minimum=0.0, exclusive_minimum=True)
        check_bool("attention_bias", self.attention_bias)
        check_bool("tied_embeddings", self.tied_embeddings)
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)

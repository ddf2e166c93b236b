"""Pure tensor maths of every mechanism family, with float64 references beside the fast paths.

All functions take per-head tensors q, k, v of shape (batch, heads, seq, head_dim).
"""

from .masks import allowed_mask, causal_allowed
from .softmax import softmax_attention, softmax_attention_reference
from .linear import (
    kernel_attention,
    kernel_attention_prefill,
    kernel_attention_reference,
    kernel_attention_step,
    linear_attention,
    linear_attention_reference,
)
from .shrinkage import shrink_towards_mean, shrunk_kernel_attention, shrunk_kernel_attention_reference

__all__ = ["allowed_mask", "causal_allowed", "softmax_attention", "softmax_attention_reference",
           "kernel_attention", "kernel_attention_prefill", "kernel_attention_reference", "kernel_attention_step",
           "linear_attention", "linear_attention_reference", "shrink_towards_mean", "shrunk_kernel_attention",
           "shrunk_kernel_attention_reference"]

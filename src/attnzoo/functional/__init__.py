"""Pure tensor maths of every mechanism family, with float64 references beside the fast paths.

All functions take per-head tensors q, k, v of shape (batch, heads, seq, head_dim).

Each attention function validates its arguments. Its ``*_unchecked`` form skips that, for callers that have
validated them already: a mechanism's ``attend`` runs after :meth:`attnzoo.mechanisms.Mechanism.check_inputs`,
so inputs are checked once, at the entry point (the conformance suite holds every mechanism to it).
"""

from .features import elu_plus_one, exp_features, relu_features
from .masks import allowed_mask, causal_allowed
from .softmax import softmax_attention, softmax_attention_reference, softmax_attention_unchecked
from .linear import (
    kernel_attention,
    kernel_attention_prefill,
    kernel_attention_prefill_unchecked,
    kernel_attention_reference,
    kernel_attention_step,
    kernel_attention_step_unchecked,
    kernel_attention_unchecked,
    linear_attention,
    linear_attention_reference,
)
from .shrinkage import (
    shrink_towards_mean,
    shrunk_kernel_attention,
    shrunk_kernel_attention_reference,
    shrunk_kernel_attention_unchecked,
)

__all__ = ["allowed_mask", "causal_allowed", "elu_plus_one", "exp_features", "relu_features",
           "softmax_attention", "softmax_attention_reference", "softmax_attention_unchecked",
           "kernel_attention", "kernel_attention_prefill", "kernel_attention_prefill_unchecked",
           "kernel_attention_reference", "kernel_attention_step", "kernel_attention_step_unchecked",
           "kernel_attention_unchecked", "linear_attention", "linear_attention_reference", "shrink_towards_mean",
           "shrunk_kernel_attention", "shrunk_kernel_attention_reference", "shrunk_kernel_attention_unchecked"]

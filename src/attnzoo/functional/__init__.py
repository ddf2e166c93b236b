"""Pure tensor maths of every mechanism family, with float64 references beside the fast paths.

All functions take per-head tensors q, k, v of shape (batch, heads, seq, head_dim).

Each attention function validates its arguments. Its ``*_unchecked`` form skips that, for callers that have
validated them already: a mechanism's ``attend`` runs after :meth:`attnzoo.mechanisms.Mechanism.check_inputs`,
so inputs are checked once, at the entry point (the conformance suite holds every mechanism to it).
"""

from .features import elu_plus_one, exp_features, relu_features
from .masks import allowed_mask, causal_allowed
from .norms import rms_norm, unit_rows
from .grouped import grouped_query_attention, per_query_group, repeat_kv
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
from .delta import (
    delta_product,
    delta_product_prefill,
    delta_product_reference,
    delta_product_step,
    delta_rule,
    delta_rule_prefill,
    delta_rule_reference,
    delta_rule_step,
    gated_delta_rule,
    gated_delta_rule_step,
)
from .dplr import (
    dplr_delta_rule,
    dplr_delta_rule_prefill,
    dplr_delta_rule_reference,
    dplr_delta_rule_step,
)
from .ssd import ssd, ssd_prefill, ssd_reference, ssd_step
from .short_convolution import short_conv, short_conv_reference, short_conv_state, short_conv_step
from .forgetting import forgetting_attention, forgetting_attention_reference, forgetting_attention_unchecked
from .differential import differential_attention, differential_attention_reference, packed_differential_attention
from .shrinkage import (
    shrink_towards_mean,
    shrunk_kernel_attention,
    shrunk_kernel_attention_reference,
    shrunk_kernel_attention_unchecked,
)

from .linformer import linformer_attention, linformer_attention_reference, linformer_attention_unchecked
from .nystrom import iterative_pinv, nystrom_attention, nystrom_attention_reference, nystrom_attention_unchecked
from .efficient import (
    efficient_attention,
    efficient_attention_prefill,
    efficient_attention_reference,
    efficient_attention_step,
    efficient_attention_unchecked,
)
from .aft import aft_full, aft_local, aft_reference, aft_simple, aft_simple_prefill, aft_simple_step
from .synthesizer import synthesizer_attention, synthesizer_attention_reference, synthesizer_attention_unchecked
from .fnet import fourier_mixing, fourier_mixing_reference, fourier_mixing_unchecked
from .sinkhorn import (
    sinkhorn_attention,
    sinkhorn_attention_reference,
    sinkhorn_attention_unchecked,
    sinkhorn_balance,
    sinkhorn_sorting,
)
from .clustered import cluster_queries, clustered_attention, clustered_attention_reference, clustered_attention_unchecked
from .lsh import lsh_attention, lsh_attention_reference, lsh_attention_unchecked, lsh_buckets, lsh_rotations
from .blocksparse import blocksparse_attention, blocksparse_attention_reference, blocksparse_attention_unchecked
from .longformer import longformer_attention, longformer_attention_reference, longformer_attention_unchecked
from .state_scan import (
    exclusive_state_scan,
    finish_part,
    part_terms,
    prefix_states_reference,
    split_causal_attention,
)
from .gau import gau_attention, gau_attention_reference, gau_attention_unchecked
from .mixed_chunk import mixed_chunk_attention, mixed_chunk_attention_reference, mixed_chunk_attention_unchecked
from .vq import quantize, vq_attention, vq_attention_reference, vq_attention_step, vq_attention_unchecked
from .copy import (
    copy_weights,
    pointer_generator_log_probs,
    pointer_generator_log_probs_reference,
    scatter_copy,
)

__all__ = sorted(name for name in dir() if not name.startswith("_") and name not in ("annotations",)
                 and callable(globals()[name]))

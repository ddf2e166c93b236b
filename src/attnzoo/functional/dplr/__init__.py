"""The generalized delta rule with a diagonal-plus-low-rank (DPLR) transition, RWKV-7's state update:
``S_t = (diag(exp(log_decay_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``. One module per form.

* :mod:`.chunk`: the parallel form, :func:`dplr_delta_rule`, chunked by the WY representation (a batched
  triangular solve per chunk, a scan over chunks; no loop over tokens), its per-channel decays factorised
  about references that keep every exponent <= 0.
* :mod:`.fused`: the causal chunked form as one autograd Function with a hand-written backward (the fast path
  of :func:`dplr_delta_rule` when not compiled); :mod:`.gentle`, the form it takes where no chunk's decay spans
  more than a quarter of the dtype's exponent range (every factor about the chunk's start).
* :mod:`.rwkv7`: RWKV-7's vectors (decay, removal key, rate, replacement key) from the keys.
* :mod:`.recurrent`: :func:`dplr_delta_rule_step` (O(d_k d_v) per token) and :func:`dplr_delta_rule_prefill`.
* :mod:`.reference`: the float64 per-position recurrence every fast form is tested against.
* :mod:`.checks`: argument checks and the preparation every form shares (padded positions made inert).
"""

from .chunk import DEFAULT_CHUNK_SIZE, dplr_delta_rule, dplr_delta_rule_unchecked
from .recurrent import dplr_delta_rule_prefill, dplr_delta_rule_step, dplr_delta_rule_step_unchecked
from .reference import dplr_delta_rule_reference

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "dplr_delta_rule",
    "dplr_delta_rule_prefill",
    "dplr_delta_rule_reference",
    "dplr_delta_rule_step",
    "dplr_delta_rule_step_unchecked",
    "dplr_delta_rule_unchecked",
]

"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): a linear-attention state that is
corrected, not only added to, at each position. One family, one module per form.

* :mod:`.chunk`: the parallel form, :func:`delta_rule` and :func:`gated_delta_rule`, chunked by the WY / UT
  representation (a batched triangular solve per chunk, a scan over chunks; no loop over tokens).
* :mod:`.recurrent`: :func:`delta_rule_step`, :func:`gated_delta_rule_step` (O(d_k d_v) per token) and
  :func:`delta_rule_prefill`.
* :mod:`.product`: Gated DeltaProduct, n_h delta-rule steps per position, every form run on the shared core
  over the interleaved steps (:func:`delta_product`, its step and prefill).
* :mod:`.reference`: the float64 per-position recurrences every fast form is tested against.
* :mod:`.checks`: argument checks and the preparation every form shares (padded positions made inert).
"""

from .chunk import DEFAULT_CHUNK_SIZE, delta_rule, delta_rule_unchecked, gated_delta_rule
from .product import (
    DEFAULT_PRODUCT_CHUNK_SIZE,
    delta_product,
    delta_product_prefill,
    delta_product_step,
    delta_product_step_unchecked,
    delta_product_unchecked,
)
from .recurrent import delta_rule_prefill, delta_rule_step, delta_rule_step_unchecked, gated_delta_rule_step
from .reference import delta_product_reference, delta_rule_reference

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PRODUCT_CHUNK_SIZE",
    "delta_product",
    "delta_product_prefill",
    "delta_product_reference",
    "delta_product_step",
    "delta_product_step_unchecked",
    "delta_product_unchecked",
    "delta_rule",
    "delta_rule_prefill",
    "delta_rule_reference",
    "delta_rule_step",
    "delta_rule_step_unchecked",
    "delta_rule_unchecked",
    "gated_delta_rule",
    "gated_delta_rule_step",
]

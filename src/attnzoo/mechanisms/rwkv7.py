"""RWKV-7 "Goose" (Peng et al. 2025): the generalized delta rule with a diagonal-plus-low-rank transition.

In attnzoo's orientation (state ``S`` of shape (d_k, d_v), read as ``S^T r``; RWKV writes its transpose)::

    S_t = (diag(w_t) - (kappa_t * alpha_t) kappa_t^T) S_{t-1} + k~_t v_t^T,    o_t = S_t^T r_t / sqrt(d)

a per-channel decay ``w_t`` and a removal along the unit key ``kappa_t`` at a per-channel rate ``alpha_t``
(fla's ``dplr`` with ``a = -kappa``, ``b = kappa * alpha``). The query is RWKV's receptance ``r``.

The mechanism sees only q (= r), k and v per head, not the token-shifted layer input RWKV-7 projects its
vectors from, so they are computed from the (raw) key by small learned maps per head, shaped as RWKV-7's
(:func:`attnzoo.functional.dplr.rwkv7.rwkv7_vectors`):

* decay ``log w_t = -exp(-0.5) * sigmoid(w0 + tanh(k_t W1) W2)`` (LoRA head_dim -> decay_rank -> head_dim),
  so ``w_t`` is in (0.545, 1);
* rate ``alpha_t = sigmoid(a0 + (k_t A1) A2)`` (LoRA head_dim -> a_rank -> head_dim);
* removal key ``kappa_t = normalize(k_t * k_k)`` and replacement key ``k~_t = k_t (1 + (alpha_t - 1) k_a)``,
  with RWKV-7's per-channel ``k_k`` and ``k_a`` learned per head.

RWKV-7's token shift, value residual, bonus term ``(r . (k * u)) v``, output gate and GroupNorm belong to the
surrounding block, not to the attention. Capabilities: causal; non-causal (every query reads the state after
the whole sequence, as ``gated_delta``); key padding (a padded position writes nothing and does not decay the
state); decoding with the (d_k x d_v) state; self-attention only (the writes follow the keys' order).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_positive_int
from ..functional.dplr import (
    DEFAULT_CHUNK_SIZE,
    dplr_delta_rule_reference,
    dplr_delta_rule_step_unchecked,
    dplr_delta_rule_unchecked,
)
from ..functional.dplr.checks import check_chunk_size
from ..functional.dplr.rwkv7 import rwkv7_vectors
from .base import OWN, PACKED_SPLIT, REPEAT_KV, Capabilities, Mechanism, StateLayout
from .registry import register

Vectors = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@register
class RWKV7Attention(Mechanism):
    """RWKV-7's time mixing on per-head r (= q), k, v: the DPLR delta rule, chunked (module docstring).

    Options:
        chunk_size: chunk length of the parallel form, a power of two.
        decay_rank: rank of the decay's LoRA (head_dim -> decay_rank -> head_dim).
        a_rank: rank of the in-context learning rate's LoRA.

    Parameters (per head h): ``w0`` (heads, head_dim) starting at RWKV-7's decay speeds (slow to fast over
    the channels: memories from about a thousand positions down to a few), ``w1`` (heads, head_dim,
    decay_rank), ``w2`` (heads, decay_rank, head_dim); ``a0`` (zeros: alpha starts near 1/2), ``a1``, ``a2``;
    ``k_k`` (0.85) and ``k_a`` (1.0) as RWKV-7 starts them. Decoding state: ``{"state": (batch, heads,
    head_dim, head_dim_v)}`` in the working dtype.
    """

    name = "rwkv7"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N C d log C + N d^2), memory O(N C + N d^2 / C); C = chunk_size; decoding O(d^2) per token",
        summary="RWKV-7: the generalized delta rule, per-channel decay plus a rank-one removal, chunked "
                "(Peng et al. 2025)",
        # The maps are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4, "decay_rank": 3, "a_rank": 2}  # the suite's lengths cross chunk boundaries
    test_variants = ({"chunk_size": 2, "decay_rank": 1, "a_rank": 5},)

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, decay_rank: int = 16,
                 a_rank: int = 16) -> None:
        super().__init__(heads, head_dim)
        self.chunk_size = check_chunk_size(chunk_size)
        self.decay_rank = check_positive_int("decay_rank", decay_rank)
        self.a_rank = check_positive_int("a_rank", a_rank)
        # RWKV-7's decay speeds: -7 + 5 (c / (d - 1))^0.85 over the channels, plus its 0.5 offset.
        speeds = -6.5 + 5.0 * torch.linspace(0.0, 1.0, head_dim) ** 0.85
        self.w0 = nn.Parameter(speeds.expand(heads, head_dim).clone())
        self.w1, self.w2 = self._low_rank(heads, head_dim, self.decay_rank)
        self.a0 = nn.Parameter(torch.zeros(heads, head_dim))
        self.a1, self.a2 = self._low_rank(heads, head_dim, self.a_rank)
        self.k_k = nn.Parameter(torch.full((heads, head_dim), 0.85))
        self.k_a = nn.Parameter(torch.ones(heads, head_dim))

    @staticmethod
    def _low_rank(heads: int, head_dim: int, rank: int) -> Tuple[nn.Parameter, nn.Parameter]:
        """A LoRA's down and up maps: the down map of unit gain, the up map small (RWKV-7 starts the updates of
        its vectors near their biases)."""
        down = torch.randn(heads, head_dim, rank) / math.sqrt(head_dim)
        up = 0.1 * torch.randn(heads, rank, head_dim) / math.sqrt(rank)
        return nn.Parameter(down), nn.Parameter(up)

    def _vectors(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dtype: torch.dtype
                 ) -> Vectors:
        """(q, replacement k, v, a, b, log_decay) in ``dtype``. Padded keys are zeroed first, so a NaN or inf
        they hold reaches none of the maps nor a gradient."""
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        replacement, a, b, log_decay = rwkv7_vectors(k, (self.w0, self.w1, self.w2), (self.a0, self.a1, self.a2),
                                                     self.k_k, self.k_a)
        return q, replacement, v, a, b, log_decay

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        inputs = self._vectors(q, k, v, key_padding_mask, working_dtype(q.dtype))
        out, _ = dplr_delta_rule_unchecked(*inputs, key_padding_mask, None, causal, self.chunk_size)
        return out.to(q.dtype)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """The per-position recurrence in float64 (:func:`attnzoo.functional.dplr_delta_rule_reference`), the
        vectors computed from the float64 keys by the same maps."""
        inputs = self._vectors(q, k, v, key_padding_mask, torch.float64)
        return dplr_delta_rule_reference(*inputs, causal=causal, key_padding_mask=key_padding_mask)

    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        return {"state": ((self.heads, self.head_dim, self.value_width(value_width)), working_dtype(dtype))}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        inputs = self._vectors(q, k, v, None, working_dtype(q.dtype))
        out, state = dplr_delta_rule_unchecked(*inputs, None, None, True, self.chunk_size)
        return out.to(q.dtype), {"state": state}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        inputs = self._vectors(q_t, k_t, v_t, None, working_dtype(q_t.dtype))
        previous = None if tensors is None else tensors["state"]
        out, state = dplr_delta_rule_step_unchecked(*inputs, previous)
        return out.to(q_t.dtype), {"state": state}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, chunk_size={self.chunk_size}, decay_rank={self.decay_rank}, "
                f"a_rank={self.a_rank}")

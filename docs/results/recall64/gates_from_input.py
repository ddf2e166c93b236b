"""An experiment, not part of the package: ``delta`` and ``gated_delta`` with beta (and the decay) projected
from the attention layer's input, as the DeltaNet and Gated DeltaNet papers have it, instead of from the
keys. Registers ``delta_from_input`` and ``gated_delta_from_input``; use with ``attnzoo train --import
docs/results/recall64/gates_from_input.py --mechanism delta_from_input ...``.

The mechanism contract hands a mechanism only q, k and v, so this module wraps
``MultiHeadAttention.forward`` to leave the layer input (batch, seq, dim) on these two mechanisms before
they run. Only the full forward is supported (no decoding step, no packing), which is all training and
evaluation on the recall task use.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.attention import MultiHeadAttention
from attnzoo.mechanisms.registry import register
from attnzoo.mechanisms.delta import DeltaNetAttention, GatedDeltaNetAttention

_forward = MultiHeadAttention.forward


def _forward_leaving_input(self: MultiHeadAttention, x: Tensor, *args, **kwargs) -> Tensor:
    if isinstance(self.mechanism, _FromInput):
        self.mechanism.layer_input = x
    return _forward(self, x, *args, **kwargs)


MultiHeadAttention.forward = _forward_leaving_input


class _FromInput:
    """beta = sigmoid(x W_beta + b) with x the layer input (width heads * head_dim here, no grouped heads)."""

    layer_input: Optional[Tensor] = None

    def _input_logits(self, projection: nn.Linear, q: Tensor) -> Tensor:
        x = self.layer_input
        if x is None or x.shape[:2] != (q.shape[0], q.shape[2]):
            raise RuntimeError(f"{self.name}: no layer input of this batch and length was left by the layer")
        return projection(x.to(q.dtype)).transpose(1, 2)  # (B, H, N)

    def _gated_inputs(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        q, k = q.float(), k.float()
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        beta = torch.sigmoid(self._input_logits(self.beta_projection, q))
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), beta, self.input_log_decay(q)

    def input_log_decay(self, q: Tensor) -> Optional[Tensor]:
        return None


@register
class DeltaFromInput(_FromInput, DeltaNetAttention):
    """``delta`` with beta projected from the layer input (experiment)."""

    name = "delta_from_input"

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = 32) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.beta_projection = nn.Linear(heads * head_dim, heads)


@register
class GatedDeltaFromInput(_FromInput, GatedDeltaNetAttention):
    """``gated_delta`` with beta and the step size of the decay projected from the layer input (experiment);
    ``A_log`` and ``dt_bias`` initialised as ``gated_delta``'s."""

    name = "gated_delta_from_input"

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = 32) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.beta_projection = nn.Linear(heads * head_dim, heads)
        self.step_projection = nn.Linear(heads * head_dim, heads, bias=False)
        nn.init.normal_(self.step_projection.weight, std=1 / math.sqrt(heads * head_dim))

    def input_log_decay(self, q: Tensor) -> Tensor:
        logits = self._input_logits(self.step_projection, q) + self.dt_bias.to(q.dtype).unsqueeze(-1)
        return self.A_log.to(q.dtype).exp().unsqueeze(-1) * F.logsigmoid(-logits)

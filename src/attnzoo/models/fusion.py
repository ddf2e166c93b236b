"""Attention-based fusion of per-modality feature vectors into one vector.

Each modality ``p`` of a sample contributes one feature vector ``h_p`` (the output of its own encoder: an
image embedding, a text embedding, a sensor summary, ...). A one-layer MLP scores every modality,

    s_p = u . tanh(W h_p + b)            W: (hidden, dim), b: (hidden,), u: (hidden,)

the scores are normalised with a softmax over the modalities of the sample, and the fused vector is the
weighted sum ``sum_p alpha_p h_p``. The scorer is shared by every modality, so the weights depend on what a
modality's features hold, per sample: a modality whose features look uninformative for this sample can be
down-weighted for it alone. The weights are returned too, so they can be read as a per-sample importance.

Missing modalities (a sensor that failed, a record without an image) are marked in a bool mask and take no
part: their weight is exactly zero and their features are never read, so NaN or inf placeholders are safe.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_floating, check_positive_int

__all__ = ["AttentionFusion", "attention_fusion_reference"]


class AttentionFusion(nn.Module):
    """Fuse one feature vector per modality into one vector with learned, per-sample attention weights.

    Args:
        dim: size of each modality's feature vector (every modality shares it; project first if they differ).
        modalities: number of modalities, fixed at construction (the module checks every input against it).
        hidden: width of the scoring MLP (``W`` is ``hidden x dim``); ``dim`` when None.

    Forward:
        h: (batch, modalities, dim) floating features, one vector per modality.
        missing: optional (batch, modalities) bool mask, True = the modality is missing for that sample. A
            missing modality gets weight exactly 0 and its features are replaced by zeros before any use, so
            whatever they hold (NaN and inf included) changes neither output nor gradients.

    Returns:
        ``(fused, weights)``: fused (batch, dim) ``= sum_p weights[:, p] * h[:, p]`` and weights
        (batch, modalities), which sum to 1 over the present modalities of each sample. A sample whose
        modalities are ALL missing has nothing to attend to: its weights are all 0 and its fused vector is
        zeros (never NaN), as a padded query with no visible key yields zeros in the attention mechanisms.
        Both are in ``h``'s dtype. The scores and the sum are computed in float32 for half-precision
        inputs and in ``h``'s dtype otherwise, with the parameters cast to it (a float32 module takes
        float64 input and computes in float64).

    Example::

        fusion = AttentionFusion(dim=64, modalities=3)
        fused, weights = fusion(torch.randn(8, 3, 64))                 # (8, 64), (8, 3)
        missing = torch.tensor([[False, True, False]]).expand(8, -1)   # modality 1 absent everywhere
        fused, weights = fusion(torch.randn(8, 3, 64), missing=missing)  # weights[:, 1] == 0
    """

    def __init__(self, dim: int, modalities: int, hidden: Optional[int] = None) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.modalities = check_positive_int("modalities", modalities)
        self.hidden = self.dim if hidden is None else check_positive_int("hidden", hidden)
        # W and b of the scoring MLP, initialised as nn.Linear is (from the global RNG, so seeding before
        # construction makes the module reproducible).
        self.proj = nn.Linear(self.dim, self.hidden)
        # u, the context vector the hidden scores are read against; nn.Linear's bound for fan_in = hidden, so
        # the initial scores are small and the initial weights close to uniform.
        bound = 1.0 / math.sqrt(self.hidden)
        self.context = nn.Parameter(torch.empty(self.hidden).uniform_(-bound, bound))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, modalities={self.modalities}, hidden={self.hidden}"

    def check_inputs(self, h: Tensor, missing: Optional[Tensor]) -> None:
        """Raise a TypeError/ValueError naming ``h`` or ``missing`` when they do not fit this module."""
        check_floating("h", h)
        if h.dim() != 3:
            raise ValueError(
                f"h must have shape (batch, modalities, dim), got {h.dim()} dims: {tuple(h.shape)}"
            )
        if h.shape[1] != self.modalities:
            raise ValueError(
                f"h of shape {tuple(h.shape)}: got {h.shape[1]} modalities, the module was built with "
                f"modalities={self.modalities}"
            )
        if h.shape[2] != self.dim:
            raise ValueError(
                f"h of shape {tuple(h.shape)}: got feature size {h.shape[2]}, the module was built with dim={self.dim}"
            )
        device = self.proj.weight.device
        if h.device != device:
            raise ValueError(f"h must be on the module's device {device}, got {h.device}")
        if missing is None:
            return
        if not isinstance(missing, Tensor):
            raise TypeError(f"missing must be a torch.Tensor or None, got {type(missing).__name__}")
        if missing.dtype != torch.bool:
            raise TypeError(f"missing must be a bool tensor (True = modality missing), got {missing.dtype}")
        expected = (h.shape[0], self.modalities)
        if tuple(missing.shape) != expected:
            raise ValueError(
                f"missing must have shape (batch, modalities) = {expected}, got {tuple(missing.shape)}"
            )
        if missing.device != h.device:
            raise ValueError(f"missing must be on h's device {h.device}, got {missing.device}")

    def forward(self, h: Tensor, missing: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """h: (batch, modalities, dim); missing: (batch, modalities) bool or None.

        Returns fused (batch, dim) and weights (batch, modalities); see the class docstring."""
        self.check_inputs(h, missing)
        return self._fuse(h, missing)

    def _fuse(self, h: Tensor, missing: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        dtype = working_dtype(h.dtype)
        x = h.to(dtype)
        if missing is not None:
            # Zeroed before the scorer and the sum: NaN * 0 is NaN, so masking the weights alone would leak.
            x = x.masked_fill(missing.unsqueeze(-1), 0.0)
        weight, bias, context = (p.to(dtype) for p in (self.proj.weight, self.proj.bias, self.context))
        scores = torch.tanh(F.linear(x, weight, bias)) @ context  # (batch, modalities)
        if missing is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            present = ~missing
            # The lowest finite value rather than -inf: a row with every modality missing then gives a finite
            # (uniform) softmax instead of 0/0, and the product with `present` sets it to zeros. The scores are
            # bounded by ||u||_1 (tanh is), so exp(lowest - max) underflows to exactly 0 in any other row.
            scores = scores.masked_fill(missing, torch.finfo(dtype).min)
            weights = torch.softmax(scores, dim=-1) * present.to(dtype)
        fused = (weights.unsqueeze(1) @ x).squeeze(1)  # (batch, 1, modalities) @ (batch, modalities, dim)
        return fused.to(h.dtype), weights.to(h.dtype)

    def reference(self, h: Tensor, missing: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The forward pass computed by :func:`attention_fusion_reference` with this module's parameters:
        float64, explicit loops. For tests; returns float64 tensors on the CPU."""
        self.check_inputs(h, missing)
        return attention_fusion_reference(h, self.proj.weight, self.proj.bias, self.context, missing)


@torch.no_grad()
def attention_fusion_reference(
    h: Tensor, weight: Tensor, bias: Tensor, context: Tensor, missing: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """Slow, obviously-correct attention fusion in float64 with explicit loops over samples and modalities.

    Args:
        h: (batch, modalities, dim); weight: (hidden, dim); bias: (hidden,); context: (hidden,);
        missing: (batch, modalities) bool or None, True = missing.

    Returns:
        fused (batch, dim) and weights (batch, modalities), float64 on the CPU. Missing modalities get weight
        0 and are never read; a sample with none present gets zeros for both.
    """
    h, weight, bias, context = (t.detach().to("cpu", torch.float64) for t in (h, weight, bias, context))
    batch, modalities, dim = h.shape
    fused = torch.zeros(batch, dim, dtype=torch.float64)
    weights = torch.zeros(batch, modalities, dtype=torch.float64)
    for i in range(batch):
        present = [p for p in range(modalities) if missing is None or not bool(missing[i, p])]
        if not present:
            continue
        scores = {}
        for p in present:
            hidden = [math.tanh(float(weight[j] @ h[i, p]) + float(bias[j])) for j in range(weight.shape[0])]
            scores[p] = sum(float(context[j]) * hidden[j] for j in range(len(hidden)))
        top = max(scores.values())
        exps = {p: math.exp(s - top) for p, s in scores.items()}
        total = sum(exps.values())
        for p in present:
            weights[i, p] = exps[p] / total
            fused[i] += weights[i, p] * h[i, p]
    return fused, weights

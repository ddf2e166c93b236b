"""The cross-attention weights of a :class:`~attnzoo.models.seq2seq.Seq2SeqTransformer`, seen from outside:
recomputed from the queries and keys its softmax cross-attention receives, the attention itself untouched.

Used by the guide loss of training (:mod:`attnzoo.training.seq2seq`) and by monotonic decoding
(:mod:`attnzoo.models.monotonic`), whose focus follows the weights.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from torch import Tensor

from ..mechanisms.base import UnsupportedOptionError
from .seq2seq import Seq2SeqTransformer


class CrossAttentionWeights:
    """While entered, records the cross-attention weights of every decoder layer of a :class:`Seq2SeqTransformer`,
    one (batch, heads, seq_tgt, seq_src) float32 tensor per layer and call in ``weights``, in layer order,
    recomputed from the queries and keys its softmax cross-attention receives (with gradient, so that a loss
    can be put on them; padding and any other hidden source position get weight 0). Use as a context manager::

        with CrossAttentionWeights(model, "the guide loss") as recorder:
            logits = model(src, tgt, src_padding_mask=mask)
        recorder.weights  # one tensor per decoder layer

    ``purpose`` names what needs the weights in the :class:`~attnzoo.UnsupportedOptionError` raised for a model
    whose cross-attention is not exact softmax (``quiet`` included).
    """

    def __init__(self, model: Seq2SeqTransformer, purpose: str) -> None:
        self.mechanisms = [layer.cross_attention.mechanism for layer in model.decoder.layers
                           if getattr(layer, "cross_attention", None) is not None]
        for mechanism in self.mechanisms:
            if mechanism.name != "softmax" or mechanism.quiet:
                raise UnsupportedOptionError(f"{purpose} needs softmax cross-attention, got {mechanism.name!r}")
        self.weights: List[Tensor] = []
        self._handles: List[Any] = []

    def _record(self, module: Any, args: Tuple[Tensor, ...], kwargs: Dict[str, Any]) -> None:
        q, k = args[0], args[1]
        if k.shape[1] != q.shape[1]:  # grouped-query cross-attention: query head h reads key head h // groups
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = module.scale if module.scale is not None else q.shape[-1] ** -0.5
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        mask = kwargs.get("key_padding_mask")
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        self.weights.append(scores.softmax(dim=-1))

    def __enter__(self) -> "CrossAttentionWeights":
        self.weights = []
        self._handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for m in self.mechanisms]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

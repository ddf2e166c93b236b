"""The cross-attention weights of a :class:`~attnzoo.models.seq2seq.Seq2SeqTransformer`, seen from outside:
recomputed from the queries and keys its softmax cross-attention receives, the attention itself untouched.

Used by the guide loss of training (:mod:`attnzoo.training.seq2seq`) and by monotonic decoding
(:mod:`attnzoo.models.monotonic`), whose focus follows the weights.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor

from ..mechanisms.base import Mechanism, UnsupportedOptionError
from .seq2seq import Seq2SeqTransformer


def softmax_weights_refusal(mechanism: Mechanism) -> Optional[str]:
    """Why a cross-attention mechanism's weights are not a softmax distribution over the source positions that
    can be read (capabilities ``kind="exact"`` and ``attention_weights``), or None when they are."""
    caps = mechanism.capabilities
    if caps.exact and caps.attention_weights:
        return None
    missing = "attention_weights" if caps.exact else "exact"
    return f"{mechanism.refused_by(missing)} is not (capability {missing}=False)"


class CrossAttentionWeights:
    """While entered, records the cross-attention weights of every decoder layer of a :class:`Seq2SeqTransformer`,
    one (batch, heads, seq_tgt, seq_src) float32 tensor per layer and call in ``weights``, in layer order,
    recomputed from the queries and keys its softmax cross-attention receives (with gradient, so that a loss
    can be put on them; padding and any other hidden source position get weight 0). Use as a context manager::

        with CrossAttentionWeights(model, "the guide loss") as recorder:
            logits = model(src, tgt, src_padding_mask=mask)
        recorder.weights  # one tensor per decoder layer

    ``purpose`` names what needs the weights in the :class:`~attnzoo.UnsupportedOptionError` raised for a model
    whose cross-attention is not exact softmax with its weights (:func:`softmax_weights_refusal`).
    """

    def __init__(self, model: Seq2SeqTransformer, purpose: str) -> None:
        self.mechanisms = [layer.cross_attention.mechanism for layer in model.decoder.layers
                           if getattr(layer, "cross_attention", None) is not None]
        for mechanism in self.mechanisms:
            refused = softmax_weights_refusal(mechanism)
            if refused:
                raise UnsupportedOptionError(f"{purpose} needs exact softmax cross-attention: {refused}")
        self.weights: List[Tensor] = []
        self._handles: List[Any] = []

    def _record(self, module: Any, args: Tuple[Tensor, ...], kwargs: Dict[str, Any]) -> None:
        q, k = args[0], args[1]
        mask = kwargs.get("key_padding_mask")
        self.weights.append(module.attention_weights(q.float(), k.float(), mask))

    def __enter__(self) -> "CrossAttentionWeights":
        self.weights = []
        self._handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for m in self.mechanisms]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

"""Transformer layers and models built on :class:`attnzoo.MultiHeadAttention`."""

from .layers import DecoderLayer, EncoderLayer, FeedForward, LayerState
from .transformer import (
    Decoder,
    DecoderState,
    Encoder,
    LanguageModel,
    Seq2SeqTransformer,
    SequenceClassifier,
    TokenEmbedding,
)

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LayerState",
    "Decoder",
    "DecoderState",
    "Encoder",
    "LanguageModel",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "TokenEmbedding",
]

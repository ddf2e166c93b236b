"""Transformer layers and models built on :class:`attnzoo.MultiHeadAttention`."""

from .config import AttentionSpec, BlockConfig
from .fusion import AttentionFusion
from .gau import GatedAttentionUnit, GatedDecoderLayer, GatedEncoderLayer
from .layers import DecoderLayer, EncoderLayer, FeedForward, LayerState
from .reversible import ReversibleDecoder, ReversibleEncoder
from .pointer import CopyMemory, PointerGenerator
from .transformer import (
    CopyDecoderState,
    Decoder,
    DecoderState,
    Encoder,
    LanguageModel,
    Seq2SeqTransformer,
    SequenceClassifier,
    SequenceTagger,
    TokenEmbedding,
)

__all__ = [
    "AttentionFusion",
    "AttentionSpec",
    "BlockConfig",
    "CopyDecoderState",
    "CopyMemory",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "GatedAttentionUnit",
    "GatedDecoderLayer",
    "GatedEncoderLayer",
    "LayerState",
    "Decoder",
    "DecoderState",
    "Encoder",
    "LanguageModel",
    "PointerGenerator",
    "ReversibleDecoder",
    "ReversibleEncoder",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "SequenceTagger",
    "TokenEmbedding",
]

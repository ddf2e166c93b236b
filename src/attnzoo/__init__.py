"""attnzoo: every important attention mechanism behind one PyTorch API.

Quick start::

    import torch, attnzoo
    attnzoo.available()                           # registered mechanism names
    mha = attnzoo.MultiHeadAttention(dim=512, heads=8, mechanism="softmax")
    y = mha(torch.randn(2, 128, 512), causal=True)  # (batch, seq, dim) -> (batch, seq, dim)
"""

from . import functional
from .attention import AttentionState, MultiHeadAttention
from .mechanisms import (
    Capabilities,
    Mechanism,
    UnsupportedOptionError,
    available,
    build_mechanism,
    capabilities,
    mechanism_options,
    register,
)
from .positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding
from . import decoding
from .decoding import BeamSearchResult, beam_search, greedy_decode, nat_decode, sample_decode
from .swap import SwapReport, SwappedAttention, swap_attention
from .models import (
    AttentionFusion,
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    LanguageModel,
    ReversibleDecoder,
    ReversibleEncoder,
    Seq2SeqTransformer,
    SequenceClassifier,
    SequenceTagger,
)

__version__ = "0.1.0"

__all__ = [
    "functional",
    "AttentionFusion",
    "AttentionState",
    "MultiHeadAttention",
    "Capabilities",
    "Mechanism",
    "UnsupportedOptionError",
    "available",
    "build_mechanism",
    "capabilities",
    "mechanism_options",
    "register",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "decoding",
    "BeamSearchResult",
    "beam_search",
    "greedy_decode",
    "nat_decode",
    "sample_decode",
    "SwapReport",
    "SwappedAttention",
    "swap_attention",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "LanguageModel",
    "ReversibleDecoder",
    "ReversibleEncoder",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "SequenceTagger",
]

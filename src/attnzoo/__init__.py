"""attnzoo: every important attention mechanism behind one PyTorch API.

Quick start::

    import torch, attnzoo
    attnzoo.available()                           # registered mechanism names
    mha = attnzoo.MultiHeadAttention(dim=512, heads=8, mechanism="softmax")
    y = mha(torch.randn(2, 128, 512), causal=True)  # (batch, seq, dim) -> (batch, seq, dim)
"""

import sys

from . import functional
from .attention import AttentionState, MultiHeadAttention
from .mechanisms import (
    CallInput,
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
from . import dropin, parallel
from .dropin import SwapReport, SwappedAttention, swap_attention
from .models import (
    AttentionFusion,
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    LanguageModel,
    ModelConfig,
    MultiHeadLatentAttention,
    ReversibleDecoder,
    ReversibleEncoder,
    Seq2SeqTransformer,
    SequenceClassifier,
    SequenceTagger,
)

# Modules that moved into subpackages, importable under their old names so that code written against them keeps
# working: `import attnzoo.swap`, `from attnzoo.hf import use_attnzoo` give the very modules (and objects) of
# their new homes. Aliases here rather than files left at the top level, which would be second copies to keep.
_MOVED_MODULES = {
    "swap": dropin.swap,  # torch.nn.MultiheadAttention swapping
    "hf": dropin.hf,  # Hugging Face transformers
    "distributed": parallel.sequence,  # sequence parallelism
}
for _old_name, _module in _MOVED_MODULES.items():
    sys.modules[f"{__name__}.{_old_name}"] = _module
    globals()[_old_name] = _module  # what `attnzoo.swap.swap_attention` after `import attnzoo.swap` reads
del _old_name, _module

__version__ = "0.1.0"

__all__ = [
    "functional",
    "AttentionFusion",
    "AttentionState",
    "MultiHeadAttention",
    "CallInput",
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
    "dropin",
    "parallel",
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
    "ModelConfig",
    "MultiHeadLatentAttention",
    "ReversibleDecoder",
    "ReversibleEncoder",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "SequenceTagger",
]

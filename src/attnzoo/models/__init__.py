"""Transformer layers and models built on :class:`attnzoo.MultiHeadAttention`.

By role: :mod:`.config` (BlockConfig, ModelConfig), :mod:`.latent_attention` (multi-head latent attention, the
attention of ``block="mla"``), :mod:`.layers`, :mod:`.gau` and :mod:`.mamba2` (one layer),
:mod:`.stacks` and :mod:`.reversible` (stacks of layers), :mod:`.embeddings` and :mod:`.inputs`,
:mod:`.language` (language model, classifier, tagger), :mod:`.seq2seq` (encoder-decoder) with its
:mod:`.pointer`, :mod:`.nat`, :mod:`.cross_attention` and :mod:`.monotonic` options, :mod:`.fusion`.
"""

from .config import AttentionSpec, BlockConfig, ModelConfig
from .fusion import AttentionFusion
from .gau import GatedAttentionUnit, GatedDecoderLayer, GatedEncoderLayer
from .latent_attention import LatentAttentionState, MultiHeadLatentAttention
from .layers import DecoderLayer, EncoderLayer, FeedForward, LatentDecoderLayer, LatentEncoderLayer, LayerState
from .mamba2 import Mamba2Block, Mamba2DecoderLayer, Mamba2EncoderLayer, Mamba2State
from .reversible import ReversibleDecoder, ReversibleEncoder
from .pointer import CopyMemory, PointerGenerator
from .embeddings import TokenEmbedding
from .language import LanguageModel, SequenceClassifier, SequenceTagger
from .seq2seq import CopyDecoderState, Seq2SeqTransformer
from .stacks import Decoder, DecoderState, Encoder

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
    "LatentAttentionState",
    "LatentDecoderLayer",
    "LatentEncoderLayer",
    "LayerState",
    "Mamba2Block",
    "Mamba2DecoderLayer",
    "Mamba2EncoderLayer",
    "Mamba2State",
    "Decoder",
    "DecoderState",
    "Encoder",
    "LanguageModel",
    "ModelConfig",
    "MultiHeadLatentAttention",
    "PointerGenerator",
    "ReversibleDecoder",
    "ReversibleEncoder",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "SequenceTagger",
    "TokenEmbedding",
]

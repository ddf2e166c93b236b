"""The names this module held before the models were split by role, importable from here as before.

The code lives in :mod:`~attnzoo.models.inputs` (input checks), :mod:`~attnzoo.models.embeddings`
(:class:`TokenEmbedding`), :mod:`~attnzoo.models.stacks` (:class:`Encoder`, :class:`Decoder`),
:mod:`~attnzoo.models.language` (:class:`LanguageModel`, :class:`SequenceClassifier`,
:class:`SequenceTagger`) and :mod:`~attnzoo.models.seq2seq` (:class:`Seq2SeqTransformer`); import from
:mod:`attnzoo.models` or from those modules. Nothing inside :mod:`attnzoo.models` imports this one.
"""

from __future__ import annotations

from .config import POSITIONAL_KINDS
from .embeddings import TokenEmbedding
from .inputs import check_padding_mask, check_tokens
from .language import POOLING_KINDS, LanguageModel, SequenceClassifier, SequenceTagger
from .seq2seq import CopyDecoderState, Seq2SeqTransformer
from .stacks import Decoder, DecoderState, Encoder

__all__ = [
    "CopyDecoderState",
    "Decoder",
    "DecoderState",
    "Encoder",
    "LanguageModel",
    "POOLING_KINDS",
    "POSITIONAL_KINDS",
    "Seq2SeqTransformer",
    "SequenceClassifier",
    "SequenceTagger",
    "TokenEmbedding",
    "check_padding_mask",
    "check_tokens",
]

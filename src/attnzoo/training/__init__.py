"""Training on :mod:`attnzoo.tasks`: a config, the loop, evaluation and atomic checkpoints that resume exactly.

    from attnzoo.training import TrainConfig, train
    result = train(TrainConfig("listops", mechanism="performer", steps=200), output="runs/listops-performer")
    result.test, result.baseline     # {'loss': ..., 'accuracy': ...}, {'accuracy': ...}

``attnzoo train`` calls :func:`keep_freed_memory` first (glibc keeps freed tensors' pages for the next step);
``train`` itself leaves the process's allocator alone, so a script that wants the same speed calls it too.
"""

from .._malloc import keep_freed_memory
from .checkpoint import CheckpointError, find_checkpoint
from .config import TrainConfig
from .decoders import DecoderSettings
from .loop import TrainResult, batch_indices, evaluate, evaluate_checkpoint, load_trained, train
from .model import build_model, unsupported_reasons

__all__ = [
    "CheckpointError",
    "DecoderSettings",
    "TrainConfig",
    "TrainResult",
    "batch_indices",
    "build_model",
    "evaluate",
    "evaluate_checkpoint",
    "find_checkpoint",
    "keep_freed_memory",
    "load_trained",
    "train",
    "unsupported_reasons",
]

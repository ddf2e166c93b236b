"""Parallel training and attention across processes.

Data parallelism (:mod:`attnzoo.parallel.data`): every rank holds the whole model and trains on its share of each
batch, gradients averaged by DDP (``attnzoo train`` under torchrun).
"""

from .data import DataParallel, launched_by_torchrun, mechanism_reasons, start_from_environment, stop

__all__ = ["DataParallel", "launched_by_torchrun", "mechanism_reasons", "start_from_environment", "stop"]

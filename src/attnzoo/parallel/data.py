"""Data-parallel training over ``torch.distributed``: ``attnzoo train`` under ``torchrun --nproc-per-node N``.

Every rank builds the same model from the same seed, and :class:`DataParallel` wraps it in
``DistributedDataParallel`` (which also broadcasts rank 0's parameters and buffers once, at wrapping). Each
optimiser step takes the configured global batch (the same on every rank), and each rank trains on its contiguous
``1 / N`` share of it (:meth:`DataParallel.shard`). The loss of a shard is weighted
(:meth:`DataParallel.loss_weight`) so that DDP's all-reduced mean of the gradients is exactly the single-process
gradient of the global batch, whatever number of scored targets each shard holds. Every rank then takes the same
optimiser step (clipping sees the same all-reduced gradients), so the replicas stay equal.

Rank 0 alone evaluates, logs, shows the progress bar and writes checkpoints, ``metrics.csv`` and
``results.json``; the other ranks wait for it at a barrier after each checkpoint. A mechanism's update after the
optimiser step (:meth:`attnzoo.Mechanism.after_optimizer_step`: redraws of random features) draws from a
generator seeded by the step and the run's seed, so every rank updates alike without communicating. Dropout
differs between ranks (each rank's generator is seeded from its rank), as it would between the examples of one
large batch.

A model whose mechanisms give reasons against data parallelism (:meth:`attnzoo.Mechanism.data_parallel_reasons`,
e.g. codebooks updated from per-rank statistics; :func:`mechanism_reasons`) is refused when wrapped. The settings
of a training run that data parallelism cannot honour are the training side's to name
(:func:`attnzoo.training.data_parallel_reasons`): this module knows models, batches and ranks, not runs.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..mechanisms.base import Mechanism

TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
"""Environment variables torchrun sets for every worker; their presence is what marks a torchrun launch."""
_RANK_SEED_STRIDE = 7_919  # a prime: each rank's dropout generator seed differs from every other's
# DDP's switch for broadcasting rank 0's buffers before every forward: renamed in newer torch, which warns on the
# old name (both still sync the buffers once, when the model is wrapped).
_BUFFER_SYNC_OPTION = ("forward_sync_buffers"
                       if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                       else "broadcast_buffers")


class _Replica(DistributedDataParallel):
    """DistributedDataParallel that reads attributes it lacks from the wrapped model (``model.decoder`` for the
    guide loss's recorder of cross-attention weights), so the training code treats it as the model itself."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not wrapped yet: nothing to fall back on
                raise
            return getattr(self.module, name)


def mechanism_reasons(model: nn.Module) -> List[str]:
    """Why the mechanisms in ``model`` cannot train data-parallel: every reason their
    :meth:`~attnzoo.Mechanism.data_parallel_reasons` give, each once, in module order; empty when they can."""
    reasons: List[str] = []
    for module in model.modules():
        if isinstance(module, Mechanism):
            reasons += [reason for reason in module.data_parallel_reasons() if reason not in reasons]
    return reasons


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel run: its ``rank`` of ``world_size`` in ``group`` (the default group
    when None), and the ``device`` its replica lives on (CPU with gloo; ``cuda:LOCAL_RANK`` with nccl)."""

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")
    group: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_group(cls, group: Optional[dist.ProcessGroup] = None,
                   device: Optional[torch.device] = None) -> "DataParallel":
        """The run of an already initialised process group (the default one when ``group`` is None)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("data-parallel training needs torch.distributed initialised "
                               "(torch.distributed.init_process_group, or a launch by torchrun)")
        return cls(dist.get_rank(group), dist.get_world_size(group), device or torch.device("cpu"), group)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that evaluates, logs and writes files."""
        return self.rank == 0

    # -- the batch and the loss ------------------------------------------------------------------------------
    def shard(self, index: Tensor) -> Tensor:
        """This rank's contiguous share of a global batch's example indices (length divisible by the ranks)."""
        size = index.shape[0] // self.world_size
        return index[self.rank * size:(self.rank + 1) * size]

    def loss_weight(self, local_count: int, global_count: int) -> float:
        """The factor on this rank's mean loss (over its ``local_count`` scored targets) such that DDP's mean of
        the ranks' gradients is the gradient of the mean over all ``global_count`` scored targets of the global
        batch: ``world_size * local_count / global_count`` (sum over ranks of ``local_sum / global_count``)."""
        return self.world_size * local_count / max(global_count, 1)

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` (already on :attr:`device`) wrapped in DistributedDataParallel; a ValueError giving every
        reason of :func:`mechanism_reasons` when its mechanisms cannot train data-parallel.

        No buffer broadcast before each forward (``forward_sync_buffers=False``, formerly
        ``broadcast_buffers``): the buffers (random projections among them) are equal on every rank by
        construction and seeded redraws, so they need none. ``static_graph=True``:
        the same parameters take part in every step, which lets DDP skip the ones a mechanism never uses
        (the query and key projections of a mixing that reads only the values) without searching the graph for
        them each step."""
        reasons = mechanism_reasons(model)
        if reasons:
            raise ValueError("; ".join(reasons))
        device_ids = None if self.device.type == "cpu" else [self.device]
        return _Replica(model, device_ids=device_ids, process_group=self.group, static_graph=True,
                        **{_BUFFER_SYNC_OPTION: False})

    def seed_dropout(self, seed: int, step: int) -> None:
        """Give this rank its own global generator (dropout), derived from the run's seed, its rank and the step
        it starts at; rank 0 keeps the generator it has, so one process and rank 0 draw alike."""
        if self.rank:
            torch.manual_seed(seed * 1_000_003 + _RANK_SEED_STRIDE * self.rank + step)

    # -- communication ---------------------------------------------------------------------------------------
    def sum(self, values: Sequence[float]) -> List[float]:
        """Each of ``values`` summed over the ranks (float64, one all_reduce)."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._communication_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.tolist()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank."""
        holder = [value]
        dist.broadcast_object_list(holder, src=self._global_rank(0), group=self.group,
                                   device=self._communication_device)
        return holder[0]

    def gather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Wait until every rank arrives (after rank 0 has written a checkpoint)."""
        dist.barrier(group=self.group, device_ids=None if self.device.type == "cpu" else [self.device.index])

    @property
    def _communication_device(self) -> torch.device:
        return self.device  # nccl communicates CUDA tensors only; gloo CPU ones

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def launched_by_torchrun(environment: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is one worker of a multi-process torchrun launch (WORLD_SIZE > 1)."""
    environment = os.environ if environment is None else environment
    if not all(name in environment for name in TORCHRUN_VARIABLES):
        return False
    try:
        return int(environment["WORLD_SIZE"]) > 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {environment['WORLD_SIZE']!r}") from None


def start_from_environment(timeout_s: float = 1800.0) -> Optional[DataParallel]:
    """Join the process group of a torchrun launch: nccl on ``cuda:LOCAL_RANK`` when CUDA is available, gloo on
    the CPU otherwise. None when this process was not started by torchrun with more than one worker."""
    if not launched_by_torchrun():
        return None
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DataParallel.from_group(None, device)


def stop(parallel: Optional[DataParallel]) -> None:
    """Leave the process group :func:`start_from_environment` joined (nothing when None)."""
    if parallel is not None and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["DataParallel", "launched_by_torchrun", "mechanism_reasons", "start_from_environment", "stop"]

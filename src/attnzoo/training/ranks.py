"""How many processes a training run spans, as the loop sees it: :class:`SingleProcess`, or :class:`Replicas`
around an :class:`attnzoo.parallel.DataParallel` (one of several ranks). The loop calls the same methods on
either and never asks which it has.

:func:`data_parallel_reasons` names what keeps a run's settings from training data-parallel: the settings
this side knows (the global batch, scheduled sampling) and the mechanism's own reasons
(:meth:`attnzoo.Mechanism.data_parallel_reasons`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..mechanisms import build_mechanism
from ..parallel.data import DataParallel, mechanism_reasons
from .config import TrainConfig


def data_parallel_reasons(config: TrainConfig, world_size: int) -> List[str]:
    """Why ``config`` cannot train on ``world_size`` ranks (empty when it can), each reason naming the setting.

    The mechanism is asked with the run's options (built once, on the side, with its default length option where
    the run leaves it to the task); options it refuses are left to building the model to report."""
    reasons = []
    if config.batch_size % world_size:
        reasons.append(f"batch_size {config.batch_size} is the global batch and must be divisible by the "
                       f"{world_size} ranks (each trains on an equal share)")
    for name, options in config.attention_items():  # the one mechanism, or each of the schedule's
        try:
            with torch.random.fork_rng(devices=[]):
                mechanism = build_mechanism(name, config.heads, config.dim // config.heads, **options)
        except (TypeError, ValueError):
            continue
        reasons += mechanism_reasons(mechanism)
    if config.scheduled_sampling != "none":
        reasons.append(f"scheduled_sampling {config.scheduled_sampling!r} draws its mixing mask for the rank's "
                       "share of the batch, not for the global batch: use 'none' with data parallelism")
    return reasons


class SingleProcess:
    """A run in this process alone, on one device: the whole batch, nothing to communicate."""

    device = torch.device("cpu")
    is_main = True  # the process that evaluates, logs and writes files

    def __init__(self, device: Optional[torch.device] = None) -> None:
        if device is not None:
            self.device = device

    def check(self, config: TrainConfig) -> None:
        """Nothing to refuse."""

    def prepare(self, model: nn.Module, seed: int, start: int, restored: bool) -> nn.Module:
        """What the training step calls: the model itself (``restored``: whether :meth:`restore_rng` set this
        process's generators from a checkpoint; nothing to draw either way)."""
        return model

    def shard(self, index: Tensor) -> Tensor:
        return index

    def loss_weight(self, local_count: int, global_count: int) -> float:
        return 1.0

    def reduce(self, tally_sums: Tuple[float, int, int], stopping: bool) -> Tuple[Tuple[float, int, int], bool]:
        """The tally's sums (loss, scored, correct) and whether to stop, over every rank: these."""
        return tally_sums, stopping

    def stops(self, interrupted: bool, requested: bool) -> bool:
        """Whether to stop after this step: an interrupt ``requested`` by now, even during ``on_step``
        (``interrupted``: one by the end of the step's update, on any rank)."""
        return requested

    def broadcast(self, value: Any) -> Any:
        return value

    def rng_states(self) -> Dict[str, Any]:
        """Generator states a checkpoint keeps beside the main one: a CUDA device's (its dropout draws from it)."""
        if self.device.type == "cuda":
            return {"cuda_rng": torch.cuda.get_rng_state(self.device)}
        return {}

    def restore_rng(self, state: Dict[str, Any]) -> bool:
        """Set the generators :meth:`rng_states` saved in ``state`` (a checkpoint's training state; the main
        CPU generator is the caller's); whether this process's generators are now the saved ones."""
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return True

    def barrier(self) -> None:
        """No other rank to wait for."""


class Replicas(SingleProcess):
    """This rank of a data-parallel run (:class:`~attnzoo.parallel.DataParallel`): its share of each global batch,
    DDP's averaged gradients, rank 0's evaluations broadcast, a barrier after each checkpoint."""

    def __init__(self, parallel: DataParallel) -> None:  # noqa: D107 (the device is the rank's)
        super().__init__(parallel.device)
        self.parallel = parallel
        self.device = parallel.device
        self.is_main = parallel.is_main

    def check(self, config: TrainConfig) -> None:
        """ValueError naming every setting of ``config`` that data parallelism cannot honour."""
        reasons = data_parallel_reasons(config, self.parallel.world_size)
        if reasons:
            raise ValueError("; ".join(reasons))

    def prepare(self, model: nn.Module, seed: int, start: int, restored: bool) -> nn.Module:
        """The model on this rank's device, wrapped in DDP; unless :meth:`restore_rng` ``restored`` this rank's
        generators, ones drawn from ``(seed, rank, start)`` (rank 0 keeps the single process's)."""
        trained = self.parallel.wrap(model)
        if not restored:
            self.parallel.seed_dropout(seed, start)
        return trained

    def shard(self, index: Tensor) -> Tensor:
        return self.parallel.shard(index)

    def loss_weight(self, local_count: int, global_count: int) -> float:
        # Both loss terms are means over this shard's scored targets; weighted by the shard's share of the global
        # batch's, DDP's mean gradient is the one of the global batch's mean.
        return self.parallel.loss_weight(local_count, global_count)

    def reduce(self, tally_sums: Tuple[float, int, int], stopping: bool) -> Tuple[Tuple[float, int, int], bool]:
        loss_sum, scored, correct, stops = self.parallel.sum([*tally_sums, float(stopping)])
        return (loss_sum, int(round(scored)), int(round(correct))), stops > 0

    def stops(self, interrupted: bool, requested: bool) -> bool:
        # Every rank stops at the step whose all_reduce first carried an interrupt (one arriving later on one rank
        # waits for the next step's), so all reach the checkpoint together.
        return interrupted

    def broadcast(self, value: Any) -> Any:
        return self.parallel.broadcast(value)

    def rng_states(self) -> Dict[str, Any]:
        """Every rank's dropout generators (the CPU's; on GPUs each rank's CUDA device's too), for a resume on as
        many ranks; and this rank's CUDA generator as a single process saves it (rank 0 writes the checkpoint, so
        a single process resuming it, or rank 0 on another number of ranks, continues rank 0's draws)."""
        states = {**super().rng_states(), "rank_rng": self.parallel.gather(torch.get_rng_state())}
        if self.device.type == "cuda":
            states["rank_cuda_rng"] = self.parallel.gather(torch.cuda.get_rng_state(self.device))
        return states

    def restore_rng(self, state: Dict[str, Any]) -> bool:
        """This rank's saved generators when ``state`` kept them for as many ranks (on GPUs, the CUDA ones too):
        then True. Otherwise rank 0's CUDA generator where saved, and False: :meth:`prepare` then draws fresh
        ones for the other ranks."""
        super().restore_rng(state)
        world_size, rank = self.parallel.world_size, self.parallel.rank
        cpu_states, cuda_states = state.get("rank_rng"), state.get("rank_cuda_rng")
        if not (isinstance(cpu_states, list) and len(cpu_states) == world_size):
            return False
        if self.device.type == "cuda" and not (isinstance(cuda_states, list) and len(cuda_states) == world_size):
            return False  # a saved CPU state with a stale GPU one would not continue the run's dropout
        torch.set_rng_state(cpu_states[rank])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(cuda_states[rank], self.device)
        return True

    def barrier(self) -> None:
        self.parallel.barrier()  # no rank runs ahead of a checkpoint still being written


def ranks_of(parallel: Optional[DataParallel], device: Optional[torch.device] = None) -> SingleProcess:
    """The loop's view of ``parallel`` (None: this process alone, on ``device``, the CPU by default)."""
    if parallel is not None and device is not None:
        raise ValueError("device is chosen by the data-parallel process group (each rank's own); leave it None")
    return SingleProcess(device) if parallel is None else Replicas(parallel)


__all__ = ["Replicas", "SingleProcess", "data_parallel_reasons", "ranks_of"]

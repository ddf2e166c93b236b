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
    try:
        with torch.random.fork_rng(devices=[]):
            mechanism = build_mechanism(config.mechanism, config.heads, config.dim // config.heads,
                                        **config.mechanism_options)
    except (TypeError, ValueError):
        mechanism = None
    if mechanism is not None:
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

    def prepare(self, model: nn.Module, seed: int, start: int, saved_state: Optional[Dict[str, Any]]) -> nn.Module:
        """What the training step calls: the model itself (``saved_state``: the training state of the checkpoint
        the run resumes from, None for a new run; :meth:`restore_rng` has already set its generators)."""
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

    def restore_rng(self, state: Dict[str, Any]) -> None:
        """Set the generators :meth:`rng_states` saved in ``state`` (a checkpoint's training state)."""
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

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

    def prepare(self, model: nn.Module, seed: int, start: int, saved_state: Optional[Dict[str, Any]]) -> nn.Module:
        """The model on this rank's device, wrapped in DDP, with this rank's dropout generators (the CPU's, and
        the CUDA device's on a GPU): the ones ``saved_state`` (a checkpoint's training state) kept for it when
        resumed on as many ranks as it was saved from, else ones drawn from ``(seed, rank, start)``."""
        trained = self.parallel.wrap(model)
        saved = self._saved_for_this_rank(saved_state or {})
        if saved is None:
            self.parallel.seed_dropout(seed, start)
            return trained
        cpu_state, cuda_state = saved
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, self.device)
        return trained

    def _saved_for_this_rank(self, state: Dict[str, Any]) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """This rank's saved (CPU, CUDA) generator states, or None where ``state`` has none for as many ranks.
        A CUDA rank resumes exactly only from a checkpoint that kept every rank's CUDA generator too."""
        cpu_states, cuda_states = state.get("rank_rng"), state.get("rank_cuda_rng")
        world_size, rank = self.parallel.world_size, self.parallel.rank
        if not (isinstance(cpu_states, list) and len(cpu_states) == world_size):
            return None
        if self.device.type != "cuda":
            return cpu_states[rank], None
        if not (isinstance(cuda_states, list) and len(cuda_states) == world_size):
            return None
        return cpu_states[rank], cuda_states[rank]

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
        many ranks."""
        states = {"rank_rng": self.parallel.gather(torch.get_rng_state())}
        if self.device.type == "cuda":
            states["rank_cuda_rng"] = self.parallel.gather(torch.cuda.get_rng_state(self.device))
        return states

    def restore_rng(self, state: Dict[str, Any]) -> None:
        """Nothing here: :meth:`prepare` sets this rank's generator."""

    def barrier(self) -> None:
        self.parallel.barrier()  # no rank runs ahead of a checkpoint still being written


def ranks_of(parallel: Optional[DataParallel], device: Optional[torch.device] = None) -> SingleProcess:
    """The loop's view of ``parallel`` (None: this process alone, on ``device``, the CPU by default)."""
    if parallel is not None and device is not None:
        raise ValueError("device is chosen by the data-parallel process group (each rank's own); leave it None")
    return SingleProcess(device) if parallel is None else Replicas(parallel)


__all__ = ["Replicas", "SingleProcess", "data_parallel_reasons", "ranks_of"]

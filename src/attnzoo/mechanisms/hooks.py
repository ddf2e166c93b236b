"""The training hooks of the mechanism contract, over a whole model: what a training loop asks of every
mechanism in it (:meth:`attnzoo.Mechanism.auxiliary_loss`, :meth:`~attnzoo.Mechanism.after_optimizer_step`).

``attnzoo.training``'s loop calls these and nothing mechanism-specific, so a mechanism with training-time state
(a commitment loss, a codebook's EMA, random features redrawn every few steps) trains without a line changed
there; a model trained by hand calls the same two functions. Whether a model can train data-parallel is asked
the same way (:func:`attnzoo.parallel.data.mechanism_reasons`).
"""

from __future__ import annotations

from typing import List, Optional

from torch import Tensor, nn

from .._validation import check_number
from .base import Mechanism

_SEED_STRIDE = 1_000_003  # a prime: the seeds of a run's mechanisms differ from each other's and other runs'


def mechanisms(model: nn.Module) -> List[Mechanism]:
    """The mechanisms in ``model``, in module order (the order of ``model.modules()``)."""
    return [module for module in model.modules() if isinstance(module, Mechanism)]


def auxiliary_loss(model: nn.Module) -> Optional[Tensor]:
    """The sum, in module order, of the auxiliary losses the mechanisms of ``model`` set in its latest
    training-mode forward (each taken, so never added twice: no graph outlives its step); None when none has
    one. A training loop adds it to the task loss::

        extra = auxiliary_loss(model)
        loss = task_loss if extra is None else task_loss + extra
    """
    total: Optional[Tensor] = None
    for mechanism in mechanisms(model):
        loss = mechanism.auxiliary_loss()
        if loss is not None:
            total = loss if total is None else total + loss
    return total


def mechanism_seed(seed: int, index: int) -> int:
    """The seed the ``index``-th mechanism of a model (module order) gets from a run seeded ``seed``: distinct
    per mechanism, so that layers redrawing at the same step draw different projections."""
    return (seed * _SEED_STRIDE + index) % 2**63


def after_optimizer_step(model: nn.Module, step: int, seed: int) -> None:
    """Call :meth:`~attnzoo.Mechanism.after_optimizer_step` on every mechanism of ``model`` after optimiser
    step ``step`` (0-based) of a run seeded ``seed`` (ints >= 0), each with its :func:`mechanism_seed`. The
    same on every rank of a data-parallel run and on resume: nothing here reads a global generator."""
    step = check_number("step", step, integer=True, minimum=0)
    seed = check_number("seed", seed, integer=True, minimum=0)
    for index, mechanism in enumerate(mechanisms(model)):
        mechanism.after_optimizer_step(step, mechanism_seed(seed, index))


__all__ = ["after_optimizer_step", "auxiliary_loss", "mechanism_seed", "mechanisms"]

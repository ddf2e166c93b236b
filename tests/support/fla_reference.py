"""What the checks against flash-linear-attention's pure-PyTorch references share (``tests/mechanisms/test_fla_reference.py``).

fla (the ``fla-core`` distribution, in the ``peers`` extra) is imported only by the test module, behind
``pytest.importorskip``; this module needs nothing but torch, so it can be imported anywhere.

A check is one :class:`FlaCase`: attnzoo's computation and fla's, each a function of the same
:class:`Inputs`, mapped across layouts, gates and scales. A new mechanism joins with one line in ``CASES`` of
the test module, for example::

    FlaCase("ssd", ours=lambda x: ..., theirs=lambda x: from_fla(naive_chunk_simple_gla(...)[0]), float64=False)

Conventions the mappings rely on:

* attnzoo's layout is (batch, heads, seq, dim); fla's newer references (``gated_delta_rule``, ``simple_gla``,
  ``gla``, ``linear_attn``, ``forgetting_attn``, ``nsa``) take (batch, seq, heads, dim) and gates (batch, seq,
  heads): :func:`to_fla` and :func:`from_fla` move the axes. Older ones (``delta_rule``, ``retention``, ``based``) take attnzoo's layout.
* fla's default scale is ``head_dim ** -0.5`` on the queries, as attnzoo's.
* Many fla references cast to float32 whatever they are given; a case says whether its reference computes
  in float64 (``float64=True``) and is then checked to 1e-10 there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor

FLOAT32_TOLERANCE = 1e-5
FLOAT64_TOLERANCE = 1e-10


@dataclass(frozen=True)
class Inputs:
    """One set of inputs in attnzoo's layout: q, k (batch, heads, seq, d_k) L2-normalised, as the delta-rule
    mechanisms give them; v (batch, heads, seq, d_v); beta in (0, 1) and log_decay <= 0, (batch, heads, seq)."""

    q: Tensor
    k: Tensor
    v: Tensor
    beta: Tensor
    log_decay: Tensor

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_inputs(dtype: torch.dtype, *, batch: int = 2, heads: int = 3, length: int = 128, d_k: int = 16,
                d_v: int = 12, seed: int = 0) -> Inputs:
    """Seeded inputs; decays between exp(-0.5) and 1 keep some memory across the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, heads, length, d_k, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(batch, heads, length, d_v, generator=g, dtype=dtype)
    beta = torch.rand(batch, heads, length, generator=g, dtype=dtype)
    log_decay = -0.5 * torch.rand(batch, heads, length, generator=g, dtype=dtype)
    return Inputs(q, k, v, beta, log_decay)


def to_fla(x: Tensor) -> Tensor:
    """attnzoo's (batch, heads, seq, ...) to fla's (batch, seq, heads, ...)."""
    return x.transpose(1, 2).contiguous()


def from_fla(x: Tensor) -> Tensor:
    """fla's (batch, seq, heads, ...) to attnzoo's (batch, heads, seq, ...)."""
    return x.transpose(1, 2)


@dataclass(frozen=True)
class FlaCase:
    """attnzoo's output and fla's reference output on the same inputs, both (batch, heads, seq, d_v).

    ``float64``: the reference computes in float64 when given float64 inputs (many cast to float32).
    ``sizes``: keyword arguments of :func:`make_inputs` where the defaults do not suit (e.g. ``d_v=16`` for a
    mechanism whose parameters need values as wide as keys)."""

    name: str
    ours: Callable[[Inputs], Tensor]
    theirs: Callable[[Inputs], Tensor]
    float64: bool = False
    sizes: Dict[str, int] = field(default_factory=dict)


def assert_matches(case: FlaCase, dtype: torch.dtype) -> None:
    """Both sides equal to 1e-5 (float32) or 1e-10 (float64), relative to the largest output entry."""
    inputs = make_inputs(dtype, **case.sizes)
    ours, theirs = case.ours(inputs), case.theirs(inputs)
    assert ours.shape == theirs.shape, (case.name, ours.shape, theirs.shape)
    assert ours.dtype == theirs.dtype == dtype, (case.name, ours.dtype, theirs.dtype)
    tolerance = FLOAT64_TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
    magnitude = max(float(theirs.abs().max()), 1.0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance * magnitude, msg=lambda m: f"{case.name}: {m}")


__all__ = ["FLOAT32_TOLERANCE", "FLOAT64_TOLERANCE", "FlaCase", "Inputs", "assert_matches", "from_fla",
           "make_inputs", "to_fla"]

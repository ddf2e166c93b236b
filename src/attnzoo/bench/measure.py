"""Measuring one attention callable: inputs, interleaved timing, peak memory and error against softmax.

Everything here runs inside a worker process (see :mod:`attnzoo.bench.worker`); nothing here starts
processes. An attention callable has the signature ``fn(q, k, v, causal) -> out`` on tensors of shape
(batch, heads, seq, head_dim).
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._malloc import fix_malloc_threshold  # noqa: F401  (re-exported: the memory benchmarks call it)
from .._malloc import release_free_memory
from ..functional.softmax import softmax_attention

AttentionFn = Callable[[Tensor, Tensor, Tensor, bool], Tensor]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass
class Inputs:
    """Seeded q, k, v of shape (batch, heads, length, head_dim) and the output gradient used by backward."""

    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor


def make_inputs(batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype, device: str,
                seed: int = 0) -> Inputs:
    """Standard-normal q, k, v (logits then have unit variance at the default 1/sqrt(d) scale)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for _ in range(4))
    return Inputs(q, k, v, grad_out)


def scaled_logits(inputs: Inputs, logit_std: float) -> Inputs:
    """The same inputs with q and k each scaled by ``sqrt(logit_std)``, so that the logits ``q.k/sqrt(d)`` of
    standard-normal q and k have standard deviation ``logit_std`` (1: the inputs unchanged; below 1, a flatter
    softmax)."""
    if logit_std == 1.0:
        return inputs
    factor = math.sqrt(logit_std)
    return Inputs(inputs.q * factor, inputs.k * factor, inputs.v, inputs.grad_out)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def run_forward(fn: AttentionFn, inputs: Inputs, causal: bool) -> Tensor:
    with torch.no_grad():
        return fn(inputs.q, inputs.k, inputs.v, causal)


def run_forward_backward(fn: AttentionFn, inputs: Inputs, causal: bool) -> Tensor:
    """One forward and backward pass; returns the output, detached."""
    q, k, v = (t.detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    out = fn(q, k, v, causal)
    out.backward(inputs.grad_out.to(out.dtype))
    return out.detach()


@dataclass
class Timing:
    """Per-call seconds of each repeat; each sample is the mean over ``inner`` back-to-back calls."""

    forward: List[float] = field(default_factory=list)
    forward_backward: List[float] = field(default_factory=list)
    inner: int = 1

    def medians_ms(self) -> Tuple[Optional[float], Optional[float]]:
        fwd = 1e3 * statistics.median(self.forward) if self.forward else None
        train = 1e3 * statistics.median(self.forward_backward) if self.forward_backward else None
        return fwd, train

    @staticmethod
    def spread(samples: List[float]) -> Optional[float]:
        """Interquartile range over median: how noisy the samples were (0.1 = 10%)."""
        if len(samples) < 3:
            return None
        q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return (q3 - q1) / median if median > 0 else None


def _timed(call: Callable[[], object], inner: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(inner):
        call()
    _sync(device)
    return (time.perf_counter() - start) / inner


# Calls shorter than this are repeated within one timed sample: at 0.05 s, two back-to-back quick runs of
# ``attnzoo compare`` disagreed by up to 30% on millisecond calls; at 0.2 s by under 10% on an idle machine.
DEFAULT_MIN_SAMPLE_S = 0.2


# The fewest timed repeats an entry gets when a shared timing budget is tight: a median and a spread need three.
MIN_REPEATS = 3
# One repeat is a forward and a forward+backward: about 1.5 forward+backward.
REPEAT_COST = 1.5


def calibrate(fn: AttentionFn, inputs: Inputs, causal: bool, device: str, min_sample_s: float,
              budget_s: float = math.inf, check: Optional[Callable[[Tensor], None]] = None) -> Tuple[int, float]:
    """Warm up (first calls pay for lazy initialisation) and choose how many calls make one timed sample.

    Returns (inner, seconds of one forward+backward). Short calls are repeated ``inner`` times per sample so
    that a sample lasts at least ``min_sample_s``: timer resolution and scheduler noise then stay small. A
    first forward+backward already over ``budget_s`` is returned as is, without spending more time on it.
    ``check`` is given the first call's output (untimed), so that checking it costs no extra forward pass.
    """
    outputs: List[Tensor] = []
    first = _timed(lambda: outputs.append(run_forward_backward(fn, inputs, causal)), 1, device)
    output = outputs.pop()
    if check is not None:
        check(output)
    del output  # not kept alive through the second call
    if first > budget_s:
        return 1, first
    if first >= 2 * min_sample_s and REPEAT_COST * MIN_REPEATS * first <= budget_s:
        # One call makes a sample whatever lazy initialisation the first paid for, and even priced by that
        # first call the entry keeps every repeat it could get: a second call would only cost time.
        return 1, first
    # The second call's time, not the first's: a first call can pay seconds of lazy initialisation (kernels,
    # caches), which would make an entry look too slow for its budget and cut its repeats.
    one = _timed(lambda: run_forward_backward(fn, inputs, causal), 1, device)
    inner = max(1, min(1000, math.ceil(min_sample_s / max(one, 1e-9))))
    return inner, one


def time_interleaved(fns: Dict[str, AttentionFn], inputs: Inputs, causal: bool, device: str,
                     repeats: Dict[str, int], inner: Dict[str, int], deadline_s: Optional[float] = None,
                     min_rounds: int = 1) -> Tuple[Dict[str, Timing], Dict[str, BaseException]]:
    """Median-ready samples of every callable, measured round-robin.

    Each round times every callable once, forward then forward+backward, so slow drifts of the machine
    (frequency scaling, other processes) hit all mechanisms alike and their ratios stay stable. A callable
    leaves the rounds once it has ``repeats[name]`` samples, or when it raises (returned in the second dict).
    With ``deadline_s``, no round starts after that many seconds once ``min_rounds`` rounds have run: on a
    machine busier than the calibration foresaw, the callables get fewer samples (never fewer than
    ``min_rounds``, or their ``repeats`` when less), all alike, rather than the run taking much longer.
    """
    timings = {name: Timing(inner=inner[name]) for name in fns}
    failures: Dict[str, BaseException] = {}
    names = list(fns)
    began = time.perf_counter()
    for round_index in range(max(repeats.values(), default=0)):
        if round_index >= min_rounds and deadline_s is not None and time.perf_counter() - began > deadline_s:
            break
        # The starting mechanism rotates, so none always runs right after the same neighbour.
        shift = round_index % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            if name in failures or round_index >= repeats[name]:
                continue
            n = inner[name]
            try:
                timings[name].forward.append(_timed(lambda: run_forward(fn, inputs, causal), n, device))
                timings[name].forward_backward.append(
                    _timed(lambda: run_forward_backward(fn, inputs, causal), n, device))
            except Exception as error:  # noqa: BLE001 - reported as the row's reason by the caller
                failures[name] = error
    return timings, failures


def reference_output(inputs: Inputs, causal: bool) -> Tensor:
    """Exact softmax attention on the same inputs, in float64 (float32 on devices without float64 kernels)."""
    wide = torch.float64 if inputs.q.device.type == "cpu" else torch.float32
    with torch.no_grad():
        return softmax_attention(inputs.q.to(wide), inputs.k.to(wide), inputs.v.to(wide), causal)


def uniform_attention(v: Tensor, causal: bool) -> Tensor:
    """Attention that ignores q and k: each query averages the values it may see, (batch, heads, seq, dim_v).

    Its error against softmax is the floor an approximation must beat to carry any information from q, k.
    """
    if not causal:
        return v.mean(dim=2, keepdim=True).expand_as(v)
    counts = torch.arange(1, v.shape[2] + 1, device=v.device, dtype=v.dtype).view(1, 1, -1, 1)
    return v.cumsum(dim=2) / counts


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``||out - reference||_F / ||reference||_F`` over the whole batch (0 = exact softmax)."""
    out = out.detach().to(reference.dtype)
    if out.shape != reference.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference {tuple(reference.shape)}")
    return float(torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference))


# -- peak memory ---------------------------------------------------------------------------------------------
def _status_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as handle:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets the kernel's resident high-water mark (VmHWM), Linux >= 4.0.
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory added by a block of code, in bytes.

    CUDA: the caching allocator's peak of allocated bytes above what was allocated on entry. CPU (Linux):
    the resident-set high-water mark above the resident size on entry, the mark reset on entry, so the
    number includes every buffer the kernels touch (workspaces too), and nothing from earlier blocks.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.method = "cuda max_memory_allocated" if device.startswith("cuda") else "resident set high-water mark"
        self.peak_bytes: Optional[int] = None

    @staticmethod
    def cpu_supported() -> bool:
        return _status_kib("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK)

    def __enter__(self) -> "PeakMemory":
        if self.device.startswith("cuda"):
            # The device is named in every call: "cuda:1" must not read the current device's counters.
            device = torch.device(self.device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
        else:
            release_free_memory()  # a block served from a resident free chunk would not show in the mark
            if not _reset_peak_rss():
                raise RuntimeError("cannot reset the resident high-water mark (/proc/self/clear_refs)")
            self._base = 1024 * (_status_kib("VmRSS") or 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            device = torch.device(self.device)
            torch.cuda.synchronize(device)
            self.peak_bytes = torch.cuda.max_memory_allocated(device) - self._base
        else:
            self.peak_bytes = 1024 * (_status_kib("VmHWM") or 0) - self._base

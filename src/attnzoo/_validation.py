"""Input checks shared by the functional cores and the modules.

Every check raises a ``ValueError`` (or ``TypeError`` for dtypes) whose message names the argument and
what was expected, so that bad input never turns into silent broadcasting or a NaN further down.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Collection, Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_floating(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, grouped: bool = False) -> None:
    """Check q, k, v of shape (batch, heads, seq, head_dim) for rank, matching sizes, dtype and device.

    Keys and values may have a sequence length different from the queries (cross-attention) and a value
    head dim different from the query/key head dim. With ``grouped``, k and v may have fewer heads than q
    (grouped-query attention): as many as each other, a number that divides q's.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_floating(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {x.dim()} dims: {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if grouped and k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of (key/value) heads, got k={k.shape[1]}, v={v.shape[1]}")
    if grouped and (k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(
            f"k and v have kv_heads={k.shape[1]} heads, which must divide q's heads={q.shape[1]} (grouped-query "
            f"attention: each key/value head serves heads // kv_heads query heads)"
        )
    if not grouped and not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k and v must share the number of heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share head_dim, got q head_dim={q.shape[3]} and k head_dim={k.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share the sequence length, got k seq={k.shape[2]} and v seq={v.shape[2]}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be at least 1, got q seq={q.shape[2]}, k seq={k.shape[2]}")


def check_key_padding_mask(mask: Optional[Tensor], batch: int, kv_len: int, device: torch.device) -> None:
    """A key padding mask is a bool tensor (batch, kv_len); True marks a padded key that is ignored."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}")
    if mask.shape != (batch, kv_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_kv) = ({batch}, {kv_len}), got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, got {mask.device}")


# -- options: one helper per kind, shared by every constructor and forward argument ------------------------
def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a real bool; a TypeError naming ``name`` otherwise.

    Truthy stand-ins are refused on purpose: ``"False"`` is truthy, and ``causal=None`` or ``causal=2`` read as
    a yes/no would silently switch behaviour on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_number(
    name: str,
    value: object,
    *,
    integer: bool = False,
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    optional: bool = False,
) -> Any:
    """Check one numeric option: its type (TypeError), then finiteness and range (ValueError), naming ``name``.

    Args:
        integer: an int is required (a float such as 2.0 is refused: options that count things take counts).
        minimum, maximum: bounds, inclusive unless ``exclusive_minimum`` / ``exclusive_maximum``.
        optional: None is accepted (and returned).

    Returns the value: an ``int`` for integer options, a ``float`` otherwise (ints are accepted for floats).
    bools are refused everywhere, though Python counts them as ints.
    """
    if value is None and optional:
        return None
    wanted = "an integer" if integer else "a number"
    if optional:
        wanted += " or None"
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    number = int(value) if integer else float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    below = minimum is not None and (number <= minimum if exclusive_minimum else number < minimum)
    above = maximum is not None and (number >= maximum if exclusive_maximum else number > maximum)
    if below or above:
        low = "" if minimum is None else f"{'>' if exclusive_minimum else '>='} {minimum:g}"
        high = "" if maximum is None else f"{'<' if exclusive_maximum else '<='} {maximum:g}"
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {' and '.join(part for part in (low, high) if part)}, got {value!r}")
    return number


def check_positive_int(name: str, value: object) -> int:
    """A count of at least 1 (TypeError for a non-int, ValueError below 1)."""
    return check_number(name, value, integer=True, minimum=1)


def check_probability(name: str, value: object) -> float:
    """A probability in [0, 1), as dropout rates are (1 would drop everything)."""
    return check_number(name, value, minimum=0.0, maximum=1.0, exclusive_maximum=True)


def check_choice(name: str, value: object, choices: Collection[str]) -> str:
    """One of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_numbers(
    name: str, values: object, length: int, **bounds: Any
) -> Sequence[float]:
    """A sequence of ``length`` numbers, each checked as by :func:`check_number` with ``bounds``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not (
        isinstance(values, torch.Tensor) and values.dim() == 1
    ):
        raise TypeError(f"{name} must be a sequence of {length} numbers, got {values!r} ({type(values).__name__})")
    items = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(items) != length:
        raise ValueError(f"{name} must have {length} values, got {len(items)}: {items!r}")
    return [check_number(f"{name}[{i}]", item, **bounds) for i, item in enumerate(items)]


def check_indices(name: str, values: object) -> tuple:
    """A sequence of distinct int positions, returned as a tuple; negative ones count from the end (-1 is the
    last position), so their range is checked only against a sequence length, by the caller. bools, floats,
    strings and tensors are refused (TypeError), a repeated index too (ValueError), naming ``name``."""
    if isinstance(values, (str, bytes, Tensor)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a tuple of ints (positions), got {values!r} ({type(values).__name__})")
    items = tuple(check_number(f"{name}[{i}]", item, integer=True) for i, item in enumerate(values))
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise ValueError(f"{name} must not repeat a position, got {list(items)} (repeated: {repeated})")
    return items


def check_position_mask(name: str, mask: Optional[Tensor], batch: int, length: int, device: torch.device) -> None:
    """A per-position bool mask of shape (batch, length) on ``device``, or None (e.g. which positions are
    global); errors name ``name``."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    if mask.shape != (batch, length):
        raise ValueError(f"{name} must have shape (batch, seq) = ({batch}, {length}), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} must be on {device}, got {mask.device}")


def device_problem(value: object) -> Optional[str]:
    """What keeps ``value`` from naming a device attnzoo runs on ("must be 'cpu' or 'cuda[:N]', ..."), or None:
    the CPU, or a CUDA device that this process can see."""
    try:
        device = torch.device(value)  # parses "cuda:1", rejects "cuda:x"
    except (RuntimeError, ValueError, TypeError):
        return f"must be 'cpu' or 'cuda[:N]', got {value!r}"
    if device.type not in ("cpu", "cuda"):
        return f"must be 'cpu' or 'cuda[:N]', got {value!r}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"is {value!r} but CUDA is not available"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"is {value!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
    return None


def check_device(name: str, value: object) -> torch.device:
    """``value`` as a torch.device (:func:`device_problem` decides), else ValueError naming ``name``."""
    problem = device_problem(value)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return torch.device(value)

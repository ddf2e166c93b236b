"""What a benchmark row measures: an attnzoo mechanism or a peer library, built for one configuration.

An *entry* is a plain dict (it travels to worker processes as JSON)::

    {"key": "NAME", "kind": "mechanism", "name": "NAME", "options": {"OPTION": 64}}
    {"key": "peer:PEER", "kind": "peer", "name": "PEER", "options": {}}
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from ..mechanisms import UnsupportedOptionError, build_mechanism, mechanism_class, shapes_only
from .measure import AttentionFn
from .peers import build_peer

Entry = Dict[str, Any]

def mechanism_entry(name: str, options: Optional[Dict[str, Any]] = None) -> Entry:
    return {"key": name, "kind": "mechanism", "name": name, "options": dict(options or {})}


def peer_entry(name: str, options: Optional[Dict[str, Any]] = None) -> Entry:
    """A peer library's row; ``options`` are those given to its attnzoo counterpart (rank, landmarks, ...)."""
    return {"key": f"peer:{name}", "kind": "peer", "name": name, "options": dict(options or {})}


def import_user_modules(specs: Sequence[str]) -> None:
    """Import modules (dotted names or paths of .py files) that register extra mechanisms."""
    for spec in specs:
        if spec.endswith(".py") or "/" in spec:
            path = Path(spec).resolve()
            module_name = f"attnzoo_user_{abs(hash(str(path)))}"
            if module_name in sys.modules:
                continue
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot import {spec!r}: not a Python file")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            importlib.import_module(spec)


def build_target(entry: Entry, heads: int, head_dim: int, length: int, causal: bool, device: str,
                 dtype: torch.dtype) -> Union[AttentionFn, str]:
    """The entry's attention callable for this configuration, or the reason it does not apply.

    Raises whatever building raises (a broken mechanism is a failed row, not an unsupported one).
    """
    if entry["kind"] == "peer":
        peer = build_peer(entry["name"], heads, head_dim, length, causal, entry.get("options") or {}, device,
                          dtype)
        if isinstance(peer, str):
            return peer
        return peer.to(device=device, dtype=dtype).eval()
    name = entry["name"]
    options = dict(entry.get("options") or {})
    length_option = mechanism_class(name).length_option
    if length_option is not None and length_option not in options:
        options[length_option] = length  # a learned projection over positions is built for this length
    try:
        module = build_mechanism(name, heads, head_dim, **options)
    except UnsupportedOptionError as error:
        return f"unsupported: {error}"
    reasons = module.unsupported_reasons(*shapes_only(1, heads, length, length, head_dim), causal=causal)
    if reasons:
        return "unsupported: " + "; ".join(reasons)
    module = module.to(device=device, dtype=dtype).eval()
    return lambda q, k, v, c: module(q, k, v, causal=c)


def classify_failure(error: BaseException) -> Tuple[str, str]:
    """(status, reason) for an exception raised while building or running an entry."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {message}"[:300]
    lowered = message.lower()
    if isinstance(error, MemoryError) or "out of memory" in lowered or "can't allocate memory" in lowered:
        size = re.search(r"tried to allocate (\d+) bytes", message)
        if size:  # torch's CPU allocator message is long; the size is what matters
            return "oom", f"out of memory: could not allocate {int(size.group(1)) / 2**20:.0f} MiB"
        return "oom", f"out of memory ({text})"
    if isinstance(error, UnsupportedOptionError):
        return "unsupported", f"unsupported: {message}"
    return "failed", text

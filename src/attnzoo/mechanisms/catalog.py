"""The registered mechanism classes by name: the store behind :mod:`.registry`, in a module of its own so that
the contract's checks (:mod:`.call_inputs`, below the registry) can read what is registered without importing
the registry, which imports the contract."""

from __future__ import annotations

from typing import Dict

REGISTERED: Dict[str, type] = {}
"""Name -> mechanism class, filled by :func:`attnzoo.mechanisms.registry.register`."""

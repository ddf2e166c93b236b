"""The registry of mechanisms: names to classes, their declared capabilities and options, and building one.

Mechanism classes add themselves with the :func:`register` decorator when their module is imported
(``attnzoo.mechanisms`` imports every built-in one).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Tuple, Type

from .base import Mechanism
from .capabilities import Capabilities
from .catalog import REGISTERED

_REGISTRY: Dict[str, Type[Mechanism]] = REGISTERED  # one store (.catalog), read below the registry too


def register(cls: Type[Mechanism]) -> Type[Mechanism]:
    """Class decorator adding a mechanism to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} must set a non-empty class attribute 'name'")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise ValueError(f"{cls.__qualname__} must declare 'capabilities' as a Capabilities instance")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"mechanism name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> List[str]:
    """Sorted names of the registered mechanisms."""
    return sorted(_REGISTRY)


# Names no mechanism is registered under any more -> (the new name, what the mechanism is): refused with an
# error that names the new one, so an old spelling never reads as merely unknown.
_RENAMED: Dict[str, Tuple[str, str]] = {"flash": ("flash_gau", "FLASH mixed chunk attention, Hua et al. 2022")}


def mechanism_class(name: str) -> Type[Mechanism]:
    if isinstance(name, str) and name in _RENAMED and name not in _REGISTRY:
        new_name, what = _RENAMED[name]
        raise ValueError(f"mechanism {name!r} was renamed {new_name!r} ({what}); valid choices: "
                         f"{', '.join(available())}")
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; valid choices: {', '.join(available())}")
    return _REGISTRY[name]


def capabilities(name: str) -> Capabilities:
    """The declared :class:`Capabilities` of a registered mechanism."""
    return mechanism_class(name).capabilities


def mechanism_options(name: str) -> Dict[str, Any]:
    """The keyword options a mechanism takes besides ``heads`` and ``head_dim``, with their defaults."""
    signature = inspect.signature(mechanism_class(name).__init__)
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def check_option_names(name: str, options: Mapping[str, Any]) -> None:
    """Raise a TypeError listing the valid options when ``options`` names one the mechanism ``name`` does not
    take (before anything is built: a misspelt option costs nothing)."""
    valid = mechanism_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(valid) if valid else "none"
        raise TypeError(f"mechanism {name!r} got unknown option(s) {', '.join(unknown)}; valid options: {listed}")


def build_mechanism(name: str, heads: int, head_dim: int, **options: Any) -> Mechanism:
    """Instantiate a registered mechanism; an option it does not take raises an error listing the valid ones."""
    cls = mechanism_class(name)
    check_option_names(name, options)
    return cls(heads, head_dim, **options)

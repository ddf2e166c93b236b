"""The packages of the ``pretrained`` extra, imported when first needed.

attnzoo's plain install has neither ``gguf`` nor ``transformers``; importing :mod:`attnzoo.pretrained` must
still work there (and ``attnzoo compare`` never touches it), so each is imported by the function that uses it,
and its absence is one line saying what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "pretrained"


class MissingExtraError(ImportError):
    """A package of the ``pretrained`` extra is not installed."""


def require(package: str) -> ModuleType:
    """The module ``package`` (``"gguf"``, ``"transformers"``), or a :class:`MissingExtraError` naming the extra."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise MissingExtraError(
            f"attnzoo.pretrained needs the {package!r} package: pip install \"attnzoo[{EXTRA}]\" ({error})"
        ) from None

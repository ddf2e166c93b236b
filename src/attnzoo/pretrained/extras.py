"""The packages of the ``pretrained`` extra, imported when first needed.

attnzoo's plain install has neither ``gguf`` nor ``transformers``; importing :mod:`attnzoo.pretrained` must
still work there (and ``attnzoo compare`` never touches it), so each is imported by the function that uses it,
and its absence is one line saying what to install.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
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


def installed_file(distribution_name: str, file_name: str, missing: str) -> Path:
    """The path of ``file_name`` among the files the installed distribution records (nothing is imported from
    it); ``missing``: the FileNotFoundError's message when the distribution is not installed."""
    try:
        distribution = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(missing) from None
    for file in distribution.files or ():
        if file.name == file_name:
            return Path(str(file.locate()))
    raise FileNotFoundError(f"the installed {distribution_name} has no {file_name}")

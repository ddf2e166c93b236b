"""Reading a GGUF file (llama.cpp's format): its metadata and its tensors, dequantized to float32.

Built on the ``gguf`` package (llama.cpp's own reader, ``pip install "attnzoo[pretrained]"``): the file is
memory-mapped, so opening it reads only the header; a tensor is dequantized when asked for. Every tensor's type
is checked when the file is opened, so an unsupported quantization is refused before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .extras import require

MAGIC = b"GGUF"
PathLike = Union[str, "os.PathLike[str]"]


class GGUFError(ValueError):
    """A GGUF file attnzoo cannot load: not GGUF, or holding what attnzoo does not support yet (one line)."""


def check_gguf_path(path: PathLike) -> Path:
    """``path`` as a Path if it is an existing file that starts with GGUF's magic; a one-line error otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path {str(path)!r} does not exist")
    if not path.is_file():
        raise GGUFError(f"path {str(path)!r} is not a file")
    with path.open("rb") as file:
        head = file.read(len(MAGIC))
    if head != MAGIC:
        raise GGUFError(f"path {str(path)!r} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}")
    return path


def _dequantizable() -> Tuple[str, ...]:
    """The tensor types ``gguf.quants.dequantize`` turns into float32: the float types and every quantization
    it has traits for (its table is private, so a gguf without it lets :meth:`GGUFFile.tensor` find out)."""
    quants = require("gguf").quants
    traits = getattr(quants, "_type_traits", None)
    if traits is None:
        return ()
    return tuple(sorted({"F32", "F16"} | {kind.name for kind in traits}))


class GGUFFile:
    """An opened GGUF file.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (``"llama"``, ``"qwen2"``, ...).
        metadata: every key whose value is a number, a bool or a string; arrays (the tokenizer's vocabulary and
            merges) are left out, their lengths are in ``array_lengths``.
        tensor_types: each tensor's name -> its type name (``"Q4_1"``, ``"F32"``, ...), in the file's order.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = check_gguf_path(path)
        gguf = require("gguf")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as error:
            raise GGUFError(f"path {str(self.path)!r} is not a readable GGUF file: {error}") from None
        self.metadata: Dict[str, Any] = {}
        self.array_lengths: Dict[str, int] = {}
        for key, field in self._reader.fields.items():
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
                self.array_lengths[key] = len(field.data)
            else:
                self.metadata[key] = field.contents()
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self.tensor_types: Dict[str, str] = {name: tensor.tensor_type.name for name, tensor in self._tensors.items()}
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise GGUFError(f"path {str(self.path)!r} has no general.architecture: not a model's GGUF file")
        self.architecture = architecture
        self._check_tensor_types()

    def _check_tensor_types(self) -> None:
        supported = _dequantizable()
        if not supported:
            return
        for name, kind in self.tensor_types.items():
            if kind not in supported:
                raise GGUFError(f"tensor {name!r} has type {kind}, which attnzoo cannot dequantize; supported types: "
                                f"{', '.join(supported)}")

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> List[str]:
        """The tensors' names, in the file's order."""
        return list(self._tensors)

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape in PyTorch order (a weight matrix is (out_features, in_features)); GGUF lists
        dimensions innermost first, so this is its ``ne`` reversed."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def tensor(self, name: str) -> Tensor:
        """The tensor ``name`` dequantized to a float32 tensor of :meth:`shape`, in memory of its own."""
        if name not in self._tensors:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        info = self._tensors[name]
        quants = require("gguf").quants
        try:
            values = quants.dequantize(info.data, info.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"tensor {name!r} has type {info.tensor_type.name}, which attnzoo cannot dequantize") \
                from None
        # A copy: the file is memory-mapped read-only, and the model's parameters must own their memory.
        array = np.array(values, dtype=np.float32, copy=True).reshape(self.shape(name))
        return torch.from_numpy(array)

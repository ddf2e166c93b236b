"""Reading a GGUF file (llama.cpp's format): its metadata and its tensors, dequantized to float32.

The header (metadata and tensor table) is parsed here, one pass over its bytes: the ``gguf`` package's reader
builds a numpy view for every string of the tokenizer's vocabulary and merges, about 8 seconds for SmolLM2's
100,000 of them, where this pass takes a fraction of a second. The tensors' data is memory-mapped, and a tensor
is dequantized when asked for by the ``gguf`` package (llama.cpp's own code, ``pip install
"attnzoo[pretrained]"``). Every tensor's type is checked when the file is opened, so an unsupported quantization
is refused before any weight is read.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, NamedTuple, Tuple, Union

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

# GGUF's value types (gguf.GGUFValueType), by number: scalars as struct formats; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_FIRST_READ = 8 << 20  # bytes read for the header at first (SmolLM2's is about 1.8 MB), doubled until it parses


class _TensorInfo(NamedTuple):
    dims: Tuple[int, ...]  # GGUF's ne: innermost first
    type_id: int
    offset: int  # from the start of the data section


class _Header(NamedTuple):
    metadata: Dict[str, Any]
    array_lengths: Dict[str, int]
    tensors: Dict[str, _TensorInfo]
    data_start: int


class _Bytes:
    """Little-endian reads from a buffer, advancing; past its end, struct.error or IndexError (the caller reads
    more of the file, or finds it cut short)."""

    def __init__(self, buffer: bytes) -> None:
        self.buffer, self.position = buffer, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buffer, self.position)[0]
        self.position += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.position + length
        if end > len(self.buffer):
            raise IndexError("a string runs past the bytes read")
        value = self.buffer[self.position:end].decode("utf-8", errors="replace")
        self.position = end
        return value

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.position += 8 + struct.unpack_from("<Q", self.buffer, self.position)[0]
        if self.position > len(self.buffer):
            raise IndexError("a string array runs past the bytes read")

    def value(self, kind: int) -> Tuple[Any, int]:
        """A value of type ``kind``: (the value, -1), or for an array (None, its length), its items skipped."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind]), -1
        if kind == _STRING:
            return self.string(), -1
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item == _STRING:
            self.skip_strings(count)
        elif item in _SCALARS:
            self.position += count * struct.calcsize(_SCALARS[item])
        else:  # arrays of arrays: read one by one
            for _ in range(count):
                self.value(item)
        return None, count


def _read_header(file: BinaryIO, size: int) -> _Header:
    """The header of an opened GGUF file of ``size`` bytes (version 2 or 3, little-endian)."""
    buffer = file.read(min(size, _FIRST_READ))
    while True:  # the header is read whole: grow the buffer until it parses
        try:
            return _parse_header(buffer)
        except (struct.error, IndexError) as error:
            if len(buffer) >= size:
                raise ValueError(f"the header is cut short ({error})") from None
            buffer += file.read(len(buffer))


def _parse_header(buffer: bytes) -> _Header:
    reader = _Bytes(buffer)
    if buffer[:4] != MAGIC:
        raise ValueError("no GGUF magic")
    reader.position = 4
    version = reader.scalar("I")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        kind = "a big-endian file" if swapped in (2, 3) else f"version {version}"
        raise ValueError(f"{kind}, which attnzoo does not read (little-endian GGUF 2 and 3 only)")
    tensor_count, field_count = reader.scalar("Q"), reader.scalar("Q")
    # The file's counts under the names gguf's reader gives them.
    metadata: Dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                "GGUF.kv_count": field_count}
    array_lengths: Dict[str, int] = {}
    for _ in range(field_count):
        key = reader.string()
        value, length = reader.value(reader.scalar("I"))
        if length >= 0:
            array_lengths[key] = length
        else:
            metadata[key] = value
    tensors: Dict[str, _TensorInfo] = {}
    for _ in range(tensor_count):
        name = reader.string()
        dims = tuple(reader.scalar("Q") for _ in range(reader.scalar("I")))
        tensors[name] = _TensorInfo(dims, reader.scalar("I"), reader.scalar("Q"))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.position // alignment) * alignment
    return _Header(metadata, array_lengths, tensors, data_start)


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
            with self.path.open("rb") as file:
                header = _read_header(file, self.path.stat().st_size)
            self._types = {name: gguf.GGMLQuantizationType(info.type_id) for name, info in header.tensors.items()}
        except (ValueError, OSError) as error:
            raise GGUFError(f"path {str(self.path)!r} is not a readable GGUF file: {error}") from None
        self.metadata: Dict[str, Any] = header.metadata
        self.array_lengths: Dict[str, int] = header.array_lengths
        self._tensors = header.tensors
        self._data_start = header.data_start
        self._map: Any = None  # the file memory-mapped, when a tensor is first read
        self.tensor_types: Dict[str, str] = {name: kind.name for name, kind in self._types.items()}
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
        return tuple(int(n) for n in reversed(self._tensors[name].dims))

    def tensor(self, name: str) -> Tensor:
        """The tensor ``name`` dequantized to a float32 tensor of :meth:`shape`, in memory of its own."""
        if name not in self._tensors:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        kind = self._types[name]
        quants = require("gguf").quants
        try:
            values = quants.dequantize(self._raw(name), kind)
        except NotImplementedError:
            raise GGUFError(f"tensor {name!r} has type {kind.name}, which attnzoo cannot dequantize") from None
        # A copy: the file is memory-mapped read-only, and the model's parameters must own their memory.
        array = np.array(values, dtype=np.float32, copy=True).reshape(self.shape(name))
        return torch.from_numpy(array)

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as ``gguf.quants.dequantize`` takes them (as gguf's own reader lays them out): float
        types as their values, (innermost last) dims; quantized ones as uint8 rows of blocks."""
        gguf = require("gguf")
        info, kind = self._tensors[name], self._types[name]
        dims = tuple(reversed(info.dims))
        plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if kind in plain:
            item, shape = np.dtype(plain[kind]), dims
        else:
            item, shape = np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(dims, kind)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._data_start + info.offset
        count = int(np.prod(shape, dtype=np.int64)) * item.itemsize
        if start + count > self._map.shape[0]:
            raise GGUFError(f"tensor {name!r} runs past the end of {self.path.name}: the file is cut short")
        return self._map[start:start + count].view(item).reshape(shape)

"""Byte-level language modelling on real text: the Python standard library's own source files.

The text is the ``.py`` files of the standard library that ships with the running interpreter (the directory
``sysconfig.get_paths()["stdlib"]``), leaving out ``site-packages`` and, unless ``include_tests``, the test
suites (directories named ``test``, ``tests`` or ``idle_test``: more than half of the files, many of them
data and deliberately odd encodings rather than ordinary source).
The data therefore depends on the Python version; :meth:`Bytes.describe` names the directory and version.

The file list is sorted (by path relative to that directory), shuffled with the seed, and dealt out whole:
validation takes files until it holds ``validation_bytes``, then test until ``test_bytes``, then train until
``train_bytes``; the file that fills a split gives only its beginning and the rest of it is not used, so no
file is in two splits. At most ``max_file_bytes`` are taken from any one file (its beginning), so that one
large file cannot fill a small split on its own. Each split's bytes, its files concatenated in order, are cut
into non-overlapping windows of ``seq_len + 1`` (the remainder dropped): inputs are ``window[:, :-1]``,
targets ``window[:, 1:]``. No padding; the metric is bits per byte (cross-entropy in bits per target byte).

Packed (:meth:`Bytes.packed_split`, ``attnzoo train --pack``), the files are documents with their own lengths:
laid back to back in rows of ``seq_len`` bytes, each file a document of its own (positions and attention restart
at its start), its last byte predicting nothing, so no file's first byte is predicted from the file before it.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .._validation import check_bool, check_number, check_positive_int
from .base import Split, Task, register
from .packing import PackedSplit, pack_documents

OUTSIDE_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directories never read: installed packages are not the standard library."""
TEST_DIRECTORIES = frozenset({"test", "tests", "idle_test"})
"""The standard library's test suites, read only with ``include_tests=True``."""


def stdlib_directory() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path, include_tests: bool = False) -> List[str]:
    """The ``.py`` files under ``root`` outside :data:`OUTSIDE_DIRECTORIES` (and :data:`TEST_DIRECTORIES`
    unless ``include_tests``), as sorted posix paths relative to ``root``."""
    skipped = OUTSIDE_DIRECTORIES if include_tests else OUTSIDE_DIRECTORIES | TEST_DIRECTORIES
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in skipped]
        relative = Path(directory).relative_to(root)
        found.extend((relative / name).as_posix() for name in files if name.endswith(".py"))
    return sorted(found)


def deal_files(
    root: Path, files: List[str], budgets: Dict[str, int], max_file_bytes: int
) -> Dict[str, Tuple[bytes, List[str], List[int]]]:
    """Deal ``files`` (in this order) to the splits of ``budgets`` (in its order): each split takes whole
    files, at most ``max_file_bytes`` of each, until it holds its budget. Returns split -> (its bytes, its
    files, the bytes taken from each). Raises ValueError naming the budget when the files run out."""
    dealt: Dict[str, Tuple[bytes, List[str], List[int]]] = {}
    queue = iter(files)
    for split_name, budget in budgets.items():
        chunks, taken, size = [], [], 0
        while size < budget:
            name = next(queue, None)
            if name is None:
                raise ValueError(
                    f"the {len(files)} source files under {root} ran out before the {split_name} split "
                    f"held {split_name}_bytes={budget} bytes: ask for fewer bytes"
                )
            data = (root / name).read_bytes()[: min(max_file_bytes, budget - size)]
            if data:
                chunks.append(data)
                taken.append(name)
                size += len(data)
        dealt[split_name] = (b"".join(chunks), taken, [len(chunk) for chunk in chunks])
    return dealt


def windows(stream: bytes, seq_len: int) -> Split:
    """Non-overlapping windows of ``seq_len + 1`` bytes: inputs ``window[:, :-1]``, targets ``window[:, 1:]``;
    ``seq_len`` an int >= 1."""
    seq_len = check_positive_int("seq_len", seq_len)
    count = len(stream) // (seq_len + 1)
    array = np.frombuffer(stream, dtype=np.uint8)[: count * (seq_len + 1)].reshape(count, seq_len + 1)
    cut = torch.from_numpy(array.astype(np.int64))
    return Split(cut[:, :-1].contiguous(), cut[:, 1:].contiguous(), None)


@register
class Bytes(Task):
    """Next-byte prediction on the Python standard library's source files, split by file."""

    name = "bytes"
    kind = "lm"
    metric = "bits_per_byte"
    needs_causal = True
    summary = "next-byte prediction on the Python standard library's .py files, split by file"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_bytes: int = 1 << 20,
        validation_bytes: int = 1 << 17,
        test_bytes: int = 1 << 17,
        seq_len: int = 256,
        max_file_bytes: int = 1 << 16,
        include_tests: bool = False,
    ) -> None:
        self.seed = self._check_seed(seed)
        self.seq_len = check_positive_int("seq_len", seq_len)
        # Every split must hold at least one window of seq_len + 1 bytes.
        self.train_bytes = check_number("train_bytes", train_bytes, integer=True, minimum=self.seq_len + 1)
        self.validation_bytes = check_number("validation_bytes", validation_bytes, integer=True,
                                             minimum=self.seq_len + 1)
        self.test_bytes = check_number("test_bytes", test_bytes, integer=True, minimum=self.seq_len + 1)
        self.max_file_bytes = check_positive_int("max_file_bytes", max_file_bytes)
        self.include_tests = check_bool("include_tests", include_tests)

        self.vocab_size = 256
        self.num_classes = 256
        self.pad_id = None

        self.root = stdlib_directory()
        every_file = source_files(self.root, self.include_tests)
        order = np.random.default_rng(self.seed).permutation(len(every_file))
        dealt = deal_files(
            self.root, [every_file[i] for i in order],
            {"validation": self.validation_bytes, "test": self.test_bytes, "train": self.train_bytes},
            self.max_file_bytes,
        )
        self.files: Dict[str, List[str]] = {name: files for name, (_, files, _) in dealt.items()}
        """The files each split's bytes come from, in order, as paths relative to :attr:`root`."""
        self.file_lengths: Dict[str, List[int]] = {name: lengths for name, (_, _, lengths) in dealt.items()}
        """The bytes taken from each of those files: the documents' lengths."""
        self._streams = {name: stream for name, (stream, _, _) in dealt.items()}
        self._packed: Dict[str, PackedSplit] = {}
        self._set_splits({name: windows(stream, self.seq_len) for name, (stream, _, _) in dealt.items()})

    def packing_refusal(self) -> Optional[str]:
        """None: the files are the documents of packed rows."""
        return None

    def stream(self, name: str) -> torch.Tensor:
        """(bytes,) int64: the files of split ``name`` concatenated in order (their lengths: :attr:`file_lengths`)."""
        self.split(name)  # checks the name
        return torch.from_numpy(np.frombuffer(self._streams[name], dtype=np.uint8).astype(np.int64))

    def packed_split(self, name: str) -> Split:
        """The split ``name`` packed: each file a document of its own, laid back to back in rows of ``seq_len``
        bytes (a :class:`~attnzoo.tasks.packing.PackedSplit`; built on first use)."""
        if name not in self._packed:
            self._packed[name] = pack_documents(self.stream(name), self.file_lengths[name], self.seq_len)
        return self._packed[name]

    def _describe_extra(self) -> List[str]:
        counts = ", ".join(f"{name} {len(self.files[name])}" for name in ("train", "validation", "test"))
        tests = "tests included" if self.include_tests else "tests left out"
        return [
            f"the .py files of {self.root} (Python {sys.version.split()[0]}; other versions give other data), "
            f"{tests}; files per split: {counts}; at most {self.max_file_bytes} bytes from a file; seed {self.seed}",
        ]


COMPRESSORS = ("gzip -9", "bz2 -9", "xz -9")
"""The general-purpose compressors of :func:`compression_baselines`, by the command line they match."""


def _compressed_size(name: str, data: bytes) -> int:
    """Bytes of ``data`` compressed by the compressor ``name`` of :data:`COMPRESSORS`, container included."""
    if name == "gzip -9":
        return len(gzip.compress(data, compresslevel=9, mtime=0))
    if name == "bz2 -9":
        return len(bz2.compress(data, compresslevel=9))
    if name == "xz -9":
        return len(lzma.compress(data, preset=9))
    raise ValueError(f"unknown compressor {name!r}; expected one of {', '.join(COMPRESSORS)}")


def order0_entropy(data: bytes) -> float:
    """Bits per byte of the best fixed byte distribution for ``data``: its unigram entropy."""
    if not data:
        raise ValueError("order0_entropy needs at least one byte")
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.float64)
    shares = counts[counts > 0] / len(data)
    return float(-(shares * np.log2(shares)).sum())


def compression_baselines(data: bytes, context: bytes = b"") -> Dict[str, float]:
    """Bits per byte of ``data`` under each of :data:`COMPRESSORS` and its unigram entropy.

    With ``context`` (e.g. the training split), each compressor is also charged only for what ``data`` adds:
    ``size(context + data) - size(context)``, reported under ``"<name>, after context"``. That is the fair
    comparison with a model that has learnt from the context; gzip's 32 KiB window gains little from it, xz's
    large dictionary much more."""
    if not data:
        raise ValueError("compression_baselines needs at least one byte of data")
    bits = 8.0 / len(data)
    result = {"order-0 entropy": order0_entropy(data)}
    for name in COMPRESSORS:
        result[name] = _compressed_size(name, data) * bits
        if context:
            added = _compressed_size(name, context + data) - _compressed_size(name, context)
            result[f"{name}, after context"] = added * bits
    return result

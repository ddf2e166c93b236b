"""The lists of mechanisms by grouped_kv and packing in README.md, docs/architecture.md and docs/grouped.md name
exactly the mechanisms that declare it (``Capabilities.grouped_kv``, ``Capabilities.packing``): a mechanism
that gains a native path, or a new one, shows up here until every list says so."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

import pytest

import attnzoo

ROOT = Path(__file__).resolve().parents[2]
NAMES = attnzoo.available()


def declared(field: str, value: str) -> Set[str]:
    return {name for name in NAMES if getattr(attnzoo.capabilities(name), field) == value}


def names_in(text: str) -> Set[str]:
    """The registered mechanism names ``text`` mentions as words (``flash_gau`` is not ``gau``)."""
    return {name for name in NAMES if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)}


def between(path: str, start: str, end: str) -> str:
    """The text of ``path`` from ``start`` to the next ``end`` (line breaks and comment marks as spaces)."""
    text = re.sub(r"\s*\n\s*#?\s*", " ", (ROOT / path).read_text())
    begin = text.index(start)
    return text[begin : text.index(end, begin + len(start))]


def table(path: str, header: str) -> Dict[str, Set[str]]:
    """The rows of the markdown table under ``header`` (its first column), by first cell: the names in the second."""
    lines = (ROOT / path).read_text().splitlines()
    start = lines.index(header)
    rows: Dict[str, Set[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.setdefault(cells[0].strip("`"), set()).update(names_in(cells[1]))
    return rows


PROSE = [
    ("README.md", "8 query heads share 2 key/value heads.", "share them natively", "grouped_kv", "native"),
    ("docs/architecture.md", '`"native"` mechanisms (', '`"repeat"`', "grouped_kv", "native"),
    ("docs/architecture.md", '`"none"` (learned per-head tables', "refuses", "grouped_kv", "none"),
    ("docs/architecture.md", '`Capabilities.packing` is `"native"`', '`"split"`', "packing", "native"),
    ("docs/architecture.md", '`"none"` (refused, naming `cu_seqlens`', ")", "packing", "none"),
]


@pytest.mark.parametrize("path, start, end, field, value", PROSE, ids=[f"{p}-{f}-{v}" for p, _, _, f, v in PROSE])
def test_prose_lists_name_every_declared_mechanism(path, start, end, field, value):
    said = names_in(between(path, start, end))
    assert said == declared(field, value), (
        f"{path}: the {field}={value!r} list after {start!r} names {sorted(said)}; the declarations: "
        f"{sorted(declared(field, value))}")


def test_grouped_md_grouped_kv_table():
    rows = table("docs/grouped.md", "| `grouped_kv` | mechanisms | what happens |")
    for value in ("native", "none"):  # "repeat" ends with every other mechanism
        assert rows[value] == declared("grouped_kv", value), value


def test_grouped_md_packing_table():
    rows = table("docs/grouped.md", "| `packing` | mechanisms | how |")
    for value in ("native", "split", "none"):
        assert rows[value] == declared("packing", value), value


def test_the_list_check_can_fail():
    assert names_in("softmax, linear, performer and the fixed sparse patterns") != declared("grouped_kv", "native")
    assert names_in("gau and flash_gau, not gla") == {"gau", "flash_gau", "gla"}

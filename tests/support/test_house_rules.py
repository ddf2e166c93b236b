"""Rules of the package's layout that keep it easy to extend, read from the source (nothing is run).

* No module outside ``mechanisms/`` and ``functional/`` names a specific mechanism in its code: the
  training loop, data parallelism, the models, the drop-in and the benchmarks read what a mechanism declares
  (capabilities, training hooks, sweep options), so a new mechanism needs no edit anywhere else. Docstrings
  and comments may name mechanisms; code may not, except the registry's default (``softmax``) and the
  exceptions listed in ``ALLOWED`` with their reasons.
* No function over 80 lines, no file over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

import attnzoo

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "attnzoo"
MECHANISM_HOMES = {"mechanisms", "functional"}
DEFAULT_MECHANISM = "softmax"

# (module relative to the package, mechanism name): why that module may name it.
ALLOWED = {
    # The peer libraries attnzoo is measured against: which library implements which mechanism is the
    # benchmark's data, kept in one table.
    **{("bench/peers.py", name): "the peer table" for name in attnzoo.available()},
    # The gated blocks are the architecture of their own attention (Hua et al. 2022): block="gau" builds the
    # gau mechanism and block="flash_gau" the mixed chunk attention.
    ("models/config.py", "gau"): "the gated block of that name",
    ("models/config.py", "flash_gau"): "the gated block of that name",
    ("models/gau.py", "gau"): "the gated block of that name",
    ("models/gau.py", "flash_gau"): "the gated block of that name",
    ("models/__init__.py", "gau"): "imports models/gau.py, the gated blocks' module",
    ("models/stacks.py", "gau"): "imports models/gau.py, the gated blocks' module",
    ("models/mamba2.py", "ssd"): "block='mamba2' runs Mamba-2's SSD core (functional/ssd.py)",
    # Scheduled sampling's "linear" decay of the teacher-forcing probability, a word that is also a mechanism's.
    ("training/config.py", "linear"): "the sampling decay",
    ("training/seq2seq.py", "linear"): "the sampling decay",
}

MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def _modules() -> List[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _docstrings(tree: ast.AST) -> Set[int]:
    """ids of the string constants that are documentation: a string standing alone as a statement (a module,
    class or function docstring, or an attribute's docstring below it)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def mechanism_names_in(source: str, names: Set[str]) -> Iterator[Tuple[int, str]]:
    """(line, name) for each mechanism name that ``source`` uses in code: a string constant that is the name
    or quotes it (``"vq"``, ``"mechanism 'vq' ..."``), or an import of a module named after it."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for name in names:
                if node.value == name or f"'{name}'" in node.value or f'"{name}"' in node.value:
                    yield node.lineno, name
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") + [alias.name for alias in node.names]
            for name in names & set(parts):
                yield node.lineno, name


def _outside_mechanisms() -> List[Path]:
    return [p for p in _modules() if p.relative_to(PACKAGE).parts[0] not in MECHANISM_HOMES]


@pytest.mark.parametrize("path", _outside_mechanisms(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_mechanism_named_outside_mechanisms(path):
    names = set(attnzoo.available()) - {DEFAULT_MECHANISM}
    where = str(path.relative_to(PACKAGE))
    found = [f"line {line}: {name!r}" for line, name in mechanism_names_in(path.read_text(), names)
             if (where, name) not in ALLOWED]
    assert not found, f"{where} names mechanisms; read their declarations instead: {found}"


def test_the_name_check_can_fail():
    names = {"vq", "performer"}
    assert [n for _, n in mechanism_names_in('if config.mechanism == "vq": pass', names)] == ["vq"]
    assert [n for _, n in mechanism_names_in("x = f\"mechanism 'performer' {y}\"", names)] == ["performer"]
    assert [n for _, n in mechanism_names_in("from ..mechanisms.vq import update", names)] == ["vq"]
    assert not list(mechanism_names_in('"""Like vq and \'performer\'."""\nx = "linear attention"', names))


def _function_lengths(source: str) -> Iterator[Tuple[str, int]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_and_files_short(path):
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_FILE_LINES, f"{lines} lines: split the file by role"
    long = [f"{name} ({n} lines)" for name, n in _function_lengths(source) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_length_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert dict(_function_lengths(f"def f():\n{body}\n"))["f"] == MAX_FUNCTION_LINES + 1

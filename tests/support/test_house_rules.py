"""Rules of the package's layout that keep it easy to extend, read from the source (nothing is run).

* No module outside ``mechanisms/`` and ``functional/`` names a specific mechanism in its code: the
  training loop, data parallelism, the models, the drop-in and the benchmarks read what a mechanism declares
  (capabilities, training hooks, sweep options), so a new mechanism needs no edit anywhere else. Docstrings
  and comments may name mechanisms; code may not, except the registry's default (``softmax``) and the
  exceptions listed in ``ALLOWED`` with their reasons.
* No module outside ``mechanisms/`` and ``functional/`` asks what a mechanism is instead of what it declares:
  no ``isinstance`` or ``issubclass`` against a mechanism class (the base class :class:`~attnzoo.Mechanism`,
  which says only that a module is a mechanism, excepted), and no probing for an option by name (``"scale" in
  mechanism_options(name)``, ``getattr(mechanism, "window", ...)``, ``mechanism.quiet``): what the drop-in and
  the models need is declared in :class:`~attnzoo.Capabilities` or offered by the contract's methods.
* No function over 80 lines, no file over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

import attnzoo
from attnzoo.mechanisms import Mechanism, mechanism_options

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
    # attnzoo mqar's presets: the mechanisms of Zoology's comparison (Arora et al. 2024), the experiment's data,
    # kept in one table as the peer table is.
    **{("experiments/mqar_presets.py", name): "the MQAR presets" for name in ("linear", "based", "gated_delta",
                                                                              "ssd")},
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


# -- asking what a mechanism declares, never what it is -----------------------------------------------------
def _mechanism_classes() -> Set[str]:
    """The names of every class below :class:`Mechanism` (registered or a family's base), not Mechanism."""
    found, todo = set(), list(Mechanism.__subclasses__())
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


def _option_names() -> Set[str]:
    """Every option of a registered mechanism that the base class does not also have as an attribute."""
    options = {option for name in attnzoo.available() for option in mechanism_options(name)}
    return options - set(dir(Mechanism))


def _is_mechanism_expression(node: ast.AST) -> bool:
    """``mechanism``, ``x.mechanism``, ``self.attention.mechanism``, ``mechanism_class(name)``: an expression
    that names a mechanism."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.startswith("mechanism") and name not in {"mechanism_options", "mechanism_name"}


def mechanism_probes_in(source: str, classes: Set[str], options: Set[str]) -> Iterator[Tuple[int, str]]:
    """(line, what) for each place ``source`` asks a mechanism's class, or looks for one of its options by name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"isinstance",
                                                                                              "issubclass"}:
            kinds = node.args[1].elts if len(node.args) > 1 and isinstance(node.args[1], ast.Tuple) else node.args[1:]
            for kind in kinds:
                name = kind.id if isinstance(kind, ast.Name) else kind.attr if isinstance(kind, ast.Attribute) else ""
                if name in classes:
                    yield node.lineno, f"{node.func.id}(..., {name})"
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            for comparator in node.comparators:
                if isinstance(comparator, ast.Call) and isinstance(comparator.func, ast.Name) \
                        and comparator.func.id == "mechanism_options":
                    yield node.lineno, "an option looked for in mechanism_options()"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr"} \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in options \
                and _is_mechanism_expression(node.args[0]):
            yield node.lineno, f"{node.func.id}(mechanism, {node.args[1].value!r})"
        if isinstance(node, ast.Attribute) and node.attr in options and _is_mechanism_expression(node.value):
            yield node.lineno, f"mechanism.{node.attr}"


@pytest.mark.parametrize("path", _outside_mechanisms(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_mechanism_class_or_option_probed_outside_mechanisms(path):
    found = [f"line {line}: {what}" for line, what in
             mechanism_probes_in(path.read_text(), _mechanism_classes(), _option_names())]
    assert not found, (f"{path.relative_to(PACKAGE)} asks what a mechanism is; read what it declares "
                       f"(Capabilities) instead: {found}")


def test_the_probe_check_can_fail():
    classes, options = {"BlockSparseAttention", "KernelizedMechanism"}, {"scale", "window", "quiet"}
    toy = """
if isinstance(mechanism, BlockSparseAttention) or isinstance(m, (int, kernelized.KernelizedMechanism)):
    pass
if "scale" in mechanism_options(mechanism.name):
    pass
scale = getattr(self.attention.mechanism, "scale", None)
if layer.mechanism.quiet or mechanism_class(name).window:
    pass
ok = isinstance(module, Mechanism) and mechanism.capabilities.exact and getattr(config, "window", None)
"""
    found = sorted(mechanism_probes_in(toy, classes, options))
    assert found == [(2, "isinstance(..., BlockSparseAttention)"), (2, "isinstance(..., KernelizedMechanism)"),
                     (4, "an option looked for in mechanism_options()"), (6, "getattr(mechanism, 'scale')"),
                     (7, "mechanism.quiet"), (7, "mechanism.window")], found

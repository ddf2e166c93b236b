"""Data flows one way: each part of the package imports only from the parts below it.

Parsed from the source (no imports run), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "attnzoo"

# Lowest first. A module may import from its own layer or any layer below.
LAYERS = [
    {"_validation", "_dtypes", "_malloc", "state"},
    {"functional"},
    {"feature_maps"},
    {"mechanisms"},
    {"positional", "attention"},
    {"parallel"},  # sequence parallelism (sequence.py) and data parallelism (data.py)
    {"tasks"},  # training data; imports only _validation (test_tasks_import_only_validation)
    {"models"},
    {"decoding"},
    {"pretrained"},  # pretrained models from GGUF files, on the models' parts; decodes with decoding's
    {"dropin"},  # torch.nn swapping (swap.py) and Hugging Face (hf.py)
    {"training"},
    {"conversion"},  # pretrained softmax models converted to other attention (attention transfer, LoRA)
    {"bench"},  # the kernel benchmark behind attnzoo compare
    {"experiments"},  # training experiments: attnzoo lra, the seq2seq report, their cell runner
    {"cli", "__main__"},  # __main__: python -m attnzoo, the command itself
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _part(module_path: Path) -> str:
    """Top-level part of the package a file belongs to: ``functional/linear/chunk.py`` -> ``functional``."""
    return module_path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_parts(path: Path, source: str) -> set:
    """Top-level parts of attnzoo that ``source`` (the text of the file at ``path``) imports."""
    package_depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for attnzoo/x.py, 1 for attnzoo/sub/x.py
    parts = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1  # levels above the file's own package
                if up > package_depth:
                    continue
                here = list(path.relative_to(PACKAGE).parts[:-1])[: package_depth - up]
                target = here + (node.module.split(".") if node.module else [])
                if target:
                    parts.add(target[0])
                else:  # "from . import x" at the package root
                    parts.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("attnzoo."):
                parts.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            parts.update(a.name.split(".")[1] for a in node.names if a.name.startswith("attnzoo."))
    return parts


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_part_has_a_layer():
    parts = {_part(p) for p in MODULES}
    assert parts <= set(RANK), f"give these parts a layer: {sorted(parts - set(RANK))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_from_below(path):
    own = RANK[_part(path)]
    upward = sorted(part for part in _imported_parts(path, path.read_text()) if RANK.get(part, -1) > own)
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {own}) reaches up to {upward}"


def test_tasks_import_only_validation():
    """Tasks are data: their layer would allow mechanisms and attention below it, but they need neither."""
    paths = sorted((PACKAGE / "tasks").rglob("*.py"))
    assert paths
    for path in paths:
        reached = _imported_parts(path, path.read_text()) - {"tasks", "_validation"}
        assert not reached, f"{path.relative_to(PACKAGE)} imports {sorted(reached)}"
    assert _imported_parts(PACKAGE / "tasks" / "base.py", "from ..mechanisms import base") == {"mechanisms"}


def test_the_check_can_fail():
    """An upward import, relative or absolute, at module level or inside a function, is seen."""
    path = PACKAGE / "functional" / "softmax.py"
    for line in ("from ..mechanisms import base", "import attnzoo.models.layers",
                 "def f():\n    from attnzoo.bench import compare"):
        assert _imported_parts(path, line) & {"mechanisms", "models", "bench"}, line
    assert _imported_parts(path, "from .masks import allowed_mask") == {"functional"}


# -- no two modules import each other ------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    """``attnzoo.functional.linear.chunk`` for ``functional/linear/chunk.py``; a package by its ``__init__``."""
    parts = ("attnzoo",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(name: str, is_package: bool, source: str, known: set) -> set:
    """The modules of attnzoo that ``source`` (module ``name``) imports, at module level or in a function:
    ``from x import y`` counts as an import of ``x.y`` when that is a module, else of ``x``."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in known} - {name}


def import_graph(sources: dict) -> dict:
    """{module: modules it imports} from {(module name, is_package): source}."""
    known = {name for name, _ in sources}
    return {name: _imported_modules(name, is_package, source, known) for (name, is_package), source in sources.items()}


def import_cycles(graph: dict) -> list:
    """Every cycle of the import graph found depth-first, each from a module back to itself."""
    cycles, finished = [], set()

    def visit(module, path):
        if module in path:
            cycles.append(path[path.index(module):] + [module])
        elif module not in finished:
            for imported in sorted(graph.get(module, ())):
                visit(imported, path + [module])
            finished.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def _package_sources() -> dict:
    return {(_module_name(p), p.name == "__init__.py"): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _package_init_edge(importer: str, imported: str) -> bool:
    """A package's ``__init__`` importing its own modules, which import names the package re-exports from
    elsewhere, is how a package exposes its parts; only cycles between modules count."""
    return importer.startswith(imported + ".")


def test_no_two_modules_import_each_other():
    graph = import_graph(_package_sources())
    assert "attnzoo.functional.linear.chunk" in graph["attnzoo.functional.linear"]
    modules = {name: {m for m in imported if not _package_init_edge(name, m)} for name, imported in graph.items()}
    assert import_cycles(modules) == []


def test_the_import_cycle_check_can_fail():
    sources = {("attnzoo.p", True): "", ("attnzoo.p.a", False): "from .b import B",
               ("attnzoo.p.b", False): "def f():\n    from attnzoo.p.a import A",
               ("attnzoo.q", False): "from attnzoo.p import a", ("attnzoo.r", False): "import attnzoo.q"}
    graph = import_graph(sources)
    assert graph == {"attnzoo.p": set(), "attnzoo.p.a": {"attnzoo.p.b"}, "attnzoo.p.b": {"attnzoo.p.a"},
                     "attnzoo.q": {"attnzoo.p.a"}, "attnzoo.r": {"attnzoo.q"}}
    assert import_cycles(graph) == [["attnzoo.p.a", "attnzoo.p.b", "attnzoo.p.a"]]

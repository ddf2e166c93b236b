"""Data flows one way: each part of the package imports only from the parts below it.

Parsed from the source (no imports run), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "attnzoo"

# Lowest first. A module may import from its own layer or any layer below.
LAYERS = [
    {"_validation", "_dtypes", "_malloc", "state"},
    {"functional"},
    {"feature_maps"},
    {"mechanisms"},
    {"positional", "attention"},
    {"distributed", "parallel"},  # parallel: sequence parallelism (sequence.py) and data parallelism (data.py)
    {"tasks"},  # training data; imports only _validation (test_tasks_import_only_validation)
    {"models"},
    {"decoding"},
    {"swap", "hf", "dropin"},  # dropin: torch.nn swapping (swap.py) and Hugging Face (hf.py)
    {"training"},
    {"bench"},  # the kernel benchmark behind attnzoo compare
    {"experiments"},  # training experiments: attnzoo lra, the seq2seq report, their cell runner
    {"cli", "cli_training"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _part(module_path: Path) -> str:
    """Top-level part of the package a file belongs to: ``functional/linear.py`` -> ``functional``."""
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
    path = PACKAGE / "functional" / "linear.py"
    for line in ("from ..mechanisms import base", "import attnzoo.models.layers",
                 "def f():\n    from attnzoo.bench import compare"):
        assert _imported_parts(path, line) & {"mechanisms", "models", "bench"}, line
    assert _imported_parts(path, "from .masks import allowed_mask") == {"functional"}

"""The indexes of scripts/ and tests/ name everything in their folder, and nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def named(index: Path) -> set:
    """The `file` or `folder/` names an index's Markdown puts in backquotes."""
    return set(re.findall(r"`([\w.-]+/?)`", index.read_text()))


def test_every_script_has_a_line_in_the_scripts_index():
    scripts = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file() and p.name != "README.md"}
    listed = named(ROOT / "scripts" / "README.md")
    assert scripts - listed == set(), "scripts without a line in scripts/README.md"
    assert {name for name in listed if re.search(r"\.(py|sh)$", name)} - scripts == set(), "indexed but gone"


def test_every_test_area_is_in_the_tests_index():
    areas = {p.name + "/" for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    listed = {name for name in named(ROOT / "tests" / "README.md") if name.endswith("/")}
    assert areas == listed
    assert not list((ROOT / "tests").glob("test_*.py")), "tests belong in an area folder"

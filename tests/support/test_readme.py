"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def test_readme_examples_run_in_order(tmp_path, monkeypatch):
    """Every block, in order, in one namespace (later blocks build on the names of earlier ones, as a reader
    typing them in would), in an empty directory so that files they write land there."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for index, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md block {index}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README.md python block {index} fails: {type(error).__name__}: {error}\n{block}")


def _table_rows() -> dict:
    """The README's mechanism table: name -> its cells after the name."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `([a-z0-9_-]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_mechanism_table_matches_every_declaration():
    """One row per registered mechanism, whose yes/- columns and kind are what its class declares."""
    import attnzoo

    rows = _table_rows()
    assert sorted(rows) == attnzoo.available(), "the README table must list exactly the registered mechanisms"
    for name, cells in rows.items():
        caps = attnzoo.capabilities(name)
        _, causal, cross, padding, step, kind = cells
        said = {"causal": causal, "cross": cross, "key_padding": padding, "recurrent_step": step}
        for field, cell in said.items():
            assert cell.startswith("yes") == getattr(caps, field), f"{name}: README says {field} {cell!r}"
            assert cell.startswith("yes") or cell == "-", f"{name}: {field} cell must start with yes or be -"
        assert kind == caps.kind, f"{name}: README says kind {kind!r}, the class declares {caps.kind!r}"

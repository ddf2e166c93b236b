"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    namespace: dict = {}
    # Later blocks build on the names of earlier ones, as a reader typing them in order would.
    for block in BLOCKS[: index + 1]:
        exec(compile(block, f"README.md block {index}", "exec"), namespace)

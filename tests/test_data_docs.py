"""docs/world.md stays runnable: every ```python block not starting with `# not run:` executes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "world.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    return [b for b in blocks if not b.lstrip().startswith("# not run:")]


def test_doc_has_runnable_examples():
    assert len(_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_doc_example_runs(index, capsys):
    exec(compile(_blocks()[index], f"{DOC.name}[block {index}]", "exec"), {"__name__": "__doc_example__"})

"""The Python examples in the README and the core docs run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/verify.md", "docs/var.md", "docs/mar.md", "docs/vlm.md", "docs/demos.md",
        "docs/architecture.md", "docs/llamagen_pipeline.md", "docs/budgets.md", "docs/diffusers.md",
        "docs/transformers_image.md"]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_examples_run(doc):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python example"
    for block in blocks:
        exec(compile(block, doc, "exec"), {"__name__": "__doc_example__"})

"""The embedded VAR default (assets/var) as users meet it: `mmspec generate --family var`, the quality its card
claims (on a small sample) for the large model and for CoDe at the default split, the extreme splits on the real
models, and the docs' examples."""

import json
import re
from pathlib import Path

import pytest
import torch

from image_ar.var import VARPipeline
from image_ar.var.code import CoDePipeline
from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.testing import seeded_generators as gens

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipe():
    pipe = CoDePipeline.from_pretrained(ASSETS_DIR / "var")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_generate_code_on_the_embedded_default(tmp_path):
    out = tmp_path / "var"
    assert main(["generate", "--family", "var", "--method", "code", "--classes", "all", "--num-images", "1",
                 "--out", str(out), "--quiet"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 16 and (out / "grid.png").is_file()
    stats = json.loads((out / "stats.json").read_text())
    assert stats["method"] == "code" and stats["stats"]["num_draft_forwards"] == 3  # 2 scales + the prefill


@pytest.mark.parametrize("which", ["large", "code"])
def test_generated_images_are_judged_as_their_class(pipe, which):
    """The card reports the accuracies on 512 images; 32 images must clear 0.8 (a broken model scores ~1/16)."""
    from mmspec.metrics import class_accuracy

    labels = torch.arange(32) % 16
    call = pipe.as_var_pipeline("drafter") if which == "large" else pipe
    out = call(class_labels=labels, generator=gens(32), output_type="pt")
    assert class_accuracy(out.images, labels) >= 0.8


def test_extreme_splits_are_the_single_models(pipe):
    labels, n = [0, 5, 10, 15], len(pipe.drafter.patch_nums)
    for draft_steps, which in ((n, "drafter"), (0, "refiner")):
        alone = pipe.as_var_pipeline(which)(class_labels=labels, generator=gens(4, 7), output_type="latent")
        code = pipe(class_labels=labels, draft_steps=draft_steps, generator=gens(4, 7), output_type="latent")
        assert torch.equal(code.tokens, alone.tokens)
    assert isinstance(pipe.as_var_pipeline(), VARPipeline)


def test_the_documented_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/var.md").read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/var.md", "exec"), {"__name__": "__doc_example__"})

"""The embedded MAR default (assets/mar) as users meet it: `mmspec generate --family mar --method cspd`, the quality
its card claims (on a small sample) for the target, CSpD's exact special case on the real models, and a CSpD run
that accepts draft tokens."""

import json

import pytest
import torch

from continuous.mar import CSpDPipeline, MARPipeline
from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR


@pytest.fixture(scope="module")
def pipe():
    pipe = CSpDPipeline.from_pretrained(ASSETS_DIR / "mar")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gens(n: int, offset: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def test_generate_cspd_on_the_embedded_default(tmp_path):
    out = tmp_path / "mar"
    assert main(["generate", "--family", "mar", "--method", "cspd", "--classes", "0,7", "--num-images", "1",
                 "--method-arg", "gamma=4", "--method-arg", "num_sampling_steps=25", "--out", str(out),
                 "--quiet"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 2
    stats = json.loads((out / "stats.json").read_text())["stats"]
    assert stats["num_draft_forwards"] > 0 and stats["num_target_forwards"] < 64


def test_target_images_are_judged_as_their_class(pipe):
    """The card reports the accuracy on 256 images; 32 images must clear 0.8 (a broken model scores ~1/16)."""
    from mmspec.metrics import class_accuracy

    labels = torch.arange(32) % 16
    out = pipe.as_mar_pipeline("target")(class_labels=labels, generator=gens(32), output_type="pt")
    assert class_accuracy(out.images, labels) >= 0.8


def test_cspd_on_the_real_models(pipe):
    labels = [0, 5, 10, 15]
    vanilla = pipe.as_mar_pipeline("target")(class_labels=labels, generator=gens(4, 3), num_sampling_steps=25,
                                             output_type="latent")
    same = CSpDPipeline(target=pipe.target, draft=pipe.target, vae=pipe.vae)
    same.set_progress_bar_config(disable=True)
    exact = same(class_labels=labels, generator=gens(4, 3), gamma=1, num_sampling_steps=25, output_type="latent")
    assert torch.equal(exact.tokens, vanilla.tokens)
    out = pipe(class_labels=labels, generator=gens(4, 3), gamma=4, num_sampling_steps=25,
               output_type="latent")
    assert out.stats.num_target_forwards < 64 and torch.isfinite(out.tokens).all()
    assert isinstance(pipe.as_mar_pipeline(), MARPipeline)

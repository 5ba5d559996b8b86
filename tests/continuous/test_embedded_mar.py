"""The embedded MAR default (assets/mar) as users meet it: `mmspec generate --family mar --method cspd`, the quality
its card claims (on a small sample) for the target, CSpD's exact special case on the real models, and a CSpD run
that accepts draft tokens."""

import json

import pytest
import torch

from continuous.mar import CSpDPipeline, MARPipeline
from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.testing import seeded_generators as gens
from mmspec.verify.cspd import CSpDRule


@pytest.fixture(scope="module")
def pipe():
    pipe = CSpDPipeline.from_pretrained(ASSETS_DIR / "mar")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_generate_cspd_on_the_embedded_default(tmp_path):
    out = tmp_path / "mar"
    assert main(["generate", "--family", "mar", "--method", "cspd", "--classes", "0,7", "--num-images", "1",
                 "--method-arg", "gamma=4", "--method-arg", "num_sampling_steps=10", "--out", str(out),
                 "--quiet"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 2
    stats = json.loads((out / "stats.json").read_text())["stats"]
    assert stats["num_draft_forwards"] > 0 and stats["num_emitted_tokens"] == 2 * (64 - 4)  # 4 pre-filled


def test_target_images_are_judged_as_their_class(pipe):
    """The card reports 0.881 on 512 images at the shipped sampling defaults (constant CFG 2.0; the issue's 0.9 is
    not reached yet). These 16 images (one per class), at 25 diffusion steps and 4 tokens a step (num_iter 16: the
    official code's pace, 64 steps for 256 tokens), score 1.0 (one token a step: 1.0 at 25 steps, 0.94 at 50, and
    32 images 0.91); they must clear 0.7: a broken model scores ~1/16, colours alone give at most 0.25 (4 colours x
    4 shapes)."""
    from mmspec.metrics import class_accuracy

    labels = torch.arange(16)
    out = pipe.as_mar_pipeline("target")(class_labels=labels, generator=gens(16), output_type="pt",
                                         num_sampling_steps=25, num_iter=16)
    assert class_accuracy(out.images, labels) >= 0.7


def test_cspd_on_the_real_models(pipe):
    labels = [15]
    vanilla = pipe.as_mar_pipeline("target")(class_labels=labels, generator=gens(1, 3), num_sampling_steps=10,
                                             output_type="latent")
    same = CSpDPipeline(target=pipe.target, draft=pipe.target, vae=pipe.vae)
    same.set_progress_bar_config(disable=True)
    exact = same(class_labels=labels, generator=gens(1, 3), gamma=1, num_sampling_steps=10, output_type="latent")
    assert torch.equal(exact.tokens, vanilla.tokens)
    code = pipe(class_labels=labels, generator=gens(1, 3), gamma=4, num_sampling_steps=10, output_type="latent",
                rule=CSpDRule.reference_code(), budget="fixed")  # independent checks: every window is emitted whole
    assert code.stats.num_target_forwards == 4 + 15 and torch.isfinite(code.tokens).all()
    assert isinstance(pipe.as_mar_pipeline(), MARPipeline)


def test_the_shipped_draft_is_distilled_to_agree_with_its_target(pipe):
    """The draft was distilled from the target (`mmspec train mar-draft`): under the public code's criterion it is
    accepted about 0.39 of the time on these 4 images with trajectory alignment and 0.34 without (0.05 / 0.03 for
    the independently trained draft it replaced, docs/mar.md): at least 0.2, and alignment helps."""
    labels = [0, 5, 10, 15]
    rates = [pipe(class_labels=labels, generator=gens(4, 3), gamma=4, num_sampling_steps=25, output_type="latent",
                  rule=CSpDRule.reference_code(), align=align, budget="fixed").stats.draft_acceptance_rate
             for align in (True, False)]
    assert rates[0] >= 0.2 and rates[0] > rates[1]

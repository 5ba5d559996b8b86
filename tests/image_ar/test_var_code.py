"""CoDe collaborative decoding: with the same model as drafter and refiner it reproduces vanilla VAR exactly at
every split (so the one-pass re-encoding hands over the right state); the extreme splits are the drafter alone /
the refiner alone; the refiner's prefill equals scale-by-scale caching; errors are clear."""

import pytest
import torch
from var_dummies import get_dummy_components, small_refiner

from image_ar.var import VARPipeline, VARTransformer
from image_ar.var.code import CoDePipeline, default_draft_steps, refiner_prefill
from image_ar.var.pipeline import ScaleState, prepare_run
from mmspec.errors import InputError
from mmspec.testing import seeded_generators
from mmspec.testing.pipeline_tester import PipelineTesterMixin


class TestCoDePipeline(PipelineTesterMixin):
    pipeline_class = CoDePipeline
    image_shape, token_shape, num_classes = (8, 8), (21,), 3
    steps_instead = "its 3 steps are fixed by the models' scales .*draft_steps"
    extra_bad_inputs = (({"draft_steps": 4}, "draft_steps"),)

    def get_dummy_components(self) -> dict:
        c = get_dummy_components()
        return {"drafter": c["transformer"], "refiner": small_refiner(), "vqvae": c["vqvae"]}

    def get_dummy_inputs(self) -> dict:
        return {"draft_steps": 2}


def gens(n):
    return seeded_generators(n, offset=100)


def pipes(refiner=None):
    c = get_dummy_components()
    vanilla = VARPipeline(**c)
    code = CoDePipeline(drafter=c["transformer"], refiner=refiner or c["transformer"], vqvae=c["vqvae"])
    for p in (vanilla, code):
        p.set_progress_bar_config(disable=True)
    return vanilla, code


@pytest.mark.parametrize("draft_steps", [0, 1, 2, 3])
def test_same_model_on_both_sides_equals_vanilla_at_every_split(draft_steps):
    vanilla, code = pipes()
    want = vanilla(class_labels=[0, 1, 2], generator=gens(3), output_type="latent").tokens
    got = code(class_labels=[0, 1, 2], draft_steps=draft_steps, generator=gens(3), output_type="latent")
    assert torch.equal(got.tokens, want)
    assert got.num_forwards == 3 + (1 if 0 < draft_steps < 3 else 0)  # the refiner's hand-over prefill
    assert (got.stats.num_target_forwards, got.draft_steps) == (draft_steps, draft_steps)


def test_extreme_splits_are_one_model_alone():
    refiner = small_refiner()
    vanilla, code = pipes(refiner)
    drafter_alone = vanilla(class_labels=[1, 2], generator=gens(2), output_type="latent").tokens
    assert torch.equal(code(class_labels=[1, 2], draft_steps=3, generator=gens(2), output_type="latent").tokens,
                       drafter_alone)
    small = VARPipeline(transformer=refiner, vqvae=vanilla.vqvae)
    small.set_progress_bar_config(disable=True)
    assert torch.equal(code(class_labels=[1, 2], draft_steps=0, generator=gens(2), output_type="latent").tokens,
                       small(class_labels=[1, 2], generator=gens(2), output_type="latent").tokens)
    mixed = code(class_labels=[1, 2], draft_steps=2, generator=gens(2), output_type="pt")
    assert mixed.images.shape == (2, 3, 8, 8)


def test_refiner_prefill_equals_scale_by_scale_caching():
    refiner = small_refiner()
    quantizer = get_dummy_components()["vqvae"].quantize
    labels = torch.tensor([0, 2])
    pyramid = [torch.randint(0, 16, (2, pn * pn), generator=torch.Generator().manual_seed(pn)) for pn in (1, 2)]
    with torch.no_grad():
        run = prepare_run(refiner, labels, 4.0, 1.0, 0, 1.0, 1, None, "latent")
        one_pass = refiner_prefill(refiner, quantizer, run, ScaleState(pyramid=pyramid), 2)
        rows = torch.cat([labels, torch.full_like(labels, 3)])
        cond, step_cache = refiner.condition(rows), refiner.new_cache(4)
        refiner.forward_cached(refiner.first_token_map(cond), cond, step_cache, 0)
        x = quantizer.scale_inputs(pyramid, 2).repeat(2, 1, 1)
        refiner.forward_cached(refiner.embed_inputs(x, 1), cond, step_cache, 1)
    assert torch.equal(one_pass.lengths, step_cache.lengths)
    for a, b in zip(one_pass.k + one_pass.v, step_cache.k + step_cache.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_default_split_is_the_papers():
    assert default_draft_steps(10) == 8 and default_draft_steps(4) == 2


def test_mismatched_models_are_clear_errors():
    _, code = pipes()
    other = VARTransformer(vocab_size=16, cvae=4, num_classes=5, depth=1, embed_dim=8, num_heads=2,
                           patch_nums=(1, 2, 4))
    with pytest.raises(InputError, match="classes"):
        CoDePipeline(drafter=code.drafter, refiner=other, vqvae=code.vqvae)

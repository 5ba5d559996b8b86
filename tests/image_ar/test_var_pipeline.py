"""VARPipeline with dummy components: the shared pipeline tests (`mmspec.testing.pipeline_tester`), the CFG schedule,
greedy generation == teacher-forced argmax, one callback per scale, VAR's own bad inputs."""

import pytest
import torch
from var_dummies import get_dummy_components

from image_ar.var import VARVQVAE
from image_ar.var.pipeline import VARPipeline, guidance_schedule
from mmspec.errors import InputError
from mmspec.testing import seeded_generators as gens
from mmspec.testing.pipeline_tester import PipelineTesterMixin


@pytest.fixture(scope="module")
def pipe():
    pipe = VARPipeline(**get_dummy_components())
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TestVARPipeline(PipelineTesterMixin):
    pipeline_class = VARPipeline
    image_shape, token_shape, num_classes = (8, 8), (21,), 3
    steps_instead = "one step per scale, so its 3 steps are fixed"
    extra_bad_inputs = (({"temperature": [1.0, 1.0]}, "one value per scale"),
                        ({"guidance_scale": -1.0}, "guidance_scale"))

    def get_dummy_components(self) -> dict:
        return get_dummy_components()


def test_vanilla_counts_one_forward_per_scale(pipe):
    out = pipe(class_labels=[0, 2], generator=gens(2), output_type="latent")
    assert out.num_forwards == 3 and out.stats.num_draft_forwards == 0 and out.draft_steps is None


def test_guidance_schedule_rises_from_one_to_one_plus_cfg():
    assert guidance_schedule(4.0, 5) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_greedy_generation_equals_the_teacher_forced_argmax(pipe):
    """Without CFG and at temperature 0, each scale's codes are the argmax of the teacher-forced logits given
    the codes before them: the loop wires cache, inputs and quantiser like training does."""
    labels = torch.tensor([0, 1])
    tokens = pipe(class_labels=labels, guidance_scale=0.0, temperature=0.0, output_type="latent").tokens
    model, quantizer = pipe.transformer, pipe.vqvae.quantize
    pyramid = [tokens[:, b:e] for b, e in model.bounds]
    with torch.no_grad():
        logits = model(labels, quantizer.teacher_inputs(pyramid))
    assert torch.equal(logits.argmax(-1), tokens)


def test_callback_sees_every_scale(pipe):
    seen = []
    pipe(class_labels=[0], generator=gens(1), output_type="latent",
         callback_on_step_end=lambda p, si, n, t: seen.append((si, n, t["tokens"].shape[1])))
    assert seen == [(0, 1, 1), (1, 5, 5), (2, 21, 21)]


def test_components_with_different_schedules_are_refused():
    components = get_dummy_components()
    other = VARVQVAE(vocab_size=16, z_channels=4, ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_num_groups=4,
                     patch_nums=(1, 4))
    with pytest.raises(InputError, match="patch_nums"):
        VARPipeline(transformer=components["transformer"], vqvae=other)

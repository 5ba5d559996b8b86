"""VARPipeline with dummy components, in the diffusers style: outputs, save/load, batch-of-one equals in-batch,
num_images_per_prompt, seeded determinism, the CFG schedule, and greedy generation == teacher-forced argmax."""

import inspect

import PIL.Image
import pytest
import torch
from var_dummies import get_dummy_components

from image_ar.var import VARVQVAE
from image_ar.var.pipeline import VARPipeline, guidance_schedule
from mmspec.errors import InputError
from mmspec.testing import seeded_generators as gens


@pytest.fixture(scope="module")
def pipe():
    pipe = VARPipeline(**get_dummy_components())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_call_signature_has_the_documented_arguments():
    params = inspect.signature(VARPipeline.__call__).parameters
    for name in ("class_labels", "guidance_scale", "temperature", "top_k", "top_p", "num_images_per_prompt",
                 "generator", "output_type", "return_dict", "callback_on_step_end"):
        assert name in params


@pytest.mark.parametrize("output_type", ["pil", "np", "pt", "latent"])
def test_output_types(pipe, output_type):
    out = pipe(class_labels=[0, 2], generator=gens(2), output_type=output_type)
    assert out.tokens.shape == (2, 21) and out.num_forwards == 3
    if output_type == "pil":
        assert isinstance(out.images[0], PIL.Image.Image) and out.images[0].size == (8, 8)
    elif output_type == "np":
        assert out.images.shape == (2, 8, 8, 3)
    elif output_type == "pt":
        assert out.images.shape == (2, 3, 8, 8) and 0 <= float(out.images.min()) <= float(out.images.max()) <= 1
    else:
        assert torch.equal(out.images, out.tokens)


def test_seeded_runs_repeat_and_batch_of_one_equals_in_batch(pipe):
    a = pipe(class_labels=[0, 1, 2], generator=gens(3), output_type="latent").tokens
    b = pipe(class_labels=[0, 1, 2], generator=gens(3), output_type="latent").tokens
    single = pipe(class_labels=[1], generator=gens(1, 1), output_type="latent").tokens
    assert torch.equal(a, b) and torch.equal(a[1:2], single)
    other = pipe(class_labels=[0, 1, 2], generator=gens(3, 10), output_type="latent").tokens
    assert not torch.equal(a, other)


def test_num_images_per_prompt_and_tuple_output(pipe):
    images, tokens = pipe(class_labels=[0, 1], num_images_per_prompt=2, generator=gens(4), output_type="pt",
                          return_dict=False)
    assert images.shape[0] == 4 and tokens.shape == (4, 21)


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "var")
    loaded = VARPipeline.from_pretrained(tmp_path / "var")
    loaded.set_progress_bar_config(disable=True)
    a = pipe(class_labels=[2], generator=gens(1), output_type="latent").tokens
    assert torch.equal(loaded(class_labels=[2], generator=gens(1), output_type="latent").tokens, a)


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


@pytest.mark.parametrize("kwargs, match", [
    ({"class_labels": [3]}, "outside"),
    ({"class_labels": [0], "temperature": [1.0, 1.0]}, "one value per scale"),
    ({"class_labels": [0], "output_type": "gif"}, "output_type"),
    ({"class_labels": [0], "guidance_scale": -1.0}, "guidance_scale"),
    ({"class_labels": [0, 1], "generator": [torch.Generator()]}, "generators"),
])
def test_bad_inputs_are_clear_errors(pipe, kwargs, match):
    with pytest.raises(InputError, match=match):
        pipe(**kwargs)


def test_components_with_different_schedules_are_refused():
    components = get_dummy_components()
    other = VARVQVAE(vocab_size=16, z_channels=4, ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_num_groups=4,
                     patch_nums=(1, 4))
    with pytest.raises(InputError, match="patch_nums"):
        VARPipeline(transformer=components["transformer"], vqvae=other)

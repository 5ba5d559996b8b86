"""LlamaGenPipeline with tiny dummy components: the shared pipeline tests (`mmspec.testing.pipeline_tester`) and
LlamaGen's own (the draft model, stopping from the callback, lossless methods; greedy CFG against full forwards is
the method contract's, tests/test_contract.py)."""

import inspect

import numpy as np
import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.pipeline import LlamaGenPipeline, LlamaGenPipelineOutput
from mmspec.errors import InputError
from mmspec.testing.pipeline_tester import PipelineTesterMixin


def get_dummy_inputs(seed: int = 0, n: int = 2) -> dict:
    return {"class_labels": list(range(n)), "guidance_scale": 3.0, "top_k": 16,
            "generator": [torch.Generator().manual_seed(seed + i) for i in range(n)], "output_type": "np"}


@pytest.fixture(scope="module")
def pipe():
    p = LlamaGenPipeline(**get_dummy_components())
    p.set_progress_bar_config(disable=True)
    return p


class TestLlamaGenPipeline(PipelineTesterMixin):
    pipeline_class = LlamaGenPipeline
    image_shape, token_shape, num_classes = (16, 16), (16,), 4
    steps_instead = "one token per image position, so its 16 steps are fixed by the image size"
    extra_bad_inputs = (({"method": "nope"}, "unknown"), ({"top_p": 0.0}, "top_p"),
                        ({"method": "draft-model", "method_kwargs": {"bogus": 1}}, "takes num_draft_tokens"))

    def get_dummy_components(self) -> dict:
        return get_dummy_components()

    def get_dummy_inputs(self) -> dict:
        return {"guidance_scale": 3.0, "top_k": 16}


def test_call_signature_has_the_sampling_and_text_arguments():
    params = inspect.signature(LlamaGenPipeline.__call__).parameters
    for name in ("guidance_scale", "callback_on_step_end_tensor_inputs", "temperature", "top_k", "top_p",
                 "prompt_embeds", "method", "method_kwargs"):
        assert name in params


def test_vanilla_makes_one_target_forward_per_token(pipe):
    out = pipe(**get_dummy_inputs())
    assert isinstance(out, LlamaGenPipelineOutput) and out.stats.num_target_forwards == 16
    assert (out.tokens >= 0).all() and (out.tokens < 64).all()


def test_sampled_draft_model_is_reproducible_and_valid(pipe):
    inputs = {**get_dummy_inputs(seed=9, n=3), "output_type": "latent"}
    a = pipe(**inputs, method="draft-model", budget="fixed")
    b = pipe(**{**get_dummy_inputs(seed=9, n=3), "output_type": "latent"}, method="draft-model", budget="fixed")
    assert torch.equal(a.tokens, b.tokens)
    assert a.stats.num_accepted_tokens > 0  # it did accept drafts


def test_callback_sees_tokens_and_can_stop(pipe):
    seen = []

    def callback(p, step, num_tokens, kwargs):
        seen.append((step, num_tokens, kwargs["tokens"].shape))
        return {"stop": step == 2}

    out = pipe(**{**get_dummy_inputs(), "output_type": "latent"}, callback_on_step_end=callback)
    assert [s for s, _, _ in seen] == [0, 1, 2]
    assert all(shape == (2, 16) for _, _, shape in seen)
    assert (out.tokens == -1).any()  # stopped early; latents returned as they were


def test_an_interrupted_call_decodes_the_tokens_made_with_the_rest_a_zero_latent(pipe):
    """The default output_type ("pil") after `pipe._interrupt = True`: images of what was made, not an error; the
    positions not generated (tokens -1) decode from a zero latent vector."""
    def stop_after_five(p, step, num_tokens, kwargs):
        p._interrupt = num_tokens >= 5

    inputs = {k: v for k, v in get_dummy_inputs().items() if k != "output_type"}
    out = pipe(**inputs, callback_on_step_end=stop_after_five)
    made = out.tokens >= 0  # [2, 16]
    assert pipe.interrupt and not made.all() and made[:, :5].all() and not made[:, -1].any()
    assert len(out.images) == 2 and all(image.size == (16, 16) for image in out.images)
    vq = pipe.vqvae
    latents = vq.quantize.lookup(out.tokens.clamp_min(0)) * made.unsqueeze(-1)  # [2, 16, C], zero where not made
    expected = ((vq.decode(latents.unflatten(1, (4, 4)).permute(0, 3, 1, 2)) + 1) / 2).clamp(0, 1)
    pixels = torch.from_numpy(np.stack([np.asarray(image) for image in out.images])).permute(0, 3, 1, 2)
    assert torch.equal(pixels, (expected * 255).round().to(torch.uint8))


def test_save_and_load_keep_the_draft_model(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.draft_transformer is not None
    a = pipe(**get_dummy_inputs(seed=5), method="draft-model", budget="fixed")
    b = loaded(**get_dummy_inputs(seed=5), method="draft-model", budget="fixed")
    assert np.array_equal(a.images, b.images)


def test_pipeline_without_draft_model_explains_what_is_missing(tmp_path):
    comps = get_dummy_components()
    comps.pop("draft_transformer")
    pipe = LlamaGenPipeline(**comps)
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(InputError, match="draft_transformer"):
        pipe(class_labels=[0], method="draft-model")
    pipe.save_pretrained(tmp_path)
    assert LlamaGenPipeline.from_pretrained(tmp_path).draft_transformer is None


def test_methods_declare_whether_they_are_lossless():
    from image_ar.llamagen.family import FAMILY

    def is_lossless(name, params=None):
        return FAMILY.get_method(name).is_lossless(params)

    assert {"vanilla", "draft-model", "sjd", "gsd", "eagle", "lantern"} <= set(FAMILY.methods)
    assert is_lossless("vanilla") and is_lossless("draft-model") and is_lossless("sjd") and is_lossless("eagle")
    assert not is_lossless("sjd", {"accept": "lantern"}) and not is_lossless("gsd") and not is_lossless("lantern")
    assert is_lossless("gsd", {"group_size": 1}) and is_lossless("lantern", {"delta": 0.0})
    assert is_lossless("lantern", {"lam": 1}) and not is_lossless("lantern", {"lam": 2})
    assert is_lossless("eagle", {"accept": "gsd", "group_size": 1})
    with pytest.raises(InputError, match="unknown"):
        is_lossless("nope")

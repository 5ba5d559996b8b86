"""LlamaGenPipeline with tiny dummy components (diffusers' PipelineTesterMixin style)."""

import inspect

import numpy as np
import PIL.Image
import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.pipeline import LlamaGenPipeline, LlamaGenPipelineOutput
from mmspec.errors import InputError
from mmspec.sampling import cfg_combine


def get_dummy_inputs(seed: int = 0, n: int = 2) -> dict:
    return {"class_labels": list(range(n)), "guidance_scale": 3.0, "top_k": 16,
            "generator": [torch.Generator().manual_seed(seed + i) for i in range(n)], "output_type": "np"}


@pytest.fixture(scope="module")
def pipe():
    p = LlamaGenPipeline(**get_dummy_components())
    p.set_progress_bar_config(disable=True)
    return p


def test_call_signature_follows_diffusers_conventions():
    params = inspect.signature(LlamaGenPipeline.__call__).parameters
    for name in ("class_labels", "guidance_scale", "num_images_per_prompt", "generator", "output_type", "return_dict",
                 "callback_on_step_end", "callback_on_step_end_tensor_inputs", "temperature", "top_k", "top_p",
                 "prompt_embeds"):
        assert name in params
    assert params["output_type"].default == "pil" and params["return_dict"].default is True


def test_output_shapes_and_types(pipe):
    out = pipe(**get_dummy_inputs())
    assert isinstance(out, LlamaGenPipelineOutput)
    assert out.images.shape == (2, 16, 16, 3) and out.images.min() >= 0 and out.images.max() <= 1
    assert out.tokens.shape == (2, 16) and (out.tokens >= 0).all() and (out.tokens < 64).all()
    assert out.stats.num_target_forwards == 16  # vanilla: one forward per token
    pil = pipe(**{**get_dummy_inputs(), "output_type": "pil"}).images
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (16, 16)
    pt = pipe(**{**get_dummy_inputs(), "output_type": "pt"}).images
    assert pt.shape == (2, 3, 16, 16)
    assert torch.equal(pipe(**{**get_dummy_inputs(), "output_type": "latent"}).images, out.tokens)


def test_dict_and_tuple_outputs_agree(pipe):
    as_dict = pipe(**get_dummy_inputs())
    images, tokens, stats = pipe(**get_dummy_inputs(), return_dict=False)
    assert np.array_equal(as_dict.images, images) and torch.equal(as_dict.tokens, tokens)


def test_seeded_determinism_and_batch_of_one_equals_single(pipe):
    a = pipe(**get_dummy_inputs(seed=3, n=3))
    b = pipe(**get_dummy_inputs(seed=3, n=3))
    assert torch.equal(a.tokens, b.tokens)
    single = pipe(class_labels=[1], guidance_scale=3.0, top_k=16, generator=[torch.Generator().manual_seed(4)],
                  output_type="np")
    assert torch.equal(single.tokens[0], a.tokens[1])


def test_num_images_per_prompt(pipe):
    out = pipe(class_labels=[0, 3], num_images_per_prompt=3, guidance_scale=2.0,
               generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape[0] == 6 and out.tokens.shape == (6, 16)


@torch.no_grad()
def reference_greedy_cfg(transformer, labels, scale):
    """Greedy CFG decoding with full forwards (no cache): the independent reference."""
    n = len(labels)
    cond = torch.tensor(labels)
    uncond = torch.full_like(cond, transformer.config.num_classes)
    tokens = torch.zeros(n, 0, dtype=torch.long)
    for _ in range(transformer.config.block_size):
        idx = torch.cat([tokens, torch.zeros(n, 1, dtype=torch.long)], 1)  # position t predicts token t
        c = transformer(idx, cond).logits[:, -1]
        u = transformer(idx, uncond).logits[:, -1]
        tokens = torch.cat([tokens, cfg_combine(c, u, scale).argmax(-1, keepdim=True)], 1)
    return tokens


@pytest.mark.parametrize("method, kwargs", [("vanilla", {}), ("draft-model", {"num_draft_tokens": 3})])
def test_greedy_matches_the_full_forward_reference(pipe, method, kwargs):
    out = pipe(class_labels=[0, 2, 3], guidance_scale=2.5, temperature=0, method=method, method_kwargs=kwargs,
               output_type="latent")
    assert torch.equal(out.tokens, reference_greedy_cfg(pipe.transformer, [0, 2, 3], 2.5))
    if method == "draft-model":
        assert out.stats.num_draft_tokens > 0


def test_sampled_draft_model_is_reproducible_and_valid(pipe):
    inputs = {**get_dummy_inputs(seed=9, n=3), "output_type": "latent"}
    a = pipe(**inputs, method="draft-model")
    b = pipe(**{**get_dummy_inputs(seed=9, n=3), "output_type": "latent"}, method="draft-model")
    assert torch.equal(a.tokens, b.tokens)
    assert a.stats.num_target_forwards < 16  # it did accept drafts


def test_callback_sees_tokens_and_can_stop(pipe):
    seen = []

    def callback(p, step, num_tokens, kwargs):
        seen.append((step, num_tokens, kwargs["tokens"].shape))
        return {"stop": step == 2}

    out = pipe(**{**get_dummy_inputs(), "output_type": "latent"}, callback_on_step_end=callback)
    assert [s for s, _, _ in seen] == [0, 1, 2]
    assert all(shape == (2, 16) for _, _, shape in seen)
    assert (out.tokens == -1).any()  # stopped early; latents returned as they were


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.draft_transformer is not None
    a = pipe(**get_dummy_inputs(seed=5), method="draft-model")
    b = loaded(**get_dummy_inputs(seed=5), method="draft-model")
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


@pytest.mark.parametrize("kwargs, match", [
    ({"class_labels": [7]}, "outside"), ({"class_labels": None}, "class_labels"),
    ({"class_labels": [0], "output_type": "jpg"}, "output_type"), ({"class_labels": [0], "method": "nope"}, "unknown"),
    ({"class_labels": [0], "top_p": 0.0}, "top_p"), ({"class_labels": [0], "num_images_per_prompt": 0}, "num_images"),
    ({"class_labels": [0, 1], "generator": [torch.Generator()]}, "generators"),
    ({"class_labels": [0], "method": "draft-model", "method_kwargs": {"bogus": 1}}, "bad parameters"),
])
def test_bad_inputs_are_clear_errors(pipe, kwargs, match):
    with pytest.raises(InputError, match=match):
        pipe(**kwargs)


def test_methods_declare_whether_they_are_lossless():
    from image_ar.llamagen.methods import available_methods, is_lossless

    assert {"vanilla", "draft-model", "sjd", "gsd", "eagle", "lantern"} <= set(available_methods())
    assert is_lossless("vanilla") and is_lossless("draft-model") and is_lossless("sjd") and is_lossless("eagle")
    assert not is_lossless("sjd", {"accept": "lantern"}) and not is_lossless("gsd") and not is_lossless("lantern")
    assert is_lossless("gsd", {"group_size": 1}) and is_lossless("lantern", {"delta": 0.0})
    with pytest.raises(InputError, match="unknown"):
        is_lossless("nope")

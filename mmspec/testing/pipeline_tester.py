"""One set of tests every image pipeline passes (diffusers' `PipelineTesterMixin` style; `PromptPipelineTesterMixin`
for the text-conditional ones, whose conditions are prompts): the call conventions, every output type, the tuple
output (`(images,)` with return_dict=False), seeded determinism and batch-of-one equals in-batch,
num_images_per_prompt, save / load, the step callback (functions and diffusers' `PipelineCallback` objects, the
`interrupt` stop, after which the partial image is decoded), clear errors for bad inputs, and `num_inference_steps`
refused before any work (these pipelines are autoregressive), or equal to the family's own diffusion step count
where it has one (MAR's num_sampling_steps).

A family's test module declares one class:

    class TestVARPipeline(PipelineTesterMixin):
        pipeline_class = VARPipeline
        image_shape = (8, 8)            # H, W of the decoded images
        token_shape = (21,)             # per image: discrete ids (L,) or continuous tokens (L, C)
        num_classes = 3
        steps_instead = "scales"        # what num_inference_steps' refusal names instead (a regex), or
        inference_steps_name = "num_sampling_steps"  # the family's own name for it (MAR's diffusion head steps)

        def get_dummy_components(self): return {"transformer": ..., "vqvae": ...}
        def get_dummy_inputs(self): return {"guidance_scale": 4.0}   # call arguments besides labels/generators

and gets every test below (pytest collects them; `extra_bad_inputs` adds the family's own bad calls). Families
whose batched arithmetic may round differently from a batch of one set `batch_tolerance`. A text-conditional
pipeline declares `class TestJanusPipeline(PromptPipelineTesterMixin)` with `prompts` (ragged once tokenized)
instead of `num_classes`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.errors import InputError
from mmspec.pipeline_io import GenerationOutput
from mmspec.stats import SpecStats
from mmspec.testing import seeded_generators

CALL_PARAMETERS = ("class_labels", "num_images_per_prompt", "generator", "output_type", "return_dict",
                   "callback_on_step_end", "num_inference_steps")


class PipelineTesterMixin:
    """Shared pipeline tests (see the module docstring)."""

    pipeline_class: type
    image_shape: tuple[int, int]
    token_shape: tuple[int, ...]
    num_classes: int
    batch_tolerance: float = 0.0  # 0: the in-batch row equals the row alone bit for bit
    steps_instead: str = ""  # a regex the num_inference_steps refusal must match: what sets the steps instead
    inference_steps_name: str | None = None  # set where num_inference_steps means a step count the family has
    extra_bad_inputs: tuple[tuple[dict, str], ...] = ()
    condition_name: str = "class_labels"  # the call argument the conditions go to

    def get_dummy_components(self) -> dict:
        raise NotImplementedError

    def get_dummy_inputs(self) -> dict:
        return {}

    # ------------------------------------------------------------------------------------------- helpers
    @pytest.fixture(scope="class")
    def pipe(self):
        pipe = self.pipeline_class(**self.get_dummy_components())
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(self, pipe, labels: list, seed: int = 0, **kwargs: Any):
        """The pipeline on the conditions `labels` with one generator per image (seeded seed, seed + 1, ...)."""
        inputs = {**self.get_dummy_inputs(), self.condition_name: labels,
                  "generator": seeded_generators(len(labels), seed), "output_type": "latent", **kwargs}
        return pipe(**inputs)

    def labels(self, n: int) -> list:
        """n conditions (class ids here; captions in `PromptPipelineTesterMixin`)."""
        return [i % self.num_classes for i in range(n)]

    def bad_inputs(self) -> dict[str, tuple[dict, str]]:
        """kind -> (call arguments on top of one condition, the error's regex)."""
        return {"label outside": ({"class_labels": [self.num_classes]}, "outside"),
                "no labels": ({"class_labels": None}, "class_labels"),
                "label type": ({"class_labels": [1.5]}, "class_labels must be"),
                "label text": ({"class_labels": "a cat"}, "class_labels|prompt"),
                "generator type": ({"generator": "x"}, "generator must be"),
                "output_type": ({"output_type": "gif"}, "output_type"),
                "generators": ({"class_labels": [0, 0], "generator": [torch.Generator()]}, "generators"),
                "num_images": ({"num_images_per_prompt": 0}, "num_images_per_prompt")}

    # --------------------------------------------------------------------------------------------- tests
    def test_call_signature_follows_diffusers_conventions(self):
        params = inspect.signature(self.pipeline_class.__call__).parameters
        missing = [name for name in (*CALL_PARAMETERS, self.condition_name) if name not in params]
        assert not missing, f"{self.pipeline_class.__name__}.__call__ lacks {missing}"
        assert params["output_type"].default == "pil" and params["return_dict"].default is True
        assert params["num_inference_steps"].default is None

    @pytest.mark.parametrize("output_type", ["pil", "np", "pt", "latent"])
    def test_output_types(self, pipe, output_type):
        out = self.call(pipe, self.labels(2), output_type=output_type)
        assert isinstance(out, GenerationOutput) and isinstance(out.stats, SpecStats)
        assert tuple(out.tokens.shape) == (2, *self.token_shape) and out.stats.num_target_forwards > 0
        h, w = self.image_shape
        if output_type == "pil":
            assert isinstance(out.images[0], PIL.Image.Image) and out.images[0].size == (w, h)
        elif output_type == "np":
            assert out.images.shape == (2, h, w, 3) and 0 <= out.images.min() <= out.images.max() <= 1
        elif output_type == "pt":
            assert out.images.shape == (2, 3, h, w) and 0 <= float(out.images.min()) <= float(out.images.max()) <= 1
        else:
            assert torch.equal(out.images, out.tokens)

    def test_dict_and_tuple_outputs_agree(self, pipe):
        as_dict = self.call(pipe, self.labels(2), output_type="np")
        as_tuple = self.call(pipe, self.labels(2), output_type="np", return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 1  # (images,) as diffusers' pipelines
        assert np.array_equal(as_dict.images, as_tuple[0])

    def test_num_inference_steps_is_refused_before_any_work_or_means_the_familys_steps(self, pipe):
        if self.inference_steps_name is not None:  # diffusers' name for a step count of the family's own
            steps = self.get_dummy_inputs()[self.inference_steps_name]  # what the dummy calls pass by its name
            given = self.call(pipe, self.labels(1), output_type="latent", num_inference_steps=steps)
            named = self.call(pipe, self.labels(1), output_type="latent")
            assert torch.equal(given.tokens, named.tokens)
            with pytest.raises(InputError, match="disagree"):
                self.call(pipe, self.labels(1), num_inference_steps=steps + 1)
            return
        forwards = []
        models = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
        hooks = [sub.register_forward_pre_hook(lambda *_: forwards.append(1)) for m in models for sub in m.modules()]
        try:
            with pytest.raises(InputError, match="num_inference_steps") as error:
                self.call(pipe, self.labels(1), num_inference_steps=10)
        finally:
            for hook in hooks:
                hook.remove()
        assert models and not forwards and "\n" not in str(error.value)
        assert re.search(self.steps_instead, str(error.value)), str(error.value)

    def test_seeded_runs_repeat_and_batch_of_one_equals_in_batch(self, pipe):
        labels = self.labels(3)
        a, b = self.call(pipe, labels, seed=3).tokens, self.call(pipe, labels, seed=3).tokens
        assert torch.equal(a, b)
        alone = self.call(pipe, labels[1:2], seed=4).tokens  # row 1 of the batch used generator 3 + 1
        if self.batch_tolerance:
            torch.testing.assert_close(alone, a[1:2], atol=self.batch_tolerance, rtol=self.batch_tolerance)
        else:
            assert torch.equal(alone, a[1:2])
        assert not torch.equal(a, self.call(pipe, labels, seed=30).tokens)

    def test_num_images_per_prompt(self, pipe):
        out = pipe(**{**self.get_dummy_inputs(), self.condition_name: self.labels(2), "num_images_per_prompt": 2,
                      "generator": torch.Generator().manual_seed(0), "output_type": "pt"})
        assert out.images.shape[0] == 4 and tuple(out.tokens.shape) == (4, *self.token_shape)

    def test_save_and_load_round_trip(self, pipe, tmp_path):
        pipe.save_pretrained(tmp_path)
        loaded = self.pipeline_class.from_pretrained(tmp_path)
        loaded.set_progress_bar_config(disable=True)
        before = self.call(pipe, self.labels(2), seed=5).tokens
        assert torch.equal(self.call(loaded, self.labels(2), seed=5).tokens, before)

    def test_callback_sees_the_tokens_after_each_step(self, pipe):
        seen = []
        self.call(pipe, self.labels(2), callback_on_step_end=lambda p, step, n, kw: seen.append(
            (step, n, tuple(kw["tokens"].shape))))
        assert seen, "callback_on_step_end was never called"
        assert all(shape[0] == 2 for _, _, shape in seen)
        assert [n for _, n, _ in seen] == sorted(n for _, n, _ in seen)  # tokens so far never go back

    def test_interrupt_stops_after_the_current_step(self, pipe):
        steps = []

        def stop_at_first(p, step, n, kw):
            steps.append(step)
            p._interrupt = True

        out = self.call(pipe, self.labels(2), callback_on_step_end=stop_at_first)
        assert len(steps) == 1 and pipe.interrupt and pipe.num_timesteps > 1
        full = self.call(pipe, self.labels(2))  # the next call starts uninterrupted
        assert not pipe.interrupt and tuple(full.tokens.shape) == (2, *self.token_shape)
        assert out.tokens.shape != full.tokens.shape or not torch.equal(out.tokens, full.tokens)  # it did stop
        h, w = self.image_shape  # the partial image is decoded, in the default output type too
        images = self.call(pipe, self.labels(2), output_type="pil", callback_on_step_end=stop_at_first).images
        assert pipe.interrupt and len(images) == 2 and all(image.size == (w, h) for image in images)

    def test_diffusers_pipeline_callback_objects(self, pipe):
        from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback, SDCFGCutoffCallback

        class StopAtCutoff(PipelineCallback):
            tensor_inputs = ["tokens"]

            def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
                seen.append((step_index, pipeline.num_timesteps, tuple(callback_kwargs)))
                if step_index >= self.config.cutoff_step_index:
                    pipeline._interrupt = True
                return callback_kwargs

        seen = []
        self.call(pipe, self.labels(2), callback_on_step_end=MultiPipelineCallbacks([StopAtCutoff(
            cutoff_step_ratio=None, cutoff_step_index=1)]))
        assert len(seen) == 2 and all(n == pipe.num_timesteps and names == ("tokens",) for _, n, names in seen)
        with pytest.raises(InputError, match="prompt_embeds"):  # a Stable Diffusion callback: named, refused
            self.call(pipe, self.labels(1), callback_on_step_end=SDCFGCutoffCallback(cutoff_step_ratio=0.5))

    def test_bad_inputs_are_clear_errors(self, pipe):
        for kind, (kwargs, match) in self.bad_inputs().items():
            with pytest.raises(InputError, match=match) as error:
                pipe(**{**self.get_dummy_inputs(), self.condition_name: self.labels(1), **kwargs})
            assert "\n" not in str(error.value), kind

    def test_family_bad_inputs_are_clear_errors(self, pipe):
        for kwargs, match in self.extra_bad_inputs:
            with pytest.raises(InputError, match=match):
                pipe(**{**self.get_dummy_inputs(), self.condition_name: self.labels(1), **kwargs})


class PromptPipelineTesterMixin(PipelineTesterMixin):
    """The same tests for a text-conditional pipeline (`pipe(prompt, ...)`: LlamaGen t2i, Janus, Emu3): the
    conditions are `prompts` (cycled; give them ragged once tokenized), and the bad inputs are about prompts."""

    condition_name = "prompt"
    prompts: tuple[str, ...] = ("a red circle", "two small blue squares on a green background", "a cross")
    num_classes = 0

    def labels(self, n: int) -> list:
        return [self.prompts[i % len(self.prompts)] for i in range(n)]

    def bad_inputs(self) -> dict[str, tuple[dict, str]]:
        return {"class labels": ({"class_labels": [0]}, "text-conditional|not both"),
                "prompt type": ({"prompt": 3}, "prompt"),
                "prompt list": ({"prompt": ["a red circle", 3]}, "list of strings"),
                "output_type": ({"output_type": "gif"}, "output_type"),
                "generators": ({"prompt": self.labels(2), "generator": [torch.Generator()]}, "generators"),
                "generator type": ({"generator": [None]}, "generator must be"),
                "num_images": ({"num_images_per_prompt": 0}, "num_images_per_prompt")}

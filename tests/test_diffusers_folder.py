"""Pipeline folders diffusers itself loads (`mmspec.diffusers_folder`, issue 29): every shipped folder and every
folder `save_pretrained` writes loads with `DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)` as
the mmspec class, with mmspec's class and no flag, and without the flag diffusers names it; folders in the older
plain-name form still load with mmspec's classes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline

from mmspec.data.artifacts import ASSETS_DIR
from mmspec.diffusers_folder import SHIM_MODULE

SHIPPED = {"llamagen": "LlamaGenPipeline", "var": "CoDePipeline", "mar": "CSpDPipeline"}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_folders_load_with_diffusers(name):
    folder = ASSETS_DIR / name
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == [SHIM_MODULE, SHIPPED[name]]
    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    assert type(pipe).__name__ == SHIPPED[name] and type(pipe).__module__.split(".")[0] in ("image_ar", "continuous")
    pipe.set_progress_bar_config(disable=True)
    extra = {"num_sampling_steps": 3} if name == "mar" else {}
    out = pipe(class_labels=[0], generator=torch.Generator().manual_seed(0), output_type="pt", **extra)
    assert out.images.shape[0] == 1
    with pytest.raises(ValueError, match="trust_remote_code"):
        DiffusionPipeline.from_pretrained(folder)


def test_save_pretrained_writes_the_entry_and_old_folders_still_load(tmp_path):
    from image_ar.llamagen.pipeline import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained(ASSETS_DIR / "llamagen")
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == [SHIM_MODULE, "LlamaGenPipeline"]
    shim = (tmp_path / "saved" / f"{SHIM_MODULE}.py").read_text()
    assert "from image_ar.llamagen.pipeline import LlamaGenPipeline" in shim
    assert isinstance(LlamaGenPipeline.from_pretrained(tmp_path / "saved"), LlamaGenPipeline)
    assert isinstance(DiffusionPipeline.from_pretrained(tmp_path / "saved", trust_remote_code=True), LlamaGenPipeline)
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "saved", old)
    (old / f"{SHIM_MODULE}.py").unlink()
    (old / "model_index.json").write_text(json.dumps({**index, "_class_name": "LlamaGenPipeline"}))
    assert isinstance(LlamaGenPipeline.from_pretrained(old), LlamaGenPipeline)


def test_diffusers_call_conventions_on_every_pipeline():
    """callback_on_step_end_tensor_inputs on all five pipelines (checked names), MAR's num_inference_steps (diffusers'
    name for its diffusion steps; refused in one line by the token-by-token pipelines), and the attention helpers:
    act or raise a one-line error."""
    from continuous.mar.cspd import CSpDPipeline
    from image_ar.llamagen.pipeline import LlamaGenPipeline
    from image_ar.var.code import CoDePipeline
    from mmspec.errors import InputError

    cspd = CSpDPipeline.from_pretrained(ASSETS_DIR / "mar")
    code = CoDePipeline.from_pretrained(ASSETS_DIR / "var")
    pipes = {"llamagen": LlamaGenPipeline.from_pretrained(ASSETS_DIR / "llamagen"), "code": code,
             "var": code.as_var_pipeline("refiner"), "cspd": cspd, "mar": cspd.as_mar_pipeline("target")}
    extra = {"cspd": {"num_inference_steps": 2, "gamma": 8}, "mar": {"num_inference_steps": 2, "num_iter": 4}}
    for name, pipe in pipes.items():
        pipe.set_progress_bar_config(disable=True)
        seen: list = []

        def record(p, step, t, kwargs, seen=seen):
            seen.append(sorted(kwargs))

        pipe(class_labels=[0], output_type="latent", callback_on_step_end_tensor_inputs=["tokens"],
             callback_on_step_end=record, **extra.get(name, {}))
        assert seen and seen[0] == ["tokens"], name
        with pytest.raises(InputError, match="callback tensor input 'latents' not available"):
            pipe(class_labels=[0], callback_on_step_end_tensor_inputs=["latents"])
        with pytest.raises(InputError, match="does not slice attention"):
            pipe.enable_attention_slicing()
    with pytest.raises(InputError, match="disagree"):
        pipes["mar"](class_labels=[0], num_inference_steps=3, num_sampling_steps=5)
    with pytest.raises(InputError, match="scaled_dot_product_attention only"):
        pipes["mar"].enable_xformers_memory_efficient_attention()
    for name in ("llamagen", "var", "code"):  # CPU: the backend cannot run; the error says why and what can
        with pytest.raises(InputError, match="'xformers' cannot run on cpu.*needs CUDA.*Usable here: eager, sdpa"):
            pipes[name].enable_xformers_memory_efficient_attention()


@pytest.fixture
def counting_backend():
    """A registered backend that counts its calls (then runs sdpa): proves a model really uses the one it was set."""
    from mmspec.attention import _BACKENDS, get_backend, register_backend

    calls = []
    sdpa = get_backend("sdpa")
    register_backend("counting", lambda *args: calls.append(1) or sdpa(*args))
    yield calls
    _BACKENDS.pop("counting")


def test_set_attention_backend_acts_or_refuses(counting_backend):
    """diffusers' `model.set_attention_backend` on mmspec's models: the model then attends with that backend (its
    blocks too), `reset_attention_backend` returns to the default, diffusers' 'native' is sdpa, and an unknown
    name, a backend that cannot run here, or a model without a choice (MAR: timm's blocks) is a one-line error."""
    from continuous.mar.cspd import CSpDPipeline
    from image_ar.llamagen.pipeline import LlamaGenPipeline
    from image_ar.var.code import CoDePipeline
    from mmspec.errors import InputError

    llamagen = LlamaGenPipeline.from_pretrained(ASSETS_DIR / "llamagen")
    var = CoDePipeline.from_pretrained(ASSETS_DIR / "var").as_var_pipeline("refiner")
    for pipe, kwargs in ((llamagen, {"temperature": 0}), (var, {"top_k": 1})):
        pipe.set_progress_bar_config(disable=True)
        reference = pipe(class_labels=[0, 1], output_type="latent", **kwargs).tokens
        pipe.transformer.set_attention_backend("counting")
        assert torch.equal(pipe(class_labels=[0, 1], output_type="latent", **kwargs).tokens, reference)
        assert counting_backend, type(pipe.transformer).__name__
        counting_backend.clear()
        pipe.transformer.reset_attention_backend()
        pipe(class_labels=[0], output_type="latent", **kwargs)
        assert not counting_backend and pipe.transformer.attention_backend is None
        pipe.transformer.set_attention_backend("native")
        assert pipe.transformer.attention_backend == "sdpa"
        with pytest.raises(InputError, match="unknown attention backend 'flash_hub'.*choose from"):
            pipe.transformer.set_attention_backend("flash_hub")
        with pytest.raises(InputError, match="cannot run on cpu"):
            pipe.transformer.set_attention_backend("xformers")
    with pytest.raises(InputError, match="MARModel runs timm's attention blocks"):
        CSpDPipeline.from_pretrained(ASSETS_DIR / "mar").target.set_attention_backend("flash")


def test_vq_enable_slicing_decodes_one_image_at_a_time():
    """`vqvae.enable_slicing()` (diffusers' AutoencoderKL name) on LlamaGen's and VAR's VQ models: the decoder runs
    once per image and the images equal the batched decode."""
    from image_ar.llamagen.pipeline import LlamaGenPipeline
    from image_ar.var.code import CoDePipeline

    llamagen = LlamaGenPipeline.from_pretrained(ASSETS_DIR / "llamagen")
    var = CoDePipeline.from_pretrained(ASSETS_DIR / "var").as_var_pipeline("refiner")
    for pipe in (llamagen, var):
        pipe.set_progress_bar_config(disable=True)
        batches: list[int] = []
        pipe.vqvae.decoder.register_forward_hook(lambda module, args, out, seen=batches: seen.append(args[0].shape[0]))
        call = {"class_labels": [0, 1, 2], "generator": torch.Generator().manual_seed(0), "output_type": "pt"}
        whole = pipe(**call).images
        pipe.vqvae.enable_slicing()
        sliced = pipe(**{**call, "generator": torch.Generator().manual_seed(0)}).images
        pipe.vqvae.disable_slicing()
        assert batches == [3, 1, 1, 1], type(pipe.vqvae).__name__
        torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=0)

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
    name for its diffusion steps), and the attention helpers: act or raise a one-line error."""
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
        pipes["var"].enable_xformers_memory_efficient_attention()
    with pytest.raises(InputError, match="xformers is not installed or cannot run here"):
        pipes["llamagen"].enable_xformers_memory_efficient_attention()  # CPU: the backend cannot run

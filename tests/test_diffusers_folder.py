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

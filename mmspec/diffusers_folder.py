"""Pipeline folders that diffusers' own `DiffusionPipeline.from_pretrained` loads, and the diffusers call
conventions every mmspec pipeline shares (`MMSpecPipelineMixin`).

diffusers resolves a folder's pipeline class from `model_index.json`'s `_class_name`: a name is looked up in the
diffusers package itself (where mmspec's classes are not), a `[module, class]` pair names a custom pipeline file in
the folder. So every folder an mmspec pipeline saves holds

    model_index.json   "_class_name": ["mmspec_pipeline", "LlamaGenPipeline"]
    mmspec_pipeline.py from image_ar.llamagen.pipeline import LlamaGenPipeline   (one import of installed mmspec)

and loads with either

    LlamaGenPipeline.from_pretrained(folder)                                # mmspec's class: nothing else needed
    DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)       # diffusers' entry point

diffusers (>= 0.30) runs a folder's own .py file only with `trust_remote_code=True`; without it, its error names
the flag and the file to inspect. There is no way to load a class diffusers does not ship without that flag (or
`custom_pipeline=`); the file holds nothing but the import. mmspec's own classes read the pair as their name and
never run the file. Folders written before 2026-11-24 (a plain class name) still load with mmspec's classes.

Call conventions (the mixin): `_callback_tensor_inputs` (["tokens"]) checked by `check_callback_inputs`, the
attention helpers diffusers pipelines have either act (LlamaGen's xformers backend) or raise a one-line error
saying what to use instead (`enable_attention_slicing`, `enable_xformers_memory_efficient_attention` where the
models have no backend choice).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mmspec.errors import InputError, check

SHIM_MODULE = "mmspec_pipeline"


def pipeline_class_name(value: Any) -> Any:
    """`_class_name` of a model_index.json: the class's name, also from the `[module, class]` pair."""
    return value[1] if isinstance(value, (list, tuple)) and len(value) == 2 else value


def write_diffusers_entry(folder: str | os.PathLike, pipeline_cls: type) -> None:
    """Make `folder` (written by `save_pretrained`) loadable by `DiffusionPipeline.from_pretrained`: the class
    pair in model_index.json and the one-import module it names."""
    folder = Path(folder)
    index = folder / "model_index.json"
    config = json.loads(index.read_text())
    config["_class_name"] = [SHIM_MODULE, pipeline_cls.__name__]
    index.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / f"{SHIM_MODULE}.py").write_text(
        f'"""diffusers entry point of this mmspec pipeline folder (`mmspec.diffusers_folder`)."""\n'
        f"from {pipeline_cls.__module__} import {pipeline_cls.__name__}  # noqa: F401\n")


class MMSpecPipelineMixin:
    """For mmspec's `DiffusionPipeline` subclasses (listed first in the bases): `save_pretrained` writes the
    diffusers entry (`write_diffusers_entry`), `load_config` reads the `[module, class]` pair as the class name;
    the shared call conventions (see the module docstring)."""

    _callback_tensor_inputs = ["tokens"]

    def check_callback_inputs(self, names: list[str] | None) -> None:
        """`callback_on_step_end_tensor_inputs`: every name must be one this pipeline passes to callbacks."""
        for name in names or []:
            check(name in self._callback_tensor_inputs,
                  f"callback tensor input {name!r} not available; choose from {self._callback_tensor_inputs}.")

    def enable_attention_slicing(self, slice_size: Any = "auto") -> None:
        raise InputError(f"{type(self).__name__} does not slice attention; lower the batch size (--max-batch, or "
                         "fewer class labels per call) to save memory.")

    def enable_xformers_memory_efficient_attention(self, attention_op: Any = None) -> None:
        """Switch every component model with an `attention_backend` to mmspec's xformers backend (CUDA only)."""
        from mmspec.attention.xformers_backend import xformers_available

        models = [m for m in self.components.values() if hasattr(m, "attention_backend")]
        if not models:
            raise InputError(f"{type(self).__name__}'s models use torch's scaled_dot_product_attention only; there "
                             "is no xformers backend to enable (SDPA already picks a memory-efficient kernel).")
        if not xformers_available(self.device):
            raise InputError("xformers is not installed or cannot run here (it needs CUDA): pip install "
                             "'mmspec[xformers]' on a GPU machine.")
        for model in models:
            model.attention_backend = "xformers"

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        write_diffusers_entry(save_directory, type(self))

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any) -> Any:
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if isinstance(config, dict) and "_class_name" in config:
            config["_class_name"] = pipeline_class_name(config["_class_name"])
        return out

"""Pipeline folders that diffusers' own `DiffusionPipeline.from_pretrained` loads (`MMSpecPipelineMixin`).

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
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
    diffusers entry (`write_diffusers_entry`), `load_config` reads the `[module, class]` pair as the class name."""

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

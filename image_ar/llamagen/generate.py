"""The LlamaGen adapter of `mmspec generate`: load the pipeline (embedded default or a folder), count classes,
generate a batch."""

from __future__ import annotations

import torch

from image_ar.llamagen.methods import available_methods
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.cli.family_io import load_pipeline_folder
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.stats import SpecStats

METHODS = available_methods()
DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
DEFAULT_MODEL = ASSETS_DIR / "llamagen"


def load(model_path: str | None, device: str) -> LlamaGenPipeline:
    return load_pipeline_folder(LlamaGenPipeline, model_path, DEFAULT_MODEL, family="LlamaGen",
                                made_by="mmspec train llamagen",
                                converted_by="mmspec convert llamagen --gpt c2i_*.pt --vq vq_ds16_*.pt --out DIR",
                                device=device)


def num_classes(pipe: LlamaGenPipeline) -> int:
    return pipe.transformer.config.num_classes


def generate(pipe: LlamaGenPipeline, labels: list[int], generators: list[torch.Generator],
             options: dict) -> tuple[list, SpecStats]:
    out = pipe(class_labels=labels, generator=generators, output_type="pil", **options)
    return out.images, out.stats

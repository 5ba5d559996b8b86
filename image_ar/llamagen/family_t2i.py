"""The text-to-image LlamaGen family record (`llamagen-t2i`): the same pipeline and the same methods as `llamagen`
(declared once, in `image_ar.llamagen.family`), captions instead of class labels, and its own embedded default
(`assets/llamagen-t2i`, made by `mmspec train llamagen-t2i`).

    mmspec generate --family llamagen-t2i --prompt "a small red circle in the center on a black background" \
        --method sjd --out out/
"""

from __future__ import annotations

import torch

from image_ar.llamagen.family import FAMILY, sampling_defaults
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import check
from mmspec.families import FamilyRecord
from mmspec.stats import SpecStats


def load(model_path: str | None, device: str, dtype=None):
    from image_ar.llamagen.pipeline import LlamaGenPipeline
    from mmspec.cli.family_io import load_pipeline_folder

    pipe = load_pipeline_folder(LlamaGenPipeline, model_path, ASSETS_DIR / "llamagen-t2i", family="LlamaGen t2i",
                                made_by="mmspec train llamagen-t2i",
                                converted_by="mmspec convert llamagen --gpt t2i_*.pt --vq vq_ds16_t2i.pt --t5 "
                                             "FLAN_T5_FOLDER --out DIR", device=device, dtype=dtype)
    check(pipe.transformer.config.model_type == "t2i" and pipe.text_encoder is not None,
          f"{model_path or 'the folder'} is not a text-to-image LlamaGen with a text_encoder; use --family llamagen "
          "for class-conditional folders, or convert with --t5.")
    return pipe


def bench():
    from image_ar.llamagen.bench import llamagen_t2i_family

    return llamagen_t2i_family()


def generate(pipe, prompts: list[str], generators: list[torch.Generator], options: dict) -> tuple[list, SpecStats]:
    out = pipe(prompt=prompts, generator=generators, output_type="pil", **options)
    return out.images, out.stats


FAMILY_T2I = FamilyRecord("llamagen-t2i", "LlamaGen text-to-image generation (judge attribute agreement, world-FID)",
                          default_model=ASSETS_DIR / "llamagen-t2i", load=load, generate=generate, condition="prompt",
                          sampling_defaults=sampling_defaults, bench=bench, methods=FAMILY.methods)

"""The family records of transformers' AR image generators: `janus` (Janus / Janus-Pro, `JanusPipeline`), `emu3`
(`Emu3Pipeline`) and `lumina-mgpt` (Lumina-mGPT on transformers' Chameleon, `LuminaMGPTPipeline`), with the
LlamaGen family's method records that need no trained drafter (declared once, in
`image_ar.llamagen.family`). There is no embedded default: `--model` names a local folder in transformers' layout.

    mmspec generate --family janus --model Janus-Pro-1B --prompt "a red fox in the snow" --method sjd --out out/
    mmspec generate --family emu3 --model Emu3-Gen-hf --prompt "a red fox in the snow" --method gsd --out out/
    mmspec generate --family lumina-mgpt --model lumina-mgpt-7b-768 --prompt "a red fox" --method sjd --out out/
"""

from __future__ import annotations

import torch

from image_ar.llamagen.family import FAMILY as LLAMAGEN
from mmspec.errors import InputError
from mmspec.families import FamilyRecord, model_guidance_defaults
from mmspec.stats import SpecStats

METHODS = ("vanilla", "sjd", "gsd", "eagle", "lantern")  # shared records (eagle, lantern need a trained drafter)
# transformers' Janus: CFG 5; Emu3: CFG 3 and top-k 2048 (transformers' example, the SJD paper's Emu3 setting); a
# loaded model's own guidance scale (its generation_config, `default_guidance_scale`) replaces the CFG default
JANUS_DEFAULTS = {"guidance_scale": 5.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
EMU3_DEFAULTS = {"guidance_scale": 3.0, "temperature": 1.0, "top_k": 2048, "top_p": 1.0}
# Lumina-mGPT: the official README's CFG 4.0 and image top-k 2000 (the SJD / GSD papers ran CFG 3.0); a loaded 2.0
# pipeline's top-k is 4096 (`lumina_sampling_defaults`)
LUMINA_DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}


def loader(pipeline_name: str, family: str, made_by: str = ""):
    """load(model_path, device, dtype) of a pipeline class of `image_ar.transformers_ar` (`made_by`: how a user makes
    a folder, said when none is given)."""

    def load(model_path: str | None, device: str, dtype=None):
        import image_ar.transformers_ar as pipelines

        if model_path is None:
            raise InputError(f"the {family} family has no embedded default: pass --model FOLDER (a local {family} "
                             f"folder in transformers' layout{made_by}; `python -m image_ar.transformers_ar.tiny "
                             f"FOLDER --model {family}` writes a tiny random one to try).")
        pipe = getattr(pipelines, pipeline_name).from_pretrained(model_path, dtype=dtype, device=device)
        pipe.set_progress_bar_config(disable=True)  # the commands show their own bars (images, runs), as folders'
        return pipe

    return load


def generate(pipe, prompts: list[str], generators: list[torch.Generator], options: dict) -> tuple[list, SpecStats]:
    out = pipe(prompts, generator=generators, output_type="pil", **options)
    return out.images, out.stats


def bench_of(family: str):
    """The family's bench hook (`image_ar.transformers_ar.bench`, imported when a bench runs)."""

    def bench():
        from image_ar.transformers_ar.bench import transformers_image_family

        return transformers_image_family(family)

    return bench


def shared_methods() -> dict:
    return {name: LLAMAGEN.methods[name] for name in METHODS}


JANUS = FamilyRecord("janus", "transformers' Janus / Janus-Pro text-to-image (a local model folder; --model)",
                     load=loader("JanusPipeline", "janus"), generate=generate, condition="prompt",
                     sampling_defaults=model_guidance_defaults(JANUS_DEFAULTS), bench=bench_of("janus"),
                     methods=shared_methods())
EMU3 = FamilyRecord("emu3", "transformers' Emu3 text-to-image (a local model folder; --model)",
                    load=loader("Emu3Pipeline", "emu3"), generate=generate, condition="prompt",
                    sampling_defaults=model_guidance_defaults(EMU3_DEFAULTS), bench=bench_of("emu3"),
                    methods=shared_methods())
def lumina_sampling_defaults(pipeline) -> dict:
    """`LUMINA_DEFAULTS` with a loaded pipeline's guidance scale and image top-k (its version's: 2.0 samples 4096)."""
    pipe = pipeline()
    found = model_guidance_defaults(LUMINA_DEFAULTS)(lambda: pipe)
    return found if pipe is None else {**found, "top_k": pipe.default_top_k}


LUMINA_MGPT = FamilyRecord("lumina-mgpt", "Lumina-mGPT text-to-image on transformers' Chameleon (a folder `mmspec "
                           "convert lumina-mgpt` wrote; --model)",
                           load=loader("LuminaMGPTPipeline", "lumina-mgpt",
                                       ", which `mmspec convert lumina-mgpt` writes from an official one"),
                           generate=generate, condition="prompt",
                           sampling_defaults=lumina_sampling_defaults, bench=bench_of("lumina-mgpt"),
                           methods=shared_methods())
DEFAULTS = {"janus": JANUS_DEFAULTS, "emu3": EMU3_DEFAULTS, "lumina-mgpt": LUMINA_DEFAULTS}  # by model_type

"""Bench families `janus`, `emu3` and `lumina-mgpt`: a local model folder side by side with every method it runs, in
one process.

    mmspec bench --family janus --family-option model=Janus-Pro-1B --methods vanilla,sjd,gsd --batch-sizes 1,8 \
        --temperature 1 --out runs/bench-janus

Options (`--family-option`): model (a folder in transformers' layout; required: there is no embedded default),
prompts (a text file, one prompt a line; default: the world's held-out captions), guidance_scale, top_k, top_p
(default: the model's and the family's, as `mmspec generate`), budget (auto | fixed). An official size with random
weights instead of a folder: size=janus-pro-1b|janus-pro-7b, size=emu3-gen or size=lumina-mgpt-7b-768|lumina-mgpt-2.0
(`image_ar.transformers_ar.official`),
dtype (float32, bfloat16, float16), logit_scale (the image head drawn that many times wider: peaked laws); its
quality is token exactness alone. decode=false (any model) skips decoding the images. Figures: step compression,
speed-up, acceptance, token exactness against vanilla for lossless methods at temperature 0, and how closely the
tokens follow the target (`mmspec.metrics.calibration`, when the distributions fit in `CALIBRATION_BYTES`). There is
no judge for these models' images: they are not world models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from image_ar.llamagen.bench import caption_inputs
from image_ar.transformers_ar.family import DEFAULTS, EMU3, JANUS, LUMINA_MGPT
from mmspec.bench.image_family import (
    image_options,
    reproduces_vanilla,
    run_image_method,
    token_calibration,
    token_exactness,
)
from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of, pop_budget
from mmspec.budget import check_budget_mode
from mmspec.cli.family_io import torch_dtype
from mmspec.errors import check

RECORDS = {"janus": JANUS, "emu3": EMU3, "lumina-mgpt": LUMINA_MGPT}  # (their sampling defaults: `DEFAULTS`)
OFFICIAL_SIZES = {"janus": ("janus-pro-1b", "janus-pro-7b"), "emu3": ("emu3-gen",),  # `official.py`'s
                  "lumina-mgpt": ("lumina-mgpt-7b-768", "lumina-mgpt-2.0")}
CALIBRATION_BYTES = 2 ** 31  # the scored distributions of one chunk (n x T x V float32) must fit in this


def _options(settings: BenchSettings, family: str) -> dict[str, Any]:
    defaults = {**DEFAULTS[family], "guidance_scale": None}  # None: the model's own (its generation_config)
    if family == "lumina-mgpt":
        defaults["top_k"] = None  # the pipeline's: its version's official image top-k
    options = image_options(settings, family, defaults,
                            extra=("budget", "prompts", "decode", "size", "dtype", "logit_scale"))
    check(options.get("size") is None or options["size"] in OFFICIAL_SIZES[family],
          f"--family-option size={options.get('size')}: the {family} family's official sizes are "
          f"{', '.join(OFFICIAL_SIZES[family])}.")
    check(options["model"] is not None or options.get("size") is not None,
          f"bench family {family!r} needs --family-option model=FOLDER (a local {family} folder in transformers' "
          f"layout; there is no embedded default) or size={'|'.join(OFFICIAL_SIZES[family])} (random weights).")
    check_budget_mode(options["budget"], "--family-option budget")
    return options


def prompt_inputs(family: str):
    def inputs(settings: BenchSettings) -> list[Sample]:
        path = _options(settings, family)["prompts"]
        if path is None:
            return caption_inputs(settings)
        check(Path(path).is_file(), f"--family-option prompts={path}: no such file (one prompt a line).")
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        check(len(lines) > 0, f"--family-option prompts={path} holds no prompt.")
        return [Sample(question_id=i, category="prompt", data=lines[i % len(lines)])
                for i in range(settings.num_samples)]

    return inputs


def _runner(family: str):
    def runner(record):
        def run(pipe, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
            o = _options(settings, family)
            given, budget = pop_budget(given, o["budget"])
            return run_image_method(pipe, {"prompt": [s.data for s in batch]}, batch, settings, o, record.name,
                                    given, budget, output_type="latent" if o["decode"] == "false" else "pt")

        return run

    return runner


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    if reproduces_vanilla(method, params, settings):
        return {"exactness": token_exactness(outputs, vanilla)}
    return {}


def calibration(family: str):
    def figures(pipe, samples: Sequence[Sample], outputs: list, settings: BenchSettings) -> dict:
        o = _options(settings, family)
        if o.get("size") is not None:  # (random weights: no law worth scoring)
            return {}
        size = outputs[0]["tokens"].numel() * pipe.lm.vocab_size * 4
        chunk = max(1, min(32, CALIBRATION_BYTES // max(size, 1)))
        if size > CALIBRATION_BYTES:  # one image's distributions alone do not fit (Emu3 at 90 x 90 tokens)
            return {}
        return token_calibration(lambda prompts, tokens: pipe.target_probs(
            prompts, tokens, guidance_scale=o["guidance_scale"], temperature=settings.temperature,
            top_k=o["top_k"] if o["top_k"] is not None else pipe.default_top_k,
            top_p=o["top_p"]), outputs, settings, batch_size=chunk)

    return figures


def runnable_methods(record, model: str | None) -> list[str]:
    """The family's methods a model folder can run: eagle and lantern only with its trained drafter."""
    from image_ar.transformers_ar.pipeline import has_eagle_drafter

    drafter = has_eagle_drafter(model)
    return [name for name, method in record.methods.items() if drafter or "eagle_drafter" not in method.needs]


def transformers_image_family(family: str) -> Family:
    record = RECORDS[family]

    def build(settings: BenchSettings):
        o = _options(settings, family)
        dtype = torch_dtype(o.get("dtype"))
        if o.get("size") is None:
            return record.load(o["model"], settings.device)
        from image_ar.transformers_ar import official

        build_random = {"janus": official.random_janus_pipeline, "emu3": official.random_emu3_pipeline,
                        "lumina-mgpt": official.random_lumina_mgpt_pipeline}[family]
        return build_random(o["size"], settings.device, dtype or torch.float32, seed=settings.seed,
                            logit_scale=float(o["logit_scale"] or 1.0))

    def model_id(settings: BenchSettings) -> str:
        o = _options(settings, family)
        return str(o["model"]) if o.get("size") is None else f"{o['size']} (random weights)"

    return Family(name=family, model_id=model_id, build=build,
                  inputs=prompt_inputs(family), methods=methods_of(record, _runner(family), budget=True),
                  quality=quality, primary_quality=None, to_turn=lambda o: o["tokens"].tolist(),
                  default_methods=lambda s: (runnable_methods(record, _options(s, family)["model"])
                                             if _options(s, family).get("size") is None else list(record.methods)),
                  model_quality=calibration(family), description=record.description)

"""The `llamagen` and `llamagen-t2i` bench families: the LlamaGen pipeline (embedded default or
`--family-option model=PATH`), on class labels or on held-out captions.

`llamagen-t2i`: inputs are the captions of `num_samples` held-out (val split, seed 0) single-object world scenes;
quality is the judge's agreement with every caption attribute (`attribute_agreement`: shape, colour, size,
position, background, and all five at once) and world-FID against the real images of the same captions; the
rest as below.

Inputs: `num_samples` class labels cycling through the classes. Methods: every method of the family record
(`image_ar.llamagen.family`, vanilla first), run through the pipeline with one generator per image seeded by
(seed, sample id), so a sample's randomness does not depend on its batch. Quality: judge class accuracy and
world-FID (against held-out real world images; compare figures with equal sample counts), plus token exactness
versus vanilla for lossless methods at temperature 0, and at temperature > 0 how closely each method's tokens
follow the target's distribution (`pit_ks` and friends, `mmspec.metrics.calibration`, scored by
`image_ar.llamagen.scoring.target_probs`). `max_new_tokens` does not apply: an image is always
`block_size` tokens. Family options: see `mmspec.bench.image_family`, plus `budget` (`auto`: `mmspec.budget` picks
each step's draft size, the default of lossless methods; `fixed`: the configured size, the default of relaxed ones;
`auto-no-<part>`: the model without one part) for every method, or per method: `eagle:budget=fixed`.

Official sizes (`llamagen` only): `size=B|L|XL|XXL|3B` builds that official configuration with random weights
(`image_ar.llamagen.official`: the GPT, the VQ-16 tokenizer, an EAGLE head at its width and, for draft-model, a
`draft_size` GPT, default B) in `dtype` (float32, bfloat16, float16; default float32) at `image_size` 256 or 384,
its output head scaled by `logit_scale` (default 1; see `official.py`: peaked heads let EAGLE trees grow deep).
Random weights accept nothing worth timing: run such a bench with `--force-acceptance` (`mmspec.forced`). Its
quality figures are token exactness only (the judge and world-FID read world images). `decode=false` (any model)
skips decoding the images (tokens only: the time of the generation alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from image_ar.llamagen.family import DEFAULTS, FAMILY, load
from image_ar.llamagen.scoring import target_probs
from mmspec.bench.image_family import (
    check_official_only,
    class_inputs,
    image_options,
    image_quality,
    reproduces_vanilla,
    run_image_method,
    token_calibration,
    token_exactness,
    token_figures,
    tokens_only,
)
from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of, pop_budget
from mmspec.budget import check_budget_mode
from mmspec.cli.family_io import torch_dtype
from mmspec.compile import compile_pipeline

OFFICIAL = ("size", "draft_size", "image_size", "logit_scale")  # an official size with random weights (`official.py`)


def _options(settings: BenchSettings, family: str = "llamagen") -> dict[str, Any]:
    # guidance None: each model's own default (LlamaGenPipeline.default_guidance_scale)
    options = image_options(settings, family, {**DEFAULTS, "guidance_scale": None},
                            extra=("budget", "decode", "dtype", *(OFFICIAL if family == "llamagen" else ())))
    check_budget_mode(options["budget"], "--family-option budget")
    check_official_only(options, ("draft_size", "image_size", "logit_scale"), "B|L|XL|XXL|3B")
    return options


def build(settings: BenchSettings):
    o = _options(settings)
    dtype = torch_dtype(o["dtype"])
    if o["size"] is not None:
        from image_ar.llamagen.official import random_pipeline

        pipe = random_pipeline(o["size"], settings.device, dtype or torch.float32, draft_size=o["draft_size"] or "B",
                               image_size=int(o["image_size"] or 256), seed=settings.seed,
                               logit_scale=float(o["logit_scale"] or 1.0))
    else:
        pipe = load(o["model"], settings.device, dtype)
    return compile_pipeline(pipe, o["compile"])


def _runner(record, family: str = "llamagen"):
    def run(pipe, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        o = _options(settings, family)
        given, budget = pop_budget(given, o["budget"])
        conditions = ({"prompt": [s.data for s in batch]} if family == "llamagen-t2i" else
                      {"class_labels": [int(s.data) for s in batch]})
        return run_image_method(pipe, conditions, batch, settings, o, record.name, given, budget,
                                output_type="latent" if o["decode"] == "false" else "pt")

    return run


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    if tokens_only(_options(settings)):
        return token_figures(outputs, vanilla, reproduces_vanilla(method, params, settings))
    return image_quality(outputs, vanilla, settings, _options(settings)["fid_reference"],
                         exactness=reproduces_vanilla(method, params, settings))


def calibration(pipe, samples: Sequence[Sample], outputs: list, settings: BenchSettings) -> dict:
    o = _options(settings, "llamagen-t2i" if pipe.transformer.config.model_type == "t2i" else "llamagen")
    if o.get("size") is not None:  # random weights: no distribution worth checking
        return {}
    return token_calibration(lambda labels, tokens: target_probs(
        pipe, labels, tokens, guidance_scale=o["guidance_scale"], temperature=settings.temperature, top_k=o["top_k"],
        top_p=o["top_p"]), outputs, settings)


def model_id(settings: BenchSettings) -> str:
    o = _options(settings)
    if o["size"] is not None:
        return f"LlamaGen-{o['size']} (official config, random weights)"
    return str(o["model"] or "embedded llamagen (world)")


def llamagen_family() -> Family:
    return Family(name="llamagen", model_id=model_id,
                  build=build, inputs=class_inputs, methods=methods_of(FAMILY, _runner, budget=True), quality=quality,
                  primary_quality="class_accuracy", to_turn=lambda o: o["tokens"].tolist(), model_quality=calibration,
                  description=FAMILY.description)


# ------------------------------------------------------------------------------------------------ t2i
@lru_cache(maxsize=2)
def held_out_scenes(n: int):
    """The n val-split world scenes (seed 0) whose captions are the t2i bench's inputs."""
    from mmspec.data import generate_batch
    from mmspec.world_training import IMAGE_SIZE

    return generate_batch(n, 0, split="val", image_size=IMAGE_SIZE)


def caption_inputs(settings: BenchSettings) -> list[Sample]:
    from mmspec.data import CLASS_NAMES

    scenes = held_out_scenes(settings.num_samples)
    return [Sample(question_id=i, category=CLASS_NAMES[int(scenes.labels[i])], data=scenes.captions[i])
            for i in range(settings.num_samples)]


def caption_quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list,
                    settings: BenchSettings) -> dict:
    """The judge's agreement with each caption attribute and with all of them, world-FID against the real images of
    the same captions (2+ images), token exactness vs vanilla where it must be 1 (`reproduces_vanilla`)."""
    from mmspec.metrics import attribute_agreement, world_fid
    from mmspec.metrics.train_judge import scene_targets

    if tokens_only(_options(settings, "llamagen-t2i")):
        return token_figures(outputs, vanilla, reproduces_vanilla(method, params, settings))
    scenes = held_out_scenes(settings.num_samples)
    rows = torch.tensor([int(o["index"]) for o in outputs])
    images = torch.stack([o["image"] for o in outputs])
    agreement = attribute_agreement(images, {k: v[rows] for k, v in scene_targets(scenes).items()})
    figures: dict[str, Any] = {"attribute_agreement": agreement["all_attributes"],
                               **{f"{k}_agreement": v for k, v in agreement["attributes"].items()}}
    if len(outputs) >= 2:
        figures["world_fid"] = world_fid(images, scenes.float_images()[rows]).fid
    if reproduces_vanilla(method, params, settings):
        figures["exactness"] = token_exactness(outputs, vanilla)
    return figures


def build_t2i(settings: BenchSettings):
    from image_ar.llamagen.family_t2i import load as load_t2i

    o = _options(settings, "llamagen-t2i")
    return compile_pipeline(load_t2i(o["model"], settings.device, torch_dtype(o["dtype"])), o["compile"])


def llamagen_t2i_family() -> Family:
    from image_ar.llamagen.family_t2i import FAMILY_T2I

    return Family(name="llamagen-t2i",
                  model_id=lambda s: str(_options(s, "llamagen-t2i")["model"] or "embedded llamagen-t2i (world)"),
                  build=build_t2i, inputs=caption_inputs,
                  methods=methods_of(FAMILY, lambda record: _runner(record, "llamagen-t2i"), budget=True),
                  quality=caption_quality, primary_quality="attribute_agreement",
                  to_turn=lambda o: o["tokens"].tolist(), model_quality=calibration,
                  description=FAMILY_T2I.description)

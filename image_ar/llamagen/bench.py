"""The `llamagen` bench family: the LlamaGen pipeline (embedded default or `--family-option model=PATH`).

Inputs: `num_samples` class labels cycling through the classes. Methods: every method of the family record
(`image_ar.llamagen.family`, vanilla first), run through the pipeline with one generator per image seeded by
(seed, sample id), so a sample's randomness does not depend on its batch. Quality: judge class accuracy and
world-FID (against held-out real world images; compare figures with equal sample counts), plus token exactness
versus vanilla for lossless methods at temperature 0, and at temperature > 0 how closely each method's tokens
follow the target's distribution (`pit_ks` and friends, `mmspec.metrics.calibration`, scored by
`image_ar.llamagen.scoring.target_probs`). `max_new_tokens` does not apply: an image is always
`block_size` tokens. Family options: see `mmspec.bench.image_family`, plus `budget` (`fixed`, the default, or
`auto`: `mmspec.budget` picks each step's draft size) for every method, or per method: `eagle:budget=auto`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from image_ar.llamagen.family import DEFAULTS, FAMILY, load
from image_ar.llamagen.scoring import target_probs
from mmspec.bench.image_family import (
    class_inputs,
    image_options,
    image_outputs,
    image_quality,
    sample_generators,
    token_calibration,
)
from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of, pop_budget
from mmspec.budget import check_budget_mode
from mmspec.compile import compile_pipeline


def _options(settings: BenchSettings) -> dict[str, Any]:
    options = image_options(settings, "llamagen", DEFAULTS, extra=("budget",))
    check_budget_mode(options["budget"], "--family-option budget")
    return options


def build(settings: BenchSettings):
    o = _options(settings)
    return compile_pipeline(load(o["model"], settings.device), o["compile"])


def _runner(record):
    def run(pipe, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        o = _options(settings)
        given, budget = pop_budget(given, o["budget"] or "fixed")
        out = pipe(class_labels=[int(s.data) for s in batch], generator=sample_generators(batch, settings),
                   guidance_scale=o["guidance_scale"], temperature=settings.temperature, top_k=o["top_k"],
                   top_p=o["top_p"], method=record.name, method_kwargs=dict(given), output_type="pt",
                   budget=budget)
        return MethodOutput(outputs=image_outputs(out.images, out.tokens, batch),
                            new_tokens=[out.tokens.shape[1]] * len(batch), stats=out.stats)

    return run


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    return image_quality(outputs, vanilla, settings, _options(settings)["fid_reference"],
                         exactness=method.is_lossless(params) and settings.greedy)


def calibration(pipe, samples: Sequence[Sample], outputs: list, settings: BenchSettings) -> dict:
    o = _options(settings)
    return token_calibration(lambda labels, tokens: target_probs(
        pipe, labels, tokens, guidance_scale=o["guidance_scale"], temperature=settings.temperature, top_k=o["top_k"],
        top_p=o["top_p"]), outputs, settings)


def llamagen_family() -> Family:
    return Family(name="llamagen", model_id=lambda s: str(_options(s)["model"] or "embedded llamagen (world)"),
                  build=build, inputs=class_inputs, methods=methods_of(FAMILY, _runner, budget=True), quality=quality,
                  primary_quality="class_accuracy", to_turn=lambda o: o["tokens"].tolist(), model_quality=calibration,
                  description=FAMILY.description)

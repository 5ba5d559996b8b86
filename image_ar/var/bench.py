"""The `var` bench family: VAR alone (`vanilla`, the large model) and CoDe (`code`, param draft_steps: the scales
the large model makes; default all but the last two) on the embedded default or `--family-option model=PATH`.

A table over every split: `--methods vanilla,code:draft_steps=0,code:draft_steps=1,...` (0 = the small model
alone; S = the large model alone through CoDe's code path). Inputs, generators, options and quality (judge class
accuracy, world-FID) as the llamagen family (`mmspec.bench.image_family`); at temperature 0 every configuration also
reports token exactness vs vanilla (1.0 for CoDe with draft_steps = S). "target fwd" counts the large model's
forwards and "draft fwd" the small model's; the scales differ in size, so the speed-up column (wall-clock), not
the forward count, is CoDe's figure. For the peak memory of the tensors a run allocates (KV caches, activations;
not the weights), run with `--memory tensors`.

Official sizes: `size=d16|d20|d24|d30` builds that VAR with random weights, and with `small_size` (default d16) CoDe's
pair (`image_ar.var.official`), in `dtype` (float32, bfloat16, float16); CoDe needs no acceptance, so its speed-up
there is real, while its quality figures are token exactness alone. `decode=false` (any model) skips decoding the
images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from image_ar.var.family import DEFAULTS, FAMILY, load
from mmspec.bench.image_family import (
    check_official_only,
    class_inputs,
    image_options,
    image_outputs,
    image_quality,
    sample_generators,
    token_figures,
    tokens_only,
)
from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of
from mmspec.cli.family_io import torch_dtype
from mmspec.compile import compile_pipeline


def _options(settings: BenchSettings) -> dict[str, Any]:
    o = image_options(settings, "var", DEFAULTS, extra=("size", "small_size", "dtype", "decode"))
    check_official_only(o, ("small_size",), "d16|d20|d24|d30")
    return o


def build(settings: BenchSettings):
    o = _options(settings)
    dtype = torch_dtype(o["dtype"])
    if o["size"] is not None:
        from image_ar.var.official import random_pipeline

        pipe = random_pipeline(o["size"], o["small_size"] or "d16", settings.device, dtype or torch.float32,
                               seed=settings.seed)
    else:
        pipe = load(o["model"], settings.device, dtype)
    return compile_pipeline(pipe, o["compile"])


def _runner(record):
    def run(pipe, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        o = _options(settings)
        call, extra = record.build(pipe, given, FAMILY.name)
        out = call(class_labels=[int(s.data) for s in batch], generator=sample_generators(batch, settings),
                   guidance_scale=o["guidance_scale"], temperature=settings.temperature, top_k=o["top_k"],
                   top_p=o["top_p"], output_type="latent" if o["decode"] == "false" else "pt", **extra)
        return MethodOutput(outputs=image_outputs(out.images, out.tokens, batch),
                            new_tokens=[out.tokens.shape[1]] * len(batch), stats=out.stats)

    return run


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    if tokens_only(_options(settings)):
        return token_figures(outputs, vanilla, settings.greedy)
    return image_quality(outputs, vanilla, settings, _options(settings)["fid_reference"],
                         exactness=settings.greedy)


def model_id(settings: BenchSettings) -> str:
    o = _options(settings)
    if o["size"] is not None:
        small = o["small_size"] or "d16"
        return f"VAR-{o['size']} with CoDe's {small} (official configs, random weights)"
    return str(o["model"] or "embedded var (world)")


def var_family() -> Family:
    return Family(name="var", model_id=model_id,
                  build=build, inputs=class_inputs, methods=methods_of(FAMILY, _runner), quality=quality,
                  primary_quality="class_accuracy", to_turn=lambda o: o["tokens"].tolist(),
                  description=FAMILY.description)

"""The `mar` bench family: vanilla MAR (`vanilla`, the target alone; param num_iter, default the token count: one
token per step, CSpD's baseline; fewer iterations = the multi-token fast baseline) and CSpD (`cspd`, params gamma,
prefill_ratio, align, criterion) on the embedded default or `--family-option model=PATH`.

    mmspec bench --family mar --methods vanilla,vanilla:num_iter=16,cspd:gamma=8,cspd:gamma=8:align=false

Inputs, generators, options and quality (judge class accuracy, world-FID) as the llamagen family
(`mmspec.bench.image_family`; top_k / top_p do not apply). "target fwd" counts target MAR forwards (pre-filling and
verification passes), "draft fwd" the draft's; the mean acceptance length and per-position acceptance are CSpD's
windows. Sampling is at temperature > 0 (CSpD compares Gaussians); `--temperature` sets the diffusion temperature.
`--family-option num_sampling_steps=N` sets the diffusion steps of every method that does not set its own (default
100, the official value; the records' params say N):
the diffusion head's sequential steps are a cost CSpD does not reduce, so this moves the balance it depends on.

Official sizes: `size=B|L|H` builds that MAR with random weights, and with `draft_size` (default B) CSpD's pair
(`continuous.mar.official`), in `dtype` (float32, bfloat16, float16); every operation runs at its real size, but a
random pair's acceptance is not a trained pair's, so its speed-up is timing only, and quality is not scored.
`decode=false` (any model) skips decoding the images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from continuous.mar.family import DEFAULTS, FAMILY, call_options, load
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
from mmspec.errors import InputError

BENCH_DEFAULTS = {**DEFAULTS, "guidance_scale": None, "top_k": 0, "top_p": 1.0}  # None: the target's own


def _options(settings: BenchSettings) -> dict[str, Any]:
    """The shared image options plus MAR's num_sampling_steps (diffusion steps of every method, default 100)."""
    options = dict(settings.options)
    steps = options.pop("num_sampling_steps", "100")
    parsed = image_options(dataclasses.replace(settings, options=options), "mar", BENCH_DEFAULTS,
                           extra=("size", "draft_size", "dtype", "decode"))
    try:
        parsed["num_sampling_steps"] = int(steps)
    except ValueError:
        raise InputError(f"--family-option num_sampling_steps must be an integer, got {steps!r}.") from None
    check_official_only(parsed, ("draft_size",), "B|L|H")
    return parsed


def build(settings: BenchSettings):
    o = _options(settings)
    dtype = torch_dtype(o["dtype"])
    if o["size"] is None:
        return load(o["model"], settings.device, dtype)
    from continuous.mar.official import random_pipeline

    return random_pipeline(o["size"], o["draft_size"] or "B", settings.device, dtype or torch.float32,
                           seed=settings.seed)


def _runner(record):
    def run(pipe, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        o = _options(settings)
        call, extra = record.build(pipe, given, FAMILY.name)
        sampling = call_options({"guidance_scale": o["guidance_scale"], "temperature": settings.temperature})
        out = call(class_labels=[int(s.data) for s in batch], generator=sample_generators(batch, settings),
                   output_type="latent" if o["decode"] == "false" else "pt",
                   **{"num_sampling_steps": o["num_sampling_steps"], **sampling, **extra})
        images = out.tokens if o["decode"] == "false" else out.images  # ("latent": the images are the tokens)
        return MethodOutput(outputs=image_outputs(images, out.tokens, batch),
                            new_tokens=[out.tokens.shape[1]] * len(batch), stats=out.stats)

    return run


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    o = _options(settings)
    if tokens_only(o):  # (continuous tokens: no exactness to report)
        return token_figures(outputs, vanilla, exact=False)
    return image_quality(outputs, vanilla, settings, o["fid_reference"], exactness=False)


def model_id(settings: BenchSettings) -> str:
    o = _options(settings)
    if o["size"] is not None:
        return f"MAR-{o['size'].upper()} + MAR-{(o['draft_size'] or 'B').upper()} draft (random weights)"
    return str(o["model"] or "embedded mar (world)")


def mar_family() -> Family:
    return Family(name="mar", model_id=model_id,
                  build=build, inputs=class_inputs, methods=methods_of(FAMILY, _runner), quality=quality,
                  primary_quality="class_accuracy",
                  option_params=lambda s: {"num_sampling_steps": _options(s)["num_sampling_steps"]},
                  to_turn=lambda o: {"label": o["label"], "tokens_shape": list(o["tokens"].shape)},
                  description=FAMILY.description)

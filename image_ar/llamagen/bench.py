"""The `llamagen` bench family: the LlamaGen pipeline (embedded default or `--family-option model=PATH`).

Inputs: `num_samples` class labels cycling through the classes. Methods: every method registered in
`image_ar.llamagen.methods` (vanilla first), run through the pipeline with one generator per image seeded by
(seed, sample id), so a sample's randomness does not depend on its batch. Quality: judge class accuracy and
world-FID (against held-out real world images; compare figures with equal sample counts), plus token exactness
versus vanilla for lossless methods at temperature 0. `max_new_tokens` does not apply: an image is always
`block_size` tokens. Family options: model (folder), guidance_scale (default 4.0), top_k, top_p,
fid_reference (number of real images, default 2000).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from image_ar.llamagen.generate import DEFAULTS, load
from image_ar.llamagen.methods import available_methods, is_lossless, method_parameters
from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample
from mmspec.errors import InputError

OPTIONS = ("model", "guidance_scale", "top_k", "top_p", "fid_reference")


def _options(settings: BenchSettings) -> dict[str, Any]:
    unknown = set(settings.options) - set(OPTIONS)
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} for bench family 'llamagen'; "
                         f"known: {', '.join(OPTIONS)}.")
    o = dict(settings.options)
    return {"model": o.get("model"), "guidance_scale": float(o.get("guidance_scale", DEFAULTS["guidance_scale"])),
            "top_k": int(o.get("top_k", DEFAULTS["top_k"])), "top_p": float(o.get("top_p", DEFAULTS["top_p"])),
            "fid_reference": int(o.get("fid_reference", 2000))}


def build(settings: BenchSettings):
    return load(_options(settings)["model"], settings.device)


def inputs(settings: BenchSettings) -> list[Sample]:
    from mmspec.data import CLASS_NAMES

    n_classes = len(CLASS_NAMES)
    return [Sample(question_id=i, category=CLASS_NAMES[i % n_classes], data=i % n_classes)
            for i in range(settings.num_samples)]


def given(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a configuration sets (None = not given, see `methods.method_parameters`)."""
    return {k: v for k, v in params.items() if v is not None}


def _runner(method: str):
    def run(pipe, batch: Sequence[Sample], settings: BenchSettings, params: Mapping[str, Any]) -> MethodOutput:
        o = _options(settings)
        gens = [torch.Generator(device=settings.device).manual_seed(settings.seed * 1_000_003 + int(s.question_id))
                for s in batch]
        out = pipe(class_labels=[int(s.data) for s in batch], generator=gens, guidance_scale=o["guidance_scale"],
                   temperature=settings.temperature, top_k=o["top_k"], top_p=o["top_p"], method=method,
                   method_kwargs=given(params), output_type="pt")
        outputs = [{"image": img.cpu(), "tokens": tok.cpu(), "label": int(s.data)}
                   for img, tok, s in zip(out.images, out.tokens, batch)]
        return MethodOutput(outputs=outputs, new_tokens=[out.tokens.shape[1]] * len(batch), stats=out.stats)

    return run


@lru_cache(maxsize=4)
def _reference(n: int):
    from mmspec.metrics import world_reference_stats

    return world_reference_stats(n=n, seed=0)


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    from mmspec.metrics import class_accuracy, world_fid

    images = torch.stack([o["image"] for o in outputs])
    labels = torch.tensor([o["label"] for o in outputs])
    figures: dict[str, Any] = {"class_accuracy": class_accuracy(images, labels)}
    if len(outputs) >= 2:
        fid = world_fid(images, _reference(_options(settings)["fid_reference"]))
        figures["world_fid"] = fid.fid
        figures["world_fid_n"] = fid.n_generated
    if method.is_lossless(params) and settings.greedy:
        same = [torch.equal(a["tokens"], b["tokens"]) for a, b in zip(outputs, vanilla)]
        figures["exactness"] = sum(same) / len(same)
    return figures


def llamagen_family() -> Family:
    methods = {name: Method(_runner(name), lossless=lambda params, name=name: is_lossless(name, given(params)),
                            params=method_parameters(name))
               for name in available_methods()}
    return Family(name="llamagen", model_id=lambda s: str(_options(s)["model"] or "embedded llamagen (world)"),
                  build=build, inputs=inputs, methods=methods, quality=quality, primary_quality="class_accuracy",
                  to_turn=lambda o: o["tokens"].tolist(),
                  description="LlamaGen class-conditional image generation (judge accuracy, world-FID)")

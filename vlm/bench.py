"""The `vlm` bench family: long answers about held-out world scenes from a LLaVA target, alone (`vanilla`) or with
the EagleVLM drafter (`eagle`, params depth, top_k, total_tokens).

    mmspec bench --family vlm --methods vanilla,eagle,eagle:depth=7:top_k=10:total_tokens=60 --max-new-tokens 96

Inputs: `--num-samples` test-split scenes, one question each, asked with the long-answer prompt ("Answer in
detail."): short answers hide any speed-up, so every paper lengthens them, and so does this family (say so when
quoting its numbers). Family options (`--family-option KEY=VALUE`): model (target folder, default the embedded
`assets/vlm`; drafters in MODEL/drafters/<kind>), top_p. Quality: `exactness` (fraction of answers equal to
vanilla's token for token; lossless methods must give 1.0 at temperature 0) and `answer_contains_short` (the
answer contains the world's short answer as a word: how often the target is right, the same for every lossless
method at temperature 0). The drafter's prefill cost is reported as the figure `drafter_image_tokens_per_row`:
how many image tokens the drafter attends to per row (EagleVLM: all of them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError
from vlm.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS

OPTIONS = ("model", "top_p")


def _options(settings: BenchSettings) -> dict[str, Any]:
    unknown = set(settings.options) - set(OPTIONS)
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} for bench family 'vlm'; known: {', '.join(OPTIONS)}.")
    return {"model": settings.options.get("model") or str(ASSETS_DIR / "vlm"),
            "top_p": float(settings.options.get("top_p", 1.0))}


def build(settings: BenchSettings):
    from vlm.pipeline import SpeculativeVLM

    model = _options(settings)["model"]
    return SpeculativeVLM.from_pretrained(model, "eagle" if _has(model, "eagle") else None, device=settings.device)


def _has(model: str, kind: str) -> bool:
    from pathlib import Path

    return (Path(model) / "drafters" / kind / "config.json").is_file()


def inputs(settings: BenchSettings) -> list[Sample]:
    from vlm.world import world_vqa_examples

    examples = world_vqa_examples("test", settings.num_samples, seed=settings.seed, long_fraction=1.0)
    return [Sample(question_id=i, category=ex.qa.kind, data=ex) for i, ex in enumerate(examples)]


def _runner(use_drafter: bool):
    def run(vlm, batch: Sequence[Sample], settings: BenchSettings, params: Mapping[str, Any]) -> MethodOutput:
        if use_drafter and vlm.drafter is None:
            raise InputError("method 'eagle' needs an EagleVLM drafter in MODEL/drafters/eagle; train one with "
                             "`mmspec train vlm-drafter --kind eagle --target MODEL`.")
        tree = (params.get("depth", DEFAULT_DEPTH), params.get("top_k", DEFAULT_TOP_K),
                params.get("total_tokens", DEFAULT_TOTAL_TOKENS))
        examples = [s.data for s in batch]
        out = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], settings.max_new_tokens,
                           settings.temperature, _options(settings)["top_p"], tree=tree, batch_size=len(batch),
                           generator=torch.Generator().manual_seed(settings.seed), use_drafter=use_drafter)
        attended = _image_tokens(vlm) if use_drafter else None
        outputs = [{"tokens": ids, "text": text, "short": ex.qa.short, "drafter_image_tokens": attended}
                   for ids, text, ex in zip(out.token_ids, out.texts, examples)]
        return MethodOutput(outputs=outputs, new_tokens=[len(ids) for ids in out.token_ids], stats=out.stats)

    return run


def _image_tokens(vlm) -> int:
    from vlm.world import num_image_tokens

    return num_image_tokens(vlm.processor)


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    same = [a["tokens"] == b["tokens"] for a, b in zip(outputs, vanilla)]
    right = [re.search(rf"\b{re.escape(o['short'].lower())}\b", o["text"].lower()) is not None for o in outputs]
    figures = {"exactness": sum(same) / len(same), "answer_contains_short": sum(right) / len(right)}
    if outputs and outputs[0]["drafter_image_tokens"] is not None:
        figures["drafter_image_tokens_per_row"] = outputs[0]["drafter_image_tokens"]
    return figures


def vlm_family() -> Family:
    methods = {"vanilla": Method(_runner(False), lossless=True, description="the LLaVA target alone"),
               "eagle": Method(_runner(True), lossless=True,
                               params={"depth": DEFAULT_DEPTH, "top_k": DEFAULT_TOP_K,
                                       "total_tokens": DEFAULT_TOTAL_TOKENS},
                               description="EagleVLM drafter, EAGLE-2 dynamic tree, lossless tree verification")}
    return Family(name="vlm", model_id=lambda s: _options(s)["model"], build=build, inputs=inputs, methods=methods,
                  quality=quality, primary_quality="answer_contains_short",
                  to_turn=lambda o: {"text": o["text"], "token_ids": o["tokens"]},
                  description="LLaVA long answers about world scenes, EagleVLM (exactness, answer accuracy)")

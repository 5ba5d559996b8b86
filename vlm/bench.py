"""The `vlm` bench family: long answers about held-out world scenes from a LLaVA target, alone (`vanilla`) or with
a drafter from MODEL/drafters/<kind> (`eagle`: EagleVLM, `vispec`: ViSpec, `msd`: MSD, `specvlm`: SpecVLM;
params depth, top_k, total_tokens, child_ranking, budget (`auto`, the default, or `fixed`: `mmspec.budget`);
the tree defaults to each drafter's paper setting, depth in drafted levels: EAGLE's code's depth + 1, see `vlm.eagle`).

    mmspec bench --family vlm --methods vanilla,eagle,vispec,eagle:depth=6:top_k=8:total_tokens=40

Inputs: `--num-samples` test-split scenes, one question each, asked with the long-answer prompt ("Answer in
detail."): short answers hide any speed-up, so every paper lengthens them, and so does this family (say so when
quoting its numbers). Family options (`--family-option KEY=VALUE`): model (target folder, default the embedded
`assets/vlm`; drafters in MODEL/drafters/<kind>), top_p, long_fraction (the share of questions asking for the long
answer, default 1; 0.5 is the world's own mix of one-word and long answers), drop_finished (true, the pipeline's
default: a batch drops its finished answers; false keeps every row to the end, as transformers does). Quality:
`exactness` (fraction of answers equal to vanilla's token for token; lossless methods must give 1.0 at temperature
0) and `answer_contains_short` (the answer contains the world's short answer as a word: how often the target is
right, the same for every lossless method at temperature 0); at temperature > 0 the token calibration figures
(`pit_ks`, its p-value...: `mmspec.metrics.calibration`; one teacher-forced target pass per answer, its EOS
included) test that each method's tokens follow the target's distribution. The drafter's prefill cost is reported as
the figure `drafter_image_tokens_per_row`: how many image tokens the drafter attends to per row, averaged over the
pass's rows (EagleVLM and MSD: all of them; ViSpec: one compressed token; SpecVLM: what its gate chose; 0 in calls
the draft budget ran without the drafter).

Official sizes: `size=llava-1.5-7b|llava-1.5-13b|llava-qwen2-0.5b|llava-qwen2-1.5b` builds that LLaVA with random
weights and EAGLE, ViSpec and MSD drafters at its width (`vlm.official`), in `dtype` (float32, bfloat16, float16);
random weights accept nothing worth timing, so run it with `--force-acceptance` (`mmspec.forced`). Its quality
figures are exactness alone.

transformers' own decoding runs beside them as peer methods (`vlm.bench_peers`): `hf_generate`,
`hf_prompt_lookup` (num_tokens) and `hf_assisted` (layers), in the same process, on the same prompts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of, pop_budget
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from vlm.bench_peers import peer_methods
from vlm.family import ACCEPT, FAMILY, TREE, training_free_drafter

OPTIONS = ("model", "top_p", "long_fraction", "drop_finished", "size", "dtype")


def _options(settings: BenchSettings) -> dict[str, Any]:
    unknown = set(settings.options) - set(OPTIONS)
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} for bench family 'vlm'; known: {', '.join(OPTIONS)}.")
    options = settings.options
    long_fraction, drop = float(options.get("long_fraction", 1.0)), str(options.get("drop_finished", "true")).lower()
    check(0.0 <= long_fraction <= 1.0, f"long_fraction must be in [0, 1] (the share of questions asking for the long "
                                       f"answer), got {long_fraction}.")
    check(drop in ("true", "false"), f"drop_finished must be true or false, got {drop!r}.")
    check("size" not in options or "model" not in options,
          "--family-option size builds an official size with random weights; it cannot go with model=PATH.")
    return {"model": options.get("model") or str(ASSETS_DIR / "vlm"), "top_p": float(options.get("top_p", 1.0)),
            "long_fraction": long_fraction, "drop_finished": drop == "true", "size": options.get("size"),
            "dtype": options.get("dtype")}


def model_id(settings: BenchSettings) -> str:
    o = _options(settings)
    return o["model"] if o["size"] is None else f"{o['size']} (official config, random weights)"


def build(settings: BenchSettings) -> dict:
    """The target (loaded once) and every drafter found in MODEL/drafters/<kind> (an official size: random ones)."""
    from mmspec.cli.family_io import torch_dtype
    from vlm.family import drafter_kinds_in
    from vlm.pipeline import SpeculativeVLM, load_drafter

    o = _options(settings)
    dtype = torch_dtype(o["dtype"])
    if o["size"] is not None:
        from vlm.official import random_drafters, random_vlm

        vlm = random_vlm(o["size"], settings.device, dtype or torch.float32, seed=settings.seed)
        return {"target": vlm, "drafters": random_drafters(vlm), "folder": o["size"], "top_p": o["top_p"]}
    model = Path(o["model"])
    vlm = SpeculativeVLM.from_pretrained(model, device=settings.device, dtype=dtype)
    drafters = {kind: load_drafter(model / "drafters" / kind, kind, dtype).to(settings.device)
                for kind in drafter_kinds_in(model)}
    return {"target": vlm, "drafters": drafters, "folder": model, "top_p": _options(settings)["top_p"]}


def inputs(settings: BenchSettings) -> list[Sample]:
    from vlm.world import world_vqa_examples

    examples = world_vqa_examples("test", settings.num_samples, seed=settings.seed,
                                  long_fraction=_options(settings)["long_fraction"])
    return [Sample(question_id=i, category=ex.qa.kind, data=ex) for i, ex in enumerate(examples)]


def _runner(record):
    kind = None if record.run is None else record.name

    def run(models: dict, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        from vlm.pipeline import SpeculativeVLM

        given, budget = pop_budget(given, None)
        params = {**TREE, **ACCEPT, **record.check_given(given, "vlm")}  # vanilla too: its target's cache room
        vlm = models["target"]
        if kind is not None and not record.trained:  # built from its parameters, one pipe per setting and budget
            key = (kind, tuple(sorted(record.resolved(given).items())), str(budget))  # (a table learns: not shared)
            pipes = models.setdefault("pipes", {})
            if key not in pipes:
                pipes[key] = SpeculativeVLM(vlm.model, vlm.processor, training_free_drafter(kind, given))
            vlm = pipes[key]
        elif kind is not None:
            if kind not in models["drafters"] and _options(settings)["size"] is not None:
                raise InputError(f"method {kind!r} has no drafter at official size {models['folder']} (random "
                                 f"drafters: {', '.join(models['drafters'])}).")
            if kind not in models["drafters"]:
                raise InputError(f"method {kind!r} needs a drafter in {models['folder']}/drafters/{kind}; train one "
                                 f"with `mmspec train vlm-drafter --kind {kind} --target {models['folder']}`.")
            pipes = models.setdefault("pipes", {})  # one per drafter, so budget="auto" learns across batches
            if kind not in pipes:
                pipes[kind] = SpeculativeVLM(vlm.model, vlm.processor, models["drafters"][kind])
            vlm = pipes[kind]
        use_drafter = kind is not None
        vlm.drop_finished = _options(settings)["drop_finished"]
        tree = (params.get("depth"), params.get("top_k"), params.get("total_tokens")) if record.trained else None
        examples = [s.data for s in batch]
        out = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], settings.max_new_tokens,
                           settings.temperature, _options(settings)["top_p"], tree=tree, batch_size=len(batch),
                           generator=torch.Generator().manual_seed(settings.seed), use_drafter=use_drafter,
                           child_ranking=params.get("child_ranking", "raw"), budget=budget,
                           accept=params.get("accept", ACCEPT["accept"]))
        attended = None
        if use_drafter:  # a call the budget ran without the drafter (its drafting lost) attended no image token
            attended = 0.0 if out.stats.extra.get("calls_without_drafter") else vlm.drafter_image_tokens()
        outputs = [{"tokens": ids, "text": text, "short": ex.qa.short, "drafter_image_tokens": attended}
                   for ids, text, ex in zip(out.token_ids, out.texts, examples)]
        return MethodOutput(outputs=outputs, new_tokens=[len(ids) for ids in out.token_ids], stats=out.stats)

    return run


def quality(method: Method, params: Mapping[str, Any], outputs: list, vanilla: list, settings: BenchSettings) -> dict:
    same = [a["tokens"] == b["tokens"] for a, b in zip(outputs, vanilla)]
    if _options(settings)["size"] is not None:  # random weights: no answer worth judging
        return {"exactness": sum(same) / len(same)}
    right = [re.search(rf"\b{re.escape(o['short'].lower())}\b", o["text"].lower()) is not None for o in outputs]
    figures = {"exactness": sum(same) / len(same), "answer_contains_short": sum(right) / len(right)}
    attended = [o["drafter_image_tokens"] for o in outputs if o["drafter_image_tokens"] is not None]
    if attended:  # each output carries its batch's figure: the mean over the pass's rows
        figures["drafter_image_tokens_per_row"] = sum(attended) / len(attended)
    if outputs and "transformers_error" in outputs[0]:  # the transformers peers (vlm.bench_peers)
        figures["transformers_errors"] = sum(o["transformers_error"] for o in outputs) / len(outputs)
    return figures


def calibration(models: dict, samples: Sequence[Sample], outputs: list, settings: BenchSettings) -> dict:
    """Token calibration of sampled answers under the target given their questions (empty at temperature 0);
    each answer is scored with its prompt, one row at a time."""
    from mmspec.lm import GuidedRunner, teacher_forced_probs
    from mmspec.metrics.calibration import calibration_figures
    from mmspec.sampling import SamplingParams
    from vlm.target import prefill_vlm

    if settings.greedy or _options(settings)["size"] is not None:  # (random weights: no law worth checking)
        return {}
    vlm = models["target"]
    params = SamplingParams(settings.temperature, 0, _options(settings)["top_p"])

    def scored():
        for sample, output in zip(samples, outputs):
            if output["tokens"]:
                tokens = torch.tensor([output["tokens"]], device=vlm.lm.device)  # [1, T]
                prompt = vlm.encode([sample.data.image], [sample.data.prompt])
                yield teacher_forced_probs(GuidedRunner(vlm.lm, None, prefill_vlm), prompt, tokens, params), tokens

    return calibration_figures(scored(), settings.seed)


def vlm_family() -> Family:

    return Family(name="vlm", model_id=model_id, build=build, inputs=inputs,
                  methods={**methods_of(FAMILY, _runner, budget=True), **peer_methods()}, quality=quality,
                  primary_quality="answer_contains_short",
                  to_turn=lambda o: {"text": o["text"], "token_ids": o["tokens"]}, model_quality=calibration,
                  description=FAMILY.description)

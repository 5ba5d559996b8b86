"""The MAR family record: its pipeline folders, its `mmspec generate` / demo / bench hooks, and its two methods,
`vanilla` (the target MAR alone) and `cspd` (continuous speculative decoding with the draft MAR), declared once here
(`mmspec.families`).

    mmspec generate --family mar --method cspd --method-arg gamma=8 --classes "red circle" --out out/

A folder is a `CSpDPipeline` (the embedded default, or `mmspec convert mar --draft ...`) or a single-model
`MARPipeline` (vanilla only). A method's run gives `(the pipeline to call, its extra keyword arguments)`. vanilla
takes num_iter (default the token count), num_sampling_steps, cfg_schedule; cspd takes gamma, prefill_ratio, align,
num_sampling_steps, cfg_schedule, `criterion` ("paper", the default, or "reference_code": the public code's
criterion, `CSpDRule.reference_code()`) and any `CSpDRule` option on top of the criterion's (distance_scale,
invert_variance_factor, independent_checks, max_residual_tries). MAR has no top-k / top-p. The guidance scale and
cfg_schedule default to the target model's own (`MARModel.config.default_guidance_scale` / `default_cfg_schedule`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from continuous.mar.cspd import CSpDPipeline, check_window_settings
from continuous.mar.pipeline import MARPipeline
from mmspec.budget import check_budget_mode
from mmspec.cli.family_io import folder_loader
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.families import CallMethod, FamilyRecord, method_call_generate, parameters_of, split
from mmspec.verify.cspd import CSpDRule

DEFAULTS = {"guidance_scale": 3.0, "temperature": 1.0, "top_k": None, "top_p": None}
SHARED = ("num_sampling_steps", "cfg_schedule")  # the call parameters vanilla and cspd share
CRITERIA = {"paper": CSpDRule, "reference_code": CSpDRule.reference_code}


load = folder_loader((CSpDPipeline, MARPipeline), ASSETS_DIR / "mar", family="MAR", made_by="mmspec train mar",
                     converted_by="mmspec convert mar --target checkpoint-last.pth --vae kl16.ckpt "
                                  "[--draft checkpoint-last.pth] --out DIR")


def target_model(pipe: CSpDPipeline | MARPipeline):
    return pipe.target if isinstance(pipe, CSpDPipeline) else pipe.transformer


def sampling_defaults(pipeline) -> dict:
    """`DEFAULTS` with the (target) model's own guidance scale (`pipeline()` gives the loaded pipeline, or None
    where the caller has not loaded it: then the static `DEFAULTS`)."""
    pipe = pipeline()
    if pipe is None:
        return dict(DEFAULTS)
    return {**DEFAULTS, "guidance_scale": float(target_model(pipe).config.default_guidance_scale)}


def call_options(options: dict) -> dict:
    """The pipeline's sampling keyword arguments from generate's options (no top-k / top-p for MAR)."""
    for key in ("top_k", "top_p"):
        check(options.get(key) is None, f"MAR samples continuous tokens: --{key.replace('_', '-')} does not apply.")
    return {k: options[k] for k in ("guidance_scale", "temperature") if options.get(k) is not None}


def bench():
    from continuous.mar.bench import mar_family

    return mar_family()


PROFILE_SAMPLING_STEPS = 100  # the pipelines' default num_sampling_steps


def profile(pipe) -> dict:
    """The target (and the draft, in a CSpD folder) as CSpD's windows run them (`window_forward`): per batch size,
    the classes 0..B-1 at the target's default guidance and CFG schedule, `PROFILE_SAMPLING_STEPS` diffusion steps a
    token, then one forward and the head over W tokens of a half-known canvas (the first W of a random order)."""
    import torch

    from continuous.mar.cspd import window_forward
    from continuous.mar.pipeline import prepare_run
    from mmspec.profiling import runner_per_batch

    target = target_model(pipe)
    models = {"target": target, "draft": getattr(pipe, "draft", None)}

    def runner(model):
        def start(batch: int):
            labels = [i % target.config.num_classes for i in range(batch)]
            run = prepare_run(target, labels, None, None, 1.0, PROFILE_SAMPLING_STEPS, 1,
                              torch.Generator().manual_seed(0), "latent")
            return window_forward(model, run)

        return runner_per_batch(start, lambda window, width: window(width), target.seq_len)

    return {name: (model, runner(model)) for name, model in models.items() if model is not None}


FAMILY = FamilyRecord("mar", "MAR class-conditional generation and CSpD (judge accuracy, world-FID)",
                      default_model=ASSETS_DIR / "mar", load=load,
                      num_classes=lambda pipe: target_model(pipe).config.num_classes,
                      sampling_defaults=sampling_defaults, bench=bench,
                      profile=profile, method_kind=CallMethod)
_call_generate = method_call_generate(FAMILY, call_options)


def generate(pipe, labels: list[int], generators: list, options: dict):
    """`mmspec generate`'s hook: `--budget` is cspd's `budget` parameter (vanilla drafts nothing)."""
    options = dict(options)
    if "budget" in options:
        budget = options.pop("budget")
        check(options["method"].split(":")[0] == "cspd",
              f"--budget sets CSpD's window budget; method {options['method']!r} drafts nothing: drop --budget.")
        options["method_kwargs"] = {**options.get("method_kwargs", {}), "budget": budget}
    return _call_generate(pipe, labels, generators, options)


FAMILY.generate = generate


@FAMILY.method(params=(parameters_of(MARPipeline.__call__, only=("num_iter", *SHARED)),))
def vanilla(pipe: CSpDPipeline | MARPipeline, **given: Any) -> tuple[MARPipeline, dict[str, Any]]:
    """The target MAR alone (num_iter default: one token per step, CSpD's baseline; fewer = the fast multi-token
    baseline)."""
    return (pipe.as_mar_pipeline("target") if isinstance(pipe, CSpDPipeline) else pipe), given


def cspd_call(given: Mapping[str, Any]) -> dict[str, Any]:
    """CSpDPipeline's keyword arguments for cspd's given parameters: the call's own, and `rule`, the criterion's
    CSpDRule with the given rule options on top (needs no model)."""
    given = dict(given)
    criterion = given.pop("criterion", "paper")
    check(criterion in CRITERIA, f"criterion must be one of {sorted(CRITERIA)}, got {criterion!r}.")
    call, rule, _ = split(given, CSpDPipeline.__call__, CSpDRule)
    preset = {k: v for k, v in CRITERIA[criterion]().config().items() if k != "name"}
    return {**call, "rule": CSpDRule(**{**preset, **rule})}


def check_cspd(given: Mapping[str, Any]) -> None:
    """`check(given)` of cspd: the criterion and the rule built from it (`cspd_call`), the window settings and the
    budget mode, so a command refuses a bad value before it loads a model."""
    call = {**parameters_of(CSpDPipeline.__call__, only=("gamma", "prefill_ratio", "budget")), **cspd_call(given)}
    check_window_settings(call["gamma"], call["prefill_ratio"])
    check_budget_mode(call["budget"])


@FAMILY.method(params=(parameters_of(CSpDPipeline.__call__, only=("gamma", "prefill_ratio", "align", "budget",
                                                                   *SHARED)),
                       {"criterion": "paper"}, CSpDRule), lossless=False, needs=("draft",), check=check_cspd)
def cspd(pipe: CSpDPipeline | MARPipeline, **given: Any) -> tuple[CSpDPipeline, dict[str, Any]]:
    """CSpD: the draft MAR proposes a window of gamma tokens, one target pass verifies it (criterion "paper" or
    "reference_code", CSpDRule options on top)."""
    if not isinstance(pipe, CSpDPipeline):
        raise InputError("method 'cspd' needs a CSpD folder (a target and a draft MAR sharing the VAE); this one "
                         "holds a single MARPipeline. Make one with `mmspec convert mar --draft ...`.")
    return pipe, cspd_call(given)

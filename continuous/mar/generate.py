"""The MAR adapter of `mmspec generate`: `vanilla` (the target MAR alone) and `cspd` (continuous speculative
decoding with the draft MAR).

    mmspec generate --family mar --method cspd --method-arg gamma=8 --classes "red circle" --out out/

The folder is a `CSpDPipeline` (the embedded default, or `mmspec convert mar --draft ...`) or a single-model
`MARPipeline` (vanilla only). Method parameters (`--method-arg KEY=VALUE`): vanilla takes num_iter (default the
token count), num_sampling_steps, cfg_schedule; cspd takes gamma, prefill_ratio, align, criterion ("paper" or
"reference_code"), num_sampling_steps, cfg_schedule. MAR has no top-k / top-p. The guidance scale and cfg_schedule
default to the target model's own (`MARModel.config.default_guidance_scale` / `default_cfg_schedule`).
"""

from __future__ import annotations

import torch

from continuous.mar.cspd import CSpDPipeline
from continuous.mar.pipeline import MARPipeline
from mmspec.cli.family_io import load_pipeline_folder
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.stats import SpecStats
from mmspec.verify.cspd import CSpDRule

METHODS = ("vanilla", "cspd")
DEFAULTS = {"guidance_scale": 3.0, "temperature": 1.0, "top_k": None, "top_p": None}
DEFAULT_MODEL = ASSETS_DIR / "mar"
COMMON = {"num_sampling_steps", "cfg_schedule"}
PARAMS = {"vanilla": COMMON | {"num_iter"}, "cspd": COMMON | {"gamma", "prefill_ratio", "align", "criterion"}}
CRITERIA = {"paper": CSpDRule, "reference_code": CSpDRule.reference_code}


def load(model_path: str | None, device: str) -> CSpDPipeline | MARPipeline:
    return load_pipeline_folder((CSpDPipeline, MARPipeline), model_path, DEFAULT_MODEL, family="MAR",
                                made_by="mmspec train mar",
                                converted_by="mmspec convert mar --target checkpoint-last.pth --vae kl16.ckpt "
                                             "[--draft checkpoint-last.pth] --out DIR",
                                device=device)


def _model(pipe: CSpDPipeline | MARPipeline):
    return pipe.target if isinstance(pipe, CSpDPipeline) else pipe.transformer


def num_classes(pipe: CSpDPipeline | MARPipeline) -> int:
    return _model(pipe).config.num_classes


def sampling_defaults(pipe: CSpDPipeline | MARPipeline) -> dict:
    """`DEFAULTS` with the (target) model's own guidance scale."""
    return {**DEFAULTS, "guidance_scale": float(_model(pipe).config.default_guidance_scale)}


def method_pipeline(pipe: CSpDPipeline | MARPipeline, method: str, method_kwargs: dict) -> tuple:
    """(the pipeline to call, its extra keyword arguments) for a method; InputError for what does not apply."""
    check(method in METHODS, f"unknown MAR method {method!r}; available: {', '.join(METHODS)}.")
    unknown = set(method_kwargs) - PARAMS[method]
    check(not unknown, f"method {method!r} takes {sorted(PARAMS[method])}, got {sorted(unknown)}.")
    kwargs = dict(method_kwargs)
    if method == "vanilla":
        return (pipe.as_mar_pipeline("target") if isinstance(pipe, CSpDPipeline) else pipe), kwargs
    if not isinstance(pipe, CSpDPipeline):
        raise InputError("method 'cspd' needs a CSpD folder (a target and a draft MAR sharing the VAE); this one "
                         "holds a single MARPipeline. Make one with `mmspec convert mar --draft ...`.")
    criterion = kwargs.pop("criterion", "paper")
    check(criterion in CRITERIA, f"criterion must be one of {sorted(CRITERIA)}, got {criterion!r}.")
    return pipe, {**kwargs, "rule": CRITERIA[criterion]()}


def call_options(options: dict) -> dict:
    """The pipeline's sampling keyword arguments from generate's options (no top-k / top-p for MAR)."""
    for key in ("top_k", "top_p"):
        check(options.get(key) is None, f"MAR samples continuous tokens: --{key.replace('_', '-')} does not apply.")
    return {k: options[k] for k in ("guidance_scale", "temperature") if options.get(k) is not None}


def run_stats(out) -> SpecStats:
    """CSpD's SpecStats, or the vanilla target's forward count."""
    return out.stats if out.stats is not None else SpecStats(num_target_forwards=out.num_forwards)


def generate(pipe: CSpDPipeline | MARPipeline, labels: list[int], generators: list[torch.Generator],
             options: dict) -> tuple[list, SpecStats]:
    options = dict(options)
    call, extra = method_pipeline(pipe, options.pop("method"), options.pop("method_kwargs", {}))
    out = call(class_labels=labels, generator=generators, output_type="pil", **call_options(options), **extra)
    return out.images, run_stats(out)

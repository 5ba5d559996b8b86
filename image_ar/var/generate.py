"""The VAR adapter of `mmspec generate`: `vanilla` (the large model alone) and `code` (CoDe: the large model makes
the first `draft_steps` scales, the small one the rest).

The folder is a `CoDePipeline` (the embedded default, or `mmspec convert var --small ...`) or a single-model
`VARPipeline` (vanilla only). Stats: `num_target_forwards` counts the large model's forwards and
`num_draft_forwards` the small model's (its hand-over prefill included); scales differ in size, so forward
counts are not a speed proxy here, wall-clock is.
"""

from __future__ import annotations

import torch

from image_ar.var.code import CoDePipeline
from image_ar.var.pipeline import VARPipeline
from mmspec.cli.family_io import load_pipeline_folder
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.stats import SpecStats

METHODS = ("vanilla", "code")
DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
DEFAULT_MODEL = ASSETS_DIR / "var"


def load(model_path: str | None, device: str) -> CoDePipeline | VARPipeline:
    return load_pipeline_folder((CoDePipeline, VARPipeline), model_path, DEFAULT_MODEL, family="VAR",
                                made_by="mmspec train var",
                                converted_by="mmspec convert var --transformer var_d*.pth --vqvae "
                                             "vae_ch160v4096z32.pth [--small var_d16.pth] --out DIR",
                                device=device)


def num_classes(pipe: CoDePipeline | VARPipeline) -> int:
    model = pipe.drafter if isinstance(pipe, CoDePipeline) else pipe.transformer
    return model.config.num_classes


def method_pipeline(pipe: CoDePipeline | VARPipeline, method: str, method_kwargs: dict) -> tuple:
    """(the pipeline to call, its extra keyword arguments) for a method; InputError for what does not apply."""
    check(method in METHODS, f"unknown VAR method {method!r}; available: {', '.join(METHODS)}.")
    if method == "vanilla":
        check(not method_kwargs, f"method 'vanilla' takes no parameters, got {sorted(method_kwargs)}.")
        return (pipe.as_var_pipeline("drafter") if isinstance(pipe, CoDePipeline) else pipe), {}
    if not isinstance(pipe, CoDePipeline):
        raise InputError("method 'code' needs a CoDe folder (a large and a small model sharing the VQVAE); this one "
                         "holds a single VARPipeline. Make one with `mmspec convert var --small ...`.")
    unknown = set(method_kwargs) - {"draft_steps"}
    check(not unknown, f"method 'code' takes only draft_steps, got {sorted(unknown)}.")
    return pipe, dict(method_kwargs)


def forward_stats(num_scales: int, draft_steps: int | None, batches: int = 1) -> SpecStats:
    """Large-model forwards as target forwards, small-model forwards (hand-over prefill included) as draft ones."""
    n = num_scales if draft_steps is None else draft_steps
    small = (num_scales - n) + (1 if 0 < n < num_scales else 0)
    return SpecStats(num_target_forwards=n * batches, num_draft_forwards=small * batches)


def generate(pipe: CoDePipeline | VARPipeline, labels: list[int], generators: list[torch.Generator],
             options: dict) -> tuple[list, SpecStats]:
    options = dict(options)
    call, extra = method_pipeline(pipe, options.pop("method"), options.pop("method_kwargs", {}))
    out = call(class_labels=labels, generator=generators, output_type="pil", **options, **extra)
    n_scales = len(call.vqvae.config.patch_nums)
    return out.images, forward_stats(n_scales, out.draft_steps)


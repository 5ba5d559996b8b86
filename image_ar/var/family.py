"""The VAR family record: its pipeline folders, its `mmspec generate` / demo / bench hooks, and its two methods,
`vanilla` (the large model alone) and `code` (CoDe: the large model makes the first `draft_steps` scales, the small
one the rest), declared once here (`mmspec.families`).

A folder is a `CoDePipeline` (the embedded default, or `mmspec convert var --small ...`) or a single-model
`VARPipeline` (vanilla only). A method's run gives `(the pipeline to call, its extra keyword arguments)`. Stats
(the pipelines': `image_ar.var.pipeline.forward_stats`): `num_target_forwards` counts the large model's forwards and
`num_draft_forwards` the small model's (its hand-over prefill included); scales differ in size, so forward counts
are not a speed proxy here, wall-clock is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from image_ar.var.code import CoDePipeline
from image_ar.var.pipeline import VARPipeline
from mmspec.cli.family_io import folder_loader
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.families import CallMethod, FamilyRecord, method_call_generate, parameters_of

DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


load = folder_loader((CoDePipeline, VARPipeline), ASSETS_DIR / "var", family="VAR", made_by="mmspec train var",
                     converted_by="mmspec convert var --transformer var_d*.pth --vqvae vae_ch160v4096z32.pth "
                                  "[--small var_d16.pth] --out DIR")


def num_classes(pipe: CoDePipeline | VARPipeline) -> int:
    model = pipe.drafter if isinstance(pipe, CoDePipeline) else pipe.transformer
    return model.config.num_classes


def bench():
    from image_ar.var.bench import var_family

    return var_family()


FAMILY = FamilyRecord("var", "VAR next-scale class-conditional generation and CoDe (judge accuracy, world-FID)",
                      default_model=ASSETS_DIR / "var", load=load, num_classes=num_classes,
                      sampling_defaults=lambda pipeline: DEFAULTS, bench=bench, method_kind=CallMethod)
FAMILY.generate = method_call_generate(FAMILY)


@FAMILY.method()
def vanilla(pipe: CoDePipeline | VARPipeline) -> tuple[VARPipeline, dict[str, Any]]:
    """The large VAR alone (CoDe's baseline)."""
    return (pipe.as_var_pipeline("drafter") if isinstance(pipe, CoDePipeline) else pipe), {}


def check_code(given: Mapping[str, Any]) -> None:
    """`check(given)` of code before a model loads: draft_steps None or an integer >= 0 (its upper bound, the
    models' scale count, is checked by the call)."""
    steps = given.get("draft_steps")
    check(steps is None or (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0),
          f"draft_steps must be an integer >= 0 (the scales the large model makes), got {steps!r}.")


@FAMILY.method(params=(parameters_of(CoDePipeline.__call__, only=("draft_steps",)),), lossless=False,
               needs=("refiner",), check=check_code)
def code(pipe: CoDePipeline | VARPipeline, **given: Any) -> tuple[CoDePipeline, dict[str, Any]]:
    """CoDe: the large model makes the first draft_steps scales (default all but the last two), the small one the
    rest."""
    if not isinstance(pipe, CoDePipeline):
        raise InputError("method 'code' needs a CoDe folder (a large and a small model sharing the VQVAE); this one "
                         "holds a single VARPipeline. Make one with `mmspec convert var --small ...`.")
    return pipe, given

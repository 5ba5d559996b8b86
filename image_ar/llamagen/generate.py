"""The LlamaGen adapter of `mmspec generate`: load the pipeline (embedded default or a folder), name classes,
generate a batch."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from image_ar.llamagen.methods import available_methods
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.stats import SpecStats

METHODS = available_methods()
DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
DEFAULT_MODEL = ASSETS_DIR / "llamagen"


def load(model_path: str | None, device: str) -> LlamaGenPipeline:
    path = Path(model_path) if model_path else DEFAULT_MODEL
    if path.is_file():
        raise InputError(f"--model {path} is a file; pass a pipeline folder. Official LlamaGen checkpoints become one "
                         "with `mmspec convert llamagen --gpt c2i_*.pt --vq vq_ds16_*.pt --out DIR`.")
    index = path / "model_index.json"
    if not index.is_file():
        hint = ("the embedded default is made by `mmspec train llamagen`" if model_path is None
                else "pass a folder written by LlamaGenPipeline.save_pretrained or `mmspec convert llamagen`")
        raise InputError(f"no LlamaGen pipeline at {path} (model_index.json missing); {hint}.")
    try:
        kind = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        raise InputError(f"{index} is not a valid model_index.json.") from None
    if kind != LlamaGenPipeline.__name__:
        raise InputError(f"{path} holds a {kind} pipeline, not a LlamaGen one; pick the family that matches it.")
    try:
        pipe = LlamaGenPipeline.from_pretrained(path).to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"could not load the LlamaGen pipeline in {path}: {first_line}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


def num_classes(pipe: LlamaGenPipeline) -> int:
    return pipe.transformer.config.num_classes


def _world_names(pipe: LlamaGenPipeline) -> list[str] | None:
    from mmspec.data import CLASS_NAMES

    return list(CLASS_NAMES) if num_classes(pipe) == len(CLASS_NAMES) else None


def resolve_class(text: str, pipe: LlamaGenPipeline) -> int:
    """A class id ("5") or, for world models, a class name ("red circle")."""
    n = num_classes(pipe)
    if text.lstrip("-").isdigit():
        value = int(text)
        check(0 <= value < n, f"class id {value} outside [0, {n}).")
        return value
    names = _world_names(pipe)
    if names and text.lower() in names:
        return names.index(text.lower())
    known = f"; names: {', '.join(names)}" if names else ""
    raise InputError(f"unknown class {text!r}: give an id in [0, {n}){known}.")


def class_slug(label: int, pipe: LlamaGenPipeline) -> str:
    names = _world_names(pipe)
    return names[label].replace(" ", "-") if names else f"class{label}"


def generate(pipe: LlamaGenPipeline, labels: list[int], generators: list[torch.Generator],
             options: dict) -> tuple[list, SpecStats]:
    out = pipe(class_labels=labels, generator=generators, output_type="pil", **options)
    return out.images, out.stats

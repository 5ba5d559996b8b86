"""What the families' `load` and `mmspec generate` share: loading a pipeline folder with clear errors, and class ids /
world class names on the command line.

    pipe = load_pipeline_folder(LlamaGenPipeline, model_path, ASSETS_DIR / "llamagen", family="LlamaGen",
                                made_by="mmspec train llamagen", converted_by="mmspec convert llamagen ...",
                                device="cpu")
    resolve_class("red circle", num_classes=16)  # -> 0
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmspec.errors import InputError, check

DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices of mmspec generate and mmspec vlm


def torch_dtype(name: str | None):
    """A --dtype name -> torch dtype (None stays None: the checkpoint's float32)."""
    import torch

    if name is None:
        return None
    check(name in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {name!r}.")
    return getattr(torch, name)


def load_pipeline_folder(pipeline_cls: type | tuple[type, ...], model_path: str | None, default: Path, *,
                         family: str, made_by: str, converted_by: str, device: str, dtype: Any = None):
    """`from_pretrained` of --model (default: the embedded asset) with the pipeline class (or the one of several
    classes) its model_index.json names, in `dtype` (a torch dtype; None: as saved), progress bars off; InputError
    with what to do for a file, a folder without model_index.json, another pipeline's folder or unreadable
    weights."""
    classes = pipeline_cls if isinstance(pipeline_cls, tuple) else (pipeline_cls,)
    names = " or ".join(c.__name__ for c in classes)
    path = Path(model_path) if model_path else default
    if path.is_file():
        raise InputError(f"--model {path} is a file; pass a pipeline folder. Official {family} checkpoints become "
                         f"one with `{converted_by}`.")
    index = path / "model_index.json"
    if not index.is_file():
        hint = (f"the embedded default is made by `{made_by}`" if model_path is None
                else f"pass a folder written by {names}.save_pretrained or `{converted_by}`")
        raise InputError(f"no {family} pipeline at {path} (model_index.json missing); {hint}.")
    from mmspec.diffusers_folder import pipeline_class_name  # (torch: only once a model is asked for)

    try:
        kind = pipeline_class_name(json.loads(index.read_text()).get("_class_name"))
    except (json.JSONDecodeError, AttributeError):
        raise InputError(f"{index} is not a valid model_index.json.") from None
    by_name = {c.__name__: c for c in classes}
    if kind not in by_name:
        raise InputError(f"{path} holds a {kind} pipeline, not a {names}; pick the family that matches it.")
    try:
        with warnings.catch_warnings():  # diffusers >= 0.36 prefers `dtype`; `torch_dtype` works on every version
            warnings.simplefilter("ignore", FutureWarning)
            pipe = by_name[kind].from_pretrained(path, **({} if dtype is None else {"torch_dtype": dtype}))
        pipe = pipe.to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"could not load the {family} pipeline in {path}: {first_line}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


def folder_loader(pipeline_cls: type | tuple[type, ...], default: Path, *, family: str, made_by: str,
                  converted_by: str) -> Callable[[str | None, str], Any]:
    """A family record's `load(model_path, device, dtype=None)`: `load_pipeline_folder` with the family's classes
    and hints."""

    def load(model_path: str | None, device: str, dtype: Any = None):
        return load_pipeline_folder(pipeline_cls, model_path, default, family=family, made_by=made_by,
                                    converted_by=converted_by, device=device, dtype=dtype)

    return load


def world_class_names(num_classes: int) -> list[str] | None:
    """The world's class names when a model has exactly the world's classes, else None."""
    from mmspec.data import CLASS_NAMES

    return list(CLASS_NAMES) if num_classes == len(CLASS_NAMES) else None


def resolve_class(text: str, num_classes: int) -> int:
    """A class id ("5") or, for world models, a class name ("red circle")."""
    if text.lstrip("-").isdigit():
        value = int(text)
        check(0 <= value < num_classes, f"class id {value} outside [0, {num_classes}).")
        return value
    names = world_class_names(num_classes)
    if names and text.lower() in names:
        return names.index(text.lower())
    known = f"; names: {', '.join(names)}" if names else ""
    raise InputError(f"unknown class {text!r}: give an id in [0, {num_classes}){known}.")


def class_slug(label: int, num_classes: int) -> str:
    """The file-name part of a class: 'red-circle' for world models, else 'class5'."""
    names = world_class_names(num_classes)
    return names[label].replace(" ", "-") if names else f"class{label}"

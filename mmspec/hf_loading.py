"""Loading a transformers model and its processor from a local folder in transformers' own layout.

    folder = resolve_model_folder("llava-hf/llava-1.5-7b-hf", "the target")  # a folder, or a hub id in the cache
    config = read_folder_config(folder, "a Janus model")          # config.json as a dict, before any weights load
    model, processor = load_transformers_folder(folder, AutoModelForImageTextToText, AutoProcessor)

Local files only (nothing downloads; a hub id resolves through the local Hugging Face cache); a folder
transformers cannot read is a one-line InputError, and so is one whose weights leave parameters of the model at
their random init (missing or shape-mismatched keys: a folder written by a transformers version with another
parameter layout would otherwise run with random layers, silently).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmspec.errors import InputError, check

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")  # "owner/name", optionally "@revision"


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, read at call time: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_model_folder(name: str | Path, what: str) -> Path:
    """The local folder of `name`: a folder as given, or a hub id's ("owner/name", optionally "@revision") snapshot in
    the local Hugging Face cache (`hub_cache_dir`), as transformers' `local_files_only=True` finds it: never a
    network call. InputError (one line) when a hub id is not in the cache."""
    path = Path(name)
    if isinstance(name, Path) or path.exists() or not HUB_ID.match(str(name)):
        return path
    from huggingface_hub import snapshot_download

    repo, _, revision = str(name).partition("@")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache, local_files_only=True))
    except Exception:  # (huggingface_hub's LocalEntryNotFoundError and its relatives)
        raise InputError(f"{what} {name!r} is neither a folder nor in the local Hugging Face cache ({cache}); mmspec "
                         f"never downloads: fetch it where there is network (`hf download {repo}`; HF_HOME or "
                         "HF_HUB_CACHE choose the cache) or give its folder.") from None


def read_folder_config(folder: str | Path, what: str, made_by: str = "transformers' save_pretrained",
                       processor_files: tuple[str, ...] = PROCESSOR_FILES) -> dict:
    """config.json of a transformers folder as a dict (InputError when the folder or its processor, one of
    `processor_files`, is missing)."""
    folder = Path(folder)
    check((folder / "config.json").is_file() and any((folder / name).is_file() for name in processor_files),
          f"no {what} in {folder}: expected a transformers folder with config.json and its processor (made by "
          f"{made_by}).")
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"could not read {folder / 'config.json'}: {err}") from None


def check_weights_loaded(loading: dict, class_name: str, folder: Path, unused_prefix: str | None = None) -> None:
    """InputError when transformers' `from_pretrained` left parameters of the model at their random init (but those
    under `unused_prefix`, a module the caller removes and never runs)."""
    import transformers

    missing = [k for k in loading.get("missing_keys") or [] if unused_prefix is None or not k.startswith(unused_prefix)]
    bad = sorted(missing) + [str(k) for k, *_ in loading.get("mismatched_keys") or []]
    if bad:
        raise InputError(f"{len(bad)} weights of {class_name} are not in {folder} (e.g. {bad[0]}); the folder was "
                         f"probably saved by another transformers version with another parameter layout than this one "
                         f"({transformers.__version__}): install the version that wrote it (config.json's "
                         "transformers_version).")


@contextmanager
def library_output(libraries: Sequence[Any], *, bars: bool = True, errors_only: bool = False) -> Iterator[None]:
    """Within the block, the progress bars of `libraries` (transformers' or diffusers' `utils.logging` modules) off
    unless `bars`, and their notices off (errors only) with `errors_only`; after it each library's bars and
    verbosity are as they were before."""
    saved = [(library, library.is_progress_bar_enabled(), library.get_verbosity()) for library in libraries]
    for library, _, _ in saved:
        if not bars:
            library.disable_progress_bar()
        if errors_only:
            library.set_verbosity_error()
    try:
        yield
    finally:
        for library, enabled, verbosity in saved:
            library.set_verbosity(verbosity)
            (library.enable_progress_bar if enabled else library.disable_progress_bar)()


def load_transformers_folder(folder: str | Path, model_class: Any, processor_class: Any,
                             unused_prefix: str | None = None, **model_kwargs: Any) -> tuple[Any, Any]:
    """(model, processor) from `folder` with `model_class.from_pretrained` (e.g. an Auto class) and
    `processor_class.from_pretrained`, local files only, every weight checked to be loaded (but those under
    `unused_prefix`: see `check_weights_loaded`)."""
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    # (errors only with an unused prefix: transformers' load report would list its weights as missing)
    with library_output([hf_logging], bars=False, errors_only=unused_prefix is not None):
        try:
            model, loading = model_class.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                                         **model_kwargs)
            processor = processor_class.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise InputError(f"could not load the model in {folder}: {str(err).splitlines()[0]}") from None
    check_weights_loaded(loading, type(model).__name__, folder, unused_prefix)
    return model, processor


def folder_fingerprint(folder: str | Path) -> str:
    """A short fingerprint of a model folder's weights and config (names, sizes, and the first and last MiB of
    every weight file), so data cached for one model (a trainer's answers or samples) is never reused for another.
    Cheap for multi-GB folders."""
    digest = hashlib.sha256()
    folder = Path(folder)
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + [folder / "config.json"]:
        if not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]

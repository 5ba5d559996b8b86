"""Reading checkpoint files: safetensors files and shard folders, and `torch.save` files loaded safely.

`.safetensors` files hold only tensors and are read with safetensors. `.pt`/`.pth`/`.ckpt`/`.bin` files are
pickles; they are read with `torch.load(weights_only=True)` plus the allow-list in
`mmspec.checkpoints.allowlist`, so loading a file never runs code from it unless the caller passes
`allow_pickle=True`. Every failure is a `CheckpointError` that names the path and says what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from mmspec.checkpoints.allowlist import SafeGlobal, check_extra_safe_globals, default_safe_globals
from mmspec.errors import CheckpointError, InputError

logger = logging.getLogger(__name__)
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pth.tar")
SAFETENSORS_SUFFIX = ".safetensors"
_INDEX_SUFFIX = ".safetensors.index.json"
_PREFERRED_INDEX = "model.safetensors.index.json"

# what torch's weights_only unpickler says when it refuses an object; each pattern captures the name
_REFUSAL_PATTERNS = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+) whose module"),
    re.compile(r"but got <class '([^']+)'>"),
)
_TORCH_REASON = re.compile(r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)", re.S)


def as_path(path: str | os.PathLike[str], name: str = "path") -> Path:
    """Turn a user-given path into a `Path`, rejecting anything else with an `InputError`."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"{name} must be a str or os.PathLike, got {type(path).__name__}.")
    return Path(path).expanduser()


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    extra_safe_globals: Iterable[SafeGlobal] = (),
) -> object:
    """Load a checkpoint file or a folder of safetensors shards onto the CPU, safely by default.

    - `*.safetensors`: a dict of tensors.
    - a folder: every `*.safetensors` shard merged into one dict (checked against
      `model.safetensors.index.json` or another `*.safetensors.index.json` when present).
    - `*.pt`, `*.pth`, `*.ckpt`, `*.bin`, `*.pth.tar`: whatever was `torch.save`d, loaded with
      `weights_only=True` and mmspec's allow-list (`default_safe_globals()`) plus `extra_safe_globals`.
      A file holding any other Python object raises `CheckpointError` naming the object(s).

    `allow_pickle=True` loads pickles with `weights_only=False`: that runs arbitrary code stored in the file,
    so only use it for files you trust.
    """
    p = as_path(path)
    if not p.exists():
        raise CheckpointError(f"Checkpoint not found: {p} (absolute: {p.absolute()}). Check the path.")
    if p.is_dir():
        return load_safetensors_dir(p)
    name = p.name.lower()
    if name.endswith(SAFETENSORS_SUFFIX):
        return load_safetensors_file(p)
    if name.endswith(PICKLE_SUFFIXES):
        extra = check_extra_safe_globals(extra_safe_globals)
        return _load_pickle(p, allow_pickle=allow_pickle, extra=extra)
    supported = ", ".join((SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES))
    raise CheckpointError(
        f"Unknown checkpoint extension for {p}: supported are {supported}, or a folder of safetensors shards. "
        "Rename the file if you know its format."
    )


# ----------------------------------------------------------------------------------------------- safetensors
def load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """Read one safetensors file onto the CPU."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception) for bad files
        raise CheckpointError(
            f"Could not read safetensors file {path}: {exc}. The file is corrupt or truncated; "
            "download or convert it again."
        ) from exc


def load_safetensors_dir(folder: Path) -> dict[str, torch.Tensor]:
    """Merge the safetensors shards of a folder (Hugging Face layout), checked against its index if any."""
    index = _find_index(folder)
    if index is not None:
        return _load_indexed_shards(folder, index)
    shards = sorted(folder.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not shards:
        raise CheckpointError(_no_weights_message(folder))
    merged: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for shard in shards:
        for key, tensor in load_safetensors_file(shard).items():
            if key in merged:
                raise CheckpointError(
                    f"Tensor {key!r} is in both {origin[key].name} and {shard.name} in {folder}; the folder "
                    "mixes several checkpoints (e.g. fp16 and fp32 variants). Pass the file you want instead."
                )
            merged[key], origin[key] = tensor, shard
    return merged


def _find_index(folder: Path) -> Path | None:
    indexes = sorted(folder.glob(f"*{_INDEX_SUFFIX}"))
    if not indexes:
        return None
    preferred = folder / _PREFERRED_INDEX
    if preferred in indexes:
        return preferred
    if len(indexes) == 1:
        return indexes[0]
    names = ", ".join(i.name for i in indexes)
    raise CheckpointError(f"{folder} holds several shard indexes ({names}); pass the shard files you want.")


def _load_indexed_shards(folder: Path, index: Path) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"Shard index {index} is unreadable or has no 'weight_map' ({exc}); download it again."
        ) from exc
    absent = [f for f in files if not (folder / f).is_file()]
    if absent:
        raise CheckpointError(f"Shard index {index} lists files missing from {folder}: {absent}.")
    merged: dict[str, torch.Tensor] = {}
    for file in files:
        merged.update(load_safetensors_file(folder / file))
    lost = [k for k in weight_map if k not in merged]
    if lost:
        raise CheckpointError(
            f"{len(lost)} tensor(s) listed in {index.name} are in none of the shards, e.g. {lost[:5]}; "
            "a shard is stale or truncated."
        )
    return merged


def _no_weights_message(folder: Path) -> str:
    entries = sorted(p.name for p in folder.iterdir())
    pickles = [e for e in entries if e.lower().endswith(PICKLE_SUFFIXES)]
    hint = f" It holds {pickles[:5]}: pass such a file's path directly." if pickles else ""
    listing = ", ".join(entries[:10]) + (" ..." if len(entries) > 10 else "") if entries else "nothing"
    return f"No weights in directory {folder}: no *{SAFETENSORS_SUFFIX} files (contents: {listing}).{hint}"


# --------------------------------------------------------------------------------------------------- pickle
def _load_pickle(path: Path, *, allow_pickle: bool, extra: list[SafeGlobal]) -> object:
    if allow_pickle:
        logger.warning(
            "Loading %s with allow_pickle=True (torch.load weights_only=False): this runs arbitrary code "
            "stored in the file. Only do this for files you trust.",
            path,
        )
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise _unreadable(path, exc) from exc
    with torch.serialization.safe_globals(_not_yet_allowed([*default_safe_globals(), *extra])):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            if "Weights only load failed" not in str(exc):
                raise _unreadable(path, exc) from exc
            names = _refused_names(path, str(exc))  # inside the context: allowed names are not reported
            error = exc
    raise _not_allow_listed(path, names, str(error)) from error


def _not_yet_allowed(wanted: list[SafeGlobal]) -> list[SafeGlobal]:
    """Drop entries the user already allow-listed globally: leaving the context would remove them again. torch
    before 2.6 takes no (object, "dotted.name") pairs: there each pair becomes its object (matched by its own
    module and name)."""
    if _TORCH_VERSION < (2, 6):
        wanted = [g[0] if isinstance(g, tuple) else g for g in wanted]
    present = set(torch.serialization.get_safe_globals())
    return [g for g in dict.fromkeys(wanted) if g not in present]


def _refused_names(path: Path, message: str) -> list[str]:
    """The objects that weights_only refused: a static scan of the pickle, plus what torch's message names."""
    names: list[str] = []
    try:
        names += torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # legacy (non-zip) files cannot be scanned; the message still names the first one
        pass
    for pattern in _REFUSAL_PATTERNS:
        # torch's message shortens "builtins.getattr" to "getattr"; restore it to match the scan
        names += [n if "." in n else f"builtins.{n}" for n in pattern.findall(message)]
    return sorted(set(names))


def _not_allow_listed(path: Path, names: list[str], torch_message: str) -> CheckpointError:
    if names:
        what = ", ".join(names)
    else:
        reason = _TORCH_REASON.search(torch_message)
        what = f"(unnamed; torch says: {reason.group(1)[:300] if reason else torch_message[:300]})"
    return CheckpointError(
        f"{path} contains Python objects that are not allow-listed for safe loading: {what}. "
        "mmspec reads .pt/.pth/.ckpt/.bin files with torch.load(weights_only=True) and a small allow-list "
        "(see docs/checkpoints.md). If you trust this file, allow exactly these objects with "
        "extra_safe_globals=[...], or pass allow_pickle=True (--allow-pickle on mmspec convert): that runs "
        "arbitrary code from the file and should only be used for files you trust. Better, convert it once to "
        ".safetensors (save_safetensors)."
    )


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    text = str(exc).splitlines()[0] if str(exc) else ""
    if "TorchScript" in str(exc):
        return CheckpointError(f"{path} is a TorchScript archive, not a checkpoint; load it with torch.jit.load.")
    return CheckpointError(
        f"Could not read checkpoint {path}: {type(exc).__name__}: {text[:300]}. The file is corrupt, truncated "
        "or not a torch.save file; download it again or check that it is the file you meant."
    )

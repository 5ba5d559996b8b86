"""Writing state dicts as safetensors: contiguous CPU tensors, tied weights cloned, atomic replace."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from mmspec.checkpoints.loading import SAFETENSORS_SUFFIX, as_path
from mmspec.errors import CheckpointError, InputError


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Save `state_dict` to `path` (`*.safetensors`) atomically and return the path.

    Tensors are moved to the CPU and made contiguous; tensors sharing memory (tied weights, views of one
    buffer) are cloned so each is stored on its own. The file is written to a temporary file in the same
    folder and moved into place with `os.replace`, so readers never see a half-written file. The folder is
    created if needed.
    """
    p = as_path(path)
    if not p.name.endswith(SAFETENSORS_SUFFIX):
        raise InputError(f"path must end with {SAFETENSORS_SUFFIX} (got {p.name!r}) so it loads back as one.")
    tensors = _prepare(state_dict)
    meta = _check_metadata(metadata)
    p.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(tensors, p, meta)
    return p


def _prepare(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(state_dict, Mapping):
        raise InputError(f"state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}.")
    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise InputError(f"state_dict entry {key!r} must map a str to a tensor, got {type(tensor).__name__}.")
        if tensor.is_meta or tensor.layout != torch.strided:
            raise InputError(
                f"state_dict[{key!r}] is a {tensor.layout} tensor on {tensor.device}; "
                "safetensors stores dense tensors with data: materialise it first."
            )
        t = tensor.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen_storage:
            t = t.clone(memory_format=torch.contiguous_format)
        seen_storage.add(ptr)
        out[key] = t.contiguous()
    return out


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    ok = isinstance(metadata, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    if not ok:
        raise InputError(
            "metadata must be a dict of str to str (safetensors stores strings only); json.dumps other values."
        )
    return dict(metadata)


def _write_atomically(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    from safetensors.torch import save_file

    # a fresh unique name in the same folder (so os.replace is atomic); created by save_file, honouring umask
    tmp_name = str(path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        save_file(tensors, tmp_name, metadata=metadata)
        with open(tmp_name, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except Exception as exc:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(exc, (InputError, CheckpointError)):
            raise
        raise CheckpointError(f"Could not write {path}: {type(exc).__name__}: {exc}") from exc

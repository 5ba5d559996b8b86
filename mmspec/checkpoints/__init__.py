"""Safe checkpoint loading, state-dict surgery for converters, and strict loading with one clear error.

Safe by default: `.safetensors` files and shard folders hold only tensors; `.pt`/`.pth`/`.ckpt`/`.bin` files
are read with `torch.load(weights_only=True)` plus a small, documented allow-list (`default_safe_globals`:
`argparse.Namespace` for MAR, numpy scalars/dtypes/arrays). Anything else raises `CheckpointError` naming the
objects; `allow_pickle=True` opts in to full pickle (runs code from the file: trusted files only).

Typical converter::

    sd = load_state_dict("c2i_L_256.pt")                      # unwraps {'model': sd}, strips 'module.'
    sd = rename_keys(sd, RULES)                               # (regex, replacement) pairs, in order
    assert not unused_rename_rules(raw_keys, RULES)           # catch typos in rules
    report = load_into(model, sd, ignore_missing=[r"freqs_cis$"])
    save_safetensors(model.state_dict(), "out/model.safetensors")

See docs/checkpoints.md for the policy and a runnable example.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from mmspec.checkpoints.allowlist import SafeGlobal, default_safe_globals
from mmspec.checkpoints.keys import (
    DEFAULT_CONTAINER_KEYS,
    RenameRule,
    StateDict,
    add_prefix,
    drop_keys,
    extract_state_dict,
    is_state_dict,
    rename_keys,
    strip_prefix,
    strip_wrapper_prefixes,
    unused_rename_rules,
)
from mmspec.checkpoints.loading import load_checkpoint
from mmspec.checkpoints.matching import LoadReport, load_into
from mmspec.checkpoints.saving import save_safetensors

__all__ = [
    "DEFAULT_CONTAINER_KEYS",
    "LoadReport",
    "RenameRule",
    "SafeGlobal",
    "StateDict",
    "add_prefix",
    "default_safe_globals",
    "drop_keys",
    "extract_state_dict",
    "is_state_dict",
    "load_checkpoint",
    "load_into",
    "load_state_dict",
    "rename_keys",
    "save_safetensors",
    "strip_prefix",
    "strip_wrapper_prefixes",
    "unused_rename_rules",
]


def load_state_dict(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    extra_safe_globals: Iterable[SafeGlobal] = (),
    keys: Sequence[str] = DEFAULT_CONTAINER_KEYS,
    prefer: str | None = None,
) -> StateDict:
    """`load_checkpoint` then `extract_state_dict`: the weights of a checkpoint file or shard folder."""
    obj = load_checkpoint(path, allow_pickle=allow_pickle, extra_safe_globals=extra_safe_globals)
    return extract_state_dict(obj, keys=keys, prefer=prefer)

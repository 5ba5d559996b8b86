"""Loading a state dict into a module with every key and shape checked first, and one clear error.

`torch.nn.Module.load_state_dict` reports missing and unexpected keys but stops at the first shape mismatch
with a long traceback. `load_into` compares everything up front and raises a single `CheckpointError` that
lists missing keys, unexpected keys and `key: checkpoint shape [..] vs model shape [..]`, with a hint.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from mmspec.checkpoints.keys import compile_patterns, matches_any
from mmspec.errors import CheckpointError, InputError

MAX_LISTED = 20  # keys shown per group in an error message


@dataclass(frozen=True)
class LoadReport:
    """What `load_into` did: how many tensors it loaded and which keys it skipped."""

    loaded: int
    missing: tuple[str, ...] = ()  # left at their initial values (only with strict=False)
    unexpected: tuple[str, ...] = ()  # in the checkpoint, not used (only with strict=False)
    ignored_missing: tuple[str, ...] = ()  # absent from the checkpoint, matched by ignore_missing
    ignored_unexpected: tuple[str, ...] = ()  # extra in the checkpoint, matched by ignore_unexpected

    def summary(self) -> str:
        return (
            f"loaded {self.loaded} tensors; missing {len(self.missing)}, unexpected {len(self.unexpected)}, "
            f"ignored missing {len(self.ignored_missing)}, ignored unexpected {len(self.ignored_unexpected)}"
        )


@dataclass(frozen=True)
class _Diff:
    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, list[int], list[int]]]  # key, checkpoint shape, model shape
    ignored_missing: list[str]
    ignored_unexpected: list[str]


def load_into(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    ignore_missing: str | Iterable[str] = (),
    ignore_unexpected: str | Iterable[str] = (),
    assign: bool = False,
) -> LoadReport:
    """Check `state_dict` against `module` (keys and shapes), then load it.

    `ignore_missing` / `ignore_unexpected` are regexes (`re.search`) for keys that may be absent from the
    checkpoint (e.g. `r"freqs_cis$"` buffers computed at init) or present but unused. With `strict=True`
    (default) any other missing or unexpected key raises; with `strict=False` they are only reported.
    Shape mismatches always raise. `assign` is passed to `module.load_state_dict` (for meta-device models).
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    if not isinstance(state_dict, Mapping):
        raise InputError(f"state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}.")
    model_sd = module.state_dict()
    diff = _compare(
        model_sd,
        state_dict,
        compile_patterns("ignore_missing", ignore_missing),
        compile_patterns("ignore_unexpected", ignore_unexpected),
    )
    if diff.mismatched or (strict and (diff.missing or diff.unexpected)):
        raise CheckpointError(format_mismatch(type(module).__name__, diff.missing, diff.unexpected, diff.mismatched))
    to_load = {k: v for k, v in state_dict.items() if k in model_sd}
    module.load_state_dict(to_load, strict=False, assign=assign)
    return LoadReport(
        loaded=len(to_load),
        missing=tuple(diff.missing),
        unexpected=tuple(diff.unexpected),
        ignored_missing=tuple(diff.ignored_missing),
        ignored_unexpected=tuple(diff.ignored_unexpected),
    )


def _compare(
    model_sd: Mapping[str, Any],
    ckpt_sd: Mapping[str, Any],
    ignore_missing: Sequence[re.Pattern[str]],
    ignore_unexpected: Sequence[re.Pattern[str]],
) -> _Diff:
    absent = [k for k in model_sd if k not in ckpt_sd]
    extra = [k for k in ckpt_sd if k not in model_sd]
    mismatched = []
    for key, target in model_sd.items():
        ckpt_shape, model_shape = _shape(ckpt_sd.get(key)), _shape(target)
        if key in ckpt_sd and ckpt_shape != model_shape and None not in (ckpt_shape, model_shape):
            mismatched.append((key, ckpt_shape, model_shape))
    return _Diff(
        missing=[k for k in absent if not matches_any(k, ignore_missing)],
        unexpected=[k for k in extra if not matches_any(k, ignore_unexpected)],
        mismatched=mismatched,
        ignored_missing=[k for k in absent if matches_any(k, ignore_missing)],
        ignored_unexpected=[k for k in extra if matches_any(k, ignore_unexpected)],
    )


def _shape(value: object) -> list[int] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else list(shape)


# ------------------------------------------------------------------------------------------------ message
def format_mismatch(
    model_name: str,
    missing: Sequence[str],
    unexpected: Sequence[str],
    mismatched: Sequence[tuple[str, list[int], list[int]]],
) -> str:
    """The one error message: grouped, each group truncated to `MAX_LISTED` keys with a count, and hints."""
    total = len(missing) + len(unexpected) + len(mismatched)
    lines = [f"Checkpoint does not match {model_name} ({total} problem(s)):"]
    lines += _group("missing from the checkpoint (in the model, not in the file)", list(missing))
    lines += _group("unexpected in the checkpoint (in the file, not in the model)", list(unexpected))
    lines += _group("shape mismatch", [f"{k}: checkpoint shape {c} vs model shape {m}" for k, c, m in mismatched])
    lines.append("Hint: " + " ".join(_hints(missing, unexpected, mismatched)))
    return "\n".join(lines)


def _group(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    shown = [f"    {item}" for item in items[:MAX_LISTED]]
    more = [f"    ... and {len(items) - MAX_LISTED} more"] if len(items) > MAX_LISTED else []
    return [f"  {title} ({len(items)}):", *shown, *more]


def _hints(missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[object]) -> list[str]:
    hints = []
    prefix = _prefix_hint(missing, unexpected)
    if prefix:
        hints.append(prefix)
    if mismatched:
        hints.append(
            "Shape mismatches usually mean the model was built with another size/config than the checkpoint "
            "(width, depth, heads, vocabulary or codebook size, image/token grid): check the model config."
        )
    if missing or unexpected:
        hints.append(
            "Different key names usually mean the file is an official checkpoint that needs a converter "
            "(rename_keys rules) first, or a checkpoint of another model. Keys that may legitimately differ "
            "can be skipped with ignore_missing=[regex] (e.g. r'freqs_cis$' buffers computed at init) or "
            "ignore_unexpected=[regex]; strict=False tolerates missing/unexpected keys but never shape mismatches."
        )
    return hints


def _prefix_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """Suggest strip_prefix/add_prefix when the key sets differ by one leading component."""
    missing_set, unexpected_set = set(missing), set(unexpected)
    strip = Counter(k.split(".", 1)[0] + "." for k in unexpected if "." in k and k.split(".", 1)[1] in missing_set)
    add = Counter(k.split(".", 1)[0] + "." for k in missing if "." in k and k.split(".", 1)[1] in unexpected_set)
    for counter, template in ((strip, "strip_prefix(sd, {!r})"), (add, "add_prefix(sd, {!r})")):
        if counter:
            prefix, count = counter.most_common(1)[0]
            if 2 * count >= len(missing):
                return f"The checkpoint keys look shifted by a prefix: try {template.format(prefix)}."
    return ""

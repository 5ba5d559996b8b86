"""Finding the state dict inside a checkpoint container, and rewriting its keys for converters.

Official checkpoints wrap their weights differently: LlamaGen `{'model': sd}` (or `'module'`, `'state_dict'`,
or a raw state dict), MAR `{'model': sd, 'model_ema': sd_ema, ...}`, `kl16.ckpt` `{'model': sd}`, VAR a raw
state dict. `extract_state_dict` unwraps all of them. The key helpers return new dicts (the tensors are
shared, never copied) and refuse to let two keys collapse onto one name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mmspec.errors import CheckpointError, InputError

StateDict = dict[str, torch.Tensor]
Replacement = str | Callable[[re.Match[str]], str]
RenameRule = tuple[str | re.Pattern[str], Replacement]

DEFAULT_CONTAINER_KEYS = ("model_ema", "model", "module", "state_dict")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel / DeepSpeed, torch.compile
_MAX_DEPTH = 3


# -------------------------------------------------------------------------------------------- extraction
def extract_state_dict(
    obj: object,
    keys: Sequence[str] = DEFAULT_CONTAINER_KEYS,
    prefer: str | None = None,
) -> StateDict:
    """Return the state dict inside a loaded checkpoint.

    `obj` may be a raw state dict, a container whose value under one of `keys` (first match wins, so EMA
    weights beat raw ones by default) is a state dict or another such container, or an `nn.Module`.
    `prefer` names the container key to use and must be present. A prefix that every key has
    (`module.`, `_orig_mod.`) is stripped.
    """
    if isinstance(keys, str):
        raise InputError(f"keys must be a sequence of container keys, got the string {keys!r}; use ({keys!r},).")
    found = _find_state_dict(obj, tuple(keys), prefer, depth=0)
    return strip_wrapper_prefixes(found)


def _find_state_dict(obj: object, keys: tuple[str, ...], prefer: str | None, depth: int) -> Mapping[str, Any]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"Expected a checkpoint dict (state dict or container), got {type(obj).__name__}; "
            "this file does not hold model weights in a known layout."
        )
    if prefer is not None:
        if prefer not in obj:
            raise CheckpointError(f"prefer={prefer!r} is not in the checkpoint. {describe_top_level(obj)}")
        if not is_state_dict(obj[prefer]):
            raise CheckpointError(f"checkpoint[{prefer!r}] is not a state dict. {describe_top_level(obj)}")
        return obj[prefer]
    if is_state_dict(obj):
        return obj
    for key in keys:
        value = obj.get(key)
        if is_state_dict(value):
            return value
        if isinstance(value, Mapping) and depth < _MAX_DEPTH:
            try:
                return _find_state_dict(value, keys, None, depth + 1)
            except CheckpointError:
                continue
    raise CheckpointError(
        f"No state dict found in the checkpoint (looked for a dict of tensors, or one under {list(keys)}). "
        f"{describe_top_level(obj)} Pass prefer='<key>' to pick one, or write a converter."
    )


def is_state_dict(value: object) -> bool:
    """A non-empty mapping from str to tensors (non-tensor `*_extra_state` entries are allowed)."""
    if not isinstance(value, Mapping) or not value:
        return False
    return all(
        isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith("_extra_state")) for k, v in value.items()
    )


def describe_top_level(obj: Mapping[Any, Any], limit: int = 20) -> str:
    """'Top-level keys: 'model' (dict, 12 entries, 12 tensors), 'epoch' (int), ...' for error messages."""
    parts = [f"{k!r} ({_describe(v)})" for k, v in list(obj.items())[:limit]]
    more = f", ... and {len(obj) - limit} more" if len(obj) > limit else ""
    return f"Top-level keys: {', '.join(parts) or '(none)'}{more}."


def _describe(value: object) -> str:
    kind = type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)}"
    if isinstance(value, Mapping):
        tensors = sum(isinstance(v, torch.Tensor) for v in value.values())
        return f"{kind}, {len(value)} entries, {tensors} tensors"
    return kind


def strip_wrapper_prefixes(sd: Mapping[str, Any]) -> StateDict:
    """Strip `module.` / `_orig_mod.` (repeatedly, in any order) when every key carries it."""
    out = dict(sd)
    changed = True
    while changed and out:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in out):
                out = {k[len(prefix) :]: v for k, v in out.items()}
                changed = True
    return out


# ----------------------------------------------------------------------------------------------- renaming
def rename_keys(sd: Mapping[str, Any], rules: Iterable[RenameRule]) -> StateDict:
    """Rename every key by applying the `(regex, replacement)` rules in order (`re.sub` semantics).

    Each rule sees the key as rewritten by the rules before it. Two keys ending on one name raise
    `CheckpointError`. Use `unused_rename_rules` to find rules that matched nothing.
    """
    _check_state_dict(sd)
    compiled = _compile_rules(rules)
    mapping, _ = _apply_rules(sd.keys(), compiled)
    return _remap(sd, mapping, "rename_keys")


def unused_rename_rules(keys: Iterable[str], rules: Iterable[RenameRule]) -> list[RenameRule]:
    """The rules (as given) that matched no key when applied in order to `keys` (or a state dict's keys).

    A converter author can assert this is empty: a rule that matches nothing is usually a typo or a rule
    written for another checkpoint version.
    """
    rule_list = list(rules)
    _, used = _apply_rules(list(keys), _compile_rules(rule_list))
    return [rule for rule, hit in zip(rule_list, used) if not hit]


def _compile_rules(rules: Iterable[RenameRule]) -> list[tuple[re.Pattern[str], Replacement]]:
    if isinstance(rules, (str, Mapping)):
        raise InputError("rules must be a sequence of (regex, replacement) pairs, in the order to apply them.")
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise InputError(f"rename rule {rule!r} must be a (regex, replacement) pair.")
        pattern, replacement = rule
        if not (isinstance(replacement, str) or callable(replacement)):
            raise InputError(f"rename rule {rule!r}: the replacement must be a str or a function of the match.")
        compiled.append((_compile("rename rule", pattern), replacement))
    return compiled


def _apply_rules(
    keys: Iterable[str], rules: list[tuple[re.Pattern[str], Replacement]]
) -> tuple[dict[str, str], list[bool]]:
    used = [False] * len(rules)
    mapping = {}
    for key in keys:
        new = key
        for i, (pattern, replacement) in enumerate(rules):
            new, n = pattern.subn(replacement, new)
            used[i] = used[i] or n > 0
        mapping[key] = new
    return mapping, used


# ------------------------------------------------------------------------------------- prefixes, dropping
def strip_prefix(sd: Mapping[str, Any], prefix: str, *, keep_unmatched: bool = True) -> StateDict:
    """Remove `prefix` from the keys that start with it; `keep_unmatched=False` drops the other keys
    (selecting a sub-module, e.g. `strip_prefix(sd, "vae.", keep_unmatched=False)`)."""
    _check_state_dict(sd)
    _check_str("prefix", prefix)
    mapping = {k: k[len(prefix) :] for k in sd if k.startswith(prefix)}
    if keep_unmatched:
        mapping.update({k: k for k in sd if not k.startswith(prefix)})
    return _remap(sd, mapping, "strip_prefix")


def add_prefix(sd: Mapping[str, Any], prefix: str) -> StateDict:
    """Prepend `prefix` to every key."""
    _check_state_dict(sd)
    _check_str("prefix", prefix)
    return {prefix + k: v for k, v in sd.items()}


def drop_keys(sd: Mapping[str, Any], patterns: str | Iterable[str]) -> StateDict:
    """Remove the keys matching any of the regexes (`re.search`), e.g. `drop_keys(sd, [r"\\.attn\\.bias$"])`."""
    _check_state_dict(sd)
    compiled = compile_patterns("patterns", patterns)
    return {k: v for k, v in sd.items() if not matches_any(k, compiled)}


def compile_patterns(name: str, patterns: str | Iterable[str]) -> list[re.Pattern[str]]:
    """Compile one regex or an iterable of them, naming the argument in any error."""
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    if not isinstance(patterns, Iterable):
        raise InputError(f"{name} must be a regex or a list of regexes, got {type(patterns).__name__}.")
    return [_compile(name, p) for p in patterns]


def matches_any(key: str, patterns: Sequence[re.Pattern[str]]) -> bool:
    return any(p.search(key) for p in patterns)


# ------------------------------------------------------------------------------------------------ helpers
def _compile(name: str, pattern: object) -> re.Pattern[str]:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise InputError(f"{name}: {pattern!r} is not a regex string.")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"{name}: {pattern!r} is not a valid regex ({exc}).") from exc


def _remap(sd: Mapping[str, Any], mapping: Mapping[str, str], what: str) -> StateDict:
    out: StateDict = {}
    source: dict[str, str] = {}
    for old, new in mapping.items():
        if new in out:
            raise CheckpointError(
                f"{what} maps both {source[new]!r} and {old!r} to {new!r}; make the rules more specific."
            )
        out[new], source[new] = sd[old], old
    return out


def _check_state_dict(sd: object) -> None:
    if not isinstance(sd, Mapping):
        raise InputError(f"sd must be a state dict (a mapping of str to tensors), got {type(sd).__name__}.")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InputError(f"{name} must be a str, got {type(value).__name__}.")

"""Method configurations: a method of a family plus its parameters, parsed from `--methods`.

    "vanilla,draft-model,tree:depth=6:top_k=8"  ->  three configurations, labelled as written

A configuration is `NAME[:KEY=VALUE[:KEY=VALUE...]]`; values are read as bool, int, float, else text, and
override the method's defaults (an unknown key is an error). `given` holds what the configuration sets (what the
method's run receives, so the constructors' own defaults apply to the rest); `params` the defaults with those on
top (what reports show). The reference configuration (plain `vanilla`) is
always included and listed first (it is added when the list does not name it, moved to the front when the list
names it elsewhere), so every method's quality and speed-up can be taken against it within the same pass (the run
order inside a pass rotates: `mmspec.bench.runner.run_round`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmspec.bench.registry import REFERENCE_METHOD, Family
from mmspec.errors import InputError, check


@dataclass(frozen=True)
class MethodConfig:
    """One configuration to benchmark: `label` is unique and names it in every output."""

    label: str
    method: str
    params: Mapping[str, Any]
    given: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_reference(self) -> bool:
        return self.label == REFERENCE_METHOD


def parse_value(text: str) -> Any:
    """'true'/'false' -> bool, then int, then float, else the text itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_config(text: str, family: Family, settings: Any = None) -> MethodConfig:
    """Parse one `NAME[:KEY=VALUE...]` against the family's methods and their default params (with `settings`, the
    params its family options set, `Family.option_params`, replace the defaults they name)."""
    name, *assignments = [part.strip() for part in text.strip().split(":")]
    if name not in family.methods:
        raise InputError(f"unknown method {name!r} for bench family {family.name!r}; known methods: "
                         f"{', '.join(family.methods)}.")
    defaults = dict(family.methods[name].params)
    if settings is not None and family.option_params is not None:
        defaults.update({k: v for k, v in family.option_params(settings).items() if k in defaults})
    given = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        check(sep == "=" and key != "", f"method parameter {item!r} in {text!r} must be KEY=VALUE.")
        if key not in defaults:
            known = ", ".join(defaults) or "none"
            raise InputError(f"method {name!r} has no parameter {key!r}; its parameters: {known}.")
        given[key] = parse_value(value)
    if family.methods[name].check is not None:  # the values that need no model: before any is built
        family.methods[name].check(given)
    label = name if not assignments else ":".join([name, *assignments])
    return MethodConfig(label=label, method=name, params={**defaults, **given}, given=given)


def parse_method_list(methods: str | Sequence[str] | None, family: Family,
                      settings: Any = None) -> list[MethodConfig]:
    """Configurations in the given order (when None: the family's `default_methods(settings)`, else all of its
    methods), vanilla first."""
    if methods is None:
        own = family.default_methods
        items = list(own(settings)) if own is not None and settings is not None else list(family.methods)
    elif isinstance(methods, str):
        items = [m for m in methods.split(",") if m.strip()]
    else:
        items = list(methods)
    check(len(items) > 0, "--methods is empty; name at least one method (vanilla is added automatically).")
    configs = [parse_config(item, family, settings) for item in items]
    labels = [c.label for c in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    check(not duplicates, f"method configuration(s) listed twice: {', '.join(duplicates)}.")
    if REFERENCE_METHOD not in labels:
        configs.insert(0, parse_config(REFERENCE_METHOD, family, settings))
    return sorted(configs, key=lambda c: not c.is_reference)  # stable: the others keep their order

"""One record per family and per method: what `mmspec generate`, `mmspec vlm`, `mmspec bench` and the demo apps read.

A *method* is declared once, in its family's `family.py`, by decorating the function that builds it:

    FAMILY = FamilyRecord("llamagen", "LlamaGen class-conditional image generation", load=load, ...)

    @FAMILY.method(params=(EagleTreeDrafter, LanternRule), lossless=rule_lossless("lantern"))
    def lantern(ctx, **given):
        \"\"\"LANTERN: EAGLE-2 trees + relaxed acceptance over the VQ codebook's latent neighbours.\"\"\"
        tree, rule = split(given, EagleTreeDrafter, LanternRule)
        return eagle_tree_drafter(ctx, **tree), acceptance_rule(ctx, "lantern", **rule)

The record reads its name (the function's, `_` -> `-`), its one-line description (the docstring's first line), its
parameters with their defaults (the function's own keyword parameters, plus those of the constructors it forwards
`**given` to, read from their signatures: a default lives in one place) and whether it keeps the target's
distribution (`lossless`: a bool, or a function of the parameters such as `rule_lossless`, which asks the
acceptance rule the parameters select). The record's kind says what building it gives: a `LoopMethod` builds a
(drafter, acceptance rule) pair for the shared loop, a `CallMethod` (a collaborative method with its own schedule:
CoDe, CSpD) the pipeline to call and its arguments, a `DrafterMethod` names the trained drafter model the family's
tree drafter runs (the VLM). A family's `method_kind` is the kind its decorator declares; `needs` names the
pipeline components a method runs besides the target, so a pipeline offers exactly the methods it has parts for;
`check(given)` the checks of the given values that need no model, which `check_given` runs (and so every command
before it loads a model, and `build`).

A *family* record holds the pipeline folder loader and embedded default, the hooks `mmspec generate` and the image
demo use (`generate`, `num_classes`, `sampling_defaults`), the bench hook (`bench() -> mmspec.bench.Family`) and
its methods. Families are discovered the way Python packages offer plug-ins: the entry-point group
`mmspec.families` (`name = "package.module:RECORD"` in a distribution's metadata; mmspec's own are in
pyproject.toml), plus `register_family(record)` at run time (tests, notebooks). The core never names a family.

Glossary: *given* = the parameters a caller set (the run function receives only those, so the constructors'
defaults apply); *params* = every parameter with its default (what `--help`, the bench and the demos show).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple

from mmspec.errors import InputError, check

ENTRY_POINT_GROUP = "mmspec.families"
ParamSource = Callable[..., Any] | type | Mapping[str, Any]


def parameters_of(*sources: ParamSource, skip: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword parameters with defaults of callables and classes (a class: its constructor), merged in order;
    a mapping is taken as {name: default}. Parameters without a default, `*args` / `**kwargs`, `self` and `skip`
    are left out (the family supplies those); `only` keeps just those names (e.g. a pipeline call's method
    parameters)."""
    out: dict[str, Any] = {}
    for source in sources:
        if isinstance(source, Mapping):
            out.update(source)
            continue
        target = source.__init__ if isinstance(source, type) else source
        for p in inspect.signature(target).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty or p.name in skip:
                continue
            if only and p.name not in only:
                continue
            out[p.name] = p.default
    return out


def split(given: Mapping[str, Any], *sources: ParamSource) -> list[dict[str, Any]]:
    """`given` divided among the sources by the parameters each takes (`parameters_of`): one dict per source, then
    one with what none of them takes."""
    taken = [parameters_of(source) for source in sources]
    rest = {k: v for k, v in given.items() if not any(k in t for t in taken)}
    return [{k: v for k, v in given.items() if k in t} for t in taken] + [rest]


@dataclass(frozen=True)
class MethodRecord:
    """A decoding method of a family. `run` is what `build` calls with the family's context and the caller's given
    parameters; `params` every parameter with its default; `lossless(params)` whether its output keeps the target's
    distribution exactly with those parameters (defaults filled in); `needs` the pipeline components it runs besides
    the target (e.g. "eagle_drafter"): a pipeline without one of them does not offer the method. The kind of the
    record (a subclass) says what `build` gives."""

    name: str
    run: Callable[..., Any] | None
    params: Mapping[str, Any]
    lossless: Callable[[Mapping[str, Any]], bool]
    description: str = ""
    needs: tuple[str, ...] = ()
    check: Callable[[Mapping[str, Any]], None] | None = None  # check(given): value checks that need no model

    def check_given(self, given: Mapping[str, Any] | None, family: str = "") -> dict[str, Any]:
        """The given parameters, after checking that the method takes each (InputError naming the known ones) and
        the record's `check` of their values."""
        check(given is None or isinstance(given, Mapping),
              f"method_kwargs must be a dict of the method's parameters, got {type(given).__name__}.")
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(self.params) or "no parameters"
            where = f"{family} method" if family else "method"
            raise InputError(f"{where} {self.name!r} takes {known}; got {', '.join(unknown)}.")
        if self.check is not None:  # before any model loads: `mmspec generate` calls this first
            self.check(given)
        return given

    def build(self, context: Any, given: Mapping[str, Any] | None = None, family: str = "") -> Any:
        """run(context, **given) after `check_given`; a parameter the run cannot take is an InputError."""
        given = self.check_given(given, family)
        check(self.run is not None, f"method {self.name!r} builds nothing: its family runs it without a build.")
        try:
            return self.run(context, **given)
        except TypeError as err:
            raise InputError(f"bad parameters for method {self.name!r}: {err}") from None

    def resolved(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every parameter: the defaults with the given ones on top."""
        return {**self.params, **(given or {})}

    def is_lossless(self, given: Mapping[str, Any] | None = None) -> bool:
        return bool(self.lossless(self.resolved(given)))

    def offered_by(self, pipeline: Any) -> bool:
        """Whether `pipeline` has every component the method needs (set, not None)."""
        return all(getattr(pipeline, name, None) is not None for name in self.needs)

    def seed_fixes_output(self, given: Mapping[str, Any] | None, temperature: float) -> bool:
        """Whether a seed gives the same output whatever draft sizes a budget picks: vanilla, the coupled rule (the
        target's own sample at every token), or a lossless method at temperature 0 (greedy tokens). Otherwise the
        sizes, which budget="auto" picks from measured times, change which numbers decide (sampled speculative
        sampling, a relaxed rule's acceptance), so only budget="fixed" repeats a seed's output."""
        params = self.resolved(given)
        return (self.name == "vanilla" or params.get("accept") == "coupled"
                or (temperature == 0 and self.is_lossless(given)))


class LoopParts(NamedTuple):
    """What a `LoopMethod` builds for the shared loop (`mmspec.loop.generate`)."""

    drafter: Any  # a `mmspec.loop.Drafter` (NoDrafter for vanilla)
    rule: Any  # an acceptance rule or its name ("greedy", "lossless", "coupled", ...)


class PipelineCall(NamedTuple):
    """What a `CallMethod` builds: the pipeline to call and the keyword arguments the method adds to the call."""

    pipeline: Any
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class LoopMethod(MethodRecord):
    """A method of the shared draft-verify loop: run(context, **given) -> (drafter, rule) (LlamaGen, the t2i and
    transformers' image families, the toy)."""

    def build(self, context: Any, given: Mapping[str, Any] | None = None, family: str = "") -> LoopParts:
        parts = super().build(context, given, family)
        check(isinstance(parts, tuple) and len(parts) == 2,
              f"method {self.name!r} must build (drafter, rule), got {type(parts).__name__}.")
        return LoopParts(*parts)


@dataclass(frozen=True)
class CallMethod(MethodRecord):
    """A collaborative method whose pipeline runs its own schedule (VAR's CoDe, MAR's CSpD): run(pipe, **given) ->
    (the pipeline to call, its extra keyword arguments)."""

    def build(self, context: Any, given: Mapping[str, Any] | None = None, family: str = "") -> PipelineCall:
        parts = super().build(context, given, family)
        check(isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[1], dict),
              f"method {self.name!r} must build (pipeline, keyword arguments), got {type(parts).__name__}.")
        return PipelineCall(*parts)


@dataclass(frozen=True)
class DrafterMethod(MethodRecord):
    """A method that runs a drafter model through the family's loop drafter (the VLM): `run` is the drafter model
    class (None: vanilla, the target alone); `trained`: whether it needs trained weights (a folder's
    drafters/<kind>) or is built from its parameters (prompt lookup)."""

    trained: bool = True

    @property
    def drafter_model(self) -> type | None:
        return self.run


def constant(value: bool) -> Callable[[Mapping[str, Any]], bool]:
    return lambda params: value


@dataclass
class FamilyRecord:
    """A model family: how to load its pipeline folder, the hooks the CLI, demos and bench call, its methods.

    load(model_path | None, device) -> pipeline (None: the embedded default); generate(pipe, conditions,
    generators, options) -> (PIL images, SpecStats) for image families (`mmspec generate`, the image demo), where
    `condition` says what a condition is: "class" (class ids; num_classes(pipe)) or "prompt" (caption strings);
    num_classes(pipe); sampling_defaults(pipeline) -> {guidance_scale, temperature, top_k, top_p} used when a
    caller sets none, where `pipeline()` returns the loaded pipeline for a family whose model carries its own
    defaults (MAR), loading it only then, or None when the caller will not load it (the family then returns its
    static defaults); bench() -> `mmspec.bench.Family`; profile(pipe) -> {name: (model, run_forward(batch, width))}
    for the models whose forward costs `mmspec profile` measures (`mmspec.profiling`). Hooks a family does not have stay
    None."""

    name: str
    description: str = ""
    default_model: Path | None = None
    load: Callable[..., Any] | None = None  # load(model_path, device, dtype=None)
    generate: Callable[..., tuple[list, Any]] | None = None
    condition: str = "class"  # what generate's conditions are: "class" ids or "prompt" strings
    num_classes: Callable[[Any], int] | None = None
    sampling_defaults: Callable[[Any], dict] | None = None
    bench: Callable[[], Any] | None = None
    profile: Callable[[Any], dict[str, tuple[Any, Callable[[int, int], None]]]] | None = None
    methods: dict[str, MethodRecord] = field(default_factory=dict)
    method_kind: type[MethodRecord] = LoopMethod  # what its methods build (LoopMethod, CallMethod, DrafterMethod)

    def method(self, name: str | None = None, *, params: tuple[ParamSource, ...] = (), skip: tuple[str, ...] = (),
               lossless: bool | Callable[[Mapping[str, Any]], bool] = True, description: str | None = None,
               needs: tuple[str, ...] = (),
               check: Callable[[Mapping[str, Any]], None] | None = None) -> Callable[[Callable], Callable]:
        """Decorator: declare `fn` as a method (see the module docstring). `params`: the constructors (or mappings)
        its `**given` is forwarded to; `skip`: their parameters the family supplies itself; `needs`: the pipeline
        components it runs besides the target; `check(given)`: the checks of their values that need no model
        (InputError), run before a command loads one."""

        def declare(fn: Callable) -> Callable:
            own = list(inspect.signature(fn).parameters.values())[1:]  # the first is the family's context
            merged = {**parameters_of(*params, skip=skip),
                      **{p.name: p.default for p in own if p.default is not p.empty}}
            summary = description or (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
            self.add(name or fn.__name__.replace("_", "-"), fn, merged, lossless, summary, needs, check=check)
            return fn

        return declare

    def add(self, name: str, run: Callable[..., Any] | None, params: Mapping[str, Any],
            lossless: bool | Callable[[Mapping[str, Any]], bool] = True, description: str = "",
            needs: tuple[str, ...] = (), **fields: Any) -> MethodRecord:
        """Declare a method without the decorator (e.g. when `run` is a class), as a `method_kind` record (`fields`:
        that kind's own, e.g. DrafterMethod's `trained`)."""
        check(name not in self.methods, f"family {self.name!r} declares method {name!r} twice.")
        record = self.method_kind(name, run, dict(params), lossless if callable(lossless) else constant(lossless),
                                  description, tuple(needs), **fields)
        self.methods[name] = record
        return record

    def get_method(self, name: str) -> MethodRecord:
        if name not in self.methods:
            raise InputError(f"unknown {self.name} method {name!r}; available: {', '.join(self.methods)}.")
        return self.methods[name]

    def defaults(self, pipe: Any = None, load: Callable[[], Any] | None = None) -> dict:
        """The sampling settings a call uses when the caller sets none (`sampling_defaults`), given the loaded
        `pipe` or a `load()` that loads it if the family needs it."""
        check(self.sampling_defaults is not None, f"family {self.name!r} has no sampling defaults.")
        return dict(self.sampling_defaults((lambda: pipe) if pipe is not None else (load or (lambda: None))))


def model_guidance_defaults(defaults: Mapping[str, Any]) -> Callable[[Callable[[], Any]], dict]:
    """A `sampling_defaults` hook: `defaults` with the loaded pipeline's own guidance scale (its
    `default_guidance_scale()`) when the caller loads it (`pipeline()` gives it, or None)."""

    def sampling_defaults(pipeline: Callable[[], Any]) -> dict:
        pipe = pipeline()
        return dict(defaults) if pipe is None else {**defaults, "guidance_scale": pipe.default_guidance_scale()}

    return sampling_defaults


def method_call_generate(record: FamilyRecord, sampling: Callable[[dict], dict] = dict):
    """A `generate` hook for a family of `CallMethod`s (VAR, MAR): the options' method and method_kwargs pick the
    call, `sampling(options)` gives its sampling keyword arguments."""

    def generate(pipe: Any, labels: list[int], generators: list, options: dict) -> tuple[list, Any]:
        options = dict(options)
        call, extra = record.get_method(options.pop("method")).build(pipe, options.pop("method_kwargs", {}),
                                                                     record.name)
        out = call(class_labels=labels, generator=generators, output_type="pil", **sampling(options), **extra)
        return out.images, out.stats

    return generate


_REGISTERED: dict[str, FamilyRecord] = {}
_LOADED: dict[str, FamilyRecord] = {}


def register_family(record: FamilyRecord, *, replace: bool = False) -> FamilyRecord:
    """Make `record` available to every command by its name (in addition to the installed entry points)."""
    check(isinstance(record, FamilyRecord), f"register_family needs a FamilyRecord, got {type(record).__name__}.")
    check(replace or record.name not in available_families(),
          f"family {record.name!r} is already registered; pass replace=True to override.")
    _REGISTERED[record.name] = record
    return record


def unregister_family(name: str) -> None:
    """Remove a family added with `register_family` (no error if absent)."""
    _REGISTERED.pop(name, None)


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_families(hook: str | None = None) -> list[str]:
    """Every family name, sorted; with `hook` ("generate", "bench", ...), those whose record has it (this imports
    the families' record modules, which are light: no models are built)."""
    names = sorted(set(_REGISTERED) | set(_entry_points()))
    if hook is None:
        return names
    return [n for n in names if getattr(get_family(n), hook) is not None]


def get_family(name: str) -> FamilyRecord:
    """The family record registered as `name` (InputError listing the known families otherwise)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _LOADED:
        points = _entry_points()
        if name not in points:
            raise InputError(f"unknown family {name!r}; known families: {', '.join(available_families()) or 'none'}.")
        record = points[name].load()
        check(isinstance(record, FamilyRecord) and record.name == name,
              f"the entry point of family {name!r} ({points[name].value}) is not a FamilyRecord named {name!r}.")
        _LOADED[name] = record
    return _LOADED[name]

"""How a family offers its methods to `mmspec bench`: the bench view of a family record (`mmspec.families`).

A bench `Family` is one model setup (the toy LM, LlamaGen, VAR, MAR, a VLM) with the methods that run on it. A
family record's `bench` hook returns it; the harness calls `Family.build` once per bench to make the models (shared
by every method), `Family.inputs` once for the seeded inputs, then each `Method.run` on batches of those inputs
(with the parameters a configuration sets), and `Family.quality` on each method's outputs against the vanilla
outputs of the same repeat. `methods_of(record, runner)` turns the record's methods into bench methods, so a method
declared once in its family shows up here with its parameters, defaults and losslessness.

    from mmspec.bench import Family, Method, MethodOutput, register_family

    def my_family() -> Family:
        return Family(name="mine", model_id="mine-small", build=build_models, inputs=make_inputs,
                      methods={"vanilla": Method(run_vanilla), "sjd": Method(run_sjd, lossless=False,
                                                                          params={"window": 16})},
                      quality=my_quality, primary_quality="class_accuracy")

    register_family("mine", my_family)   # a bench-only family record (mmspec.families.register_family)

Families are found the way every command finds them (`mmspec.families`: the `mmspec.families` entry points, plus
records registered at run time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmspec.errors import InputError, check
from mmspec.stats import SpecStats

REFERENCE_METHOD = "vanilla"


@dataclass(frozen=True)
class BenchSettings:
    """What every family is built with: sizes, sampling temperature, seed, device and family options."""

    num_samples: int = 16
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    device: str = "cpu"
    options: Mapping[str, str] = field(default_factory=dict)  # family-specific `--family-option KEY=VALUE`

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Sample:
    """One benchmark input. `data` is whatever the family's methods consume (a prompt, a class label...)."""

    question_id: int | str
    category: str
    data: Any


@dataclass
class MethodOutput:
    """What a method returns for one batch: one output per sample, new tokens per sample, and the stats.

    `stats.num_target_forwards` is the batch's target forwards (NFE); `stats.accept_lengths_per_row()` gives
    Spec-Bench's per-sample `accept_lengths` when the method records per-row stats.
    """

    outputs: list[Any]
    new_tokens: list[int]
    stats: SpecStats


# run(models, batch, settings, params) -> MethodOutput; `models` is what Family.build returned
MethodFn = Callable[[Any, Sequence[Sample], BenchSettings, Mapping[str, Any]], MethodOutput]
# quality(method, params, outputs, vanilla_outputs, settings) -> {"figure name": number or text}
QualityFn = Callable[["Method", Mapping[str, Any], Sequence[Any], Sequence[Any], BenchSettings], dict]
# model_quality(models, samples, outputs, settings) -> {"figure name": number}: figures that need the built models;
# outputs[i] is the method's output for samples[i]
ModelQualityFn = Callable[[Any, Sequence["Sample"], Sequence[Any], BenchSettings], dict]


@dataclass(frozen=True)
class Method:
    """A decoding method of a family: `run` produces per-sample outputs and a SpecStats for one batch.

    `params` are the defaults a configuration may override (`--methods tree:depth=6`); a key that is not in
    `params` is rejected. `lossless` says whether outputs follow the target's distribution exactly (a bool, or a
    callable of the resolved params for methods whose lossiness depends on them, e.g. LANTERN's delta).
    """

    run: MethodFn
    lossless: bool | Callable[[Mapping[str, Any]], bool] = True
    params: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    check: Callable[[Mapping[str, Any]], None] | None = None  # check(given): value checks that need no model

    def is_lossless(self, params: Mapping[str, Any]) -> bool:
        return bool(self.lossless(params) if callable(self.lossless) else self.lossless)


@dataclass(frozen=True)
class Family:
    """A model setup and the methods that run on it (see the module docstring).

    build(settings) -> models, called once; inputs(settings) -> samples, seeded and deterministic;
    to_turn(output) -> a JSON-serialisable Spec-Bench turn (token ids, text, or an image description).
    `primary_quality` names the quality figure used as the x axis of the speed-up vs quality plot.
    `model_quality(models, samples, outputs, settings)`, optional, adds figures that need the models and the
    inputs (e.g. how closely the outputs follow the target's distribution given their prompts,
    `mmspec.metrics.calibration`); like `quality` it runs untimed. `default_methods(settings)`, optional, names
    the methods a run compares when it names none (e.g. only those the chosen model has a drafter for).
    `option_params(settings)`, optional: the method parameters the family's options set for every method.
    """

    name: str
    model_id: str | Callable[[BenchSettings], str]
    build: Callable[[BenchSettings], Any]
    inputs: Callable[[BenchSettings], list[Sample]]
    methods: Mapping[str, Method]
    quality: QualityFn
    primary_quality: str | None = None
    to_turn: Callable[[Any], Any] | None = None
    description: str = ""
    model_quality: ModelQualityFn | None = None
    # the methods a run without --methods compares (default: all): those the chosen model can run
    default_methods: Callable[[BenchSettings], list[str]] | None = None
    # method parameters that a --family-option sets for every method (MAR's num_sampling_steps): what the records
    # show for a method that has the parameter and does not set it itself
    option_params: Callable[[BenchSettings], Mapping[str, Any]] | None = None

    def resolved_model_id(self, settings: BenchSettings) -> str:
        return self.model_id(settings) if callable(self.model_id) else self.model_id


FamilyFactory = Callable[[], Family]


def methods_of(record: Any, runner: Callable[[Any], MethodFn], budget: bool = False) -> dict[str, Method]:
    """Bench methods from a family record's methods (`mmspec.families.MethodRecord`): runner(method record) makes
    each one's `run`; parameters, defaults, losslessness and descriptions come from the record. `budget`: every
    method but vanilla also takes the bench parameter `budget` (`fixed`, `auto`, `auto-no-<part>`: `mmspec.budget`;
    None = the method's default), which the runner pops before building the method (`pop_budget`)."""
    extra = {"budget": None} if budget else {}

    def own_check(m: Any) -> Callable[[Mapping[str, Any]], None] | None:
        return None if m.check is None else lambda given: m.check(pop_budget(given)[0])

    return {name: Method(runner(m), lossless=m.is_lossless, description=m.description,
                         params={**m.params, **(extra if name != "vanilla" else {})}, check=own_check(m))
            for name, m in record.methods.items()}


def pop_budget(given: Mapping[str, Any], default: str | None = None) -> tuple[dict[str, Any], str | None]:
    """(the method's own parameters, the draft budget) from a bench method's parameters (see `methods_of`)."""
    from mmspec.budget import check_budget_mode

    given = dict(given)
    budget = given.pop("budget", None) or default
    check_budget_mode(budget)
    return given, budget


def register_family(name: str, factory: FamilyFactory, *, replace: bool = False) -> None:
    """Make `factory` (no arguments -> Family) available as `mmspec bench --family NAME`: a bench-only family record.

    The factory must be cheap (no model building: that is `Family.build`). Registering a taken name raises
    InputError unless `replace=True`.
    """
    from mmspec.families import FamilyRecord
    from mmspec.families import register_family as register_record

    check(isinstance(name, str) and name != "", f"family name must be a non-empty string, got {name!r}.")
    check(callable(factory), f"factory for family {name!r} must be callable, got {type(factory).__name__}.")
    register_record(FamilyRecord(name=name, bench=factory), replace=replace)


def unregister_family(name: str) -> None:
    """Remove a family registered with `register_family` (no error if absent)."""
    from mmspec.families import unregister_family as unregister_record

    unregister_record(name)


def available_families() -> list[str]:
    """Every family name `get_family` accepts (families with a bench hook), sorted."""
    from mmspec.families import available_families as families_with

    return families_with("bench")


def get_family(name: str) -> Family:
    """The bench Family of the family record `name`; InputError listing the known families otherwise."""
    from mmspec.families import get_family as get_record

    record = get_record(name)
    if record.bench is None:  # (the list imports every family's record: only on this error)
        raise InputError(f"family {name!r} has no bench hook; families with one: {', '.join(available_families())}.")
    family = record.bench()
    check(isinstance(family, Family), f"the bench hook of family {name!r} returned "
          f"{type(family).__name__}, expected mmspec.bench.Family.")
    check(REFERENCE_METHOD in family.methods,
          f"bench family {name!r} must offer a {REFERENCE_METHOD!r} method (the reference every method is "
          "compared with).")
    return family

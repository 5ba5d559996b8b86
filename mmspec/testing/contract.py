"""The method contract every (family, method) pair of the family records keeps, checked on tiny models.

A family's tests declare one `ContractCase` (how to build a tiny pipeline with every component its methods need and
how to call a method on it); `contract_pairs` parametrises the checks below over every method the family's record
lists, so a method added to a record is checked without a new test:

- `check_exact`: at the exact temperature (0: greedy; a continuous family compares seeded samples instead) a lossless
  method gives vanilla's tokens on a ragged batch, with its drafts forced (budget "fixed": it must draft) and under
  its default budget; a lossy method does so with the parameters (and pipeline) under which it reduces to an exact one
  (`exact_given`, `exact_pipeline`: LANTERN with delta 0, GSD with groups of one, CoDe with one model on both sides).
  The default budget's decisions are scripted (`mmspec.testing.budgets.forced_budget`: full, plain and chain steps
  in turn), so the default path is exercised the same way on any machine.
- `check_seed_fixes_output`: where the record says a seed fixes the output (`MethodRecord.seed_fixes_output`: the
  coupled rule, the default of the discrete lossless methods), a sampled call gives vanilla's tokens for the same
  generators under the default budget.
- `check_law`: a lossless method's sampled tokens follow the target's law: the token after the first, grouped by
  the first, fits the target's teacher-forced conditional distribution (pooled chi-square) and fails it at another
  temperature (the negative control). Speculative sampling runs (accept="lossless") where the method has a choice,
  and each of the case's `law_variants` (e.g. SJD's couplings).
- `check_bad_parameters`: a parameter the method does not take is a one-line InputError naming it, raised before
  any module runs.
- `check_library`: greedy vanilla equals the model library's own decoding (or an independent full-forward
  reference), where the family has one.

Glossary: *conditions* = one call's batch of class labels, captions or (image, question) pairs; *tokens* = [B, L]
(or a list of [L_b] rows where answers differ in length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mmspec.errors import InputError
from mmspec.families import FamilyRecord, get_family
from mmspec.testing.budgets import CallScript, forced_budget
from mmspec.testing.distributions import assert_fits_law_not_control, prefix_pairs


@dataclass
class ContractRun:
    """What a case's call gives: the generated tokens ([B, L] or a list of [L_b] rows) and the call's SpecStats."""

    tokens: torch.Tensor | list[torch.Tensor]
    stats: Any


class ContractCase:
    """How the contract runs one family's methods (see the module docstring); subclasses fill in the hooks."""

    family: str  # the family record's name
    exact_temperature: float = 0.0  # 0: greedy; > 0 (continuous tokens): seeded samples are compared
    law_rows: int = 400  # rows sampled for `check_law`
    control_temperature: float = 0.5  # the negative control's law
    law_min_dof: int = 3  # degrees of freedom the law's chi-square needs (a law too peaked to test fails)
    law_variants: Mapping[str, list[dict]] = {}  # per method, more lossless parameter sets `check_law` samples
    law_settings: Mapping[str, dict] = {}  # per method, settings every `check_law` sample uses (a smaller tree)
    fewer_forwards: tuple[str, ...] = ()  # methods that need fewer target forwards than vanilla at the exact setting
    draft_free: tuple[str, ...] = ("vanilla",)  # methods that draft nothing (no drafted tokens to assert)
    budgets: tuple[str | None, ...] = ("fixed", None)  # the budgets `check_exact` runs (the family's budget modes)
    exact_drafting: bool = True  # whether the exact settings must draft tokens and need <= vanilla's target forwards
    # (the shared loop's statistics; CoDe and CSpD count their own)

    @property
    def record(self) -> FamilyRecord:
        return get_family(self.family)

    def build(self) -> Any:
        """A tiny pipeline with every component the family's methods need."""
        raise NotImplementedError

    def conditions(self) -> list:
        """A ragged batch of conditions for the exactness checks."""
        raise NotImplementedError

    def law_condition(self) -> Any:
        """The one condition `check_law` repeats over its rows."""
        return self.conditions()[0]

    def run(self, pipe: Any, method: str, given: Mapping[str, Any], conditions: Sequence, *, temperature: float,
            seed: int = 0, budget: str | None = None, law: bool = False) -> ContractRun:
        """The family's call of `method` with the given parameters, one generator per row seeded seed, seed + 1, ...;
        budget None = the method's default; `law`: the call `check_law` scores (`probs_at`'s settings)."""
        raise NotImplementedError

    def exact_given(self, method: str) -> list[dict[str, Any]]:
        """The parameter sets `check_exact` runs: the defaults for a lossless method; a lossy method must name the
        parameters under which it is exact."""
        if self.record.get_method(method).is_lossless():
            return [{}]
        raise NotImplementedError(f"{self.family}: declare the parameters under which the lossy method {method!r} "
                                  "is exact (ContractCase.exact_given)")

    def exact_pipeline(self, pipe: Any, method: str) -> Any:
        """The pipeline `check_exact` runs `method` on (a lossy method may need another: CoDe with one model)."""
        return pipe

    def probs_at(self, pipe: Any, condition: Any, tokens: torch.Tensor, position: int,
                 temperature: float) -> torch.Tensor | None:
        """The target's sampling law [n, V] of token `position` of each row of `tokens` [n, L] under `condition`
        (teacher-forced); None where the family's tokens are not discrete (no `check_law`)."""
        return None

    def library_greedy(self, pipe: Any, conditions: Sequence) -> torch.Tensor | list[torch.Tensor] | None:
        """Greedy tokens from the model library's own decoding, or an independent reference (None: none)."""
        return None

    def modules(self, pipe: Any) -> list[torch.nn.Module]:
        """The pipeline's models (watched by `check_bad_parameters`: none may run before the refusal)."""
        return [m for m in getattr(pipe, "components", {}).values() if isinstance(m, torch.nn.Module)]


def rows_of(tokens: torch.Tensor | list[torch.Tensor]) -> list[list]:
    return [row.tolist() for row in tokens]


def contract_pairs(cases: Mapping[str, ContractCase], applies=None) -> list:
    """pytest parameters (family, method) over every method of every case's family record, id "family-method";
    `applies(case, record)` keeps only the pairs a check applies to."""
    out = []
    for family in sorted(cases):
        for name, record in get_family(family).methods.items():
            if applies is None or applies(cases[family], record):
                out.append(pytest.param(family, name, id=f"{family}-{name}"))
    return out


def check_exact(case: ContractCase, pipe: Any, method: str) -> None:
    conditions = case.conditions()
    t = case.exact_temperature
    for given in case.exact_given(method):
        exact = case.exact_pipeline(pipe, method)
        vanilla = case.run(exact, "vanilla", {}, conditions, temperature=t, seed=3)
        assert len({repr(r) for r in rows_of(vanilla.tokens)}) > 1, "rows alike: the comparison could not fail"
        for budget in case.budgets if method not in case.draft_free else (None,):
            with forced_budget(CallScript(steps=("full", "plain", "chain"))):  # the default path, scripted
                out = case.run(exact, method, given, conditions, temperature=t, seed=3, budget=budget)
            assert rows_of(out.tokens) == rows_of(vanilla.tokens), (method, given, budget)
            if method in case.draft_free or not case.exact_drafting:
                continue
            assert out.stats.num_draft_tokens > 0, (method, given, budget, "drafted nothing")
            # every verify emits at least one token: never more target forwards than vanilla
            assert out.stats.num_target_forwards <= vanilla.stats.num_target_forwards, (method, given, budget)
            if budget == "fixed" and method in case.fewer_forwards:
                assert out.stats.num_target_forwards < vanilla.stats.num_target_forwards, (method, given)


def check_seed_fixes_output(case: ContractCase, pipe: Any, method: str) -> None:
    conditions = case.conditions()
    vanilla = case.run(pipe, "vanilla", {}, conditions, temperature=1.0, seed=11)
    out = case.run(pipe, method, {}, conditions, temperature=1.0, seed=11)
    assert rows_of(out.tokens) == rows_of(vanilla.tokens)


def law_given(record: Any) -> dict[str, Any]:
    """The parameters `check_law` runs a method with: speculative sampling where the method has a choice."""
    return {"accept": "lossless"} if "accept" in record.params else {}


def check_law(case: ContractCase, pipe: Any, method: str, position: int = 1) -> None:
    record = case.record.get_method(method)
    base = case.law_settings.get(method, {})
    for given in [{**base, **law_given(record)}, *({**base, **v} for v in case.law_variants.get(method, []))]:
        assert record.is_lossless(given), (method, given)
        check_law_of(case, pipe, method, given, position)


def check_law_of(case: ContractCase, pipe: Any, method: str, given: dict[str, Any], position: int) -> None:
    condition = case.law_condition()
    rows = case.run(pipe, method, given, [condition] * case.law_rows, temperature=1.0, seed=1000,
                    budget=None if method in case.draft_free else "fixed", law=True).tokens
    rows = [r for r in rows_of(rows) if len(r) > position]
    by_prefix = {tuple(r[:position]): r for r in rows}  # one row per prefix: the law of the next token is its own
    prefixes = list(by_prefix)
    tokens = torch.tensor([by_prefix[p][:position + 1] for p in prefixes])  # [n, position + 1]

    def law(temperature: float):
        probs = case.probs_at(pipe, condition, tokens, position, temperature)  # [n, V]
        table = {p: probs[i] for i, p in enumerate(prefixes)}
        return lambda prefix: table[prefix].double().cpu().numpy()

    assert_fits_law_not_control(prefix_pairs(rows, [position]), law, case.control_temperature, case.law_min_dof)


def check_bad_parameters(case: ContractCase, pipe: Any, method: str) -> None:
    forwards = []
    hooks = [sub.register_forward_pre_hook(lambda *_: forwards.append(1))
             for m in case.modules(pipe) for sub in m.modules()]
    try:
        with pytest.raises(InputError) as error:
            case.run(pipe, method, {"no_such_parameter": 1}, case.conditions()[:1], temperature=0.0)
    finally:
        for hook in hooks:
            hook.remove()
    message = str(error.value)
    assert "no_such_parameter" in message and "\n" not in message, message
    assert not forwards, f"{len(forwards)} module forwards ran before the refusal"


def check_library(case: ContractCase, pipe: Any) -> None:
    conditions = case.conditions()
    reference = case.library_greedy(pipe, conditions)
    assert reference is not None
    ours = case.run(pipe, "vanilla", {}, conditions, temperature=0.0)
    assert rows_of(ours.tokens) == rows_of(reference)

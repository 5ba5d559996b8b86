"""Draft budgets for tests: `CyclingBudget` walks through fixed sizes; `forced_budget` makes the real budgets of a
pipeline's default path (`budget="auto"`) take scripted decisions, so a test exercises every decision the loop can
be given (drafting each size, plain steps, settling on plain steps for the rest of a call, a call without the
drafter) whatever the machine's speed, while the budget's own bookkeeping runs as usual (its timing of options, its
estimates and call gate).

    with forced_budget(CallScript(steps=("full", "plain", "chain")), CallScript(settle_after=2),
                       CallScript(drafts=False)):
        vlm.generate(**enc)   # call 1: full, plain, chain, full, ..; call 2 settles; call 3 runs without the drafter

Step names: "full" the drafter's full size (a tree drafter's full shape, a chain or window drafter's largest size),
"small" its smallest drafting size (the smallest tree of the menu, else a chain of 1), "chain" a chain of about a
third of the full depth (a window drafter: its middle size), "plain" a plain step; or an option of the budget's menu
by its name (`chain2`, `tree10x2n8`: a `TreeShape`'s `str`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

STEP_NAMES = ("full", "small", "chain", "plain")
OPTION_NAME = re.compile(r"chain\d+|tree\d+x\d+n\d+")  # an option of a budget's menu by name


class CyclingBudget:
    """A `mmspec.budget.Budget` that chooses sizes[0], sizes[1], .. in a cycle; learns nothing."""

    def __init__(self, sizes: Sequence[Any]) -> None:
        self.sizes, self.step = list(sizes), 0

    def begin(self, target: Any, drafter: Any, state: Any, rule: Any) -> bool:
        return True

    def choose(self, rows_held: int, tokens_left: Any) -> Any:
        self.step += 1
        return self.sizes[(self.step - 1) % len(self.sizes)]

    def observe(self, result: Any, active: Any, draft: Any) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class CallScript:
    """One call's decisions: `drafts` False runs it without the drafter (the call gate's verdict); else its steps
    draft `steps` in turn (cycled), and from step `settle_after` on (None: never) the call settles on plain steps."""

    drafts: bool = True
    steps: tuple[str, ...] = ("full",)
    settle_after: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEP_NAMES and not OPTION_NAME.fullmatch(s)]
        if unknown or not self.steps:
            raise ValueError(f"steps must be a non-empty tuple of {STEP_NAMES} or option names (chain2, tree10x2n8), "
                             f"got {self.steps!r}.")


def named_size(budget: Any, name: str) -> Any:
    """The size `name` (a step name or an option's, see the module docstring) in `budget`'s menu (a
    `ThroughputBudget`): a `TreeShape` of a tree drafter, an int of a chain or window drafter; 0 for "plain"."""
    if name == "plain":
        return 0
    options, keys = budget.options, budget.keys
    if OPTION_NAME.fullmatch(name):
        names = [str(o) for o in options]
        if name not in names:
            raise ValueError(f"{name!r} is not in the budget's menu: {', '.join(names[1:])}.")
        return keys[names.index(name)]
    if name == "full":
        return budget.full_key
    chains = [i for i, o in enumerate(options) if o.is_chain]
    trees = sorted((i for i, o in enumerate(options) if o.top_k > 1 and keys[i] != budget.full_key),
                   key=lambda i: options[i].total)
    if name == "small":
        return keys[trees[0]] if trees else keys[chains[0]]
    if not hasattr(budget.full_key, "depth"):  # a chain or window drafter: its middle size
        return keys[chains[len(chains) // 2]]
    deep = [i for i in chains if options[i].depth >= max(1, budget.full_key.depth // 3)]
    return keys[deep[0] if deep else chains[-1]]


class ScriptedBudget:
    """A real budget (`budget`) whose decisions follow `script`; everything else is the real budget's (attribute
    access falls through to it). Each choice first asks the real budget, so it times and counts as it would, then
    the scripted size is the one drafted (and the one the real budget learns from)."""

    def __init__(self, budget: Any, script: CallScript) -> None:
        self.budget, self.script, self.steps = budget, script, 0
        self.choices: list[Any] = []  # the sizes chosen in this call, in order (tests read them)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.budget, name)

    def begin(self, target: Any, drafter: Any, state: Any, rule: Any) -> bool:
        self.budget.gate.skip = 0  # (the real budget drafts; the verdict is the script's)
        self.budget.begin(target, drafter, state, rule)
        self.steps = 0
        return self.script.drafts

    def choose(self, rows_held: int, tokens_left: Any) -> Any:
        from mmspec.budget import SETTLE

        self.budget.choose(rows_held, tokens_left)
        script = self.script
        if script.settle_after is not None and self.steps >= script.settle_after:
            self.choices.append(0)
            return SETTLE
        size = named_size(self.budget, script.steps[self.steps % len(script.steps)])
        self.budget._last = self.budget.keys.index(size)  # the option it learns from is the one drafted
        self.steps += 1
        self.choices.append(size)
        return size

    def observe(self, result: Any, active: Any, draft: Any) -> None:
        self.budget.observe(result, active, draft)

    def end(self) -> None:
        self.budget.end()


@contextlib.contextmanager
def forced_budget(*scripts: CallScript) -> Iterator[list[ScriptedBudget]]:
    """Inside the block every budget `mmspec.budget.make_budget` builds (one per call; a pipeline's batches are
    calls) follows the next of `scripts` (cycled). Yields the list of the scripted budgets made so far."""
    from mmspec.budget import BUDGET_WRAPPER

    if not scripts:
        raise ValueError("give at least one CallScript.")
    made: list[ScriptedBudget] = []

    def wrap(budget: Any) -> ScriptedBudget:
        made.append(ScriptedBudget(budget, scripts[len(made) % len(scripts)]))
        return made[-1]

    token = BUDGET_WRAPPER.set(wrap)
    try:
        yield made
    finally:
        BUDGET_WRAPPER.reset(token)

"""How much to draft each step: the draft budget (docs/budgets.md).

One small model in four parts: `cost` (each option's step seconds, a profiled table corrected by the call's own
steps), `acceptance` (per-position rates, per tree shape counts, the batch tail), `policy` (the option with the most
expected tokens per second, a plain step always one) and `gate` (whole calls without the drafter where drafting
bought nothing); every constant in `config.BudgetConfig`. The loop speaks to a budget through `Budget` alone, via
`BudgetCall` (shared by `mmspec.loop.generate` and CSpD's loop).

    budget = make_budget("auto", target, drafter, rule, batch=4)   # None for "fixed" (and relaxed rules' default)
    out = mmspec.loop.generate(target, drafter, rule, inputs, batch_size=4, max_new_tokens=64, budget=budget)
    out.stats.extra   # budget_<option>: steps at each option; calls_without_drafter

Modes: "auto" (the model), "fixed" (the drafter's configured size every step), None (the method's default: "auto"
for lossless rules, whose output law the budget cannot change; "fixed" for relaxed rules, whose output law depends
on the drafts, so a seeded call does not depend on the machine's timings or load).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from mmspec.budget.config import BudgetConfig
from mmspec.budget.policy import SETTLE, ThroughputBudget
from mmspec.errors import check
from mmspec.tree import PLAIN, TreeShape, chain, max_chain_depth, pool_size
from mmspec.verify import get_rule

BUDGET_MODES = ("auto", "fixed")
# "auto-no-<part>": the model with one part switched off, for A/B runs (`--methods sjd:budget=auto-no-gate`)
PARTS = {"timing": {"timing": False}, "tail": {"batch_tail": False}, "gate": {"gate": False},
         "explore": {"warmup": 0, "refresh_every": 0}, "settle": {"settle_after": 10 ** 9}, "hold": {"hold": 1},
         "probe": {"plain_probe": 0}, "segments": {"segments": 1}, "window-memory": {"window_decay": 0.9},
         "retime": {"retime": False}, "resume": {"resume": False}}


class Budget(Protocol):
    """What the loop asks a draft budget (one per model pair, batch size and setting; it lives across calls)."""

    def begin(self, target: Any, drafter: Any, state: Any, rule: Any) -> bool:
        """A call starts (before the prefill; `state` holds its rows); False runs it without the drafter."""

    def choose(self, rows_held: int, tokens_left: Callable[[], torch.Tensor]) -> Any:
        """The next step's size for `drafter.set_draft_size` (0: a plain step; SETTLE: plain to the call's end)."""

    def observe(self, result: Any, active: torch.Tensor, draft: Any) -> None:
        """The verdicts of the step just chosen."""

    def end(self) -> None:
        """The call ended."""


class BudgetCall:
    """The loop's side of a budget for one call: None = the drafter's own size every step. Counts in `stats.extra`
    the steps at each option (`budget_<option>`) and the calls run without the drafter (`calls_without_drafter`)."""

    def __init__(self, budget: Budget | None, stats: Any) -> None:
        self.budget, self.stats = budget, stats
        self.plain_for_good = False  # the rest of the call runs plain steps: neither budget nor drafter is asked

    def begin(self, target: Any, drafter: Any, state: Any, rule: Any) -> bool:
        """Whether the call drafts (the drafter's begin runs only then)."""
        if self.budget is None:
            return True
        drafts = self.budget.begin(target, drafter, state, rule)
        self.stats.add_extra("calls_without_drafter", int(not drafts))
        self.plain_for_good = not drafts
        return drafts

    def choose(self, rows_held: int, tokens_left: Callable[[], torch.Tensor]) -> Any:
        """None without a budget (the drafter's own size), else the budget's size (0: a plain step)."""
        if self.budget is None:
            return None
        if self.plain_for_good:
            return 0
        size = self.budget.choose(rows_held, tokens_left)
        if size == SETTLE:
            self.plain_for_good, size = True, 0
        return size

    def observe(self, size: Any, result: Any, active: torch.Tensor, draft: Any) -> None:
        if self.budget is None:
            return
        if not self.plain_for_good:
            self.budget.observe(result, active, draft)
        self.stats.add_extra(f"budget_{size}", 1)

    def end(self) -> None:
        if self.budget is not None:
            self.budget.end()


def check_budget_mode(mode: str | BudgetConfig | None, what: str = "budget") -> None:
    """InputError unless `mode` is one of `BUDGET_MODES`, None (the method's default) or a `BudgetConfig` ("auto"
    with that config: how the bench compares the model with a part of it switched off)."""
    check(mode is None or isinstance(mode, BudgetConfig) or mode in BUDGET_MODES
          or (isinstance(mode, str) and mode.removeprefix("auto-no-") in PARTS),
          f"{what} must be one of {BUDGET_MODES}, auto-no-<part> (parts: {', '.join(PARTS)}), None or a "
          f"BudgetConfig, got {mode!r}.")


def budget_config(mode: str | BudgetConfig | None, rule: Any) -> BudgetConfig | None:
    """The config of the budget `mode` asks for under `rule` (None: the drafter's own size every step)."""
    check_budget_mode(mode)
    if isinstance(mode, BudgetConfig):
        return mode
    if mode is not None and mode.startswith("auto-no-"):
        return BudgetConfig(**PARTS[mode.removeprefix("auto-no-")])
    rule = get_rule(rule) if isinstance(rule, str) else rule
    return BudgetConfig() if (mode or default_mode(getattr(rule, "lossless", False))) == "auto" else None


def default_mode(lossless: bool) -> str:
    """The method's default budget: "auto" for a lossless rule, "fixed" for a relaxed one (the module docstring)."""
    return "auto" if lossless else "fixed"


def menu_of(drafter: Any, config: BudgetConfig) -> tuple[list[TreeShape], list[Any], Any] | None:
    """(options, the drafter's key of each, its full size) of a drafter a budget can steer, None otherwise. A tree
    drafter (`full_shape`): the plain step, greedy chains of depth 1..max_chain_depth, trees of its top_k at smaller
    depths and node counts and its full shape. A chain or window drafter (`draft_sizes`): its sizes."""
    full = getattr(drafter, "full_shape", None)
    if full is not None:
        chains = [chain(d) for d in range(1, max_chain_depth(full) + 1)]
        depths = sorted({d for d in config.tree_depths if d < full.depth} | {full.depth}) if full.top_k > 1 else []
        totals = sorted({n for n in config.tree_totals if n < full.total} | {full.total})
        trees = [TreeShape(full.top_k, d, n) for d in depths for n in totals if d + 1 < n <= pool_size(full.top_k, d)]
        options = [PLAIN, *chains, *trees]
        return options, [0, *options[1:]], full
    sizes = sorted(set(getattr(drafter, "draft_sizes", ())) | {0})
    if len(sizes) < 2:
        return None  # vanilla's NoDrafter, or a drafter that cannot be steered: its own size
    return [chain(k) for k in sizes], sizes, sizes[-1]


def make_budget(mode: str | BudgetConfig | None, target: Any, drafter: Any, rule: Any, batch: int,
                keep: dict | None = None) -> Budget | None:
    """The draft budget of a call (None: the drafter's own size every step). `keep`: a dict the caller holds (a
    pipeline's) in which a budget stays between calls of the same drafter, size, batch size, rule and sampling
    setting, so what it learnt carries over. A function set in `BUDGET_WRAPPER` gets the budget first (tests force
    its decisions: `mmspec.testing.budgets.forced_budget`)."""
    config = budget_config(mode, rule)
    if config is None:
        return None
    menu = menu_of(drafter, config)
    if menu is None:
        return None
    options, keys, full = menu
    model = getattr(getattr(drafter, "runner", None), "model", None)
    key = (type(drafter).__name__, id(model), str(full), tuple(map(str, options)), batch,
           str(getattr(rule, "name", rule)), str(getattr(target, "params", "")), config)
    budget = None if keep is None else keep.get(key)
    if budget is None:
        budget = ThroughputBudget(options, keys, config, per_size=getattr(drafter, "valued_per_size", False),
                                  full_key=full)
        if keep is not None:
            keep[key] = budget
    wrap = BUDGET_WRAPPER.get()
    return budget if wrap is None else wrap(budget)


# a function every budget `make_budget` returns passes through (None: none): how a test forces a budget's decisions
# while its bookkeeping (timing, estimates) runs as usual (`mmspec.testing.budgets`)
BUDGET_WRAPPER: ContextVar[Callable[[Any], Any] | None] = ContextVar("mmspec_budget_wrapper", default=None)

__all__ = ["BUDGET_MODES", "BUDGET_WRAPPER", "PARTS", "SETTLE", "Budget", "BudgetCall", "BudgetConfig",
           "ThroughputBudget", "budget_config", "check_budget_mode", "default_mode", "make_budget", "menu_of"]

"""The cost model: the seconds of one loop step under each option of a budget's menu, at the rows held.

- The table: each option's step timed on the live call (`time_options`: the drafter's `propose` per (top_k, depth),
  the target's verify plus the acceptance rule per node count, chains and trees apart), once per model pair,
  device, dtype, threads, batch size, prefix length bucket and rule, then read from the cache
  (`mmspec.profiling.cached_json`). Or given (CSpD's windows, tests).
- The correction (`timing`): an option that ran costs the median of its own last steps (from one choice to the next:
  drafting, verify, acceptance and the drafter's bookkeeping, as the loop ran them, under the machine's load, with
  the rows the loop held); the others cost their table seconds times the median ratio measured / table of those that
  ran. (Tables per level of rows held after the loop drops finished rows did not pay: docs/budgets.md.)
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec.budget.config import BudgetConfig
from mmspec.phases import synchronize
from mmspec.profiling import cached_json, profile_key
from mmspec.tree import PLAIN, TreeShape
from mmspec.verify import ChainDraft, accept

log = logging.getLogger("mmspec.budget")


class StepCosts:
    """Each option's step seconds [S] (see the module docstring)."""

    def __init__(self, options: Sequence[TreeShape], config: BudgetConfig) -> None:
        self.options, self.config = list(options), config
        self.table: list[float] | None = None  # [S] table seconds at the budget's batch size
        self.steps: dict[int, deque] = {}  # option index -> its last measured seconds
        self.medians: dict[int, float] = {}  # option index -> the median of its `steps`

    def note(self, option: int, seconds: float) -> None:
        """A step of option index `option` took `seconds`."""
        self.steps.setdefault(option, deque(maxlen=self.config.step_samples)).append(seconds)
        self.medians[option] = statistics.median(self.steps[option])

    def seconds(self) -> list[float]:
        """[S] each option's step seconds: measured, or its table's read like the measured ones'."""
        table, measured = self.table or [1.0] * len(self.options), self.medians
        ratio = statistics.median([m / max(table[s], 1e-12) for s, m in measured.items()]) if measured else 1.0
        return [measured.get(s, table[s] * ratio) for s in range(len(table))]


def time_options(target: Any, drafter: Any, state: Any, rule: Any, options: Sequence[TreeShape],
                 keys: Sequence[Any], repeats: int, full_key: Any) -> list[float]:
    """[S] the median seconds of a step under each option on the live call (nothing committed): drafting
    (`drafter.set_draft_size(key)`, `propose`) plus the target's verify and the acceptance rule on that draft. A
    drafter whose drafts may be shorter than asked (prompt lookup: only where an n-gram recurs) gives the full-width
    draft the option costs when it drafts through `timing_propose`."""
    log.info("mmspec: timing draft options for budget='auto' on this device (once per model pair, batch size and "
             "device; cached)")
    device = state.output.device
    generator = torch.Generator(device=device).manual_seed(0)
    drafts, draft_seconds, step_seconds = {}, {}, {}
    for option, key in zip(options, keys):
        if option == PLAIN:
            drafts[option] = ChainDraft(torch.empty(state.batch_size, 0, dtype=torch.long, device=device))
            continue
        drafter.set_draft_size(key)
        propose = getattr(drafter, "timing_propose", drafter.propose)
        draft_seconds[(option.top_k, option.depth)] = median_seconds(lambda p=propose: p(state), repeats, device)
        drafts[option] = propose(state)
    for option, draft in drafts.items():
        step = (option.is_chain, option.total)  # a chain's verify takes the causal mask, cheaper than a tree's
        if step not in step_seconds:
            step_seconds[step] = median_seconds(
                lambda d=draft: accept(rule, d, target.verify(state, d), generator, validate=False), repeats, device)
    drafter.set_draft_size(full_key)
    return [draft_seconds.get((o.top_k, o.depth), 0.0) + step_seconds[(o.is_chain, o.total)] for o in options]


def median_seconds(run: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The median seconds of `run()` over `repeats` calls after one warm-up call."""
    run()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def options_key(target: Any, drafter: Any, state: Any, rule: Any, options: Sequence[TreeShape], batch: int) -> str:
    """The cache key of a table: the models, device, dtype and threads (`profile_key`), the batch size, the prompts'
    length bucket, the rule, the sampling setting, CFG and the options."""
    runner = target.runner
    prefix = int(runner.lengths.max())
    target_model = module_of(runner.model)
    drafter_model = module_of(getattr(getattr(drafter, "runner", None), "model", None))
    drafter_part = (profile_key(drafter_model, "cpu") if isinstance(drafter_model, torch.nn.Module)
                    else str(getattr(drafter, "config", dict)()))
    extra = (f"budget-v4|B={batch}|prefix<={1 << max(prefix - 1, 0).bit_length()}|{getattr(rule, 'name', rule)}|"
             f"{target.params}|cfg={runner.guidance_scale is not None}|{type(drafter).__name__}|{drafter_part}|"
             f"{[str(o) for o in options]}")
    return profile_key(target_model, state.output.device, extra)


def module_of(model: Any) -> Any:
    """The torch module behind a runner's model (a wrapper's `.model`), or None."""
    return model if model is None or isinstance(model, torch.nn.Module) else getattr(model, "model", None)


def cached_option_seconds(target: Any, drafter: Any, state: Any, rule: Any, options: Sequence[TreeShape],
                          keys: Sequence[Any], repeats: int, full_key: Any) -> list[float]:
    """`time_options` at the call's batch size, cached."""
    key = options_key(target, drafter, state, rule, options, state.batch_size)
    value = cached_json(key, lambda: {"seconds": time_options(target, drafter, state, rule, options, keys, repeats,
                                                              full_key)})
    return list(value["seconds"])

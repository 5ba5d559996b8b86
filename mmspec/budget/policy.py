"""The policy: before every step, the option with the most expected tokens per second, a plain step always one.

    option* = argmax_o E[X | o] / seconds(o)                       (vLLM's adaptive K: E_acc(K) / ITL(K))
    at batch > 1: argmax_o r / (seconds(o) * E[steps until the last of n rows has r more tokens | o])

E[X | o] and its variance come from the `AcceptanceModel` of the call's segment (`segments` equal parts of the tokens a
call generates, by its longest row's progress: an image's first rows draft worse than its later ones), seconds(o) from
`StepCosts`; plain steps win ties. A segment's first choices, until `warmup` rows, and refreshes at choices
`refresh_every`, 3 x, 7 x .. (over the budget's life; in each call for drafters valued per size) draft the exploration
option (the option that shows the most trees, then the deepest, among those costing at most `explore_cost` plain steps;
a refresh while chains are chosen drafts the deepest such chain, the only way to learn the positions past them). While
the estimate drafts and fewer than `plain_probe` plain steps were measured, a plain step runs (its cost measured).
`settle_after` plain choices in a row settle the segment on plain steps (no estimate until the next segment or refresh);
where every later segment, explored, would choose a plain step too, they return SETTLE: plain steps for the rest of the
call. Drafters valued per size hold a window (not a plain step) for `hold` steps. A call after calls without the drafter
(the gate's `retrying`) probes: its first segment explores again (once), the later ones only once an estimate drafts,
and its steps are timed afresh (`retime`: the prices measured before the skipped calls are dropped, a chain timed at a
bad moment among them).

Lossless: an option is chosen from past verdicts and measured costs only, before the step drafts anything, so the
draft length is a stopping time of the draft-side process and the output law is the target's (docs/budgets.md;
tested by a distribution test).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec.budget.acceptance import AcceptanceModel, batch_steps_of
from mmspec.budget.config import BudgetConfig
from mmspec.budget.cost import StepCosts, cached_option_seconds
from mmspec.budget.gate import CallGate
from mmspec.compile import compilations
from mmspec.tree import PLAIN, TreeShape

log = logging.getLogger("mmspec.budget")

SETTLE = -1  # `choose`'s answer for a plain step and every step after it in this call


class ThroughputBudget:
    """The draft budget (the `mmspec.budget.Budget` protocol) over a menu of options: `options` [S] TreeShapes
    (PLAIN first), `keys` [S] what `drafter.set_draft_size` takes for each (an int for chain and window drafters).
    costs: [S] step seconds (None: timed on the live call at its first choice, `time_options`)."""

    def __init__(self, options: Sequence[TreeShape], keys: Sequence[Any], config: BudgetConfig | None = None, *,
                 costs: Sequence[float] | None = None, per_size: bool = False, full_key: Any = None) -> None:
        self.options, self.keys, self.config = list(options), list(keys), config or BudgetConfig()
        self.names = [str(o) for o in self.options]
        assert self.options[0] == PLAIN and len(self.keys) == len(self.options)
        self.full_key = self.keys[-1] if full_key is None else full_key
        self.by_segment = [AcceptanceModel(self.options, self.config, per_size) for _ in range(self.config.segments)]
        self.explored = [0] * self.config.segments  # rows of the exploration choices made in each segment
        self.costs = StepCosts(self.options, self.config)
        self.costs.table = None if costs is None else list(costs)
        self.gate, self.per_size = CallGate(self.config), per_size
        self.chosen: dict[str, int] = {}  # choices per option over the budget's life
        self.choices, self.refresh_at, self.refreshes = 0, self.config.refresh_every, 0
        self._rows_held = self._compiled_at = 0
        self._exploring = False  # the choice held is an exploration
        self._start_call(None)

    # ------------------------------------------------------------------------------------------- protocol
    def begin(self, target: Any, drafter: Any, state: Any, rule: Any) -> bool:
        """A call starts (before its prefill): whether it drafts (the call gate)."""
        drafts = self.gate.drafts_this_call()
        self._start_call((target, drafter, state, rule) if drafts else None)
        if drafts and self.gate.retrying:  # after calls without the drafter: a probe of the first segment (`_pick`)
            self.explored[0] = min(self.explored[0], self.config.warmup - 1)
            if self.config.retime:  # .. whose steps are timed afresh: the load may have moved meanwhile
                self.costs.steps, self.costs.medians = {}, {}
        if drafts and self.per_size:  # a window learns from its own steps alone: its refreshes are counted per call
            self.choices, self.refresh_at, self.refreshes = 0, self.config.refresh_every, 0
        return drafts

    def _start_call(self, live: tuple | None) -> None:
        """A call's own fields afresh; `live`: (target, drafter, state, rule), None for a call without the drafter."""
        self._live, self._last, self._chosen_at = live, None, None  # (the option of the step chosen last, its time)
        self._before: int | None = None  # the option of the step before
        self._held = self._plain_run = self._call_choices = 0
        self._settled = False  # the call settles on plain steps: no later segment drafts either
        self._estimated = [0, 0]  # this call's choices by estimate, and how many of them drafted
        self.segment, self._total = 0, 0.0  # the segment of the step chosen last; the call's longest row at its start

    @property
    def acceptance(self) -> AcceptanceModel:
        """The acceptance model of the segment of the step chosen last."""
        return self.by_segment[self.segment]

    def choose(self, rows_held: int, tokens_left: Callable[[], torch.Tensor]) -> Any:
        """The next step's option key (0: a plain step; SETTLE: plain steps for the rest of the call). rows_held:
        the rows the loop holds; tokens_left() [rows_held] the tokens each may still emit (0: finished)."""
        self._price_rows(rows_held)
        self._time_last_step()
        left = tokens_left().tolist()  # [rows_held] the step's one read of the rows' progress
        tail = [max(left), sum(r > 0 for r in left)]
        self._enter_segment(float(tail[0]))
        index = self._pick(rows_held, tail)
        self._before, self._last = self._last, index
        self.choices, self._call_choices = self.choices + 1, self._call_choices + 1
        self.chosen[self.names[index]] = self.chosen.get(self.names[index], 0) + 1
        if index == 0 and self._settled:
            return SETTLE
        return self.keys[index]

    def observe(self, result: Any, active: torch.Tensor, draft: Any) -> None:
        """Learn the verdicts of the step just chosen."""
        if self._last is not None and not (self.per_size and self._before != self._last):  # (a window's first step
            self.acceptance.observe(self.options[self._last], draft, result, active)  # at a size under-reads it)

    def end(self) -> None:
        """The call ended: the call gate's verdict (its choices by estimate) and a DEBUG line."""
        if self._live is not None:
            self.gate.end_call(*self._estimated)
            if log.isEnabledFor(logging.DEBUG) and self.costs.table is not None:
                log.debug("budget: %s", self.describe())
        self._live = None

    # -------------------------------------------------------------------------------------------- choice
    def _enter_segment(self, longest: float) -> None:
        """Set the segment from the longest row's tokens left (`longest`) against the call's first one; a new segment
        starts its plain run afresh."""
        self._total = self._total or max(longest, 1.0)
        segments = self.config.segments
        segment = min(int(segments * (1.0 - longest / self._total)), segments - 1)
        if segment != self.segment:
            self.segment, self._plain_run = segment, 0

    def _pick(self, rows_held: int, tail: list) -> int:
        config = self.config
        if self.per_size and self._last and 0 < self._held < config.hold:
            self._held += 1  # a window is kept `hold` steps, explorations too: its first step under-reads it
            self.explored[self.segment] += rows_held * self._exploring
            return self._last
        self._held, self._exploring = 1, False
        refresh = config.refresh_every > 0 and self.choices >= self.refresh_at
        if refresh:  # (what it shows is read by estimates again, in a segment settled on plain steps too: `resume`)
            self.refreshes, self._plain_run = self.refreshes + 1, 0 if config.resume else self._plain_run
            self.refresh_at += config.refresh_every * 2 ** self.refreshes
        if refresh and self._last is not None and self.options[self._last].is_chain:
            return self.explore_option(chains_only=True)
        if self.explored[self.segment] < config.warmup or refresh:
            self.explored[self.segment] += rows_held
            self._exploring = True
            return self.explore_option()
        if self._plain_run >= config.settle_after:
            return 0  # the segment settled on plain steps
        best = self.chosen_by(rows_held, tail, self.segment)
        if best != 0 and config.timing and len(self.costs.steps.get(0, ())) < config.plain_probe:
            return 0  # a plain step measured, so drafting is compared with what a plain step really costs
        self._estimated[0] += 1
        self._estimated[1] += int(best != 0)
        if self.gate.retrying and best != 0:  # the probe found drafting pays: the later segments explore again
            self.explored[1:], self.gate.retrying = [min(n, config.warmup - 1) for n in self.explored[1:]], False
        self._plain_run = self._plain_run + 1 if best == 0 else 0
        if self._plain_run == config.settle_after:
            self._settled = all(self.explored[s] >= config.warmup and self.chosen_by(rows_held, tail, s) == 0
                                for s in range(self.segment + 1, config.segments))
        return best

    def chosen_by(self, rows_held: int, tail: list, segment: int) -> int:
        """The option of most expected tokens per second under `segment`'s model (plain steps win ties)."""
        speed = self.speeds(rows_held, tail, segment)  # [S]
        best = max(range(len(speed)), key=speed.__getitem__)  # (the first of equals)
        return best if speed[best] > speed[0] else 0

    def speeds(self, rows_held: int = 1, tail: list | None = None, segment: int | None = None) -> list[float]:
        """[S] each option's expected tokens per second (per row; at batch > 1 with the batch tail, the longest row's
        tokens left over the expected time until every row is done; tail: [the longest row's tokens left, the rows
        not finished]) under the model of `segment` (None: the current one)."""
        mean, var = self.by_segment[self.segment if segment is None else segment].moments()  # [S], [S]
        seconds = [max(s, 1e-12) for s in self.costs.seconds()]  # [S]
        if self.config.batch_tail and rows_held > 1 and tail is not None:
            longest, rows = tail
            if rows > 1 and longest > 0:
                steps = batch_steps_of(longest, rows, mean, var).tolist()  # [S]
                return [longest / (s * n) for s, n in zip(seconds, steps)]
        return [m / s for m, s in zip(mean, seconds)]

    def explore_option(self, chains_only: bool = False) -> int:
        """Of the drafting options (or chains only) costing at most `explore_cost` plain steps (else the cheapest),
        the one that shows the most trees, then the deepest, then the cheapest."""
        seconds = self.costs.seconds()
        drafting = [i for i in range(1, len(self.options)) if self.options[i].is_chain or not chains_only]
        affordable = ([i for i in drafting if seconds[i] <= self.config.explore_cost * seconds[0]]
                      or [min(drafting, key=lambda i: seconds[i])])
        trees = [o for o in self.options if o.top_k > 1]
        return max(affordable, key=lambda i: (sum(self.options[i].contains(t) for t in trees),
                                              self.options[i].depth, -seconds[i]))

    # --------------------------------------------------------------------------------------------- costs
    def _price_rows(self, rows_held: int) -> None:
        """Time the options on the live call at its first choice (or read their cached table); the step across a
        change of the rows held (a drop of finished rows) is not timed."""
        if self.costs.table is None and self._live is not None:
            target, drafter, state, rule = self._live
            self.costs.table = cached_option_seconds(target, drafter, state, rule, self.options, self.keys,
                                                     self.config.timing_repeats, self.full_key)
            self._chosen_at = None  # (the timing is not the step's)
        if rows_held != self._rows_held:
            self._rows_held, self._chosen_at = rows_held, None

    def _time_last_step(self) -> None:
        """Note the seconds of the step chosen last (from that choice to this one; the loop syncs in between),
        unless it was the call's first (it follows the prefill: slower than its like) or torch.compile compiled
        during it."""
        now, compiled = time.perf_counter(), compilations()
        if (self.config.timing and self._chosen_at is not None and compiled == self._compiled_at
                and self._call_choices > 1):
            self.costs.note(self._last, now - self._chosen_at)
        self._chosen_at, self._compiled_at = now, compiled

    def describe(self) -> str:
        """One line: each option chosen so far, its count, seconds and expected tokens in each segment."""
        means = [model.moments()[0] for model in self.by_segment]  # [segments][S]
        seconds = self.costs.seconds()
        parts = [f"{name} x{count} ({1e3 * seconds[i]:.2f} ms, {'/'.join(f'{m[i]:.2f}' for m in means)} tok)"
                 for i, name in enumerate(self.names) if (count := self.chosen.get(name))]
        return ", ".join(parts) + f"; calls {self.gate.calls}"

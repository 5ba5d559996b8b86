"""How much to draft each step: the loop's draft budget (docs/architecture.md; facts: ../shared/reference/budgets.md).

Speculation pays only when the tokens it saves cost more than the drafting and the wider verify it adds, and that
depends on the device, the batch and the acceptance seen so far. `AutoBudget` picks, before every draft, the draft
size k (chain drafts or Jacobi window drafts; 0 = a plain one-token step) that maximises expected tokens per second:

    E[tokens | k] = 1 + sum_{i=1..k} prod_{j<=i} a_j        a_j = P(draft j accepted | drafts 1..j-1 accepted)
    seconds(k)    = draft_seconds(B, k) + T_step(B, k + 1)        T_step: one target step of k + 1 tokens per row
                                                                  (verify forward + acceptance), measured (mmspec.cost)
    k*            = argmax_k E[tokens | k] / seconds(k)           k = 0 (no drafts) is always a candidate

a_j is estimated from the verdicts of earlier steps (all rows pooled), shrunk towards the pooled rate of every
position (a Beta prior of strength `prior_strength`), and positions never reached yet take the rate of the deepest
one reached. Because a drafter's acceptance can depend on the size itself (a Jacobi window's tail converges only
in a long window), E[tokens | k] blends that position model with the mean tokens actually emitted per row at size
k; drafters that say so (`budget_options`: Jacobi) are valued by that mean alone once a size has run, and keep a
choice for a few steps. seconds(k) starts from the measured tables and becomes each size's own measured step time
once it has run (the drafter's bookkeeping and the machine's load included), until it has not run for STALE_AFTER
choices (then its table's again, read like the sizes measured since: `fresh_seen`, `table_reading`). The first
`warmup` steps draft the largest size that costs at most `explore_cost` plain steps (the method's configured size
where drafting is cheap), so the rates are learnt without paying for a size this device cannot afford; after that the
choice is the best estimate (no random exploration), with the warm-up size again at refresh steps.

At batch > 1 a call lasts as long as its slowest row, and drafting makes rows diverge (plain steps keep them
together): with the tokens left known (`note_rows_left`, which the loop calls before each choice), sizes are
compared by the expected time until every active row is done, `seconds(k) * batch_steps(r, n, mean_k, var_k, s)`
(r tokens left in the longest row, n active rows, the mean and variance of the tokens a row emits per step at k, s
how much the rows' own acceptance rates differ, `row_spread`), instead of by a row's tokens per second. At batch 1
the two orderings are the same. Whole calls go through a call gate (`drafts_this_call`, `end_call`): calls whose
drafting lost, or that the estimates say would lose (the drafter's begin included), run without the drafter.

Why it stays lossless: k is chosen from past verdicts and measured costs only, before any token of this step is
drafted; a drafted token is never dropped because of its own value, and the verifier's randomness is fresh. The
draft length is then a stopping time of the draft-side process, which changes the speed, not the law (SpecDec++,
DISCO; reference budgets.md; tested with a distribution test). With measured step times (`timing`, as the
pipelines build it) the choices follow the machine, so a seeded sampled call repeats bit for bit only with
`budget="fixed"`; its law is the target's either way.

    budget = AutoBudget(sizes=range(0, 17), verify_seconds=lambda b, n: table.seconds_at(b, n))
    k = budget.choose(batch=4); ...; budget.observe(result, active)
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from mmspec.compile import compilations
from mmspec.errors import check
from mmspec.phases import synchronize
from mmspec.verify import VerifyResult

log = logging.getLogger(__name__)  # DEBUG: the call gate's verdict on every call (`end_call`)

# (batch, drafts k) -> seconds the drafter spends producing k drafts (0 for model-free drafters such as Jacobi)
DraftSeconds = Callable[[int, int], float]
# (batch, tokens per row) -> seconds of one target step (verify forward, its distributions, the acceptance rule)
VerifySeconds = Callable[[int, int], float]


CALL_BACKOFF = 4  # calls run as vanilla after a call whose drafting lost to plain steps (doubled after each loss)
RETRY_SHARE = 0.02  # and at least so many that the last drafted call's time over vanilla's is this share of theirs
CALL_DECAY = 0.9  # weight of earlier drafted calls in that comparison, per call
UNJUDGED_CALLS = 1  # a budget's first drafted calls are not judged: they pay one-time costs (see `end_call`)
REFERENCE_EVERY = 32  # a call without the drafter measures vanilla's step again after this many drafted calls,
REFERENCE_MARGIN = 1.25  # while the drafted calls won by less than this (a clear win survives a drift of the load)
REFERENCE_SKIP_MARGIN = 1.5  # no reference call while drafted calls beat a lower bound of vanilla's step by this
CONFIRM_BELOW = 3  # a loss judged against fewer calls without the drafter than this is confirmed by one more first
CALL_SPREAD = 0.1  # a drafted call's speed over vanilla's varies so much from call to call, before 3 were judged
STEP_SAMPLES = 9  # a size's step seconds: the median of its last this many measured steps
STALE_AFTER = 64  # choices after a size's last measured step, its measured seconds give way to its scaled table's
PLAIN_PROBE_EVERY = 8  # until STEP_SAMPLES plain steps are measured, every this many choices is a plain step
PROBE_SAMPLES = 3  # drafting read from fewer measured steps (at the rows held) is tried again: `_drafting_probe`
LINE_MIN_SIZES = 3  # drafting sizes measured before an unmeasured one is priced by their line (`table_reading`)
LINE_MIN_SLOPE = 0.5  # .. whose slope is at least this (a step does not cost less than half its table's)
LOAD_SLOW = 1.2  # a drafted call whose timed steps took this much longer than the same sizes' usual is not judged
LOAD_MIN_STEPS = 3  # .. read from this many of its steps (each against its size's median of 3 or more before it)


def call_drafts(budget) -> bool:
    """The loop's side of the call gate, before a call drafts anything: False runs the whole call as vanilla (a
    budget's `drafts_this_call`); no budget, or one without a gate, always drafts."""
    return budget is None or not hasattr(budget, "drafts_this_call") or budget.drafts_this_call()


def drafts_nothing(drafter) -> bool:
    """Whether the drafter can only take plain steps (its `draft_sizes` are 0 alone: vanilla's `NoDrafter`): no
    budget steers it, and its calls keep no room for drafts."""
    sizes = getattr(drafter, "draft_sizes", None)
    return sizes is not None and max(sizes) == 0


def begin_call(budget, drafter, inputs: Any, state: Any, device: torch.device) -> float:
    """The loop's side of the drafter's begin (its prompt pass) in a drafted call: runs it and returns its seconds,
    synced for a budget with a call gate (`end_call` hears them; the first step would sync there anyway). The
    budget's first drafted call (`wants_warm_begin`) runs it twice and times the second: the first run of the
    drafter's kernels and shapes carries one-time costs (SpecVLM's first drafted call on an H200 ran 0.41x of
    vanilla's step, the next 1.71x; runs/gpu-s26b), and the time goes into every later call's prediction
    (`MeasuredSteps._estimates_plain`). A begin starts the drafter's state afresh, so the second run replaces the
    first."""
    gated = hasattr(budget, "end_call")
    if gated and getattr(budget, "wants_warm_begin", lambda: False)():
        drafter.begin(inputs, state)
        synchronize(device)
    start = time.perf_counter()
    drafter.begin(inputs, state)
    if gated:
        synchronize(device)
    return time.perf_counter() - start


def choose_size(budget, batch: int, plain_for_good: bool,
                tokens_left: Callable[[], torch.Tensor]) -> tuple[Any, bool]:
    """The loop's side of a budget before each step: (the size it chose: None without a budget, 0 a plain step;
    whether the call runs plain steps from now on). A call that is plain for good does not ask the budget; at batch
    > 1 the budget first hears each row's tokens left (`note_rows_left`; `tokens_left()` [B] is made only then);
    after a plain choice a budget that has `settled()` is not asked again in this call."""
    if budget is None or plain_for_good:
        return (None if budget is None else 0), plain_for_good
    if batch > 1 and hasattr(budget, "note_rows_left"):
        budget.note_rows_left(tokens_left())  # the batch tail
    size = budget.choose(batch)
    return size, size == 0 and hasattr(budget, "settled") and budget.settled()


def report_call(budget, stats, batch: int, seconds: float, plain_steps: int, drafted: bool,
                compiled_before: int, begin_seconds: float = 0.0, held_rows: list[int] | None = None) -> None:
    """The loop's side of the call gate after a call, for a budget that has one (`end_call`): `seconds` the call took
    from the drafter's start (or, without the drafter, the first step), `plain_steps` the steps vanilla takes for it,
    `begin_seconds` the drafter's begin (its prompt pass) and `held_rows` (a call that drops finished rows: the rows
    vanilla would hold at each of its steps) go to `end_call`, unless torch.compile compiled a forward during the
    call (`compiled_before`: `compilations()` at its start), whose time is the compiler's; `stats` counts a call
    without the drafter."""
    if compilations() == compiled_before:
        held = {} if held_rows is None else {"held_rows": held_rows}
        budget.end_call(batch, seconds, plain_steps, drafted, begin_seconds=begin_seconds, **held)
    stats.add_extra("calls_without_drafter", int(not drafted))


class MeasuredSteps:
    """What the chain and tree budgets share: each size's measured step seconds (`seen`, the median of its last
    steps, each from one choice to the next: drafting, verify, acceptance and bookkeeping, as the loop ran them),
    settling on plain steps for the rest of a call (`settled`) and running whole calls as vanilla after a call whose
    drafting lost (`drafts_this_call`, `end_call`). Subclasses set `_last` (the size chosen last) and call
    `_init_steps`, `_time_last_step` at every choice, `_note_plain_margin` when they choose by estimate and
    `_new_call` at a call's start."""

    plain_size: object = 0  # the key of a plain step in `seen`

    def _init_steps(self, timing: bool, settle_after: int, settle_margin: float) -> None:
        self.timing, self.settle_after, self.settle_margin = timing, settle_after, settle_margin
        self.seen: dict = {}  # size -> its steps' measured seconds (the median of the last STEP_SAMPLES)
        self._samples: dict = {}  # size -> deque of its last STEP_SAMPLES measured seconds
        self._compiled_at = 0  # `compilations()` at the last choice
        self.skip_calls, self.backoff = 0, CALL_BACKOFF  # calls left to run as vanilla; the next loss's backoff
        self.call_seconds = self.call_steps = 0.0  # drafted calls' seconds and the plain steps they replaced, decayed
        self.call_weights = (0.0, 0.0)  # the sum of those calls' weights and of their squares (`loss_margin`)
        self.calls = {"drafted": 0, "without_drafter": 0, "lost": 0, "reference": 0, "unjudged": 0,
                      "predicted_plain": 0, "loaded": 0}
        self._reference: deque = deque(maxlen=STEP_SAMPLES)  # a plain step's seconds in calls without the drafter
        self._begins: deque = deque(maxlen=STEP_SAMPLES)  # the drafter's begin seconds in drafted calls
        self._drafted_since_reference = 0
        self._confirming = False  # the next call measures vanilla's step again before a loss is acted on
        self._drafted_total = (0.0, 0)  # all drafted calls' seconds and the plain steps they replaced
        self._last_drafted: deque = deque(maxlen=2)  # the last two drafted calls' seconds and plain steps replaced
        self._batch = 1  # the batch size of the last call (a budget serves one)
        self._chosen_at: float | None = None
        self._plain_run = 0  # choices in a row (this call) where a plain step beat every size by the margin
        self._since_probe = 0  # choices since the last plain step kept for its timing (`_plain_probe`)
        self._since_draft_probe = 0  # plain choices by estimate since the last drafting probe (`_drafting_probe`)
        self._tail: tuple[int, int] | None = None  # (tokens left in the longest row, active rows), if noted
        self._estimated = (0, 0)  # this call's choices by estimate, and how many of them drafted
        self._call_tokens = 0  # the plain steps of the last call (its longest row's tokens after the first)
        self._predicted: float | None = None  # seconds the running drafted call was predicted to take
        self._prediction: tuple[float, float] | None = None  # (begin seconds, best drafting speed) it came from
        self._overruns: deque = deque(maxlen=STEP_SAMPLES)  # drafted calls' seconds over their predicted seconds
        self._judged: deque = deque(maxlen=STEP_SAMPLES)  # the last judged drafted calls' (seconds, plain steps)
        self._explore_next = False  # the next drafted call re-explores (`_exploring`): it follows a backoff
        self._explore_call = False  # this call re-explores
        self._call_choices = 0  # choices made in this call
        self._call_step_times: list[tuple[float, float]] = []  # this call's timed steps: (seconds, size's median)
        self._choices = 0  # choices made over the budget's life (the warm-up's, refreshes' and staleness's clock)
        self._sampled_at: dict = {}  # size -> `_choices` when its seconds were last measured
        # a call's per-row acceptance at batch > 1 (`note_row_accepts`): [2, 2, B] (odd / even drafting steps) x
        # (the row's accepted drafts, the batch mean's over the same steps); the spread it gave, pooled over calls
        self._row_sums: torch.Tensor | None = None
        self._retired_sums: list[torch.Tensor] = []  # [2, 2, b] sums of rows the loop dropped (`select_rows`)
        self._call_dropped = self._last_call_dropped = False  # the loop dropped rows in this / the last drafted call
        self._row_half = 0
        self._spread_pooled = (0.0, 0.0)  # (sum of rows x each call's covariance, rows), each earlier call x CALL_DECAY

    def _time_last_step(self) -> None:
        """Time the previous step (from its choice to this one: the loop syncs between). A step during which
        torch.compile compiled a forward (a shape its graphs had not seen) is not counted: seconds of compilation
        are not the step's cost (with `compile=` and budget "auto", LlamaGen's Jacobi windows once read so and ran
        plain steps at 0.94-1.07x where the fixed window gave 1.78x, runs/bench-llamagen-s23-compile). Nor is a
        call's first step: it runs just after the prefill, and every call's first step is slower than its later
        ones of the same shape (the world LLaVA's target verify at batch 32: 12-16 ms where the next ones took 8, in
        the same operations; one such chain step read 23.4 ms where its like took 13.7-14, and the level's every
        drafting shape then read slower than a plain step for the rest of the call; its cost is the call's, which
        the call gate weighs)."""
        now, compiled = time.perf_counter(), compilations()
        first = self._call_choices == 1  # (the step being timed was this call's first choice)
        if self._chosen_at is not None and self.timing and compiled == self._compiled_at and not first:
            self._note_seconds(self._last, now - self._chosen_at)
        self._chosen_at, self._compiled_at = now, compiled

    def _note_seconds(self, size, took: float) -> None:
        """A step of `size` took `took` seconds. Its estimate is the median of the last STEP_SAMPLES: a step that
        the machine paused (another process, a page fault) reads 2-5x its usual time, which a running mean would
        carry for several steps, and more for short steps than long ones (so plain steps read slow and drafting
        looks better than it is); a median ignores such outliers and still follows a lasting change of load."""
        samples = self._samples.setdefault(size, deque(maxlen=STEP_SAMPLES))
        if len(samples) >= 3:  # this step against its size's usual (`call_load`)
            self._call_step_times.append((took, self.seen[size]))
        samples.append(took)
        self.seen[size] = statistics.median(samples)
        self._sampled_at[size] = self._choices

    def fresh_seen(self) -> dict:
        """`seen` without the sizes not measured in the last STALE_AFTER choices: a size left after steps timed
        during a passing load reads that load until it runs again, and so it would not run again (GSD's window of
        15 read 27.3 ms from a slow spell and lost to the window of 7 for the rest of a run, 1.63x where SJD's
        window of 15 ran at 1.73x, runs/bench-llamagen-s28c). A stale size takes its table time scaled like the
        fresh ones', so it is chosen, and measured, again where that says it should."""
        return {k: v for k, v in self.seen.items() if self._choices - self._sampled_at.get(k, 0) <= STALE_AFTER}

    def _count_choice(self) -> None:
        """A choice was made (this call's and the budget's life count)."""
        self._call_choices += 1
        self._choices += 1

    def _plain_probe(self) -> bool:
        """Whether this choice is a plain step kept for its timing: every PLAIN_PROBE_EVERY-th choice until
        STEP_SAMPLES plain steps (or vanilla calls) have been measured. A budget that drafts from its first step
        would otherwise weigh drafting against a plain step's table time, timed once under another load (or
        another version of the code) and never corrected; a plain step costs at most one step's drafting."""
        if not self.timing or len(self._samples.get(self.plain_size, ())) >= STEP_SAMPLES:
            return False
        self._since_probe += 1
        if self._since_probe < PLAIN_PROBE_EVERY:
            return False
        self._since_probe = 0
        return True

    def _drafting_probe(self) -> bool:
        """Whether a choice the estimates made plain drafts the best drafting size by estimate instead, for its
        timing: every PLAIN_PROBE_EVERY-th such choice while the drafting sizes have fewer than PROBE_SAMPLES measured
        steps in all (at the rows held, for a tree budget). A size's seconds are the median of its measured steps,
        the sizes not run are read like those that ran (`table_reading`), and one step a passing load slowed is then
        every drafting size's reading; a size read slow is not chosen, so not measured again, until STALE_AFTER
        choices: the rest of a call (and its settling) would rest on it. The probe delays settling (a drafted choice
        is not a plain one); it costs at most one drafted step in PLAIN_PROBE_EVERY, PROBE_SAMPLES times in all."""
        if not self.timing or sum(len(steps) for size, steps in self._samples.items()
                                  if size != self.plain_size) >= PROBE_SAMPLES:
            return False
        self._since_draft_probe += 1
        if self._since_draft_probe < PLAIN_PROBE_EVERY:
            return False
        self._since_draft_probe, self._plain_run = 0, 0
        return True

    def plain_seconds(self, batch: int) -> float:
        """A plain step's seconds at this batch size: as measured once one ran (a plain step, a vanilla call), else
        the timed table's own (not scaled by how drafting steps compare with theirs)."""
        return self.seen.get(self.plain_size) or self.plain_table_seconds(batch)

    def plain_table_seconds(self, batch: int) -> float:
        raise NotImplementedError

    def gate_plain_seconds(self, batch: int) -> float:
        """The plain step the call gate weighs drafted calls against: the median of the last calls without the drafter
        (their seconds over their plain steps, measured as a drafted call is: from the first step to the end), the
        cost a drafted call would have had as vanilla. Not the timed table's plain step, which leaves out the loop's
        own per-step work, nor plain steps timed inside drafted calls, which carry the budget's and the drafter's
        per-step work: on an H200 LlamaGen's tree budget at batch 1 read 11.4-12.6 ms for its in-call plain steps where
        vanilla calls took 6.4-7.4 ms a step, so its drafted calls, at 0.7x of vanilla, read as wins; the world
        LLaVA's chain budgets at batch 8 judged against 3.7-3.9 ms where vanilla calls took 3.8-6.3 (runs/gpu-s26b).
        Before any call without the drafter: `plain_lower_bound` (drafted calls are judged then only while they
        clearly win, `_clear_win`)."""
        vanilla = self.vanilla_step_seconds()
        return self.plain_lower_bound() if vanilla is None else vanilla

    def vanilla_step_seconds(self) -> float | None:
        """Vanilla's own step as measured: the median of the last calls without the drafter; None before one ran."""
        return statistics.median(self._reference) if self._reference else None

    def plain_choice_seconds(self, seconds: float) -> float:
        """What choosing a plain step costs, from a plain step's estimate `seconds` (in-call plain steps, else the
        table's): at most vanilla's own step (the median of calls without the drafter), once one ran. Plain choices
        settle a call (`settled`), after which the loop asks neither the budget nor the drafter and the steps cost
        vanilla's; a plain step inside a drafted call also carries the budget's and the drafter's per-step work
        (LANTERN's tree budget at batch 8 on an H200: 12.7 ms in-call against 9.0 ms in calls without the drafter,
        where a chain of 6 at 20.6 ms for 1.95 tokens read as a win and lost the call; runs/gpu-s27c)."""
        vanilla = self.vanilla_step_seconds()
        return seconds if vanilla is None else min(seconds, vanilla)

    # ------------------------------------------------------------------------------------------ whole calls
    def drafts_this_call(self) -> bool:
        """Asked by the loop before the drafter's `begin`: False runs the whole call as vanilla (no drafter prefill, no
        budget). After a call whose drafting, the drafter's begin included, took longer than the plain steps it replaced
        (`end_call`), the next `backoff` calls run so (more after a call that lost by far: `retry_calls`), then one
        drafts again; the backoff doubles after each loss and resets after a win. A reference call, also without the
        drafter, measures vanilla's own step for the gate (`gate_plain_seconds`): the call after the first drafted one
        unless the drafted calls clearly win (`_clear_win`), and again after REFERENCE_EVERY drafted calls while they
        won by less than REFERENCE_MARGIN (the load drifts, and only a close verdict can turn on it: SJD at batch 1 here
        wins by 1.6-1.8x, and one vanilla call after every 32 drafted calls at 1.7x would give up about 2% of that, by
        arithmetic: 33 calls in 32 / 1.7 + 1 call times). Once vanilla's step is measured, a call whose estimates say no
        drafting size beats a plain step (`_estimates_plain`) runs without the drafter too, as after a loss (backoff
        included); the drafted call after a backoff re-explores (`_exploring`). Only with measured times (`timing`)."""
        self._predicted = self._prediction = None
        if self.timing and self.skip_calls > 0:
            self.skip_calls -= 1
            self.calls["without_drafter"] += 1
            return False
        if self.timing and (self._confirming or (self.calls["drafted"] and self._reference_due())):
            self.calls["without_drafter"] += 1
            self.calls["reference"] += 1
            return False
        if self.timing and not self._explore_next and self._reference and self._estimates_plain():
            self.calls["without_drafter"] += 1
            self.calls["predicted_plain"] += 1
            self._back_off(running_one=True)
            log.debug("batch %d: by the estimates a call like the last runs plain steps: it and the next %d calls "
                      "without the drafter", self._batch, self.skip_calls)
            return False
        self._explore_call, self._explore_next = self._explore_next, False
        self.calls["drafted"] += 1
        return True

    def _back_off(self, running_one: bool = False) -> None:
        """The next `backoff` calls run without the drafter (the backoff doubles), and the drafted call after them
        re-explores (`_exploring`), or more calls where that retry would cost more than RETRY_SHARE of them
        (`retry_calls`). running_one: the call running now, without the drafter, is the first of them."""
        self.skip_calls = max(self.backoff, self.retry_calls()) - int(running_one)
        self.backoff = 2 * self.backoff
        self._explore_next = True

    def retry_calls(self) -> int:
        """Calls without the drafter over which a retry like the last drafted calls costs at most RETRY_SHARE of
        their time: the smaller loss of the last two drafted calls (each one's seconds over vanilla's for the same
        steps, vanilla's step as calls without the drafter measured it), divided by RETRY_SHARE of a vanilla call's.
        A retry drafts the exploration size for `warmup` choices and pays the drafter's begin, which costs about
        what the last drafted calls lost where drafting loses by far (LlamaGen's EAGLE at batch 8 on this CPU:
        drafted calls at 0.76-0.81x of vanilla's, their chains costing 2.8x a plain step for 1.28 tokens), and
        little where it lost by a little, so a close loss keeps the doubling backoff and is retried soon. Two calls,
        not one: a call that a passing load slowed reads as a loss by far (the world LLaVA at batch 8 on this CPU: a
        drafted call at 0.66x of vanilla, its chains 35% slower than in the call before, which had won 1.04x; 21
        calls ran without the drafter where the fixed chain of 8 gave 1.15x; runs/bench-vlm-s34c), and a wait that
        long should rest on two. 0 before vanilla's step or a drafted call is measured."""
        vanilla = self.vanilla_step_seconds()
        if vanilla is None or not self._last_drafted:
            return 0
        lost = min(seconds / (steps * vanilla) for seconds, steps in self._last_drafted) - 1.0  # a share of vanilla's
        return math.ceil(lost / RETRY_SHARE - 1e-9) if lost > 0 else 0  # (no rounding up of an exact share)

    def _estimates_plain(self) -> bool:
        """Whether, at the current estimates, plain steps beat every drafting size over a call like the last one
        (its longest row's tokens, every row of the batch active: the batch tail), the drafter's begin included
        (`begin_seconds`): a call drafting at the best size takes begin + tokens / its speed, a vanilla call tokens
        / a plain step's speed. Such a call would pay the drafter's begin for too little: on this CPU the world
        LLaVA's drafted calls at batch 32 whose choices were all plain steps took 0.67-0.79x of vanilla's time, the
        drafter's prompt pass alone 16% of it, and where the estimates favoured chains of 2-4 by 6-9% a step, the
        begin still made the call lose (runs/bench-vlm-s28a). `drafts_this_call` then runs it, and the backoff's
        calls, without the drafter; the call after them re-explores, so the estimates are measured again rather
        than trusted for ever."""
        if self._call_tokens <= 0 or self._last_call_dropped:  # (its steps ran at several row counts: not
            return False  # predicted from one count's estimates; the gate judges such calls by their time alone)
        plain, best_drafting = self._call_speeds(self._call_tokens, self._batch)
        if best_drafting <= plain:
            return True
        if plain <= 0:
            return False
        self._prediction = (self.begin_seconds(), best_drafting)
        self._predicted = (self._prediction[0] + self._call_tokens / best_drafting) * self.overrun()  # (logged)
        return self._call_tokens / plain * (1.0 + self.prediction_error()) <= self._predicted

    def _call_speeds(self, tokens: int, batch: int) -> tuple[float, float]:
        """(plain, best drafting) speeds by the current estimates for a call whose longest row emits `tokens` with
        every row of `batch` active (the batch tail)."""
        saved, self._tail = self._tail, (tokens, batch)
        try:
            return self._plain_and_best_speeds()
        finally:
            self._tail = saved

    def prediction_error(self) -> float:
        """How far call predictions have erred: the standard deviation of the last drafted calls' overruns (their
        seconds over what the estimates say they took, `overrun`), CALL_SPREAD before 3 were measured. A call is
        predicted plain only where its prediction exceeds vanilla's time by more than this: where the overruns are
        steady, as on the world LLaVA at batch 32 on this CPU (drafted calls 1.15-1.3x their predictions), the
        corrected prediction is trusted; where they scatter with the calls' content, as at batch 8 (0.60-1.29x,
        while the calls won 1.16x on average), one call's overrun would run the next calls without the drafter again
        and again (auto at 0.96-1.05x where the fixed chain of 8 gave 1.08-1.16x; runs/bench-vlm-s34b, s34i)."""
        return statistics.stdev(self._overruns) if len(self._overruns) >= 3 else CALL_SPREAD

    def overrun(self) -> float:
        """How much longer drafted calls took than their estimates say: the median of the last predicted ones'
        seconds over their own begin plus their steps at the best size's speed as the estimates read at the call's
        end, its steps measured (so a load that came or went during a call shows once, in the step times, not again
        here: LlamaGen's SJD on this CPU ran one call at 0.92x under a passing load, 1.74x its prediction, and with
        the slow steps counted twice the next four calls ran without the drafter; runs/bench-llamagen-s35o), which
        `_estimates_plain` multiplies its prediction by; 1 before a call was predicted. The estimates leave out
        what a call pays beyond its best size's steady state (its first choices, sizes still explored, the batch
        tail's last steps): the world LLaVA's drafted calls at batch 8 on this CPU took 1.01-1.41x their predictions,
        and calls predicted at 0.71-1.00x of vanilla's time ran at 0.73-1.08x (runs/bench-vlm-s33a). A retry that
        wins (`_exploring` calls, which are not predicted) clears them: the estimates are trusted afresh, so calls
        that overran once are not kept plain for good."""
        return statistics.median(self._overruns) if self._overruns else 1.0

    def begin_seconds(self) -> float:
        """The drafter's begin (its prompt pass) as measured: the median over the last drafted calls; 0 before one
        ran. The first drafted call's is its second, warm run (`begin_call`)."""
        return statistics.median(self._begins) if self._begins else 0.0

    def wants_warm_begin(self) -> bool:
        """Whether the loop runs the drafter's begin twice and times the second (`begin_call`): in the first drafted
        call (no begin measured yet), with measured times."""
        return self.timing and not self._begins

    def _plain_and_best_speeds(self) -> tuple[float, float]:
        """(a plain step's expected speed, the best drafting size's) at the current estimates (`speeds`)."""
        raise NotImplementedError

    def _exploring(self) -> bool:
        """Whether this choice drafts the exploration size because the call re-explores after a backoff: its
        choices warmup .. 2 x warmup - 1 (past the call's first tokens, which an image's first steps make the
        hardest to draft: an H200's EAGLE tree read 1.79 tokens a step in a warm-up at an image's start where its
        steps average 3.60, and its calls then stayed plain; runs/gpu-s27d)."""
        return self._exploration_ahead() and self._call_choices >= self.warmup

    def _exploration_ahead(self) -> bool:
        """Whether this call re-explores and its exploring choices are not all made yet (it does not settle)."""
        return self._explore_call and self._call_choices < 2 * self.warmup

    def _reference_due(self) -> bool:
        """Whether the next call is a reference call: before any, unless drafting clearly wins (`_clear_win`); after
        one, when it is stale (`_reference_stale`)."""
        return self._reference_stale() if self._reference else not self._clear_win()

    def _clear_win(self) -> bool:
        """Before any call without the drafter: whether the drafted calls so far, the unjudged ones included, took
        less than the plain steps they replaced at `plain_lower_bound` over REFERENCE_SKIP_MARGIN. Then no reference
        call is needed yet: a call without the drafter would only confirm the win, and in a short job it is a call at
        vanilla's speed (MAR's CSpD at batch 32, 1.9x of vanilla's step, ran one of its three bench calls so: 87% of
        its fixed window, runs/bench-mar-s26b)."""
        seconds, steps, plain = *self._drafted_total, self.plain_lower_bound()
        return seconds > 0 and math.isfinite(plain) and steps * plain > REFERENCE_SKIP_MARGIN * seconds

    def plain_lower_bound(self) -> float:
        """At most vanilla's step, before a call without the drafter has measured it: the lowest of the timed
        table's plain step (a target step alone, without the loop's per-step work, but timed once, maybe under
        another load), the budget's own plain estimate (`plain_estimate_seconds`: the plain steps timed inside
        drafted calls, which carry the budget's and the drafter's per-step work, else the table's scaled by how the
        sizes that ran compare with theirs, which follows the load: LlamaGen's GSD on this CPU read a table plain
        step of 11.6 ms where vanilla's calls took 10.6, its window steps 0.83x their table's;
        runs/bench-llamagen-s27d)."""
        return min(self.plain_table_seconds(self._batch), self.plain_estimate_seconds(self._batch))

    def plain_estimate_seconds(self, batch: int) -> float:
        raise NotImplementedError

    def _reference_stale(self) -> bool:
        """Whether vanilla's step is measured again before the next drafted call (see `drafts_this_call`)."""
        if self._drafted_since_reference < REFERENCE_EVERY or self.call_seconds <= 0:
            return False
        return self.call_steps * self.vanilla_step_seconds() < REFERENCE_MARGIN * self.call_seconds

    def end_call(self, batch: int, seconds: float, plain_steps: int, drafted: bool, begin_seconds: float = 0.0,
                 held_rows: list[int] | None = None) -> None:
        """How a call went: `seconds` from the drafter's begin (or, without the drafter, the first step) to the end,
        `plain_steps` the steps vanilla takes for it (the longest row's tokens after the first), `begin_seconds` the
        drafter's begin (`begin_seconds()`), `held_rows` the rows vanilla holds at each of those steps where the loop
        drops finished rows (the call is then measured in full-batch steps, `plain_units`). A call without the drafter
        measures vanilla's step. Drafted calls are pooled (each earlier one weighs CALL_DECAY times as much) and judged
        against vanilla's step (`gate_plain_seconds`): when they took longer than the plain steps they replaced,
        drafting lost (one call's content decides too little: a batch with one unusual answer drafts badly). A loss
        judged against fewer than CONFIRM_BELOW calls without the drafter is confirmed first: the next call runs without
        the drafter (as the backoff's first would) and the pooled calls are judged again against the median with it
        (`_confirm`): one reference call of LlamaGen's GSD at batch 1 read vanilla's step at 5.65 ms where the others
        read 9-12, and a drafted call at 1.6x of the usual step lost against it (runs/bench-llamagen-s29f). The first
        UNJUDGED_CALLS drafted calls are not judged: they pay what later calls do not (the device's first run of the
        drafter's kernels and shapes, the budget's exploration of sizes): SpecVLM's first drafted call on an H200 ran at
        0.41x of vanilla's step and the next at 1.71x, and pooled with the first it lost too, so 12 calls ran as vanilla
        where the fixed budget gave 1.13x (runs/gpu-s26b). A judged call in which the budget chose sizes by estimate and
        none of them drafted lost whatever its time (it paid the drafter's begin and the budget's steps for nothing a
        vanilla call would not have given; on this CPU such calls of EAGLE and LANTERN at batch 8, all plain steps, read
        as 0.95-1.35x wins against a reference call that ran slow, runs/bench-llamagen-s27b). A retry after a backoff is
        judged on its own: pooled with the calls whose loss made the backoff, a retry that won by 5% read as a loss and
        doubled the backoff (the world LLaVA at batch 8 on this CPU, where a lost call is often just a batch of answers
        that draft badly: the fixed chain of 8 ran at 0.88-1.41x call by call). A drafted call whose steps ran
        LOAD_SLOW slower than the same sizes' usual (`call_load`) is not judged either: a load came and went, and its
        time tells of that (on this CPU with two other processes taking a core in bursts, drafted calls of the world
        LLaVA at batch 8 ran at 0.21-0.32x of vanilla with their steps at 1.85-7.17x their usual, and each loss ran the
        next 4-8 calls without the drafter; docs/benchmarks.md, the fourteenth session's "a call's load")."""
        self._close_rows()
        dropped, self._call_dropped = self._call_dropped, False
        if not self.timing or plain_steps <= 0:
            return
        self._batch, self._call_tokens = batch, plain_steps
        if drafted:
            self._last_call_dropped = dropped
        tokens, plain_steps = plain_steps, self.plain_units(plain_steps, held_rows)  # (the gate's unit from here on)
        if not drafted:
            if not dropped:  # (a call that dropped rows averages steps over fewer rows: not a plain step's seconds)
                self._note_seconds(self.plain_size, seconds / plain_steps)
            self._reference.append(seconds / plain_steps)
            self._drafted_since_reference = 0
            log.debug("batch %d: a call without the drafter, %.2f ms a plain step", batch, 1e3 * seconds / plain_steps)
            if self._confirming:
                self._confirm(batch)
            return
        load = self.call_load()
        if load > LOAD_SLOW:  # its time tells of the load, not of drafting (`call_load`): no verdict, no estimate
            self.calls["loaded"] += 1
            log.debug("batch %d: a drafted call, %.1f ms for %.1f plain steps, its steps at %.2fx their usual (a load "
                      "that came and went): not judged", batch, 1e3 * seconds, plain_steps, load)
            return
        self._drafted_since_reference += 1
        self._begins.append(begin_seconds)
        self._last_drafted.append((seconds, plain_steps))
        # against what the estimates, now holding this call's steps, say it took; not a call that dropped rows: the
        # prediction held every row to the end, and the estimates at its end are those of the rows it held last (the
        # world LLaVA's EAGLE at batch 8 on this CPU: calls within 8% of their predictions read as 1.9-2.5x overruns
        # against one row's speeds, and the next call was predicted plain where drafted calls won 1.0-1.7x)
        if self._prediction is not None and not dropped:
            speed = self._call_speeds(tokens, batch)[1]
            speed = speed if speed > 0 else self._prediction[1]
            self._overruns.append(seconds / (begin_seconds + tokens / speed))
        self._drafted_total = (self._drafted_total[0] + seconds, self._drafted_total[1] + plain_steps)
        if self.calls["unjudged"] < UNJUDGED_CALLS:
            self.calls["unjudged"] += 1
            log.debug("batch %d: a drafted call, %.1f ms for %.1f plain steps: not judged (one-time costs)",
                      batch, 1e3 * seconds, plain_steps)
            self._log_estimates(batch)
            return
        self._judged.append((seconds, plain_steps))
        if self._explore_call:  # a retry is judged afresh: the calls before it decided the backoff it ends
            self.call_seconds = self.call_steps = 0.0
            self.call_weights = (0.0, 0.0)
        self.call_seconds = CALL_DECAY * self.call_seconds + seconds
        self.call_steps = CALL_DECAY * self.call_steps + plain_steps
        weight, weight_sq = self.call_weights
        self.call_weights = (CALL_DECAY * weight + 1.0, CALL_DECAY * CALL_DECAY * weight_sq + 1.0)
        plain = self.gate_plain_seconds(batch)
        chose_plain = self._estimated[0] > 0 and self._estimated[1] == 0
        lost = chose_plain or self._pooled_calls_lost(plain)
        confirm = lost and not chose_plain and len(self._reference) < CONFIRM_BELOW
        if confirm:
            self._confirming = True
        elif lost:
            self._back_off()
            self.calls["lost"] += 1
        else:
            self.backoff = CALL_BACKOFF
            if self._explore_call:  # a retry won: the estimates are trusted afresh (`overrun`)
                self._overruns.clear()
        verdict = "won"
        if confirm:
            verdict = "lost, to be confirmed by a call without the drafter"
        elif lost:
            verdict = (f"lost{' (no size chosen by estimate drafted)' if chose_plain else ''}, the next "
                       f"{self.skip_calls} calls without the drafter")
        predicted = "" if self._predicted is None else f", predicted {1e3 * self._predicted:.1f}"
        log.debug("batch %d: a drafted call, %.1f ms (begin %.1f%s) for %.1f plain steps of %.2f ms (%.2fx; pooled "
                  "%.2fx; steps at %.2fx their usual): %s", batch, 1e3 * seconds, 1e3 * begin_seconds, predicted,
                  plain_steps, 1e3 * plain, plain_steps * plain / seconds, self.call_steps * plain / self.call_seconds,
                  self.call_load(), verdict)
        self._log_estimates(batch)

    def plain_units(self, plain_steps: int, held_rows: list[int] | None) -> float:
        """A call's length in full-batch plain steps: `plain_steps`, or where the loop drops finished rows
        (`held_rows`: the rows vanilla holds at each step) the sum of each step's cost at its rows over a full
        batch's (`rows_cost`; plain_steps while the costs by rows are unknown). A batch of one-word and long answers
        costs vanilla far less a step than one of long answers once its short rows are gone (the world LLaVA at batch
        8 on this CPU: 1.28-2.43 ms a plain step call by call), and a drafted call is judged against what vanilla
        would have spent on the same rows."""
        cost = self.rows_cost() if held_rows else None
        if cost is None:
            return float(plain_steps)
        full = cost(self._batch)
        return sum(cost(rows) for rows in held_rows) / full

    def rows_cost(self) -> Callable[[int], float] | None:
        """A plain step's seconds as a function of the rows held, where known (`TreeBudget`: from its levels)."""
        return None

    def _pooled_calls_lost(self, plain: float) -> bool:
        """Whether the pooled drafted calls ran below vanilla's speed (a plain step of `plain` seconds) by more than
        `loss_margin`."""
        return self.call_steps * plain < (1.0 - self.loss_margin()) * self.call_seconds

    def loss_margin(self) -> float:
        """How far below vanilla's speed the pooled drafted calls must run to have lost: the spread of a call's speed
        over vanilla's (the standard deviation over the last judged calls, CALL_SPREAD before 3 were judged) over
        the square root of the pooled calls' effective number (their decayed weights: 1 for one call, ~19 for a long
        run). One call decides little: the world LLaVA's calls at batch 8 on this CPU ran the fixed chain of 8 at
        0.88-1.09x of vanilla on one batch of answers and 1.08-1.41x on the three others (1.04-1.19x over a job), and
        the budget's first judged call, on the hard batch, turned drafting off (docs/benchmarks.md, "The call gate
        weighs calls by their spread"); a loss by far (LlamaGen's EAGLE at batch 8: 0.76-0.81x) is acted on at once,
        a small one once it has held over several calls."""
        weight, weight_sq = self.call_weights
        calls = weight * weight / weight_sq if weight_sq > 0 else 1.0
        vanilla = self.vanilla_step_seconds()
        spread = CALL_SPREAD
        if vanilla is not None and len(self._judged) >= 3:
            spread = statistics.stdev(steps * vanilla / seconds for seconds, steps in self._judged)
        return spread / math.sqrt(calls)

    def _confirm(self, batch: int) -> None:
        """After the call without the drafter that a close loss asked for: the pooled drafted calls judged again
        against vanilla's step with it; a loss backs off (that call was the backoff's first), a win keeps drafting."""
        self._confirming = False
        plain = self.gate_plain_seconds(batch)
        lost = self._pooled_calls_lost(plain)
        if lost:
            self._back_off(running_one=True)
            self.calls["lost"] += 1
        log.debug("batch %d: the loss judged again against %.2f ms a plain step (pooled %.2fx): %s", batch,
                  1e3 * plain, self.call_steps * plain / max(self.call_seconds, 1e-12),
                  f"lost, the next {self.skip_calls} calls without the drafter" if lost else "won")

    def _log_estimates(self, batch: int) -> None:
        """DEBUG: the estimates behind the call's choices (`describe`), after a drafted call's verdict."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch %d: sizes: %s; the rows' spread %.3f", batch, self.describe(batch), self.row_spread())

    def describe(self, batch: int) -> str:
        """The sizes' estimates, one line: how often each was chosen, its seconds (measured, or the table's
        scaled), its expected tokens per row."""
        raise NotImplementedError

    def _note_plain_margin(self, plain: float, best_drafting: float) -> None:
        """One choice by estimate: expected throughput of a plain step and of the best drafting size (chosen when
        faster: ties go to the plain step)."""
        self._plain_run = self._plain_run + 1 if best_drafting < self.settle_margin * plain else 0
        self._estimated = (self._estimated[0] + 1, self._estimated[1] + int(best_drafting > plain))

    def _new_call(self) -> None:
        self._chosen_at, self._plain_run = None, 0  # the time between calls is not a step
        self._tail = None
        self._row_sums, self._row_half = None, 0  # (a call that ended without `end_call` left its rows)
        self._retired_sums = []
        self._estimated = (0, 0)  # this call's choices by estimate, and how many of them drafted
        self._call_choices = 0
        self._call_step_times = []

    def call_load(self) -> float:
        """How slowly this call's steps ran against the same sizes' usual: their seconds over the sum of each one's
        size's median before it (steps of sizes with 3 or more earlier steps), 1 with fewer than LOAD_MIN_STEPS such
        steps. A step's cost does not follow the batch's content (the same shapes at the same rows held), so a call
        whose steps ran slow ran under a load that came and went; a sum, not a median, so a load over part of the
        call shows too."""
        if len(self._call_step_times) < LOAD_MIN_STEPS:
            return 1.0
        took, usual = map(sum, zip(*self._call_step_times))
        return took / max(usual, 1e-12)

    def note_rows_left(self, tokens_left: torch.Tensor) -> None:
        """tokens_left [B]: the tokens each row may still emit (0 for finished rows), before the next choice; read
        once, on the host, as (the longest row's, the active rows)."""
        longest, rows = torch.stack([tokens_left.max(), (tokens_left > 0).sum()]).tolist()
        self._tail = (int(longest), int(rows))

    def batch_tail(self) -> tuple[int, int] | None:
        """(tokens left in the longest row, active rows) when the batch tail is priced (noted, 2+ active rows)."""
        tail = self._tail
        return tail if tail is not None and tail[1] > 1 and tail[0] > 0 else None

    def tail_speeds(self, seconds: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """Each option's speed [S] under the batch tail (`batch_tail()` set): the longest row's tokens left over the
        expected time until every active row is done (`batch_steps_of`, with the rows' measured `row_spread`)."""
        left, rows = self._tail
        spread = self.row_spread()
        steps = batch_steps_of(left, rows, mean, var, spread)  # [S]
        return left / (seconds.double() * steps).clamp_min(1e-12)

    def note_row_accepts(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """A drafting step at batch > 1: accepted [B] drafts per row, active [B]. Each row's accepted drafts and the
        batch mean's over the same steps are summed apart for odd and even drafting steps (on the device; read at
        the call's end, `_close_rows`)."""
        if accepted.numel() < 2:
            return
        on = active.double()  # [B]
        acc = accepted.double() * on  # [B]
        mean = acc.sum() / on.sum().clamp_min(1.0)  # [] the active rows' mean
        if self._row_sums is None or self._row_sums.shape[-1] != acc.shape[0]:
            self._row_sums = torch.zeros(2, 2, acc.shape[0], dtype=torch.float64, device=acc.device)
        self._row_sums[self._row_half] += torch.stack([acc, mean * on])  # [2, B]
        self._row_half ^= 1

    def select_rows(self, rows: torch.Tensor) -> None:
        """The loop dropped the finished rows of this call and keeps rows [B'] (indices into the current B): their
        acceptance sums follow them, and the dropped rows' sums wait for the call's end (`_close_rows`). The step
        across the drop is not timed: its seconds carry the caches' compaction (the world LLaVA's first step at batch
        32 read 23-29 ms where its like took 13-15, with a drop of 15 finished rows after it)."""
        self._call_dropped = True
        self._chosen_at = None
        sums = self._row_sums
        if sums is None:
            return
        kept = torch.zeros(sums.shape[-1], dtype=torch.bool, device=sums.device).index_fill_(0, rows, True)  # [B]
        self._retired_sums.append(sums[..., ~kept])  # [2, 2, B - B']
        self._row_sums = sums.index_select(2, rows)  # [2, 2, B']

    def _close_rows(self) -> None:
        """At a call's end: how much the rows' acceptance differs (`row_spread`). A row's ratio is its accepted
        drafts over the batch mean's on the same steps, once from its odd and once from its even drafting steps;
        the covariance of the two over the rows measures the spread of the rows' own rates (each half's noise is
        independent of the other's, so it drops out). Rows with under 2 expected accepts in a half are left out."""
        sums, self._row_sums, self._row_half = self._row_sums, None, 0
        retired, self._retired_sums = self._retired_sums, []
        if sums is None:
            return
        sums = torch.cat([*retired, sums], dim=2)  # [2, 2, B] every row of the call, dropped ones included
        sums = sums.cpu()
        keep = (sums[:, 1] >= 2.0).all(0)  # [B]
        n = int(keep.sum())
        if n < 4:
            return
        ratios = sums[:, 0, keep] / sums[:, 1, keep]  # [2, n]
        centred = ratios - ratios.mean(1, keepdim=True)
        cov = float((centred[0] * centred[1]).sum()) / (n - 1)
        total, rows = self._spread_pooled
        self._spread_pooled = (CALL_DECAY * total + n * cov, CALL_DECAY * rows + n)

    def row_spread(self) -> float:
        """The standard deviation of a row's acceptance rate relative to its batch's (0.2: a row one deviation slow
        accepts 80% of the drafts an average row does), pooled over the calls seen (each earlier one x CALL_DECAY);
        0 before one was measured. At batch > 1 a call lasts as long as its slowest row, and rows that follow the
        drafter badly stay slow for the whole call: the steps' own spread averages out over a call, this does not
        (the world LLaVA at batch 32: a chain of 3 took 14.7 steps where the pooled rates gave 13.5;
        runs/bench-vlm-s28a)."""
        total, rows = self._spread_pooled
        return math.sqrt(max(total / rows, 0.0)) if rows > 0 else 0.0

    def settled(self) -> bool:
        """Plain steps for the rest of this call: for `settle_after` choices in a row a plain step was expected to
        beat every drafting size by `settle_margin` (then the loop stops asking the budget and the drafter, so the
        call runs at vanilla's cost; the next call asks again)."""
        return self._plain_run >= self.settle_after and not self._exploration_ahead()


class AutoBudget(MeasuredSteps):
    """The expected-throughput draft budget (see the module docstring). sizes: the draft counts the drafter can
    make (0 included or not: it is always added); verify_seconds(B, n): a target step's time with n tokens per row;
    draft_seconds(B, k): the drafter's. `chosen` counts how often each size was picked.

    timing: once a size has run, its steps' own measured seconds (the median of its last steps, from one choice to
    the next: drafting, verify, acceptance and the drafter's bookkeeping) replace the table, and sizes not run yet
    are scaled by how the run ones compare with their table times. per_size: value each size only by the tokens its
    own steps emitted (decayed by `decay` per step of that size), the position model only for sizes not run yet: for
    drafters whose acceptance depends on the size (a Jacobi window's tail converges only in a long window). dwell:
    keep a choice for this many steps (a Jacobi window needs a few steps to converge after a change; with
    `count_once_refilled`, this many counted steps). uncounted_after_change: per-size mode does not count the first
    this many steps after a change (a grown window's new tail is still converging: counting those steps undervalues
    the larger window, which is then not chosen again to be measured right). count_once_refilled: per-size mode
    counts a step only once the rows have emitted, since the change (or the call's start), as many tokens as the
    size: the tokens it emits then entered the window after the change and were refined at this size, as every
    later step's are (a window grown from 3 to 15 on an H200 emitted 1.2-1.7 tokens a step in the 5 steps counted
    after 3 uncounted ones, and 3.0 once converged, so SJD kept the window of 3 at 1.25-1.32x where 15 gave 2.48x:
    runs/gpu-s27b). refresh_every: the warm-up's size again at steps refresh_every, 2 x, 4 x, .. (counted
    over the budget's life), so a size left early is measured again. settle_after / settle_margin: see `settled`."""

    def __init__(self, sizes: Iterable[int], verify_seconds: VerifySeconds, draft_seconds: DraftSeconds | None = None,
                 prior_rate: float = 0.8, prior_strength: float = 4.0, warmup: int = 3,
                 explore_cost: float = 3.0, *, timing: bool = False, per_size: bool = False, dwell: int = 1,
                 decay: float = 0.95, refresh_every: int = 0, settle_after: int = 8,
                 settle_margin: float = 0.8, uncounted_after_change: int = 1,
                 count_once_refilled: bool = False) -> None:
        self.sizes = sorted({0, *(int(k) for k in sizes)})
        check(self.sizes[0] >= 0, f"draft sizes must be >= 0, got {self.sizes}.")
        check(0.0 < prior_rate < 1.0 and prior_strength > 0, "prior_rate must be in (0, 1), prior_strength > 0.")
        check(dwell >= 1 and 0.0 < decay <= 1.0, f"dwell must be >= 1 and decay in (0, 1], got {dwell}, {decay}.")
        self.verify_seconds, self.draft_seconds = verify_seconds, draft_seconds or (lambda b, k: 0.0)
        self.prior_rate, self.prior_strength = prior_rate, prior_strength
        depth = self.sizes[-1]
        self.reached = torch.zeros(depth, dtype=torch.float64)  # [K] rows that drafted position j after j-1 accepts
        self.accepted = torch.zeros(depth, dtype=torch.float64)  # [K] of those, accepted at position j
        self.rows_at: dict[int, float] = {}  # size k -> rows verified at size k (decayed in per-size mode)
        self.emitted_at: dict[int, float] = {}  # size k -> tokens they emitted
        self.emitted_sq_at: dict[int, float] = {}  # size k -> sum of squares of each row's emitted tokens
        self.chosen: dict[int, int] = {}
        self.warmup, self.explore_cost = warmup, explore_cost
        self.per_size, self.dwell, self.decay = per_size, dwell, decay
        self.uncounted_after_change, self.count_once_refilled = uncounted_after_change, count_once_refilled
        self._counted_run, self._emitted_since_change = 0, 0.0  # per-size mode, since the last change of size
        self.refresh_every, self._refresh_at = refresh_every, refresh_every
        self._init_steps(timing, settle_after, settle_margin)
        self._last, self._run = 0, 0  # the current size, steps drafted at it since it was chosen
        self._forced = 0  # steps left of a warm-up or refresh run

    # ------------------------------------------------------------------------------------------ estimates
    def rates(self) -> torch.Tensor:
        """a_j [K]: per-position acceptance given the earlier positions were accepted."""
        total_reached, total_accepted = float(self.reached.sum()), float(self.accepted.sum())
        pooled = (total_accepted + self.prior_strength * self.prior_rate) / (total_reached + self.prior_strength)
        return position_rates(self.accepted, self.reached, pooled, self.prior_strength)

    def model_moments(self) -> tuple[list[float], list[float]]:
        """The position model's (E[X], E[X^2]) per size 1..K (`chain_moments` of `rates`)."""
        return chain_moments(self.rates().tolist())

    def expected_tokens(self, k: int, moments: tuple[list[float], list[float]] | None = None) -> float:
        """E[tokens emitted per row | k drafts]: the position model 1 + sum_i prod_{j<=i} a_j (`moments`, from
        `model_moments`), blended with the mean emitted per row at size k where that size ran (per-size mode: that
        mean alone)."""
        if k == 0:
            return 1.0
        rows = self.rows_at.get(k, 0.0)
        if self.per_size and rows > 0:
            return self.emitted_at[k] / rows
        model = (moments or self.model_moments())[0][k - 1]
        return (self.emitted_at.get(k, 0.0) + self.prior_strength * model) / (rows + self.prior_strength)

    def throughput(self, batch: int, k: int, moments: tuple[list[float], list[float]] | None = None) -> float:
        """Expected tokens per second per row with k drafts at this batch size."""
        return self.expected_tokens(k, moments) / max(self.seconds(batch, k), 1e-12)

    def emitted_variance(self, k: int, moments: tuple[list[float], list[float]] | None = None) -> float:
        """Var[tokens a row emits per step | k drafts]: measured where size k ran (blended with the position model
        as `expected_tokens`), else the position model's: P(X > i) = prod_{j<=i} a_j,
        E[X^2] = 1 + sum_i (2i+1) P(X > i)."""
        if k == 0:
            return 0.0
        moments = moments or self.model_moments()
        mean = self.expected_tokens(k, moments)
        model_sq = moments[1][k - 1]
        rows = self.rows_at.get(k, 0.0)
        if self.per_size and rows > 0:
            second = self.emitted_sq_at.get(k, 0.0) / rows
        else:
            second = (self.emitted_sq_at.get(k, 0.0) + self.prior_strength * model_sq) / (rows + self.prior_strength)
        return max(second - mean * mean, 0.0)

    def speeds(self, batch: int) -> dict[int, float]:
        """Each size's expected speed: tokens per second per row, or, with the tokens left noted at batch > 1, the
        longest row's tokens left over the expected time until every active row is done (the batch tail)."""
        moments = self.model_moments()
        if self.batch_tail() is None:
            return {k: self.throughput(batch, k, moments) for k in self.sizes}
        mean = torch.tensor([self.expected_tokens(k, moments) for k in self.sizes], dtype=torch.float64)
        seconds = torch.tensor([self.seconds(batch, k) for k in self.sizes], dtype=torch.float64)
        var = torch.tensor([self.emitted_variance(k, moments) for k in self.sizes], dtype=torch.float64)
        return dict(zip(self.sizes, self.tail_speeds(seconds, mean, var).tolist()))

    def _plain_and_best_speeds(self) -> tuple[float, float]:
        return plain_and_best(self.speeds(self._batch))

    def plain_table_seconds(self, batch: int) -> float:
        return self.table_seconds(batch, 0)

    def plain_estimate_seconds(self, batch: int) -> float:
        return self.seconds(batch, 0)

    def describe(self, batch: int) -> str:
        moments = self.model_moments()
        return ", ".join(f"{k}: {self.chosen.get(k, 0)}x {1e3 * self.seconds(batch, k):.2f} ms "
                         f"(table {1e3 * self.table_seconds(batch, k):.2f}) {self.expected_tokens(k, moments):.2f} tok"
                         for k in self.sizes if self.chosen.get(k) or k == 0 or k == self.sizes[-1])

    def table_seconds(self, batch: int, k: int) -> float:
        return self.draft_seconds(batch, k) + self.verify_seconds(batch, k + 1)

    def seconds(self, batch: int, k: int) -> float:
        """A step's seconds with k drafts: as measured where that size ran (timing), else the table's, read by how
        the sizes that ran compare with theirs (`table_reading`: the drafting sizes' line once three ran, else a
        ratio); a plain step at most vanilla's (`plain_choice_seconds`)."""
        seen = self.fresh_seen()
        if k in seen:
            seconds = seen[k]
        else:
            pairs = {s: (self.table_seconds(batch, s), seen[s]) for s in seen}
            drafted = [] if k == 0 else [pair for s, pair in pairs.items() if s != 0]
            seconds = table_reading(list(pairs.values()), drafted)(self.table_seconds(batch, k))
        return self.plain_choice_seconds(seconds) if k == 0 else seconds

    def explore_size(self, batch: int) -> int:
        """The warm-up steps' size: the largest costing at most `explore_cost` plain steps; the cheapest drafting
        size when none is that cheap (never a plain step, so measured step times can correct a table timed under
        another load)."""
        limit = self.explore_cost * self.seconds(batch, 0)
        drafting = [k for k in self.sizes if k > 0]
        if not drafting:
            return 0
        affordable = [k for k in drafting if self.seconds(batch, k) <= limit]
        return max(affordable) if affordable else min(drafting, key=lambda k: self.seconds(batch, k))

    # ------------------------------------------------------------------------------------------- the loop
    def begin(self, target=None, drafter=None, state=None, rule=None) -> None:
        """A new call: the time between calls is not a step, and its first step is a change of size."""
        self._new_call()
        self._run = 0

    def choose(self, batch: int) -> int:
        """The draft size for the next step (0 = a plain step)."""
        self._time_last_step()
        steps = self._choices
        if self.refresh_every and steps >= self._refresh_at:  # at steps r, 2r, 4r, ..
            self._refresh_at *= 2
            self._forced = self.dwell
        if steps < self.warmup or self._forced > 0 or self._exploring():
            self._forced = max(self._forced - 1, 0)
            best = self.explore_size(batch)
        elif self._holding():
            best = self._last
        elif not self.per_size and self._plain_probe():  # a Jacobi window would lose its converged tail
            best = 0
        else:
            speed = self.speeds(batch)
            best = max(self.sizes, key=lambda k: (speed[k], -k))
            self._note_plain_margin(*plain_and_best(speed))
        changed = best != self._last or not self._run
        self._run = 1 if changed else self._run + 1
        if changed:
            self._counted_run, self._emitted_since_change = 0, 0.0
        self.chosen[best] = self.chosen.get(best, 0) + 1
        self._last = best
        self._count_choice()
        return best

    def _holding(self) -> bool:
        """Whether the size chosen last is kept without a new estimate (`dwell`)."""
        if not self._run:
            return False
        return self._counted_run < self.dwell if self.count_once_refilled else self._run < self.dwell

    def observe(self, result: VerifyResult, active: torch.Tensor, draft=None) -> None:
        """Record a chain step's verdicts: position j (1-based) was reached by rows that drafted >= j and accepted
        j - 1, and accepted by those that accepted >= j (per-size mode: not the first `uncounted_after_change` steps
        after a change, nor, with `count_once_refilled`, those before the rows emitted as many tokens as the size)."""
        last = self._last
        if last:
            self.note_row_accepts(result.num_accepted, active)
        on = active.double()  # [B]
        emitted = result.num_emitted.double() * on  # [B]
        k = min(result.accepted_flags.shape[1], self.reached.shape[0])
        positions = torch.arange(k, device=result.num_accepted.device)  # [k] 0-based j - 1
        acc, drafted = result.num_accepted.unsqueeze(-1), result.num_drafted.unsqueeze(-1)  # [B, 1]
        reached = (acc >= positions) & (drafted > positions) & active.unsqueeze(-1)  # [B, k]
        counted = torch.stack([reached, reached & (acc > positions)]).sum(1).flatten()  # [2k] reached, accepted
        sums = torch.cat([torch.stack([on, emitted, emitted * emitted]).sum(1), counted]).cpu()  # [3 + 2k] float64
        rows, total, total_sq = sums[:3].tolist()  # (the step's one read of the device: the transfer above)
        if self.per_size and last:
            refilled = self._emitted_since_change >= last
            self._emitted_since_change += total / max(rows, 1.0)  # tokens per active row
            if self._run <= self.uncounted_after_change or (self.count_once_refilled and not refilled):
                return
            self._counted_run += 1
        keep = self.decay if self.per_size else 1.0
        self.rows_at[last] = self.rows_at.get(last, 0.0) * keep + rows
        self.emitted_at[last] = self.emitted_at.get(last, 0.0) * keep + total
        self.emitted_sq_at[last] = self.emitted_sq_at.get(last, 0.0) * keep + total_sq
        if k:
            self.reached[:k] += sums[3: 3 + k]
            self.accepted[:k] += sums[3 + k:]


def table_reading(measured: Sequence[tuple[float, float]],
                  drafted: Sequence[tuple[float, float]]) -> Callable[[float], float]:
    """How an unmeasured size's table seconds t read as a step's seconds, from the (table, measured) seconds of the
    sizes measured (`measured`, the plain step among them) and of the drafting ones among them (`drafted`; empty to
    price a plain step). With LINE_MIN_SIZES drafting sizes whose table times differ by 20% or more: the
    least-squares line a + b t through them (b >= LINE_MIN_SLOPE, a >= 0, else the line through the origin). A
    drafted step carries work its table leaves out, partly fixed (the drafter's pass over the accepted tokens, the
    acceptance and the budget's own) and partly in proportion (a forward in the loop runs on caches the verify has
    just filled): the world LLaVA's EAGLE chains of 6-16 at batch 8 read their table + 2.7-5.0 ms (1.17-1.56x), and a
    ratio alone priced a chain of 1 at 4.8 ms where it ran 5.5-7.0 ms (docs/benchmarks.md, "An auto call's steps").
    Else, as before, the mean of the measured sizes' ratios (1 with none)."""
    ratio = sum(s / max(t, 1e-12) for t, s in measured) / len(measured) if measured else 1.0
    tables = [t for t, _ in drafted]
    if len(drafted) < LINE_MIN_SIZES or max(tables) < 1.2 * min(tables):
        return lambda t: t * ratio
    n = len(drafted)
    mean_t, mean_s = sum(tables) / n, sum(s for _, s in drafted) / n
    slope = sum((t - mean_t) * (s - mean_s) for t, s in drafted) / sum((t - mean_t) ** 2 for t in tables)
    slope = max(slope, LINE_MIN_SLOPE)
    intercept = mean_s - slope * mean_t
    if intercept < 0.0:
        intercept, slope = 0.0, sum(t * s for t, s in drafted) / sum(t * t for t in tables)
    return lambda t: intercept + slope * t


def plain_and_best(speed: dict[int, float]) -> tuple[float, float]:
    """(a plain step's speed, the best drafting size's) from each size's speed (`AutoBudget.speeds`)."""
    return speed[0], max((v for k, v in speed.items() if k > 0), default=0.0)


def position_rates(accepted: torch.Tensor, reached: torch.Tensor, pooled: float, strength: float) -> torch.Tensor:
    """a_j [K] from counts [K] of rows that reached draft position j (the earlier ones accepted) and accepted it:
    each shrunk towards the `pooled` rate with `strength` pseudo-rows; positions never reached take the deepest
    reached position's rate."""
    rates = (accepted + strength * pooled) / (reached + strength)  # [K]
    seen = (reached > 0).nonzero()
    if seen.numel():
        rates[int(seen[-1]) + 1:] = rates[int(seen[-1])]
    return rates


def chain_moments(rates: Sequence[float]) -> tuple[list[float], list[float]]:
    """(E[X], E[X^2]) for X = the tokens a chain of depth d = 1..k emits (1 + accepted drafts) under per-position
    rates a_j (k of them): P(X > i) = prod_{j<=i} a_j, E[X] = 1 + sum_{i<=d} P(X > i), E[X^2] = 1 + sum_{i<=d}
    (2i + 1) P(X > i). Host floats in one pass: a budget reads them for every depth before every step, where tensor
    operations on a few numbers cost microseconds each (`TreeBudget.emitted_moments`, `AutoBudget.speeds`)."""
    tail, first, second = 1.0, 0.0, 0.0
    firsts, seconds = [], []
    for i, rate in enumerate(rates, 1):
        tail *= rate  # P(X > i)
        first += tail
        second += (2 * i + 1) * tail
        firsts.append(1.0 + first)
        seconds.append(1.0 + second)
    return firsts, seconds


def batch_steps(tokens_left: float, rows: int, mean: float, var: float, spread: float = 0.0) -> float:
    """Expected steps until the last of `rows` rows has emitted `tokens_left` more tokens (`batch_steps_of` for one
    option)."""
    return float(batch_steps_of(tokens_left, rows, torch.tensor([mean]), torch.tensor([var]), spread)[0])


def batch_steps_of(tokens_left: float, rows: int, mean: torch.Tensor, var: torch.Tensor,
                   spread: float = 0.0) -> torch.Tensor:
    """Expected steps [S] until the last of `rows` rows has emitted `tokens_left` (r) more tokens, for S options
    whose rows emit mean [S] tokens per step with variance var [S], the rows' own acceptance rates spread by `spread`
    (relative standard deviation: a row's mean is 1 + (mean - 1) x its rate over the average's):

        E[max_rows N] = sum_{n >= 0} 1 - (1 - P(N > n))^rows
        P(N > n) = P(S_n < r) ~ Phi((r - 1/2 - n mean) / sqrt(n var + (n (mean - 1) spread)^2))

    N is a row's step count (the first n with S_n >= r, S_n its tokens after n steps, normal with a continuity
    correction; the spread's term is a row's own mean times n). Unlike r / mean plus a normal tail, it counts the
    last step whole (a row that needs 4.3 steps of 11 tokens takes 5): against a simulation of 32 rows drafting
    chains of 10 with 48 tokens left, 7.2 steps where the simulation takes 7.5 and r / mean + z sd gives 6.5
    (tests/test_budget.py). Plain steps (mean 1, var 0) take exactly r. Only the n where P(N > n) is neither ~1
    nor ~0 are summed (6 sd either side of r / mean)."""
    m = mean.double().clamp_min(1e-9)  # [S]
    v = var.double().clamp_min(0.0)  # [S]
    r = tokens_left - 0.5
    slope = (m - 1.0).clamp_min(0.0) * spread  # [S] the spread's sd of a row's tokens, per step
    centre = r / m  # [S]
    sd_steps = (centre * v + (centre * slope) ** 2).sqrt() / m  # [S] a row's step count's sd, about
    width = 6.0 * sd_steps + 2.0  # [S]
    low = (centre - width).floor().clamp_min(0.0)  # [S] every n below: P(N > n) = 1
    n = low[:, None] + torch.arange(int((2.0 * width).ceil().max()) + 3, dtype=torch.float64)  # [S, K]
    sd = (n * v[:, None] + (n * slope[:, None]) ** 2).sqrt()  # [S, K]
    gap = r - n * m[:, None]  # [S, K]
    more = torch.where(sd > 0, torch.special.ndtr(gap / sd.clamp_min(1e-12)), (gap > 0).double())  # [S, K]
    return low + (1.0 - (1.0 - more) ** rows).sum(1)


def check_budget_mode(mode: str | None, what: str = "budget") -> None:
    """InputError unless `mode` is a draft budget mode (`BUDGET_MODES`) or None."""
    check(mode is None or mode in BUDGET_MODES, f"{what} must be one of {BUDGET_MODES} or None, got {mode!r}.")


# ------------------------------------------------------------------------------------------ building one
BUDGET_MODES = ("auto", "fixed")
PROFILE_WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65)  # verify widths measured (interpolated between)


def forward_table(runner, inputs, batch: int, widths: Sequence[int], device: torch.device | str):
    """The measured forward times (`mmspec.cost`) of a loop runner's model at this batch size, as the loop runs it
    (its prefill of `inputs`, its CFG), cached per model, device, dtype, threads, batch and widths."""
    from mmspec.cost import cached_profile, lm_forward_runner, measure_forward_times, profile_key

    widths = sorted(set(widths))
    extra = f"fwd|B={batch}|W={widths}|cfg={runner.guidance_scale is not None}|{runner.prefill_fn.__qualname__}"
    run = lm_forward_runner(runner.model, lambda b: inputs, runner.guidance_scale, runner.prefill_fn,
                            max_width=widths[-1])
    return cached_profile(profile_key(runner.model, device, extra),
                          lambda: measure_forward_times(run, [batch], widths, repeats=7, warmup=3, device=device))


def step_table(target, rule, inputs, batch: int, widths: Sequence[int], device: torch.device | str):
    """The measured seconds of one loop step of the target at this batch size and n = width tokens per row: the
    verify forward, its distributions and the acceptance rule on drafts (nothing committed), cached like
    `forward_table`."""
    from mmspec.cost import cached_profile, measure_forward_times, profile_key
    from mmspec.lm import LMTarget
    from mmspec.loop import DecodeState
    from mmspec.verify import ChainDraft, accept

    widths = sorted(set(widths))
    runner = target.runner
    extra = (f"step|B={batch}|W={widths}|cfg={runner.guidance_scale is not None}|{runner.prefill_fn.__qualname__}"
             f"|{getattr(rule, 'name', rule)}|{target.params}")
    probe = LMTarget(runner.model, target.params, 0, max_draft_nodes=widths[-1], guidance_scale=runner.guidance_scale,
                     prefill_fn=runner.prefill_fn)
    state = DecodeState.new(batch, 1, device)
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model.vocab_size

    @torch.no_grad()
    def run(b: int, width: int) -> None:
        if probe.runner.cache is None:
            probe.prefill(inputs)
        draft = ChainDraft(torch.randint(0, vocab, (b, width - 1), generator=generator).to(device))
        accept(rule, draft, probe.verify(state, draft), generator, validate=False)

    return cached_profile(profile_key(runner.model, device, extra),
                          lambda: measure_forward_times(run, [batch], widths, repeats=7, warmup=3, device=device))


def make_budget(mode: str | None, target, drafter, rule, inputs, batch: int,
                device: torch.device | str, keep: dict | None = None):
    """The draft budget of a call: "auto" -> a `mmspec.tree_budget.TreeBudget` for a tree drafter (`full_shape`),
    else an `AutoBudget` over the drafter's sizes from the measured cost of a target step (`step_table`: verify and
    acceptance) and of the drafter's forwards at this batch size, measured once and cached; "fixed" / None -> None
    (the drafter's own size every step). A drafter the budget cannot steer (no `draft_sizes`) keeps its size; a
    drafter's `budget_options` (a dict) go to its `AutoBudget` (Jacobi: per-size values, dwell, refresh).
    `keep`: a dict the caller holds (a pipeline's) in which a budget stays between calls of the same drafter, size,
    batch size, rule and sampling setting, so its acceptance estimates and step times carry over (short answers end
    before a per-call budget has learnt anything; a 256-token image at batch 1 spends a third of its steps learning);
    the next call's tokens then depend on earlier calls and on measured times (greedy ones do not). A function set
    in `BUDGET_WRAPPER` gets the budget first (tests force its decisions: `mmspec.testing.budgets.forced_budget`)."""
    budget = build_budget(mode, target, drafter, rule, inputs, batch, device, keep)
    wrap = BUDGET_WRAPPER.get()
    return budget if budget is None or wrap is None else wrap(budget)


# a function every budget `make_budget` returns passes through (None: none): how a test forces a budget's decisions
# while its bookkeeping (timing, levels of rows held, estimates) runs as usual (`mmspec.testing.budgets`)
BUDGET_WRAPPER: ContextVar[Callable[[Any], Any] | None] = ContextVar("mmspec_budget_wrapper", default=None)


def build_budget(mode: str | None, target, drafter, rule, inputs, batch: int,
                 device: torch.device | str, keep: dict | None = None):
    """`make_budget` without the wrapper."""
    check_budget_mode(mode)
    if mode in (None, "fixed"):
        return None
    if hasattr(drafter, "full_shape"):  # a tree drafter: its shapes are timed on the live models at the loop's start
        from mmspec.tree_budget import TreeBudget

        drafter.steered_by_budget = True  # its begin keeps room for chains; a drafted tree makes its own pool's

        if keep is None:
            return TreeBudget(drafter.full_shape)
        key = (type(drafter).__name__, id(drafter.model), drafter.full_shape, batch, str(getattr(rule, "name", rule)),
               str(target.params))
        if key not in keep:
            keep[key] = TreeBudget(drafter.full_shape)
        return keep[key]
    sizes = getattr(drafter, "draft_sizes", None)
    if sizes is None or drafts_nothing(drafter):
        return None
    key = ("chain", type(drafter).__name__, id(getattr(getattr(drafter, "runner", None), "model", None)),
           tuple(sizes), batch, str(getattr(rule, "name", rule)), str(target.params))
    if keep is not None and key in keep:
        return keep[key]
    widths = [w for w in PROFILE_WIDTHS if w <= max(sizes)] + [max(sizes) + 1]
    verify = step_table(target, rule, inputs, batch, widths, device)
    draft_seconds = drafter.draft_seconds(lambda runner, w: forward_table(runner, inputs, batch, w, device))
    budget = AutoBudget(sizes, lambda b, n: verify.seconds_at(b, n), draft_seconds, timing=True,
                        **getattr(drafter, "budget_options", {}))
    if keep is not None:
        keep[key] = budget
    return budget

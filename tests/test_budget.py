"""The draft budget (`mmspec.budget.AutoBudget`) and the loop's variable draft sizes: the policy's estimates and
choices, and exactness: sequences sampled with budgets that change the draft size every step (plain steps
included) have the target's exact sequence distribution, and greedy decoding stays token-identical to vanilla."""

import math
from collections import deque

import pytest
import torch
from test_jacobi import exact_sequence_distribution

from mmspec.budget import CALL_BACKOFF, AutoBudget, chain_moments
from mmspec.jacobi import JacobiDrafter
from mmspec.lm import DraftModelDrafter, LMTarget, NoDrafter, TreeModelDrafter
from mmspec.loop import DecodeState, generate
from mmspec.phases import record_phases
from mmspec.sampling import SamplingParams
from mmspec.testing.budgets import CyclingBudget
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.toy import toy_model
from mmspec.tree_budget import PLAIN, TreeBudget, TreeShape, counterfactual_accepts, tree_menu
from mmspec.verify import VerifyResult, accept


def result(accepted, drafted):
    acc, k = torch.tensor(accepted), max(drafted)
    flags = torch.arange(k) < acc.unsqueeze(-1)
    return VerifyResult(torch.zeros(len(accepted), k + 1, dtype=torch.long), acc, flags, torch.tensor(drafted))


def test_rates_count_each_position_given_the_earlier_ones_and_fill_unseen_positions():
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, prior_strength=1e-9)
    budget.observe(result([0, 2, 4, 1], [4, 4, 4, 4]), torch.ones(4, dtype=torch.bool))
    # position 1: reached by 4 rows, accepted by 3; position 2: reached by 3, accepted by 2; 3 and 4: 1 of 1
    assert budget.reached.tolist() == [4, 3, 2, 1] and budget.accepted.tolist() == [3, 2, 1, 1]
    assert budget.rates().tolist() == pytest.approx([0.75, 2 / 3, 0.5, 1.0])
    inactive = torch.tensor([True, False, False, False])
    budget.observe(result([0, 2, 4, 1], [2, 2, 2, 2]), inactive)  # only row 0 counts
    assert budget.reached.tolist() == [5, 3, 2, 1]
    fresh = AutoBudget(range(9), verify_seconds=lambda b, n: 1.0)
    fresh.observe(result([1, 1], [2, 2]), torch.ones(2, dtype=torch.bool))
    rates = fresh.rates()
    assert rates[2:].tolist() == pytest.approx([rates[1].item()] * 6)  # unseen positions take the deepest rate
    assert fresh.expected_tokens(0) == 1.0 and fresh.expected_tokens(2) == pytest.approx(
        1 + rates[0].item() + rates[0].item() * rates[1].item())


def test_chain_moments_are_those_of_a_chains_tokens():
    """E[X] and E[X^2] of X = 1 + the drafts a chain of depth d accepts, against X's distribution written out: a
    chain stops at the first rejected position (P(X = 1 + a) = a_1..a_a (1 - a_(a+1)), all d accepted: a_1..a_d)."""
    rates = [0.9, 0.5, 0.25, 1.0, 0.0, 0.7]
    firsts, seconds = chain_moments(rates)
    assert len(firsts) == len(seconds) == len(rates)
    for depth in range(1, len(rates) + 1):
        law = {1 + a: math.prod(rates[:a]) * (1.0 - rates[a] if a < depth else 1.0) for a in range(depth + 1)}
        assert sum(law.values()) == pytest.approx(1.0)
        assert firsts[depth - 1] == pytest.approx(sum(x * p for x, p in law.items()))
        assert seconds[depth - 1] == pytest.approx(sum(x * x * p for x, p in law.items()))
    assert chain_moments([]) == ([], [])


def test_the_choice_follows_cost_and_acceptance():
    cheap = AutoBudget(range(9), verify_seconds=lambda b, n: 1.0, warmup=0)
    cheap.observe(result([8] * 4, [8] * 4), torch.ones(4, dtype=torch.bool))
    assert cheap.choose(1) == 8  # verify costs the same at any width: draft all you can
    steep = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), warmup=0)
    steep.observe(result([0] * 4, [8] * 4), torch.ones(4, dtype=torch.bool))
    assert steep.choose(1) == 0  # every extra position costs a step and nothing is accepted: plain steps
    batch = AutoBudget(range(9), verify_seconds=lambda b, n: 1.0 + 0.05 * b * (n - 1),
                       draft_seconds=lambda b, k: 0.1 * k, warmup=0)
    batch.observe(result([3] * 4, [8] * 4), torch.ones(4, dtype=torch.bool))
    assert batch.choose(1) > batch.choose(64) == 0  # wide verifies stop paying at large batch
    assert batch.chosen[0] == 1
    warm = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), warmup=2)
    warm.observe(result([0] * 4, [8] * 4), torch.ones(4, dtype=torch.bool))
    # warm-up at the largest size costing <= 3 plain steps (a 3-token verify), then the estimate
    assert [warm.choose(1) for _ in range(3)] == [2, 2, 0]
    flat = AutoBudget(range(9), verify_seconds=lambda b, n: 1.0, warmup=1)
    assert flat.choose(1) == 8  # drafting costs nothing here: the warm-up drafts the configured size


def test_the_batch_tail_prices_the_slowest_row():
    """At batch > 1 a call lasts until its slowest row is done: rows that emit 1 or 5 tokens per step (mean 3) at a
    verify costing 2.8 plain steps pay at batch 1 (3 / 2.8 = 1.07x) but not across 7 active rows with 64 tokens left
    (the expected maximum of their step counts), where plain steps keep every row together."""
    from mmspec.budget import batch_steps

    assert batch_steps(64, 8, 1.0, 0.0) == 64  # plain steps: exactly the tokens left
    assert batch_steps(60, 8, 2.0, 0.0) == 30  # two tokens every step: exactly half
    # one row: its mean steps, the last one whole (renewal theory: (r + E[overshoot]) / mean, E[overshoot] =
    # (var + mean^2 - mean) / (2 mean))
    assert batch_steps(60, 1, 3.0, 4.0) == pytest.approx(20.0 + 10.0 / 18.0, abs=0.1)
    assert batch_steps(60, 8, 3.0, 4.0) > batch_steps(60, 2, 3.0, 4.0) > 20.5

    def spread_budget() -> AutoBudget:
        budget = AutoBudget([0, 4], verify_seconds=lambda b, n: 1.0 if n == 1 else 2.8, warmup=0, per_size=True)
        budget._last, budget._run = 4, 2  # steps at size 4 (not the first after a change)
        for _ in range(5):
            budget.observe(result([0, 4, 0, 4], [4] * 4), torch.ones(4, dtype=torch.bool))
        return budget

    one = spread_budget()
    one.note_rows_left(torch.tensor([64]))
    assert one.emitted_variance(4) == pytest.approx(4.0) and one.choose(1) == 4
    many = spread_budget()
    many.note_rows_left(torch.tensor([64, 60, 0, 64, 63, 64, 64, 61]))  # 7 active rows, the longest with 64 left
    assert many.choose(8) == 0
    steady = spread_budget()  # the same mean with every row emitting 3 tokens: no spread, no tail, drafting pays
    steady.emitted_sq_at[4] = 9.0 * steady.rows_at[4]
    steady.note_rows_left(torch.tensor([64] * 8))
    assert steady.choose(8) == 4


def test_the_tree_budget_prices_the_batch_tail_too():
    """A tree that accepts 0 or 4 drafts (mean 2) at 2.8 plain steps pays at batch 1 (3 / 2.8) but not for 8 rows
    with 64 tokens left; the same mean with no spread still pays at batch 8."""
    full = TreeShape(2, 4, 8)
    budget = TreeBudget(full, [PLAIN, full], warmup=0, costs={PLAIN: 1.0, full: 2.8}, timing=False)
    budget.rows[1], budget.accepted[1], budget.accepted_sq[1] = 10.0, 20.0, 80.0  # 0 or 4, mean 2, variance 4
    assert budget.emitted_variance()[1].item() == pytest.approx(4.0)
    budget.note_rows_left(torch.tensor([64]))
    assert budget.choose(1) == full
    budget.note_rows_left(torch.tensor([64] * 8))
    assert budget.choose(8) == 0
    budget.accepted_sq[1] = 40.0  # every row accepts 2: no spread
    budget.note_rows_left(torch.tensor([64] * 8))
    assert budget.choose(8) == full
    # the --gate-log line: each shape's choices, seconds (the table's here), expected tokens per row
    assert budget.describe(8) == ("0: 1x 1000.00 ms (table 1000.00) 1.00 tok, "
                                  "tree2x4n8: 2x 2800.00 ms (table 2800.00) 3.00 tok")


def test_no_reference_call_while_drafted_calls_clearly_win():
    """Before any call without the drafter, drafted calls (the unjudged one included) that beat a lower bound of
    vanilla's step (the lower of the table's plain step and in-call plain steps) by REFERENCE_SKIP_MARGIN need no
    reference call; once they stop winning by that much, the next call is one."""
    from mmspec.budget import REFERENCE_SKIP_MARGIN

    assert REFERENCE_SKIP_MARGIN == 1.5
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)  # the table's plain step: 1 s
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=5.0, plain_steps=10, drafted=True)  # unjudged, 2x against the bound
    assert budget.plain_lower_bound() == 1.0 and budget.drafts_this_call()  # no reference call
    budget._note_seconds(0, 0.8)  # in-call plain steps cheaper than the table: the bound follows
    assert budget.plain_lower_bound() == 0.8 and budget.gate_plain_seconds(1) == 0.8
    budget.end_call(1, seconds=7.0, plain_steps=10, drafted=True)  # judged against 0.8 s a step: won
    assert budget.calls["lost"] == 0 and budget.calls["reference"] == 0
    assert not budget.drafts_this_call() and budget.calls["reference"] == 1  # 20 x 0.8 s in 12 s: 1.33x < 1.5x
    faster = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True)
    faster._note_seconds(2, 0.5)  # drafted steps run at half their table time: the table is from a busier machine
    assert faster.plain_lower_bound() == 0.5  # the table's plain step scaled the same way


def test_a_call_whose_estimates_drafted_nothing_lost():
    """A judged drafted call in which every choice by estimate was a plain step lost, however fast it read: it paid
    the drafter's begin and the budget's steps for vanilla's tokens. Choices made before any estimate (warm-up) do
    not count as drafting by estimate; a call that never chose by estimate is judged by its time."""
    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0 if n == 1 else 3.0, warmup=1, timing=True)
    budget.begin()
    assert budget.choose(1) == 2  # warm-up
    budget.observe(result([0], [2]), torch.ones(1, dtype=torch.bool))  # nothing accepted: plain is better now
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # not judged
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # the reference: 1 s a step
    budget.begin()
    assert budget.choose(1) == 0 and budget.choose(1) == 0
    budget.end_call(1, seconds=5.0, plain_steps=10, drafted=True)  # 2x faster by its time, but drafted nothing
    assert budget.calls["lost"] == 1 and budget.skip_calls == CALL_BACKOFF
    never = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, warmup=5, timing=True)
    for drafted, seconds in ((True, 9.0), (False, 10.0), (True, 5.0)):
        never.begin()
        never.choose(1)  # warm-up only
        never.end_call(1, seconds=seconds, plain_steps=10, drafted=drafted)
    assert never.calls["lost"] == 0


def choose_untimed(budget, batch: int = 1):
    """budget.choose(batch) without timing the previous step (a test's steps take microseconds)."""
    budget._chosen_at = None
    return budget.choose(batch)


def test_a_call_predicted_plain_runs_without_the_drafter_and_the_retry_re_explores():
    """When, at the estimates a call starts with, a plain step beats every drafting size over a call like the last
    one (the batch tail included), the call runs without the drafter (it would pay the drafter's begin for plain
    steps) and so do the backoff's next calls; the drafted call after them re-explores: its choices warmup ..
    2 x warmup - 1 draft the exploration size, and it does not settle on plain steps before them."""
    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0 if n == 1 else 3.0, warmup=2, timing=True,
                        settle_after=2)
    assert budget.drafts_this_call()
    budget.begin()
    assert [choose_untimed(budget) for _ in range(2)] == [2, 2]  # warm-up
    budget.observe(result([0], [2]), torch.ones(1, dtype=torch.bool))  # nothing accepted: plain is better now
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # unjudged
    assert budget._estimates_plain()
    assert not budget.drafts_this_call() and budget.calls["reference"] == 1  # the reference comes first
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    gates = [budget.drafts_this_call() for _ in range(CALL_BACKOFF + 1)]
    assert gates == [False] * CALL_BACKOFF + [True] and budget.calls["predicted_plain"] == 1
    assert budget.calls["lost"] == 0 and budget.backoff == 2 * CALL_BACKOFF
    budget.begin()  # the retry: plain by estimate for `warmup` choices, then `warmup` exploring ones
    chosen = []
    for _ in range(6):
        chosen.append(choose_untimed(budget))
        if chosen[-1] == 0 and budget.settled():
            break
    assert chosen == [0, 0, 2, 2, 0] and budget.settled()  # (not settled before the exploring choices)
    budget.end_call(1, seconds=11.0, plain_steps=10, drafted=True)  # its choices by estimate were plain: lost
    assert budget.calls["lost"] == 1 and budget.skip_calls == 2 * CALL_BACKOFF  # (a retry at 10% over: 5 calls)
    assert not AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True)._estimates_plain()  # no call yet
    wins = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, warmup=0, timing=True)  # drafting is free here
    wins.end_call(1, seconds=9.0, plain_steps=10, drafted=True)
    wins.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    assert not wins._estimates_plain() and wins.drafts_this_call()


def test_the_call_prediction_counts_the_drafters_begin():
    """A call drafting at the best size takes the drafter's begin plus its steps: where the steps win by less than
    the begin costs, by more than a prediction's error, the call is predicted plain."""
    def budget_after_a_call(begin: float) -> AutoBudget:
        budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0 if n == 1 else 1.5, warmup=0, timing=True,
                            prior_strength=1e-9)
        budget._note_seconds(0, 1.0)
        budget._note_seconds(2, 1.5)
        budget.rows_at[2], budget.emitted_at[2] = 1.0, 2.0  # 2 tokens in 1.5 s: 10 tokens in 7.5 s, plain 10 s
        assert budget.wants_warm_begin()
        budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True, begin_seconds=begin)  # unjudged
        assert not budget.wants_warm_begin() and budget.begin_seconds() == begin
        budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # the reference call
        return budget

    cheap = budget_after_a_call(2.0)  # 2 + 7.5 < 10
    assert not cheap._estimates_plain() and cheap.drafts_this_call()
    close = budget_after_a_call(3.0)  # 3 + 7.5 > 10, but within a prediction's error (CALL_SPREAD: 11)
    assert not close._estimates_plain()
    dear = budget_after_a_call(4.0)  # 4 + 7.5 > 11
    assert dear._estimates_plain() and not dear.drafts_this_call() and dear.calls["predicted_plain"] == 1


def test_the_first_drafted_call_times_a_warm_begin():
    """The loop runs the drafter's begin twice in the budget's first drafted call and times the second (the first
    carries one-time costs); once in later calls, and once without a call gate."""
    from mmspec.budget import begin_call

    class Counting:
        def __init__(self):
            self.begins = 0

        def begin(self, inputs, state):
            self.begins += 1

    budget, drafter = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True), Counting()
    assert begin_call(budget, drafter, None, None, torch.device("cpu")) >= 0 and drafter.begins == 2
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True, begin_seconds=0.5)
    begin_call(budget, drafter, None, None, torch.device("cpu"))
    begin_call(None, drafter, None, None, torch.device("cpu"))
    assert drafter.begins == 4


def test_a_loss_against_one_slow_reading_of_vanilla_is_confirmed_first():
    """A reference call that ran unusually fast makes a drafted call read as a loss; while fewer than CONFIRM_BELOW
    calls without the drafter measured vanilla's step, the next call measures it again and the pooled calls are
    judged against the median: here the loss turns into a win and drafting goes on."""
    from mmspec.budget import CONFIRM_BELOW

    assert CONFIRM_BELOW == 3
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)
    budget.overrun = lambda: 1.0  # (predictions as the estimates make them: `overrun` has its own test)
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # not judged
    assert not budget.drafts_this_call()
    budget.end_call(1, seconds=3.0, plain_steps=10, drafted=False)  # a reference at 0.3 s a step: a fast spell
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=6.0, plain_steps=10, drafted=True)  # 6 s against 10 x 0.3: lost, to be confirmed
    assert not budget.drafts_this_call() and budget.calls["reference"] == 2 and budget.calls["lost"] == 0
    budget.end_call(1, seconds=13.0, plain_steps=10, drafted=False)  # 1.3 s: the median 0.8 s, 6 s < 8 s: won
    assert budget.calls["lost"] == 0 and budget.skip_calls == 0 and budget.drafts_this_call()


def test_the_tree_budget_predicts_plain_calls_and_re_explores_too():
    full = TreeShape(2, 2, 4)
    tree = TreeBudget(full, [PLAIN, full], warmup=2, refresh_every=0, costs={PLAIN: 1.0, full: 3.0}, timing=True,
                      settle_after=1)
    assert tree.drafts_this_call()
    tree.begin(None, None, None, None)
    assert [choose_untimed(tree) for _ in range(3)] == [full, full, 0]  # warm-up, then nothing seen accepted: plain
    tree.end_call(1, seconds=9.0, plain_steps=10, drafted=True)
    tree.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    assert tree._estimates_plain() and not tree.drafts_this_call() and tree.calls["predicted_plain"] == 1
    while tree.skip_calls:
        assert not tree.drafts_this_call()
    assert tree.drafts_this_call()
    tree.begin(None, None, None, None)
    first = choose_untimed(tree)
    assert first == 0 and not tree.settled()  # settle_after 1, but the re-exploration is still to come
    chosen = [first] + [choose_untimed(tree) for _ in range(4)]
    assert chosen == [0, 0, full, full, 0] and tree.settled()


def test_a_plain_choice_costs_at_most_vanillas_step():
    """In-call plain steps carry the budget's and the drafter's per-step work; once a call without the drafter has
    run, a plain choice is priced at most at its step, since settled calls run at vanilla's cost."""
    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, warmup=0, timing=True, prior_strength=1e-9)
    budget._note_seconds(0, 1.4)  # in-call plain steps
    budget._note_seconds(2, 2.0)  # a size emitting 2.5 tokens a step: 1.25 tokens a second
    budget.rows_at[2], budget.emitted_at[2] = 1.0, 2.5
    budget.observe(result([2], [2]), torch.ones(1, dtype=torch.bool))
    assert budget.seconds(1, 0) == 1.4 and budget.choose(1) == 2  # 1.25 / s against 1 / 1.4 s
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # vanilla: 1.0 s a step
    assert budget.seconds(1, 0) == 1.0 and budget.seen[0] == pytest.approx(1.2)  # the in-call estimate is kept
    full = TreeShape(2, 2, 4)
    tree = TreeBudget(full, [PLAIN, full], warmup=0, refresh_every=0, costs={PLAIN: 1.0, full: 2.0}, timing=True)
    tree._note_seconds(PLAIN, 1.5)
    tree._note_seconds(full, 2.0)
    assert tree.step_seconds().tolist() == [1.5, 2.0]
    tree.end_call(1, seconds=11.0, plain_steps=10, drafted=False)
    assert tree.step_seconds().tolist() == [1.1, 2.0]


def test_measured_step_times_replace_the_table(monkeypatch):
    """A step's seconds run from its choice to the next; a call's first step (just after the prefill, slower than
    its like later) and the time between calls are not a step's."""
    clock = iter([0.0, 5.0, 6.0, 16.0])  # the call's first step takes 5 s, the second 1 s; then 10 s between calls
    monkeypatch.setattr("mmspec.budget.time.perf_counter", lambda: next(clock))
    budget = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), warmup=2, timing=True)
    assert budget.choose(1) == 2  # warm-up: the largest size within 3 plain steps of the table (a 3-token step)
    budget.observe(result([0], [2]), torch.ones(1, dtype=torch.bool))
    assert budget.choose(1) == 2
    assert budget.seen == {}  # the call's first step is not timed
    budget.observe(result([0], [2]), torch.ones(1, dtype=torch.bool))
    budget.choose(1)
    assert budget.seen == {2: 1.0}  # the second warm-up step ran in 1 s, a third of its table time
    assert budget.seconds(1, 8) == pytest.approx(9 / 3)  # sizes not run: table x the ratio of those that ran
    budget.begin()  # a new call: the time since the last choice is not a step
    budget.choose(1)
    assert budget.seen == {2: 1.0}




def test_the_step_across_a_drop_of_rows_is_not_timed(monkeypatch):
    """A step whose time carries the loop's drop of finished rows (the caches' compaction, `select_rows`) is not a
    step's cost, at the same level of rows held as after a change of level."""
    clock = iter([0.0, 1.0, 2.0, 7.0, 8.0])  # steps of 1 s; the third, across the drop, 5 s
    monkeypatch.setattr("mmspec.budget.time.perf_counter", lambda: next(clock))
    full = TreeShape(2, 2, 4)
    tree = TreeBudget(full, [PLAIN, full], warmup=8, refresh_every=0, costs={PLAIN: 1.0, full: 2.0}, timing=True)
    for _ in range(3):  # the call's first step is not timed, its second is
        assert tree.choose(1) == full
    assert tree._samples[full] == deque([1.0])
    tree.select_rows(torch.tensor([0, 2]))  # (no live call: the rows held keep their level)
    tree.choose(1)
    tree.choose(1)
    assert tree._samples[full] == deque([1.0, 1.0])  # the 5 s step across the drop is not among them


def test_a_drafting_shape_read_slow_from_one_step_is_tried_again(monkeypatch):
    """While a tree budget's drafting shapes rest on fewer than PROBE_SAMPLES measured steps in all, the best one is
    drafted every PLAIN_PROBE_EVERY-th choice the estimates make plain: one step a passing load slowed does not keep
    drafting unchosen, and so unmeasured, for the rest of a call (the world LLaVA at batch 32 ran 33 plain steps after
    one such step); drafting slow in every step is tried only until PROBE_SAMPLES steps were measured."""
    from mmspec.budget import PLAIN_PROBE_EVERY, PROBE_SAMPLES

    full = TreeShape(2, 2, 4)

    def picks(tree_seconds: float, choices: int) -> list:
        now = [0.0]
        monkeypatch.setattr("mmspec.budget.time.perf_counter", lambda: now[0])
        tree = TreeBudget(full, [PLAIN, full], warmup=0, refresh_every=0, costs={PLAIN: 1.0, full: 2.0},
                          timing=True)
        tree.accepted[1], tree.rows[1] = 2.0, 1.0  # 3 tokens a tree step: 1.5 a second at its table time
        tree._note_seconds(PLAIN, 1.0)
        tree._note_seconds(full, 10.0)  # one step slowed by a passing load: 0.3 tokens a second, a plain step 1
        chosen = []
        for _ in range(choices):
            chosen.append(tree.choose(1))
            now[0] += tree_seconds if chosen[-1] else 1.0
        return chosen

    usual = picks(2.0, 4 * PLAIN_PROBE_EVERY)
    assert usual[0] == 0 and 0 < usual.index(full) <= PLAIN_PROBE_EVERY + 1
    assert usual[-PLAIN_PROBE_EVERY:] == [full] * PLAIN_PROBE_EVERY  # measured at its usual time, it is chosen
    slow = picks(10.0, 6 * PLAIN_PROBE_EVERY)
    assert slow.count(full) == PROBE_SAMPLES - 1  # then its seconds rest on PROBE_SAMPLES steps: no more probes


def test_a_size_not_run_for_a_while_takes_its_scaled_table_time_again():
    """A size's measured seconds hold for STALE_AFTER choices after its last measured step; then it is priced like a
    size never run (its table time, scaled like the sizes measured since), so steps timed in a passing slow spell do
    not keep it unchosen, and hence unmeasured, for the rest of a run. Chain and tree budgets alike."""
    from mmspec.budget import STALE_AFTER

    budget = AutoBudget([0, 2, 4], verify_seconds=lambda b, n: float(n), warmup=0, timing=True, per_size=True)
    budget.rows_at.update({2: 1.0, 4: 1.0})
    budget.emitted_at.update({2: 3.6, 4: 7.0})  # 1.2 and 1.4 tokens a table second (a plain step: 1)
    budget._note_seconds(4, 50.0)  # the window of 4 timed in a slow spell: 10x its table
    budget._note_seconds(2, 3.0)
    assert budget.seconds(1, 4) == 50.0 and budget.choose(1) == 2
    for _ in range(STALE_AFTER):
        budget._note_seconds(2, 3.0)  # the window of 2 keeps running (and being timed)
        budget._chosen_at = None
        assert budget.choose(1) == 2
    budget._note_seconds(2, 3.0)
    assert budget.seconds(1, 4) == pytest.approx(5.0 * 3.0 / 3.0)  # stale: the table's 5 s, scaled like size 2's
    assert budget.choose(1) == 4  # 7 tokens in 5 s beat 3.6 in 3 s: chosen, and measured, again
    full = TreeShape(2, 2, 4)
    tree = TreeBudget(full, [PLAIN, full], warmup=0, refresh_every=0, costs={PLAIN: 1.0, full: 2.0}, timing=True)
    tree._note_seconds(full, 20.0)
    tree._note_seconds(PLAIN, 1.0)
    assert tree.step_seconds().tolist() == [1.0, 20.0]
    tree._choices += STALE_AFTER + 1  # the plain step runs on, the tree does not
    tree._note_seconds(PLAIN, 1.5)  # its median: 1.25 s, 1.25x its table
    assert tree.step_seconds().tolist() == [1.25, 2.5]  # the stale tree: its table's 2 s x 1.25


def test_plain_steps_are_timed_even_when_drafting_wins(monkeypatch):
    """A budget that drafts from its first step still measures plain steps (every 8th choice until 9 have run),
    so drafting is weighed against a plain step's measured time, not only its table time; then it drafts on."""
    clock = iter(range(1000))  # every step takes 1 s, whatever its size
    monkeypatch.setattr("mmspec.budget.time.perf_counter", lambda: float(next(clock)))
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, warmup=0, timing=True)  # drafting is free
    chosen = [budget.choose(1) for _ in range(120)]
    plain = [i for i, k in enumerate(chosen) if k == 0]
    assert plain == [8 * j - 1 for j in range(1, 10)]  # the 8th, 16th, .. choice, nine of them
    assert set(chosen) - {0} == {4} and len(budget._samples[0]) == 9
    untimed = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, warmup=0)
    assert 0 not in [untimed.choose(1) for _ in range(40)]  # without timing nothing is measured


def test_a_paused_step_does_not_move_the_measured_time():
    """A step the machine paused reads several times its usual time: it must not make plain steps look slow (a
    running mean carried it for several steps), while a lasting change of load is followed within a few steps."""
    budget = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), timing=True)
    for took in (1.0, 1.1, 0.9, 1.0, 5.0):
        budget._note_seconds(0, took)
    assert budget.seen[0] == pytest.approx(1.0)  # the median of the last steps, the 5 s pause ignored
    assert budget.plain_seconds(1) == pytest.approx(1.0)
    for _ in range(5):
        budget._note_seconds(0, 2.0)  # the machine got busier for good
    assert budget.seen[0] == pytest.approx(2.0)
class SettlingBudget(CyclingBudget):
    """Plain steps; settled after the third choice. Counts what the loop asks of it."""

    def __init__(self):
        super().__init__([0])
        self.observed = 0

    def settled(self) -> bool:
        return self.step >= 3

    def observe(self, result, active, draft=None) -> None:
        self.observed += 1


class CountingSkips(JacobiDrafter):
    skips = 0

    def skip(self, *args) -> None:
        self.skips += 1
        super().skip(*args)


def test_a_settled_budget_gets_plain_steps_without_asking_it_or_the_drafter():
    v, n = 16, 12
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    budget, drafter = SettlingBudget(), CountingSkips(v, 4, "random")
    out = generate(LMTarget(model, greedy, n), drafter, "greedy", prompt, batch_size=2, max_new_tokens=n,
                   budget=budget)
    vanilla = generate(LMTarget(model, greedy, n), NoDrafter(), "greedy", prompt, batch_size=2, max_new_tokens=n)
    assert torch.equal(out.tokens, vanilla.tokens)
    assert budget.step == 3 and budget.observed == 2 and drafter.skips == 2  # the third choice settled it
    assert out.stats.extra["budget_0"] == n - 1  # every step still counted
    steep = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), warmup=0, settle_after=4)
    steep.observe(result([0] * 4, [8] * 4), torch.ones(4, dtype=torch.bool))
    assert [steep.choose(1) for _ in range(4)] == [0] * 4 and steep.settled()
    steep.begin()  # a new call asks again
    assert not steep.settled()


def test_a_retry_waits_until_it_costs_a_small_share():
    """After a loss the backoff lasts at least until the smaller loss of the last two drafted calls is RETRY_SHARE
    of the calls run without the drafter: calls that lost by far (a retry will cost about as much) wait longer than
    the doubling backoff; one loss by far after a win, a close loss, keep it; so does a call predicted plain after
    a drafted call that lost."""
    from mmspec.budget import CALL_BACKOFF, RETRY_SHARE

    assert RETRY_SHARE == 0.02
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)
    assert budget.retry_calls() == 0  # nothing measured yet
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # unjudged: 10% under vanilla's
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # vanilla: 1 s a step
    budget.end_call(1, seconds=12.5, plain_steps=10, drafted=True)  # 25% over: loses, confirmed first
    assert budget.retry_calls() == 0  # the call before won: one loss by far may be a passing load
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # the confirming call: the loss stands
    assert budget.calls["lost"] == 1 and budget.skip_calls == CALL_BACKOFF - 1  # the doubling backoff
    for _ in range(CALL_BACKOFF - 1):
        assert not budget.drafts_this_call()
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=12.5, plain_steps=10, drafted=True)  # 25% over again: its retry waits 13 calls
    assert budget.retry_calls() == 13
    assert not budget.drafts_this_call()
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # (two references so far: confirmed first)
    assert budget.calls["lost"] == 2 and budget.skip_calls == 13 - 1 > 2 * CALL_BACKOFF  # (the confirming call)
    assert budget.backoff == 4 * CALL_BACKOFF  # (the doubling goes on underneath)
    budget.end_call(1, seconds=10.5, plain_steps=10, drafted=True)  # a close loss after it: 5% over
    assert budget.retry_calls() == 3  # 0.05 / 0.02, rounded up
    predicted = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0 if n == 1 else 3.0, warmup=2, timing=True)
    assert predicted.drafts_this_call()
    predicted.begin()
    for _ in range(2):
        choose_untimed(predicted)  # warm-up
    predicted.observe(result([0], [2]), torch.ones(1, dtype=torch.bool))  # nothing accepted
    predicted.end_call(1, seconds=13.0, plain_steps=10, drafted=True)  # unjudged, 30% over vanilla's
    assert not predicted.drafts_this_call()  # the reference
    predicted.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    gates = [predicted.drafts_this_call() for _ in range(16)]  # predicted plain: 15 calls, not 4
    assert gates == [False] * 15 + [True] and predicted.calls["predicted_plain"] == 1


def test_a_loss_must_exceed_the_calls_own_spread():
    """Pooled drafted calls lose when they ran below vanilla's speed by more than a call's spread (CALL_SPREAD
    before 3 calls were judged, then their standard deviation) over the root of their effective number: one call a
    little slower than vanilla keeps drafting, one far slower backs off, and small losses that hold over several
    calls back off too."""
    from mmspec.budget import CALL_SPREAD

    def after(calls: tuple[float, ...]) -> AutoBudget:
        budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)
        budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # unjudged
        for _ in range(3):
            budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # vanilla: 1 s a step
        for seconds in calls:
            budget.end_call(1, seconds=seconds, plain_steps=10, drafted=True)
        return budget

    assert CALL_SPREAD == 0.1
    one = after((10.8,))  # 0.93x: inside the spread of one call
    assert one.loss_margin() == pytest.approx(0.1) and one.calls["lost"] == 0 and one.drafts_this_call()
    assert after((11.5,)).calls["lost"] == 1  # 0.87x: lost at once
    assert after((10.5, 10.6)).calls["lost"] == 0  # 0.95x twice: inside the spread of two calls (0.07)
    held = after((10.5, 10.6, 10.5))  # a third: their own spread is 0.005, and the loss holds
    assert held.calls["lost"] == 1 and held.loss_margin() < 0.01


def test_a_retry_is_judged_on_its_own():
    """The retry after a backoff is judged alone, not pooled with the calls whose loss made the backoff: a retry that
    won keeps drafting and resets the backoff."""
    from mmspec.budget import CALL_BACKOFF

    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # unjudged
    for _ in range(3):
        budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # vanilla: 1 s a step, measured 3 times
    budget.end_call(1, seconds=12.0, plain_steps=10, drafted=True)  # lost
    assert budget.calls["lost"] == 1 and budget.skip_calls == CALL_BACKOFF
    while budget.skip_calls:
        assert not budget.drafts_this_call()
    assert budget.drafts_this_call() and budget._explore_call
    budget.end_call(1, seconds=9.5, plain_steps=10, drafted=True)  # won alone; pooled with the loss it would lose
    assert budget.calls["lost"] == 1 and budget.backoff == CALL_BACKOFF and budget.drafts_this_call()


def test_call_predictions_carry_the_overrun_drafted_calls_showed():
    """A call's prediction (begin + its steps at the best size's speed) is multiplied by how much longer the last
    drafted calls took than predicted (the median); the call runs without the drafter only where that exceeds
    vanilla's time by more than the predictions have erred (the overruns' standard deviation, CALL_SPREAD before
    3): steady overruns are trusted, scattered ones are not; a retry that wins clears the overruns."""
    from mmspec.budget import CALL_BACKOFF, CALL_SPREAD

    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True)
    budget._plain_and_best_speeds = lambda: (1.0, 1.1)  # tokens/s: drafting 10% faster by the estimates
    assert budget.overrun() == 1.0 and budget.prediction_error() == CALL_SPREAD and budget.drafts_this_call()
    budget.end_call(1, seconds=8.0, plain_steps=10, drafted=True)  # unjudged, not predicted
    assert not budget.drafts_this_call()  # the reference: 1 s a step
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    for seconds in (8.0, 10.5, 9.5):  # predicted 10 / 1.1 = 9.09 s each; pooled, all win
        assert budget.drafts_this_call() and budget._predicted == pytest.approx(10 / 1.1 * budget.overrun())
        budget.end_call(1, seconds=seconds, plain_steps=10, drafted=True)
    assert budget.calls["lost"] == 0 and budget.overrun() == pytest.approx(9.5 / (10 / 1.1))  # the median
    assert budget.prediction_error() > 0.1  # 0.88, 1.155 and 1.045 scatter: a 10.45 s prediction does not decide
    assert budget.drafts_this_call() and budget.calls["predicted_plain"] == 0
    budget._overruns.extend([1.2, 1.21, 1.22] * 3)  # steady overruns: 11 s predicted, vanilla 10 s, error 0.009
    assert not budget.drafts_this_call() and budget.calls["predicted_plain"] == 1
    for _ in range(CALL_BACKOFF - 1):
        assert not budget.drafts_this_call()
    assert budget.drafts_this_call() and budget._predicted is None  # the retry explores; it is not predicted
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # and wins
    assert budget.overrun() == 1.0 and budget.drafts_this_call()  # trusted afresh: predicted 9.09 s


def test_calls_whose_drafting_lost_are_followed_by_vanilla_calls(monkeypatch):
    """A call whose drafting (the drafter's begin included) took longer than the plain steps it replaced makes the
    next `backoff` calls run as vanilla (no drafter begin, no budget), then one drafts again; the backoff doubles
    after each loss and resets after a win. The first drafted call is not judged (one-time costs); the call after
    it runs without the drafter and measures vanilla's step, which the gate judges drafted calls against (not the
    table's), and a reference call runs again after REFERENCE_EVERY drafted calls that won by little. (The backoff
    alone: a retry may cost a whole call here; `test_a_retry_waits_until_it_costs_a_small_share` has the rest.)"""
    from mmspec.budget import CALL_BACKOFF, REFERENCE_EVERY, UNJUDGED_CALLS

    monkeypatch.setattr("mmspec.budget.RETRY_SHARE", 1.0)
    assert UNJUDGED_CALLS == 1
    budget = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)  # a plain step: 1 s by the table
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=99.0, plain_steps=10, drafted=True)  # the first drafted call: not judged
    assert budget.calls["lost"] == 0 and budget.calls["unjudged"] == 1
    assert not budget.drafts_this_call() and budget.calls["reference"] == 1  # a reference call
    budget.end_call(1, seconds=5.0, plain_steps=10, drafted=False)  # vanilla's step: 0.5 s, not the table's 1 s
    assert budget.gate_plain_seconds(1) == 0.5 and budget.plain_seconds(1) == 0.5
    assert budget.drafts_this_call()
    budget.end_call(1, seconds=4.5, plain_steps=10, drafted=True)  # won: 4.5 s against 10 vanilla steps of 0.5 s
    assert budget.drafts_this_call() and budget.calls["lost"] == 0
    budget.end_call(1, seconds=8.0, plain_steps=10, drafted=True)  # pooled: 0.9 * 4.5 + 8 = 1.27 x (0.9 * 5 + 5)
    assert budget.calls["lost"] == 0 and not budget.drafts_this_call()  # one reference so far: confirmed first
    budget.end_call(1, seconds=5.0, plain_steps=10, drafted=False)  # vanilla's step again 0.5 s: the loss stands
    gates = [budget.drafts_this_call() for _ in range(CALL_BACKOFF)]  # (the confirming call was the first)
    assert gates == [False] * (CALL_BACKOFF - 1) + [True] and budget.calls["lost"] == 1
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=True)  # lost again: twice as many vanilla calls
    assert not budget.drafts_this_call()
    budget.end_call(1, seconds=5.0, plain_steps=10, drafted=False)  # (two references so far: confirmed too)
    assert [budget.drafts_this_call() for _ in range(2 * CALL_BACKOFF)] == [False] * (2 * CALL_BACKOFF - 1) + [True]
    assert budget.calls["lost"] == 2
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=True)  # three references: a loss backs off at once
    assert budget.calls["lost"] == 3 and budget.skip_calls == 4 * CALL_BACKOFF
    # (against the table's 1 s a plain step, the calls of 8 and 10 s would have read as wins)
    pooled = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=True)
    pooled.end_call(1, seconds=9.0, plain_steps=10, drafted=True)
    pooled.end_call(1, seconds=10.0, plain_steps=10, drafted=False)
    for seconds in (7.0, 7.0, 7.0, 12.0):  # one slow call after faster ones: drafted calls are judged pooled
        assert pooled.drafts_this_call()
        pooled.end_call(1, seconds=seconds, plain_steps=10, drafted=True)
    assert pooled.calls["lost"] == 0
    gates = []  # a clear win (10 plain steps of 1 s in 5 s) needs no new reference
    for _ in range(2 * REFERENCE_EVERY):
        gates.append(pooled.drafts_this_call())
        pooled.end_call(1, seconds=5.0, plain_steps=10, drafted=gates[-1])
    assert all(gates) and pooled.calls["reference"] == 0
    gates = []  # a close one (1.1x < REFERENCE_MARGIN) measures vanilla again after REFERENCE_EVERY drafted calls
    for _ in range(REFERENCE_EVERY):
        gates.append(pooled.drafts_this_call())
        pooled.end_call(1, seconds=9.0, plain_steps=10, drafted=gates[-1])
    assert gates.count(False) == 1 and pooled.calls["reference"] == 1
    untimed = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, timing=False)  # no measured times: never gated
    untimed.end_call(1, seconds=99.0, plain_steps=1, drafted=True)
    assert untimed.drafts_this_call()

    class Gated(SettlingBudget):
        def drafts_this_call(self):
            return False

        def end_call(self, batch, seconds, plain_steps, drafted, begin_seconds=0.0):
            self.ended = (batch, plain_steps, drafted)

    class NoBegin(CountingSkips):
        def begin(self, inputs, state):
            raise AssertionError("a call without the drafter must not run its begin")

    v, n = 16, 12
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    budget = Gated()
    gated = LMTarget(model, greedy, n, max_draft_nodes=30)
    out = generate(gated, NoBegin(v, 4, "random"), "greedy", prompt, batch_size=2, max_new_tokens=n, budget=budget)
    plain = LMTarget(model, greedy, n, max_draft_nodes=1)  # as a vanilla call sizes it
    vanilla = generate(plain, NoDrafter(), "greedy", prompt, batch_size=2, max_new_tokens=n)
    assert torch.equal(out.tokens, vanilla.tokens) and budget.step == 0
    assert gated.runner.cache.capacity == plain.runner.cache.capacity == 5 + n + 2  # no room for draft nodes
    drafted = LMTarget(model, greedy, n, max_draft_nodes=30)
    generate(drafted, CountingSkips(v, 4, "random"), "greedy", prompt, batch_size=2, max_new_tokens=n,
             budget=SettlingBudget())
    assert drafted.runner.cache.capacity == 5 + n + 30 + 1  # a drafted call keeps it
    assert out.stats.extra["budget_0"] == n - 1 and out.stats.extra["calls_without_drafter"] == 1
    assert budget.ended == (2, n - 1, False)
    compiled = iter(range(100))  # every read differs: torch.compile compiled during the call
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mmspec.loop.compilations", lambda: next(compiled))
        patch.setattr("mmspec.budget.compilations", lambda: next(compiled))
        budget = Gated()
        generate(LMTarget(model, greedy, n), NoBegin(v, 4, "random"), "greedy", prompt, batch_size=2,
                 max_new_tokens=n, budget=budget)
    assert not hasattr(budget, "ended")  # a call that compiled timed the compiler: not judged


def test_steps_that_compiled_are_not_timed(monkeypatch):
    """A step during which torch.compile compiled a forward took the compiler's seconds, not its own: not counted."""
    compiled = [0]
    monkeypatch.setattr("mmspec.budget.compilations", lambda: compiled[0])
    clock = iter([0.0, 5.0, 6.0])
    monkeypatch.setattr("mmspec.budget.time.perf_counter", lambda: next(clock))
    budget = AutoBudget(range(9), verify_seconds=lambda b, n: float(n), warmup=2, timing=True)
    assert budget.choose(1) == 2
    compiled[0] = 1  # the first step compiles its shapes
    assert budget.choose(1) == 2 and budget.seen == {}
    budget.choose(1)
    assert budget.seen == {2: 1.0}


def test_per_size_values_dwell_and_refresh():
    """Jacobi's options: a size is valued by what its own steps emitted (not by the position model), a choice is
    kept `dwell` steps, the first step after a change is not counted, the warm-up size returns at refresh steps."""
    budget = AutoBudget([0, 1, 3], verify_seconds=lambda b, n: 1.0 + 0.1 * n, warmup=2, per_size=True, dwell=3,
                        refresh_every=8, decay=1.0)
    every = torch.ones(2, dtype=torch.bool)
    chosen = []
    for _ in range(12):
        k = budget.choose(2)
        chosen.append(k)
        # size 3 emits 4 tokens per row, size 1 emits 1 (its drafts are always rejected)
        budget.observe(result([k] * 2 if k == 3 else [0, 0], [k, k]), every)
    assert chosen[:2] == [3, 3]  # warm-up at the configured size (cheap here)
    assert budget.rows_at[3] == 2 * sum(1 for i, k in enumerate(chosen) if k == 3 and i and chosen[i - 1] == 3)
    assert budget.expected_tokens(3) == 4.0 and budget.expected_tokens(0) == 1.0
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(chosen)]
    assert all(r >= 2 for r in runs[:-1])  # a change is kept at least for the rest of the dwell
    assert chosen[8] == 3  # refresh at step 8


def test_per_size_values_leave_out_the_steps_after_a_change():
    """`uncounted_after_change`: a grown window's tail is still converging, so the first steps at a new size do not
    count towards its value; the steps after them do."""
    budget = AutoBudget([0, 3], verify_seconds=lambda b, n: 1.0, warmup=6, per_size=True, dwell=1,
                        uncounted_after_change=3, decay=1.0)
    every = torch.ones(1, dtype=torch.bool)
    emitted = [1, 1, 2, 4, 4, 4]  # what the six warm-up steps at size 3 accepted + 1
    for tokens in emitted:
        assert budget.choose(1) == 3
        budget.observe(result([tokens - 1], [3]), every)
    assert budget.rows_at[3] == 3 and budget.expected_tokens(3) == 4.0  # steps 4-6 only
    assert AutoBudget([0, 3], verify_seconds=lambda b, n: 1.0).uncounted_after_change == 1  # the default


def test_per_size_values_count_a_window_once_it_is_refilled():
    """`count_once_refilled` (Jacobi's): a step counts once the rows have emitted, since the change, as many tokens
    as the size; `dwell` then counts counted steps, so a grown window is held until it has shown its converged
    value, and a change of size starts the count again."""
    budget = AutoBudget([0, 3, 7], verify_seconds=lambda b, n: 1.0, warmup=0, per_size=True, dwell=2,
                        count_once_refilled=True, decay=1.0, prior_strength=1e-9)
    budget.rows_at, budget.emitted_at = {3: 1.0, 7: 1.0}, {3: 1.0, 7: 9.0}  # 7 looks best: it is chosen
    rows = torch.tensor([True, True, False])  # the third row is done
    for accepted in ([0, 2, 0], [1, 3, 0], [2, 2, 0], [4, 4, 0], [6, 6, 0]):  # 2, 3, 3, 5, 7 tokens a row
        assert budget.choose(2) == 7  # held: until two steps are counted
        budget.observe(result(accepted, [7, 7, 7]), rows)
    # steps 1-3 left out (0, 2, 5 tokens a row emitted before them: < 7), steps 4 and 5 counted (8 and 13 before)
    assert budget.rows_at[7] == 1.0 + 2 + 2 and budget.emitted_at[7] == 9.0 + 10 + 14
    assert budget._holding() is False
    budget.emitted_at[3] = 99.0  # 3 now looks best: a change, and its count starts again
    assert budget.choose(2) == 3
    budget.observe(result([2, 2, 0], [3, 3, 3]), rows)  # before it: 0 tokens emitted at 3, not counted
    assert budget.rows_at[3] == 1.0 and budget._holding()
    budget.choose(2)
    budget.observe(result([2, 2, 0], [3, 3, 3]), rows)  # 3 tokens a row before it: counted
    assert budget.rows_at[3] == 3.0


def sampled_tv(make_drafter, budget, rows=40_000):
    v, n = 4, 4
    model = toy_model(seed=3, vocab_size=v, dim=16)
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = torch.tensor([[1, 2, 0]])
    exact = exact_sequence_distribution(model, prompt, n, params)
    gen = torch.Generator().manual_seed(6)
    target = LMTarget(model, params, max_new_tokens=n)
    out = generate(target, make_drafter(model, v, params, gen), "lossless", prompt.expand(rows, -1), batch_size=rows,
                   max_new_tokens=n, generator=gen, budget=budget)
    codes = (out.tokens * (v ** torch.arange(n - 1, -1, -1))).sum(-1)
    return tv_distance(empirical_distribution(codes, v ** n), exact), tv_tolerance(int((exact > 1e-4).sum()), rows), out


DRAFTERS = {"jacobi": lambda model, v, params, gen: JacobiDrafter(v, 4, "random"),
            "draft-model": lambda model, v, params, gen: DraftModelDrafter(toy_model(seed=4, vocab_size=v, dim=16),
                                                                           3, params)}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("budget", ["cycling", "auto", "auto-timed-per-size"])
def test_sampling_with_a_changing_draft_size_has_the_exact_sequence_distribution(drafter, budget):
    policies = {"cycling": lambda: CyclingBudget([2, 0, 3, 1, 0]),
                "auto": lambda: AutoBudget(range(4), verify_seconds=lambda b, n: 1.0 + 0.25 * n),
                # as the pipelines build Jacobi's: measured times, per-size values, dwell, refreshes
                "auto-timed-per-size": lambda: AutoBudget([0, 1, 3], verify_seconds=lambda b, n: 1.0 + 0.25 * n,
                                                          timing=True, per_size=True, dwell=2, warmup=1,
                                                          refresh_every=2)}
    policy = policies[budget]()
    tv, tol, out = sampled_tv(DRAFTERS[drafter], policy)
    assert tv < tol
    assert out.stats.num_accepted_tokens > 0
    if budget == "cycling":
        assert {"budget_0", "budget_3"} <= set(out.stats.extra)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_decoding_with_a_budget_equals_greedy_vanilla(drafter):
    v, n = 16, 20
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (3, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)

    def run(d, budget):
        return generate(LMTarget(model, greedy, n), d, "greedy", prompt, batch_size=3, max_new_tokens=n,
                        budget=budget).tokens

    vanilla = run(NoDrafter(), None)
    for budget in (CyclingBudget([3, 0, 1, 2]), AutoBudget(range(4), verify_seconds=lambda b, k: 1.0)):
        assert torch.equal(run(DRAFTERS[drafter](model, v, greedy, None), budget), vanilla)


# ------------------------------------------------------------------------------------------------ tree budgets
def tree_drafter(model, v, params, gen):
    return TreeModelDrafter(toy_model(seed=4, vocab_size=v, dim=16), top_k=2, depth=3, total_tokens=6)


TREE_CYCLE = [TreeShape(2, 3, 6), 0, TreeShape(1, 2, 3), 0, 0, 0, 0, 0, TreeShape(2, 2, 4), TreeShape(1, 1, 2)]


@pytest.mark.parametrize("budget", ["cycling", "auto"])
def test_sampling_with_changing_tree_shapes_has_the_exact_sequence_distribution(budget, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    full = TreeShape(2, 3, 6)
    costs = {s: 1.0 + 0.1 * s.total for s in tree_menu(full)}  # cheap enough that the policy drafts
    policy = CyclingBudget([0, TreeShape(1, 2, 3), 0, full]) if budget == "cycling" else TreeBudget(
        full, warmup=1, refresh_every=3, costs=costs)
    tv, tol, out = sampled_tv(tree_drafter, policy)
    assert tv < tol
    assert out.stats.num_accepted_tokens > 0
    if budget == "cycling":
        assert {"budget_0", "budget_chain2"} <= set(out.stats.extra)


def test_greedy_tree_decoding_with_changing_shapes_equals_greedy_vanilla(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    v, n = 16, 24
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (3, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)

    def run(d, budget):
        return generate(LMTarget(model, greedy, n, max_draft_nodes=8), d, "lossless", prompt, batch_size=3,
                        max_new_tokens=n, budget=budget).tokens

    vanilla = run(NoDrafter(), None)
    for budget in (CyclingBudget(TREE_CYCLE), TreeBudget(TreeShape(2, 3, 6), warmup=1)):
        assert torch.equal(run(TreeModelDrafter(model, top_k=2, depth=3, total_tokens=6), budget), vanilla)


def test_counterfactual_accepts_are_what_the_smaller_tree_accepts():
    """Greedy: for every shape inside the drafted one, the counted acceptance equals what verifying the smaller
    shape's own tree accepts (the drafter is a deterministic model, the target another)."""
    v, n = 12, 6
    target_model, draft_model = toy_model(seed=0, vocab_size=v), toy_model(seed=1, vocab_size=v)
    prompt = torch.randint(0, v, (6, 4), generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(temperature=0)
    full = TreeShape(3, 4, 20)
    shapes = tree_menu(full)
    for step in range(3):  # a few different roots: the first step of growing prompts
        p = torch.cat([prompt, torch.randint(0, v, (6, step), generator=torch.Generator().manual_seed(step))], 1)
        results = {}
        for shape in shapes[1:]:
            target = LMTarget(target_model, greedy, n, max_draft_nodes=20)
            drafter = TreeModelDrafter(draft_model, top_k=3, depth=4, total_tokens=20)
            state = DecodeState.new(6, n, "cpu")
            first = target.prefill(p)
            state.last_token = first[:, 0].argmax(-1)
            drafter.begin(p, state)
            drafter.set_draft_size(shape)
            tree = drafter.propose(state)
            results[shape] = (tree, accept("lossless", tree, target.verify(state, tree), None))
        tree, res = results[full]
        counts = counterfactual_accepts(tree, res.accepted_nodes, shapes)
        for s, shape in enumerate(shapes[1:], 1):
            assert torch.equal(counts[:, s], results[shape][1].num_accepted), shape
        assert counts[:, 0].eq(0).all()
        for shape in shapes[1:]:  # a chain counts for its own chains as the general (tree) path counts
            chain, chain_res = results[shape]
            if chain.is_chain:
                chain.max_children = 2  # the same nodes through the general path
                general = counterfactual_accepts(chain, chain_res.accepted_nodes, shapes)
                chain.max_children = 1
                shown = torch.tensor([shape.contains(o) and o != PLAIN for o in shapes])
                fast = counterfactual_accepts(chain, chain_res.accepted_nodes, shapes)
                assert torch.equal(fast[:, shown], general[:, shown]), shape


def test_the_tree_budget_picks_the_fastest_expected_shape():
    full = TreeShape(4, 3, 12)
    shapes = tree_menu(full)
    assert shapes[0] == PLAIN and TreeShape(1, 3, 4) in shapes and full in shapes
    flat = {s: 1.0 for s in shapes}  # every shape costs a plain step: the most accepting one wins
    budget = TreeBudget(full, costs=flat, warmup=0, refresh_every=0, timing=False)
    budget.accepted[:] = torch.tensor([0.0] + [s.total + 0.1 * s.top_k + 0.01 * s.depth for s in shapes[1:]])
    budget.rows[:] = 1.0
    assert budget.choose(1) == full
    steep = TreeBudget(full, costs={s: float(s.total) for s in shapes}, warmup=0, refresh_every=0, timing=False)
    assert steep.choose(1) == 0  # nothing seen accepted and wider costs more: plain steps
    warm = TreeBudget(full, costs=flat, warmup=1, refresh_every=3, timing=False)
    chosen = [str(warm.choose(1)) for _ in range(10)]  # warm-up, then refreshes at steps 3, 6, 12, ..
    assert [i for i, c in enumerate(chosen) if c == str(full)] == [0, 3, 6] and set(chosen) == {str(full), "0"}
    # where wide verifies cost, the warm-up drafts the shape containing the most others within 3 plain steps
    priced = TreeBudget(full, costs={s: 1.0 + 0.25 * (s.total - 1) for s in shapes}, warmup=1, timing=False)
    explore = priced.choose(1)
    assert explore == TreeShape(4, 3, 8) and priced.costs[explore] <= 3.0  # chains 1-3, trees of depth <= 3
    timed = TreeBudget(full, costs=flat, warmup=0, refresh_every=0)
    timed.accepted[:] = budget.accepted
    timed.rows[:] = 1.0
    timed.seen[full], timed.seen[PLAIN] = 100.0, 1.0  # as they ran: the full shape 100x its table time
    seconds = timed.step_seconds()
    assert seconds[timed.shapes.index(full)] == 100.0 and seconds[0] == 1.0
    assert seconds[1] == pytest.approx(50.5)  # shapes not run: their table time x the mean ratio of those that ran
    assert timed.choose(1) == 0
    dear = TreeBudget(full, costs={s: 1.0 if s == PLAIN else 10.0 + s.total for s in shapes}, warmup=1, timing=False)
    assert dear.choose(1) == TreeShape(1, 1, 2)  # nothing within 3 plain steps: the warm-up still drafts (cheapest)


def test_a_refresh_while_chains_are_chosen_drafts_the_deepest_chain():
    """A chain of depth d says nothing about position d + 1: refreshes then draft the deepest chain of the menu, and
    what it accepts past d revalues the deeper chains."""
    full = TreeShape(4, 3, 12)
    shapes = tree_menu(full)
    deepest = max((s for s in shapes if s.top_k == 1), key=lambda s: s.depth)
    costs = {s: 1.0 + 0.25 * (s.total - 1) for s in shapes}
    budget = TreeBudget(full, costs=costs, warmup=0, refresh_every=4, timing=False)
    chain2 = shapes.index(TreeShape(1, 2, 3))
    budget.accepted[chain2], budget.rows[chain2] = 2.0, 1.0  # chain 2 fully accepted, nothing seen deeper
    budget.chain_reached[:2], budget.chain_accepted[:2] = 1.0, 1.0
    budget.chain_reached[2], budget.chain_accepted[2] = 1.0, 0.0  # one miss at position 3
    chosen = [budget.choose(1) for _ in range(5)]
    assert chosen[:4] == [TreeShape(1, 2, 3)] * 4 and chosen[4] == deepest


@pytest.mark.parametrize("drafter", ["draft-model", "tree"])
def test_more_plain_steps_in_a_row_than_the_pending_room_keep_greedy_tokens(drafter):
    """Plain steps' tokens wait in the drafter's pending room (`PLAIN_ROOM`); a longer run of them runs and commits
    the pending tokens first (`PendingRoom.room_for_plain_token`), and the drafts after it still match vanilla."""
    from mmspec.tree_budget import PLAIN_ROOM

    v, n = 16, PLAIN_ROOM + 40
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    make = {"draft-model": lambda: DraftModelDrafter(model, 3, greedy),
            "tree": lambda: TreeModelDrafter(model, top_k=2, depth=3, total_tokens=6)}[drafter]
    size = 3 if drafter == "draft-model" else TreeShape(2, 3, 6)
    budget = CyclingBudget([0] * (PLAIN_ROOM + 20) + [size] * 4)  # past the room of either drafter

    def run(d, b):
        return generate(LMTarget(model, greedy, n, max_draft_nodes=8), d, "greedy", prompt, batch_size=2,
                        max_new_tokens=n, budget=b)

    out = run(make(), budget)
    assert torch.equal(out.tokens, run(NoDrafter(), None).tokens)
    assert out.stats.extra["budget_0"] >= PLAIN_ROOM + 20 and out.stats.num_accepted_tokens > 0


def test_the_batch_tail_counts_rows_that_follow_the_drafter_worse():
    """A call lasts as long as its slowest row: rows whose own acceptance rate is lower stay slow for the whole
    call. `row_spread` measures that spread from a call's rows (split-half: steps' noise drops out) and
    `batch_steps` adds it; plain steps are not affected."""
    from mmspec.budget import batch_steps

    assert batch_steps(48, 32, 1.0, 0.0, spread=0.5) == 48
    assert batch_steps(48, 32, 3.0, 1.0, spread=0.3) > batch_steps(48, 32, 3.0, 1.0) > 16
    # one row: no slowest row to wait for, only the slower rates' longer counts (E[r / a row's mean] > r / mean)
    assert batch_steps(48, 1, 3.0, 1.0) < batch_steps(48, 1, 3.0, 1.0, spread=0.3) < batch_steps(48, 2, 3.0, 1.0, 0.3)


@pytest.mark.parametrize("chain, rate, tokens, rows", [(10, 0.97, 48, 32), (3, 0.8, 48, 32), (10, 0.9, 48, 8),
                                                        (15, 0.6, 256, 8), (5, 0.9, 48, 2)])
def test_batch_steps_match_a_simulation_of_rows_drafting_chains(chain, rate, tokens, rows):
    """`batch_steps` against rows simulated step by step: each drafts a chain of `chain` tokens, each accepted with
    probability `rate` while the ones before it were, and emits the accepted ones plus one, until `tokens` are
    out; the call takes the most steps of its rows. Within 5% of the simulated mean over 2000 calls (r / mean plus a
    normal tail was 13% short for chains of 10 at 48 tokens: the last step is whole)."""
    from mmspec.budget import batch_steps

    gen = torch.Generator().manual_seed(0)

    def emitted(shape) -> torch.Tensor:  # tokens a row emits in one step
        accepted = (torch.rand(*shape, chain, generator=gen) < rate).long().cumprod(-1).sum(-1)
        return accepted + 1

    sample = emitted((200_000,)).double()
    calls, left, steps = 2000, torch.full((2000, rows), tokens), torch.zeros(2000, rows)
    while (left > 0).any():
        active = left > 0
        left = left - emitted((calls, rows)) * active
        steps += active
    simulated = float(steps.max(1).values.mean())
    assert batch_steps(tokens, rows, float(sample.mean()), float(sample.var())) == pytest.approx(simulated, rel=0.05)

    def spread_after(rates, steps: int = 64, seed: int = 0) -> float:
        gen = torch.Generator().manual_seed(seed)
        budget = AutoBudget([0, 4], verify_seconds=lambda b, n: 1.0, timing=True)
        budget._last = 4
        active = torch.ones(len(rates), dtype=torch.bool)
        for _ in range(steps):
            accepted = torch.binomial(torch.full((len(rates),), 4.0), torch.tensor(rates), generator=gen).long()
            budget.observe(result(accepted.tolist(), [4] * len(rates)), active)
        budget.end_call(len(rates), seconds=1.0, plain_steps=10, drafted=True)
        return budget.row_spread()

    same = spread_after([0.6] * 32)  # every row alike: the steps' own noise only
    assert same < 0.06
    # half the rows at 0.4, half at 0.8: relative to the mean 0.6, a spread of 0.2 / 0.6 = 0.33
    assert spread_after([0.4, 0.8] * 16) == pytest.approx(1 / 3, abs=0.06)
    budget = AutoBudget([0, 4], verify_seconds=lambda b, n: 1.0, timing=True)
    budget._last = 4
    budget.observe(result([1, 3, 1, 3], [4] * 4), torch.ones(4, dtype=torch.bool))
    budget._new_call()  # a call that never reached `end_call` leaves nothing to the next
    budget.end_call(4, seconds=1.0, plain_steps=10, drafted=True)
    assert budget.row_spread() == 0.0


def test_an_unmeasured_size_reads_its_table_by_the_drafting_sizes_line():
    """Once three drafting sizes ran, an unmeasured one is priced on their least-squares line (a drafted step's
    extra work is partly fixed: a ratio under-priced short chains); with fewer, by the measured sizes' mean ratio;
    an unmeasured plain step always by the ratio. Chain and tree budgets alike."""
    from mmspec.budget import table_reading

    line = table_reading([(2.0, 1.0), (4.0, 7.0), (6.0, 9.0), (8.0, 11.0)], [(4.0, 7.0), (6.0, 9.0), (8.0, 11.0)])
    assert line(1.0) == pytest.approx(4.0)  # table + 3 s
    two = table_reading([(4.0, 7.0), (8.0, 11.0)], [(4.0, 7.0), (8.0, 11.0)])
    assert two(1.0) == pytest.approx((7.0 / 4.0 + 11.0 / 8.0) / 2.0)  # a ratio
    flat = table_reading([(4.0, 4.0), (5.0, 9.0), (6.0, 6.0)], [(4.0, 4.0), (5.0, 9.0), (6.0, 6.0)])
    assert flat(10.0) >= 0.5 * 10.0  # the slope is bounded below
    budget = AutoBudget([0, 1, 2, 4, 8], verify_seconds=lambda b, n: float(n), warmup=0, timing=True)
    for k in (2, 4, 8):
        budget._note_seconds(k, k + 1.0 + 3.0)  # its table (k + 1 s) + 3 s
    assert budget.seconds(1, 1) == pytest.approx(2.0 + 3.0)
    assert budget.seconds(1, 0) == pytest.approx(1.0 * (6.0 / 3.0 + 8.0 / 5.0 + 12.0 / 9.0) / 3.0)  # the ratio
    shapes = [PLAIN] + [TreeShape(1, d, d + 1) for d in (1, 2, 4, 8)]
    costs = {shape: float(shape.total) for shape in shapes}
    tree = TreeBudget(shapes[-1], shapes, warmup=0, refresh_every=0, costs=costs, timing=True)
    for shape in shapes[2:]:
        tree._note_seconds(shape, costs[shape] + 3.0)
    assert tree.step_seconds()[1].item() == pytest.approx(2.0 + 3.0)  # the chain of 1 on the line


def predicted_budget() -> tuple[AutoBudget, dict]:
    """A budget whose estimates read `speeds["now"]` (plain, best drafting; tokens/s), after its unjudged call and a
    reference (vanilla 1 s a step), with a drafted call predicted at 10 / 1.1 s running."""
    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True)
    speeds = {"now": (1.0, 1.1)}
    budget._plain_and_best_speeds = lambda: speeds["now"]
    budget.end_call(1, seconds=8.0, plain_steps=10, drafted=True)  # unjudged, not predicted
    budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # the reference
    assert budget.drafts_this_call() and budget._predicted == pytest.approx(10 / 1.1)
    return budget, speeds


def test_a_calls_overrun_is_read_against_its_own_measured_steps():
    """A predicted call is compared, at its end, with its own begin plus its steps at the best size's speed as the
    estimates then read them (its steps measured): a call slowed by a passing load, whose steps read as slow, does
    not also count as an overrun (which would multiply the next predictions by the same slowdown)."""
    budget, speeds = predicted_budget()
    speeds["now"] = (1.0, 0.55)  # the call's steps ran at half speed, and the estimates now say so
    budget.end_call(1, seconds=10 / 0.55 + 0.5, plain_steps=10, drafted=True, begin_seconds=0.5)
    assert budget.overrun() == pytest.approx(1.0)  # not 2.05: the slowdown is in the step times already


def test_a_call_that_dropped_rows_adds_no_overrun():
    """A predicted call in which the loop dropped finished rows ran steps its prediction (every row held to the end)
    did not price, and the estimates at its end are those of the rows it held last: it adds no overrun, which would
    multiply the next predictions (one row's speeds against a full batch's call read as a 2x overrun)."""
    budget, speeds = predicted_budget()
    budget.select_rows(torch.tensor([0]))  # the loop dropped rows; the estimates now read one row's speeds
    speeds["now"] = (2.0, 2.2)
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)
    assert budget.overrun() == 1.0 and not budget._overruns
    assert budget.drafts_this_call() and budget._predicted is None  # (after a call that dropped rows: no prediction)
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # kept its rows: the next call is predicted ..
    assert budget.drafts_this_call() and budget._predicted == pytest.approx(10 / 2.2)
    budget.end_call(1, seconds=9.0, plain_steps=10, drafted=True)  # .. and, keeping its rows, adds its overrun
    assert list(budget._overruns) == [pytest.approx(9.0 / (10 / 2.2))]


def test_a_call_whose_steps_ran_slow_is_not_judged():
    """A drafted call whose steps took LOAD_SLOW longer than the same sizes' usual ran under a load that came and
    went (a step's cost does not follow the batch's content): no verdict, no backoff; the same call time with its
    steps at their usual speed loses."""
    budget = AutoBudget([0, 2], verify_seconds=lambda b, n: 1.0, timing=True)
    budget.end_call(1, seconds=8.0, plain_steps=10, drafted=True)  # unjudged
    for _ in range(3):
        budget.end_call(1, seconds=10.0, plain_steps=10, drafted=False)  # vanilla: 1 s a step
    for _ in range(5):
        budget._note_seconds(2, 1.0)  # size 2's usual step
    budget._new_call()
    assert budget.call_load() == 1.0  # (no step timed yet)
    for _ in range(4):
        budget._note_seconds(2, 2.5)
    assert budget.call_load() == pytest.approx(2.5)
    budget.end_call(1, seconds=15.0, plain_steps=10, drafted=True)  # 1.5x vanilla's time, its steps 2.5x slow
    assert budget.calls["loaded"] == 1 and budget.calls["lost"] == 0 and budget.skip_calls == 0
    assert not budget._confirming and budget.drafts_this_call()
    budget._new_call()
    for _ in range(4):
        budget._note_seconds(2, 1.0)
    assert budget.call_load() == pytest.approx(1.0)
    budget.end_call(1, seconds=15.0, plain_steps=10, drafted=True)  # the same time at the usual step speed
    assert budget.calls["lost"] == 1 and budget.skip_calls > 0


def test_a_budgets_observe_reads_the_step_in_one_transfer():
    """On a GPU every read of a device value waits for the device: a step's observe gathers its sums on the device
    and reads them in one transfer, never value by value (the H200 runs, docs/benchmarks.md)."""
    chain = AutoBudget(range(5), verify_seconds=lambda b, n: 1.0, prior_strength=1e-9)
    with record_phases(count_ops=True) as reads:  # reads.syncs: float(), int(), bool() of a tensor (not .tolist())
        chain.observe(result([0, 2, 4, 1], [4, 4, 4, 4]), torch.ones(4, dtype=torch.bool))
    assert not reads.syncs
    assert chain.reached.tolist() == [4, 3, 2, 1] and chain.accepted.tolist() == [3, 2, 1, 1]
    assert chain.rows_at[0] == 4 and chain.emitted_at[0] == 11 and chain.emitted_sq_at[0] == 1 + 9 + 25 + 4

    v, full = 12, TreeShape(3, 4, 20)
    target = LMTarget(toy_model(seed=0, vocab_size=v), SamplingParams(temperature=0), 6, max_draft_nodes=20)
    drafter = TreeModelDrafter(toy_model(seed=1, vocab_size=v), top_k=3, depth=4, total_tokens=20)
    prompt = torch.randint(0, v, (6, 4), generator=torch.Generator().manual_seed(2))
    state = DecodeState.new(6, 6, "cpu")
    state.last_token = target.prefill(prompt)[:, 0].argmax(-1)
    drafter.begin(prompt, state)
    tree = drafter.propose(state)
    res = accept("lossless", tree, target.verify(state, tree), None)
    active = torch.tensor([True, True, False, True, True, True])
    budget = TreeBudget(full, costs={s: 1.0 for s in tree_menu(full)}, warmup=1, refresh_every=0, timing=False)
    assert budget.choose(6) == full
    with record_phases(count_ops=True) as reads:
        budget.observe(res, active, tree)
    assert not reads.syncs
    covered = budget.shows[full]  # [S] the shapes the drafted tree contains
    counts = counterfactual_accepts(tree, res.accepted_nodes, budget.shapes)[active] * covered  # [5, S]
    assert budget.accepted.tolist() == counts.sum(0).double().tolist() and counts.sum() > 0
    assert budget.accepted_sq.tolist() == (counts * counts).sum(0).double().tolist()
    assert budget.rows.tolist() == (5.0 * covered).tolist()


def test_a_call_that_drops_rows_is_measured_in_full_batch_steps():
    """Where the loop drops finished rows, vanilla's steps cost what their rows cost: `vanilla_held_rows` gives the
    rows vanilla holds at each step (dropping once at most DROP_AT of those held are live), and the tree budget
    counts the call in full-batch steps from its levels' plain steps (a line in the rows held), so a batch of short
    answers is not judged against the steps of a batch of long ones."""
    from mmspec.loop import vanilla_held_rows

    assert vanilla_held_rows([0, 0, 5, 3]) == [2, 2, 2, 1, 1]
    assert vanilla_held_rows([4, 4, 4, 4]) == [4, 4, 4, 4]
    assert vanilla_held_rows([]) == []
    full = TreeShape(1, 2, 3)
    budget = TreeBudget(full, costs={s: 1.0 for s in tree_menu(full)})
    budget._batch = 8
    assert budget.plain_units(5, [8, 8, 1]) == 5.0  # no costs by rows yet: the longest row's steps
    budget._tables = {8: {PLAIN: 2.0}, 1: {PLAIN: 1.0}}  # a plain step: 1 + (rows - 1) / 7 ms
    assert budget.plain_units(3, [8, 8, 1]) == pytest.approx((2.0 + 2.0 + 1.0) / 2.0)
    budget._tables = {8: {PLAIN: 1.0}, 1: {PLAIN: 1.0}}  # rows cost nothing (a GPU): steps are steps
    assert budget.plain_units(3, [8, 8, 1]) == 3.0

"""The draft budget (`mmspec.budget`): its four parts (acceptance model, cost model, policy, call gate) one by one,
the loop's side (`BudgetCall`), the method defaults, and exactness: sequences sampled with budgets that change the
draft size every step (plain steps included) have the target's exact sequence distribution, and greedy decoding
stays token-identical to vanilla. The budget package stays small and the core has no import circle."""

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_jacobi import exact_sequence_distribution

import mmspec
from mmspec.budget import SETTLE, BudgetCall, BudgetConfig, ThroughputBudget, make_budget, menu_of
from mmspec.budget.acceptance import AcceptanceModel, batch_steps_of, chain_moments, counterfactual_accepts
from mmspec.jacobi import JacobiDrafter
from mmspec.lm import PLAIN_ROOM, DraftModelDrafter, LMTarget, NoDrafter, TreeModelDrafter
from mmspec.loop import DecodeState, generate
from mmspec.sampling import SamplingParams
from mmspec.stats import SpecStats
from mmspec.testing.budgets import CallScript, CyclingBudget, named_size
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.toy import toy_model
from mmspec.tree import PLAIN, TreeShape, chain
from mmspec.verify import ChainDraft, VerifyResult, accept

QUIET = BudgetConfig(warmup=0, refresh_every=0, timing=False, gate=False)  # decisions from the model alone
NEVER = 10 ** 9


def result(accepted, drafted):
    acc, k = torch.tensor(accepted), max(drafted)
    flags = torch.arange(k) < acc.unsqueeze(-1)
    return VerifyResult(torch.zeros(len(accepted), k + 1, dtype=torch.long), acc, flags, torch.tensor(drafted))


def chain_budget(costs, config=QUIET, **kw):
    sizes = list(range(len(costs)))
    return ThroughputBudget([chain(k) for k in sizes], sizes, config, costs=costs, **kw)


def started(budget, batch=1):
    budget.begin(None, None, DecodeState.new(batch, 8, "cpu"), "lossless")
    return budget


def set_positions(model, reached, accepted, at=slice(None)):
    """Every chain position in `at` reached by `reached` decayed rows and accepted by `accepted`."""
    for counts, value in ((model.reached, reached), (model.accepted, accepted)):
        counts[at] = [value] * len(counts[at])


def choose(budget, rows=1, left=None):
    return budget.choose(rows, lambda: torch.tensor(left if left is not None else [8] * rows))


# ------------------------------------------------------------------------------------------- acceptance model
def test_rates_count_each_position_given_the_earlier_ones_and_fill_unseen_positions():
    model = AcceptanceModel([chain(k) for k in range(5)], BudgetConfig(prior_rows=1e-9, decay=1.0))
    draft = ChainDraft(torch.zeros(4, 4, dtype=torch.long))
    model.observe(chain(4), draft, result([0, 2, 4, 1], [4, 4, 4, 4]), torch.ones(4, dtype=torch.bool))
    # position 1: reached by 4 rows, accepted by 3; position 2: reached by 3, accepted by 2; 3 and 4: 1 of 1
    assert model.reached == [4, 3, 2, 1] and model.accepted == [3, 2, 1, 1]
    assert model.position_rates() == pytest.approx([0.75, 2 / 3, 0.5, 1.0])
    only_first = torch.tensor([True, False, False, False])
    model.observe(chain(2), draft, result([0, 2, 4, 1], [2, 2, 2, 2]), only_first)  # only row 0 counts
    assert model.reached == [5, 3, 2, 1]
    fresh = AcceptanceModel([chain(k) for k in range(9)], BudgetConfig())
    fresh.observe(chain(2), draft, result([1, 1], [2, 2]), torch.ones(2, dtype=torch.bool))
    rates = fresh.position_rates()
    assert rates[2:] == pytest.approx([rates[1]] * 6)  # unseen positions take the deepest reached rate
    mean, var = fresh.moments()
    assert mean[0] == 1.0 and var[0] == 0.0 and mean[2] == pytest.approx(1 + rates[0] + rates[0] * rates[1])
    fresh.accepted[0] = 0.0  # the moments follow the counts, changed in place or by a step
    assert fresh.moments()[0][1] == pytest.approx(1 + fresh.position_rates()[0]) and mean[1] == 1 + rates[0]
    fresh.observe(chain(2), draft, result([2, 2], [2, 2]), torch.ones(2, dtype=torch.bool))
    assert fresh.moments()[0][2] == pytest.approx(1 + sum(math.prod(fresh.position_rates()[:i]) for i in (1, 2)))


def test_chain_moments_are_those_of_a_chains_tokens():
    """E[X] and E[X^2] of X = 1 + the drafts a chain of depth d accepts, against X's distribution written out: a
    chain stops at the first rejected position (P(X = 1 + a) = a_1..a_a (1 - a_(a+1)), all d accepted: a_1..a_d)."""
    rates = [0.9, 0.5, 0.25, 1.0, 0.0, 0.7]
    firsts, seconds = chain_moments(rates)
    for depth in range(1, len(rates) + 1):
        law = {1 + a: math.prod(rates[:a]) * (1.0 - rates[a] if a < depth else 1.0) for a in range(depth + 1)}
        assert sum(law.values()) == pytest.approx(1.0)
        assert firsts[depth - 1] == pytest.approx(sum(x * p for x, p in law.items()))
        assert seconds[depth - 1] == pytest.approx(sum(x * x * p for x, p in law.items()))
    assert chain_moments([]) == ([], [])


def test_per_size_options_are_valued_by_their_own_steps():
    """A window's acceptance depends on its size: a drafter valued per size counts a step for its own option only,
    and an option that ran is valued by its steps, not by the position model."""
    options = [chain(k) for k in (0, 1, 3, 7)]
    model = AcceptanceModel(options, BudgetConfig(decay=1.0), per_size=True)
    draft = ChainDraft(torch.zeros(2, 7, dtype=torch.long))
    model.observe(chain(7), draft, result([1, 3], [7, 7]), torch.ones(2, dtype=torch.bool))
    assert model.rows == [0, 0, 0, 2]
    mean, var = model.moments()
    assert mean[3] == pytest.approx(3.0) and var[3] == pytest.approx(1.0)  # its own steps: 1 + (1, 3)
    assert mean[2] > 1.0  # not run: the position model


def test_window_counts_keep_a_longer_memory_than_chain_counts():
    """A drafter valued per size decays its counts by `window_decay` (a few bad steps must not read the best window
    below a smaller one), any other by `decay`."""
    options = [chain(k) for k in (0, 1, 3)]
    draft, on = ChainDraft(torch.zeros(2, 3, dtype=torch.long)), torch.ones(2, dtype=torch.bool)
    config = BudgetConfig(decay=0.5, window_decay=0.75)
    for per_size, kept in ((True, 0.75), (False, 0.5)):
        model = AcceptanceModel(options, config, per_size=per_size)
        for _ in range(2):
            model.observe(chain(3), draft, result([1, 3], [3, 3]), on)
        assert model.reached[0] == pytest.approx(2 * kept + 2)
        assert model.rows[2] == pytest.approx(2 * kept + 2)
    with pytest.raises(ValueError, match="window_decay must be in"):
        BudgetConfig(window_decay=0.0)


@pytest.mark.parametrize("chain_len, rate, tokens, rows", [(10, 0.97, 48, 32), (3, 0.8, 48, 32), (10, 0.9, 48, 8),
                                                            (15, 0.6, 256, 8), (5, 0.9, 48, 2)])
def test_batch_steps_match_a_simulation_of_rows_drafting_chains(chain_len, rate, tokens, rows):
    """`batch_steps_of` against rows simulated step by step: each drafts a chain, each draft accepted with
    probability `rate` while the ones before it were, until `tokens` are out; the call takes the most steps of its
    rows. Within 5% of the simulated mean over 2000 calls; plain steps take exactly the tokens left."""
    gen = torch.Generator().manual_seed(0)

    def emitted(shape) -> torch.Tensor:  # tokens a row emits in one step
        return (torch.rand(*shape, chain_len, generator=gen) < rate).long().cumprod(-1).sum(-1) + 1

    sample = emitted((200_000,)).double()
    calls, left, steps = 2000, torch.full((2000, rows), tokens), torch.zeros(2000, rows)
    while (left > 0).any():
        active = left > 0
        left = left - emitted((calls, rows)) * active
        steps += active
    simulated = float(steps.max(1).values.mean())
    expected = batch_steps_of(tokens, rows, sample.mean().view(1), sample.var().view(1))
    assert float(expected[0]) == pytest.approx(simulated, rel=0.05)
    assert float(batch_steps_of(48, 32, torch.ones(1), torch.zeros(1))[0]) == 48


def test_counterfactual_accepts_are_what_the_smaller_tree_accepts():
    """Greedy: for every shape inside the drafted one, the counted acceptance equals what verifying the smaller
    shape's own tree accepts (the drafter is a deterministic model, the target another)."""
    v, n = 12, 6
    target_model, draft_model = toy_model(seed=0, vocab_size=v), toy_model(seed=1, vocab_size=v)
    prompt = torch.randint(0, v, (6, 4), generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(temperature=0)
    full = TreeShape(3, 4, 20)
    drafter = TreeModelDrafter(draft_model, top_k=3, depth=4, total_tokens=20)
    shapes = menu_of(drafter, BudgetConfig())[0]
    for step in range(3):  # a few different roots: the first step of growing prompts
        p = torch.cat([prompt, torch.randint(0, v, (6, step), generator=torch.Generator().manual_seed(step))], 1)
        results = {}
        for shape in shapes[1:]:
            target = LMTarget(target_model, greedy, n, max_draft_nodes=20)
            drafter = TreeModelDrafter(draft_model, top_k=3, depth=4, total_tokens=20)
            state = DecodeState.new(6, n, "cpu")
            state.last_token = target.prefill(p)[:, 0].argmax(-1)
            drafter.begin(p, state)
            drafter.set_draft_size(shape)
            tree = drafter.propose(state)
            results[shape] = (tree, accept("lossless", tree, target.verify(state, tree), None))
        tree, res = results[full]
        counts, first_children = counterfactual_accepts(tree, res.accepted_nodes, shapes)
        for s, shape in enumerate(shapes[1:], 1):
            assert torch.equal(counts[:, s], results[shape][1].num_accepted), shape
        assert counts[:, 0].eq(0).all()
        deepest = max((s for s in shapes if s.is_chain), key=lambda s: s.depth)
        assert torch.equal(first_children.clamp_max(deepest.depth), counts[:, shapes.index(deepest)])


# ------------------------------------------------------------------------------------------------ cost model
def test_measured_step_times_replace_the_table_and_scale_the_others():
    budget = chain_budget([1.0, 2.0, 4.0])
    budget.costs.note(2, 8.0)  # the size of 2 ran at twice its table time
    assert budget.costs.seconds() == [2.0, 4.0, 8.0]  # the others read like it
    budget.costs.note(0, 1.0)
    assert budget.costs.seconds()[0] == 1.0  # measured
    assert budget.costs.seconds()[1] == pytest.approx(2.0 * 1.5)  # median ratio of (2, 1)


def test_a_calls_first_step_and_steps_that_compiled_are_not_timed(monkeypatch):
    clock, compiled = iter([0.0, 1.0, 3.0, 7.0, 8.0]), [0]
    monkeypatch.setattr("mmspec.budget.policy.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("mmspec.budget.policy.compilations", lambda: compiled[0])
    budget = started(chain_budget([1.0, 1.0], BudgetConfig(warmup=0, refresh_every=0, gate=False)))
    choose(budget)  # t=0
    choose(budget)  # t=1: the call's first step (after its prefill) is not timed
    assert not budget.costs.steps
    choose(budget)  # t=3: a step of 2 s
    compiled[0] = 1
    choose(budget)  # t=7: torch.compile compiled during it
    assert [list(d) for d in budget.costs.steps.values()] == [[2.0]]


# ------------------------------------------------------------------------------------------------------ policy
def test_the_choice_follows_cost_and_acceptance():
    """Good acceptance and a cheap verify: the deepest chain; the same acceptance where a draft costs a plain step
    each: plain steps; nothing learnt yet: plain steps (a plain step wins ties)."""
    good = chain_budget([1.0, 1.1, 1.2, 1.3])
    set_positions(good.acceptance, 10.0, 9.0)
    assert choose(started(good)) == 3
    dear = chain_budget([1.0, 2.0, 3.0, 4.0])
    set_positions(dear.acceptance, 10.0, 9.0)
    assert choose(started(dear)) == 0
    assert choose(started(chain_budget([1.0, 1.0, 1.0, 1.0]))) in (1, 2, 3)  # (prior 0.5 per position: drafts pay)


def test_the_batch_tail_prefers_steady_options_for_many_rows():
    """At batch > 1 a call lasts as long as its slowest row: of two options with the same mean tokens and cost,
    the one whose rows vary less wins with many rows; at one row the two are alike."""
    budget = started(chain_budget([1.0, 1.0, 1.0]), 32)
    budget.acceptance.moments = lambda: ([1.0, 3.0, 3.0], [0.0, 0.1, 4.0])
    speed = budget.speeds(32, [48, 32])  # (the longest row's 48 tokens left, 32 rows not finished)
    assert speed[1] > speed[2] > speed[0]
    alone = budget.speeds(1, None)
    assert alone[1] == alone[2]


def test_warmup_refreshes_and_the_exploration_option():
    """The first choices and refreshes (16, 48, 112, ..) draft the exploration option: the deepest affordable chain
    (at most explore_cost plain steps), else the cheapest drafting one."""
    costs = [1.0 + 0.5 * k for k in range(8)]  # a chain of k costs 1 + k / 2 plain steps
    budget = started(chain_budget(costs, BudgetConfig(warmup=2, refresh_every=4, timing=False, gate=False)))
    chosen = [choose(budget) for _ in range(14)]
    assert chosen[:2] == [4, 4] and chosen[4] == 7 - 3 and chosen[12] == 4  # 4: the deepest within 3 plain steps
    assert all(c in (0, SETTLE) for i, c in enumerate(chosen) if i not in (0, 1, 4, 12))  # nothing learnt: plain
    dear = chain_budget([1.0, 10.0, 20.0], BudgetConfig(warmup=1, gate=False))
    assert choose(started(dear)) == 1


def test_acceptance_and_exploration_are_per_segment_of_the_call():
    """Two segments of an 8-token call: each explores until `warmup` rows (one step of 2 rows) and learns its own
    rates, so drafts rejected at the call's start do not keep its second half plain; a retry after calls without
    the drafter (a probe) explores its first segment once more."""
    config = BudgetConfig(warmup=2, refresh_every=0, timing=False, gate=False, plain_probe=0, segments=2)
    budget = started(chain_budget([1.0, 1.0], config), batch=2)
    draft, on = ChainDraft(torch.zeros(2, 1, dtype=torch.long)), torch.ones(2, dtype=torch.bool)
    assert choose(budget, 2, [8, 8]) == 1 and budget.segment == 0  # explores
    budget.observe(result([0, 0], [1, 1]), on, draft)  # .. and nothing is accepted
    assert choose(budget, 2, [7, 6]) == 0  # the first half: plain
    assert choose(budget, 2, [4, 3]) == 1 and budget.segment == 1  # the second half explores
    budget.observe(result([1, 1], [1, 1]), on, draft)  # .. and every draft is accepted
    assert choose(budget, 2, [3, 2]) == 1  # the second half drafts
    assert budget.by_segment[0].position_rates()[0] == 0.0 and budget.by_segment[1].position_rates()[0] == 1.0
    budget.gate.retrying = True
    started(budget, 2)
    assert budget.explored == [1, 2]  # one more step (2 rows) in the first segment


def test_windows_valued_per_size_learn_each_segment_apart_too():
    """Jacobi windows (valued per size) keep a model per segment as the other drafters: windows that accept nothing
    at an image's start (a 256-token world image's first row) do not keep the rest of the call plain."""
    config = BudgetConfig(warmup=4, refresh_every=0, timing=False, gate=False, plain_probe=0, segments=2, hold=1)
    budget = started(chain_budget([1.0, 1.0], config, per_size=True), batch=2)
    draft, on = ChainDraft(torch.zeros(2, 1, dtype=torch.long)), torch.ones(2, dtype=torch.bool)
    for left, accepted in (([8, 8], [0, 0]), ([7, 7], [0, 0]), ([4, 4], [1, 1]), ([3, 3], [1, 1])):
        assert choose(budget, 2, left) == 1  # explores (a window's first step at a size is not counted)
        budget.observe(result(accepted, [1, 1]), on, draft)
        if left == [7, 7]:
            assert choose(budget, 2, [6, 6]) == 0 and budget.segment == 0  # the first half: plain
    assert choose(budget, 2, [2, 2]) == 1 and budget.segment == 1  # the second half drafts by estimate
    assert [model.moments()[0][1] for model in budget.by_segment] == [1.0, 2.0]


def test_a_probe_explores_its_first_segment_and_settles_at_once_where_nothing_pays():
    """A call after calls without the drafter probes: its first segment explores again, and where that segment's
    estimate never drafts, the call settles after `settle_after` plain choices without exploring its later segments
    again (the drafter's work ends there); where the estimate drafts, the later segments explore again (the first,
    explored by the probe, is not explored twice)."""
    config = BudgetConfig(warmup=2, refresh_every=0, timing=False, plain_probe=0, segments=2, settle_after=2,
                          call_backoff=1)
    budget = started(chain_budget([1.0, 1.2, 1.6, 2.0, 2.4], config), batch=2)  # chains 1..4: explores the chain of 4
    draft, on = ChainDraft(torch.zeros(2, 4, dtype=torch.long)), torch.ones(2, dtype=torch.bool)
    assert choose(budget, 2, [8, 8]) == 4
    budget.observe(result([0, 0], [4, 4]), on, draft)  # .. which draws nothing
    assert choose(budget, 2, [4, 4]) == 4 and budget.segment == 1
    budget.observe(result([0, 0], [4, 4]), on, draft)
    budget.end()  # a call with no choice by estimate: no verdict
    budget.gate.retrying = True
    started(budget, 2)
    assert choose(budget, 2, [8, 8]) == 4  # the probe
    budget.observe(result([0, 0], [4, 4]), on, draft)
    assert [choose(budget, 2, [7 - i, 7 - i]) for i in range(2)] == [0, SETTLE]  # settled in the first segment
    assert budget.explored == [3, 2]  # the second segment not explored again
    budget.end()  # a verdict: the next call runs without the drafter, the one after it probes
    assert not budget.gate.retrying and not started(budget, 2)._live and budget.gate.retrying
    budget.end()
    started(budget, 2)
    assert choose(budget, 2, [8, 8]) == 4
    budget.observe(result([4, 4], [4, 4]), on, draft)  # the probe's drafts are accepted: drafting pays again
    assert choose(budget, 2, [7, 7]) != 0 and budget.explored == [3, 1] and not budget.gate.retrying
    assert choose(budget, 2, [6, 6]) != 0 and budget.explored == [3, 1]  # by estimate: no second exploration
    assert choose(budget, 2, [4, 4]) == 4 and budget.segment == 1  # the second segment explores again
    assert budget.explored == [3, 3]


@pytest.mark.parametrize("resume", [True, False])
def test_a_refresh_resumes_the_estimate_of_a_segment_settled_on_plain_steps(resume):
    """A segment settles on plain steps after `settle_after` plain choices; a refresh there explores, and (`resume`)
    the choices after it are by estimate again, so what it showed is read: here its draft was accepted."""
    config = BudgetConfig(warmup=1, refresh_every=4, timing=False, gate=False, plain_probe=0, settle_after=2,
                          segments=2, resume=resume)
    budget = started(chain_budget([1.0, 1.0], config))
    draft, on = ChainDraft(torch.zeros(1, 1, dtype=torch.long)), torch.ones(1, dtype=torch.bool)
    chosen = []
    for accepted in ([0], None, None, None, [1], None):
        chosen.append(choose(budget))
        if accepted is not None:
            budget.observe(result(accepted, [1]), on, draft)
    assert chosen == [1, 0, 0, 0, 1, 1 if resume else 0]  # explore, plain (settled at the third), refresh


def test_windows_valued_per_size_count_their_refreshes_in_each_call():
    """A window learns only from its own steps (a window not chosen is never read again but by a refresh), so a
    budget of windows refreshes at choices 4, 12, .. of every call; other drafters count them over the budget's
    life (a second call of 6 choices reaches none)."""
    config = BudgetConfig(warmup=0, refresh_every=4, timing=False, gate=False, plain_probe=0, hold=1)
    for per_size in (True, False):
        budget = chain_budget([1.0, 3.0, 3.0], config, per_size=per_size)  # no estimate drafts
        refreshes = []
        for _ in range(2):
            started(budget)
            refreshes.append([i for i in range(6) if choose(budget) not in (0, SETTLE)])
            budget.end()
        assert refreshes == ([[4], [4]] if per_size else [[4], []]), (per_size, refreshes)


def test_a_refresh_while_chains_are_chosen_drafts_the_deepest_chain():
    full = TreeShape(4, 3, 12)
    drafter = TreeModelDrafter(toy_model(seed=0, vocab_size=8), top_k=4, depth=3, total_tokens=12)
    options, keys, _ = menu_of(drafter, BudgetConfig())
    budget = started(ThroughputBudget(options, keys, BudgetConfig(warmup=0, refresh_every=4, timing=False,
                                                                   gate=False),
                                      costs=[1.0 + 0.01 * o.total for o in options],
                                      full_key=full))
    set_positions(budget.acceptance, 100.0, 100.0, slice(None, 2))  # chains of 2 always accepted
    set_positions(budget.acceptance, 100.0, 0.0, slice(2, None))  # .. and never past
    chosen = [choose(budget) for _ in range(5)]
    deepest = max((o for o in options if o.is_chain), key=lambda o: o.depth)
    assert chosen[:4] == [chain(2)] * 4 and chosen[4] == deepest
    # a chain of k costing 1 + k / 2 plain steps (trees 10): the deepest within explore_cost (3) plain steps
    dear = started(ThroughputBudget(options, keys, budget.config, full_key=full, costs=[
        1.0 if o == PLAIN else 1.0 + 0.5 * o.depth if o.is_chain else 10.0 for o in options]))
    dear.acceptance.reached[:], dear.acceptance.accepted[:] = budget.acceptance.reached, budget.acceptance.accepted
    assert [choose(dear) for _ in range(5)] == [chain(2)] * 4 + [chain(4)]


def test_plain_choices_in_a_row_settle_the_segment_then_the_call_and_the_loop_stops_asking():
    """settle_after plain choices in a row: plain steps without an estimate for the rest of the segment while a
    later segment would draft; SETTLE (the loop stops asking) where every later one would take plain steps too."""
    config = BudgetConfig(warmup=0, refresh_every=0, settle_after=3, gate=False)
    budget = started(chain_budget([1.0, 1.5], config))
    set_positions(budget.by_segment[3], 10.0, 10.0)  # the last quarter drafts
    assert [choose(budget, left=[8]) for _ in range(3)] == [0, 0, 0] and budget.segment == 0
    speeds = budget.speeds
    budget.speeds = None  # a settled segment asks no estimate
    assert choose(budget, left=[7]) == 0
    budget.speeds = speeds
    assert choose(budget, left=[2]) == 1 and budget.segment == 3
    budget = started(chain_budget([1.0, 1.5], config))  # nothing drafts anywhere
    assert [choose(budget, left=[8]) for _ in range(3)] == [0, 0, SETTLE]
    asked = []
    steering = BudgetCall(budget, SpecStats())
    budget.choose = lambda *a: asked.append(1) or SETTLE
    assert steering.choose(1, None) == 0 and steering.plain_for_good
    assert steering.choose(1, None) == 0 and len(asked) == 1


def test_plain_steps_are_measured_before_the_estimate_drafts_on_table_costs():
    """The table times a step's propose and verify only; the loop's own work on a drafting step shows against a
    measured plain step: while fewer than plain_probe plain steps ran, an estimate that drafts runs one instead."""
    budget = started(chain_budget([1.0, 1.0], BudgetConfig(warmup=0, refresh_every=0, gate=False, plain_probe=2)))
    budget._time_last_step = lambda: None  # the step seconds are the ones noted below, not this test's
    budget.acceptance.rows[:] = [1.0, 1.0]
    budget.acceptance.sums[:] = [0.0, 1.0]  # drafting doubles the tokens
    assert choose(budget) == 0  # no plain step measured yet (the call's first step is never timed)
    budget.costs.note(0, 1.0)
    assert choose(budget) == 0
    budget.costs.note(0, 1.0)
    assert choose(budget) == 1  # two measured: the estimate decides
    budget.costs.note(1, 3.0)  # a drafting step really costs 3 plain steps: 2 tokens for 3 is worse than plain
    assert choose(budget) == 0


def test_per_size_choices_hold_for_a_few_steps():
    budget = started(chain_budget([1.0, 1.0, 1.0], BudgetConfig(warmup=0, refresh_every=0, hold=3, gate=False,
                                                                plain_probe=0), per_size=True))
    budget.acceptance.rows[:] = [1.0] * 3
    budget.acceptance.sums[:] = [0.0, 0.5, 1.0]
    assert [choose(budget) for _ in range(2)] == [2, 2]
    budget.acceptance.sums[:] = [0.0, 1.0, 0.0]
    assert choose(budget) == 2 and choose(budget) == 1  # held for 3 steps, then the new best


# ----------------------------------------------------------------------------------------------------- gate
def test_a_call_that_never_drafted_by_estimate_runs_the_next_calls_without_the_drafter():
    """Backoff 2: the two calls after a call whose choices by estimate were all plain run without the drafter; the
    retry after them re-explores (warm-up again) and, drafting nothing again, doubles the backoff."""
    config = BudgetConfig(warmup=1, refresh_every=0, timing=False, call_backoff=2)
    budget = chain_budget([1.0, 9.0], config)
    drafted = []
    for _ in range(8):
        drafts = budget.begin(None, None, DecodeState.new(1, 8, "cpu"), "lossless")
        drafted.append(drafts)
        if drafts:
            choices = [choose(budget) for _ in range(3)]
            assert choices[1:] == [0, 0] and (budget.choices > 3 or choices[0] == 1)
        budget.end()
    assert drafted == [True, False, False, True, False, False, False, False]


def test_a_probe_times_its_steps_afresh():
    """Prices measured before calls without the drafter may be from another load (a chain timed once at a bad
    moment keeps every estimate plain): the probe after them drops its measured steps and times them again."""
    for retime in (True, False):
        budget = chain_budget([1.0, 1.0], BudgetConfig(warmup=0, refresh_every=0, call_backoff=1, retime=retime))
        budget.costs.note(0, 1.0)
        budget.costs.note(1, 9.0)  # the chain timed at 9 plain steps
        assert started(budget)._live and choose(budget) == 0
        budget.end()  # no choice by estimate drafted: the next call runs without the drafter
        assert not started(budget)._live and budget.gate.retrying
        budget.end()
        assert started(budget)._live  # the probe
        assert budget.costs.medians == ({} if retime else {0: 1.0, 1: 9.0}) and bool(budget.costs.steps) != retime


def test_the_gate_stays_open_while_calls_draft_by_estimate():
    budget = chain_budget([1.0, 1.0], BudgetConfig(warmup=0, refresh_every=0, timing=False, call_backoff=2))
    set_positions(budget.acceptance, 10.0, 9.0)
    for _ in range(5):
        assert budget.begin(None, None, DecodeState.new(1, 8, "cpu"), "lossless")
        assert choose(budget) == 1
        budget.end()


# -------------------------------------------------------------------------------------- defaults and making
def test_relaxed_methods_default_to_fixed_and_lossless_ones_to_auto():
    model = toy_model(seed=0, vocab_size=8)
    target, drafter = LMTarget(model, SamplingParams(temperature=1.0), 8), JacobiDrafter(8, 4)
    assert make_budget(None, target, drafter, "gsd", 1) is None  # a relaxed rule: the papers' loop
    assert make_budget("auto", target, drafter, "gsd", 1) is not None  # asked for: honoured
    assert isinstance(make_budget(None, target, drafter, "lossless", 1), ThroughputBudget)
    assert make_budget("fixed", target, drafter, "lossless", 1) is None
    assert make_budget("auto", target, NoDrafter(), "lossless", 1) is None  # nothing to steer
    keep = {}
    assert make_budget("auto", target, drafter, "lossless", 2, keep) is make_budget("auto", target, drafter,
                                                                                    "lossless", 2, keep)
    options, keys, full = menu_of(drafter, BudgetConfig())
    assert keys == [0, 1, 3] and options == [PLAIN, chain(1), chain(3)] and full == 3


def test_a_timed_auto_budget_times_its_options_once_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    v, n = 16, 12
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    target, drafter = LMTarget(model, greedy, n), DraftModelDrafter(toy_model(seed=1, vocab_size=v), 3, greedy)
    budget = make_budget("auto", target, drafter, "greedy", 2)
    out = generate(target, drafter, "greedy", prompt, batch_size=2, max_new_tokens=n, budget=budget)
    assert len(budget.costs.table) == 4
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    assert sum(v for k, v in out.stats.extra.items() if k.startswith("budget_")) == out.stats.num_target_forwards - 1


# ------------------------------------------------------------------------------------------------ exactness
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
@pytest.mark.parametrize("budget", ["cycling", "auto", "auto-per-size"])
def test_sampling_with_a_changing_draft_size_has_the_exact_sequence_distribution(drafter, budget):
    costs = [1.0 + 0.25 * k for k in range(4)]
    policies = {"cycling": lambda: CyclingBudget([2, 0, 3, 1, 0]),
                "auto": lambda: chain_budget(costs, BudgetConfig(warmup=1, refresh_every=2)),
                "auto-per-size": lambda: chain_budget(costs, BudgetConfig(warmup=1, refresh_every=2, hold=2),
                                                      per_size=True)}
    tv, tol, out = sampled_tv(DRAFTERS[drafter], policies[budget]())
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
    for budget in (CyclingBudget([3, 0, 1, 2]), chain_budget([1.0] * 4, BudgetConfig(warmup=1))):
        assert torch.equal(run(DRAFTERS[drafter](model, v, greedy, None), budget), vanilla)


def tree_drafter(model, v, params, gen):
    return TreeModelDrafter(toy_model(seed=4, vocab_size=v, dim=16), top_k=2, depth=3, total_tokens=6)


def tree_budget(drafter, config):
    options, keys, full = menu_of(drafter, config)
    return ThroughputBudget(options, keys, config, costs=[1.0 + 0.1 * o.total for o in options], full_key=full)


@pytest.mark.parametrize("budget", ["cycling", "auto"])
def test_sampling_with_changing_tree_shapes_has_the_exact_sequence_distribution(budget):
    full = TreeShape(2, 3, 6)
    policy = (CyclingBudget([0, TreeShape(1, 2, 3), 0, full]) if budget == "cycling"
              else tree_budget(tree_drafter(None, 4, None, None), BudgetConfig(warmup=1, refresh_every=3)))
    tv, tol, out = sampled_tv(tree_drafter, policy)
    assert tv < tol
    assert out.stats.num_accepted_tokens > 0
    if budget == "cycling":
        assert {"budget_0", "budget_chain2"} <= set(out.stats.extra)


def test_greedy_tree_decoding_with_changing_shapes_equals_greedy_vanilla():
    v, n = 16, 24
    model = toy_model(seed=0, vocab_size=v)
    prompt = torch.randint(0, v, (3, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)

    def run(d, budget):
        return generate(LMTarget(model, greedy, n, max_draft_nodes=8), d, "lossless", prompt, batch_size=3,
                        max_new_tokens=n, budget=budget).tokens

    vanilla = run(NoDrafter(), None)
    cycle = [TreeShape(2, 3, 6), 0, TreeShape(1, 2, 3), 0, 0, 0, 0, 0, TreeShape(2, 2, 4), TreeShape(1, 1, 2)]
    drafter = TreeModelDrafter(model, top_k=2, depth=3, total_tokens=6)
    for budget in (CyclingBudget(cycle), tree_budget(drafter, BudgetConfig(warmup=1))):
        assert torch.equal(run(TreeModelDrafter(model, top_k=2, depth=3, total_tokens=6), budget), vanilla)


@pytest.mark.parametrize("drafter", ["draft-model", "tree"])
def test_more_plain_steps_in_a_row_than_the_pending_room_keep_greedy_tokens(drafter):
    """Plain steps' tokens wait in the drafter's pending room (`PLAIN_ROOM`); a longer run of them runs and commits
    the pending tokens first (`PendingRoom.room_for_plain_token`), and the drafts after it still match vanilla."""
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


# ----------------------------------------------------------------------------------------------- structure
def imports_of(path: Path) -> set[str]:
    """The mmspec modules a file imports, at any depth of it (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmspec"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mmspec")}
    return found


def test_the_core_has_no_import_circle():
    root = Path(mmspec.__file__).parent
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    done, path = set(), []

    def visit(name):
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_budget_package_is_small():
    """At most 800 lines, no function over 60, every constant in the config (at most 15 numbers)."""
    package = Path(mmspec.__file__).parent / "budget"
    files = sorted(package.glob("*.py"))
    assert sum(len(f.read_text().splitlines()) for f in files) <= 800
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 60, (f.name, node.name)
    numbers = [f for f in BudgetConfig.__dataclass_fields__.values() if f.type in ("int", "float", "tuple[int, ...]")]
    assert len(numbers) <= 15


def test_a_forced_budget_takes_an_option_of_the_menu_by_name():
    """`CallScript` steps may name an option (`chain2`, `tree10x2n8`) as well as a step kind; a name outside the
    budget's menu is refused with the menu."""
    full = TreeShape(10, 5, 59)
    options, keys, _ = menu_of(SimpleNamespace(full_shape=full), BudgetConfig())
    budget = ThroughputBudget(options, keys, BudgetConfig(), costs=[1.0] * len(options), full_key=full)
    assert named_size(budget, "chain2") == TreeShape(1, 2, 3)
    assert named_size(budget, "tree10x2n8") == TreeShape(10, 2, 8)
    assert named_size(budget, "full") == full and named_size(budget, "plain") == 0
    with pytest.raises(ValueError, match="not in the budget's menu"):
        named_size(budget, "tree10x9n8")
    with pytest.raises(ValueError, match="option names"):
        CallScript(steps=("chains",))

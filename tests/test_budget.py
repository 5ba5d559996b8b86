"""The draft budget (`mmspec.budget.AutoBudget`) and the loop's variable draft sizes: the policy's estimates and
choices, and exactness: sequences sampled with budgets that change the draft size every step (plain steps
included) have the target's exact sequence distribution, and greedy decoding stays token-identical to vanilla."""

import pytest
import torch
from test_jacobi import exact_sequence_distribution

from mmspec.budget import AutoBudget
from mmspec.jacobi import JacobiDrafter
from mmspec.lm import DraftModelDrafter, LMTarget, NoDrafter
from mmspec.loop import generate
from mmspec.sampling import SamplingParams
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.toy import toy_model
from mmspec.verify import VerifyResult


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
    assert [warm.choose(1) for _ in range(3)] == [8, 8, 0]  # the configured size first, then the estimate


class CyclingBudget:
    """A budget that walks through fixed sizes, plain steps included (exercises every path of the loop)."""

    def __init__(self, sizes):
        self.sizes, self.step = sizes, 0

    def choose(self, batch):
        self.step += 1
        return self.sizes[(self.step - 1) % len(self.sizes)]

    def observe(self, result, active):
        pass


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


DRAFTERS = {"jacobi": lambda model, v, params, gen: JacobiDrafter(v, 4, "random", generator=gen),
            "draft-model": lambda model, v, params, gen: DraftModelDrafter(toy_model(seed=4, vocab_size=v, dim=16),
                                                                           3, params, gen)}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("budget", ["cycling", "auto"])
def test_sampling_with_a_changing_draft_size_has_the_exact_sequence_distribution(drafter, budget):
    policy = CyclingBudget([2, 0, 3, 1, 0]) if budget == "cycling" else AutoBudget(
        range(4), verify_seconds=lambda b, n: 1.0 + 0.25 * n)
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

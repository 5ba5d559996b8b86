"""The coupled rule (`mmspec.verify.coupled`): a sampled call's tokens ARE vanilla's for the same generators, whatever
the drafter, the draft sizes (a budget changing them every step) or the batch; its law is the target's exactly; a
drafter equal to the target has every draft accepted; its hand-made cases."""

import pytest
import torch

from mmspec.jacobi import JacobiDrafter
from mmspec.lm import DraftModelDrafter, LMTarget, NoDrafter, TreeModelDrafter
from mmspec.loop import generate
from mmspec.noise import KeyedNoise
from mmspec.sampling import SamplingParams
from mmspec.testing.budgets import CyclingBudget
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.toy import toy_model
from mmspec.tree import TreeShape, chain_as_tree
from mmspec.verify import ChainDraft, Randomness, get_rule

PARAMS = SamplingParams(temperature=1.0, top_k=8)
DRAFTERS = {
    "draft-model": lambda target: DraftModelDrafter(toy_model(seed=1, dim=16), 4, PARAMS),
    "self-draft": lambda target: DraftModelDrafter(target, 4, PARAMS),
    "jacobi": lambda target: JacobiDrafter(16, 5, "random"),
    "tree": lambda target: TreeModelDrafter(toy_model(seed=1, dim=16), top_k=3, depth=3, total_tokens=8),
}
BUDGETS = {"draft-model": [2, 0, 4, 1], "self-draft": [4, 0, 1], "jacobi": [4, 0, 1, 3],
           "tree": [TreeShape(3, 3, 8), 0, TreeShape(1, 2, 3)]}


def run(target, drafter, prompt, rule, rows, budget=None, n=24):
    gens = [torch.Generator().manual_seed(100 + r) for r in rows]
    return generate(LMTarget(target, PARAMS, max_new_tokens=n), drafter, rule, prompt[rows], batch_size=len(rows),
                    max_new_tokens=n, generator=gens, budget=budget)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_the_coupled_rule_emits_vanillas_sample_whatever_is_drafted(kind):
    target = toy_model(seed=0)
    prompt = torch.randint(0, 16, (5, 6), generator=torch.Generator().manual_seed(3))
    rows = list(range(5))
    vanilla = run(target, NoDrafter(), prompt, "lossless", rows).tokens
    fixed = run(target, DRAFTERS[kind](target), prompt, "coupled", rows)
    cycling = run(target, DRAFTERS[kind](target), prompt, "coupled", rows, CyclingBudget(BUDGETS[kind]))
    alone = run(target, DRAFTERS[kind](target), prompt, "coupled", [3])
    assert torch.equal(fixed.tokens, vanilla) and torch.equal(cycling.tokens, vanilla)
    assert torch.equal(alone.tokens[0], vanilla[3])  # a row's tokens ignore the batch it is in
    assert fixed.stats.num_accepted_tokens > 0
    if kind == "self-draft":  # a drafter equal to the target: its coupled drafts are the target's own samples
        assert fixed.stats.draft_acceptance_rate == 1.0
    standard = run(target, DRAFTERS[kind](target), prompt, "lossless", rows)
    assert not torch.equal(standard.tokens, vanilla)  # (the lossless rule's tokens depend on the drafts)


def test_the_coupled_rule_has_the_exact_sequence_distribution():
    """60,000 rows of 3 sampled tokens with a draft model under the coupled rule: the histogram of whole sequences
    is within a 6-sigma TV bound of the target's exact sequence law; the same rows at the law of another temperature
    are not (the bound can fail)."""
    v, n, rows = 5, 3, 60_000
    model = toy_model(seed=3, vocab_size=v, dim=16)
    prompt = torch.tensor([[1, 2, 3]])
    params = SamplingParams(temperature=1.0)

    def exact(temperature):
        import itertools

        from mmspec.sampling import logits_to_probs

        seqs = torch.tensor(list(itertools.product(range(v), repeat=n)))
        with torch.no_grad():
            logits = model(torch.cat([prompt.expand(len(seqs), -1), seqs], 1))[:, prompt.shape[1] - 1:-1]
        probs = logits_to_probs(logits, temperature)
        return probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)

    drafter = DraftModelDrafter(toy_model(seed=4, vocab_size=v, dim=16), 2, params)
    out = generate(LMTarget(model, params, max_new_tokens=n), drafter, "coupled", prompt.expand(rows, -1),
                   batch_size=rows, max_new_tokens=n, generator=torch.Generator().manual_seed(6))
    assert out.stats.num_accepted_tokens > 0
    emp = empirical_distribution((out.tokens * torch.tensor([v * v, v, 1])).sum(-1), v ** n)
    law = exact(1.0)
    assert tv_distance(emp, law) < tv_tolerance(int((law > 1e-4).sum()), rows)
    assert tv_distance(emp, exact(0.8)) > tv_tolerance(int((law > 1e-4).sum()), rows)


def test_coupled_chain_and_tree_by_hand():
    """p puts its mass on token 1 at index 0 and token 2 at index 1; with every E = 1 the race is the argmax:
    a chain [1, 2] is accepted whole (bonus from p_2), [1, 3] stops at 3 and emits 2; the tree form agrees."""
    p = torch.zeros(1, 3, 5)
    p[0, 0, 1], p[0, 1, 2], p[0, 2, 4] = 0.9, 0.8, 0.7
    p[0, 0, 0] = p[0, 1, 0] = p[0, 2, 0] = 0.1
    p[0, 1, 3] = 0.1
    p[0, 2, 3] = 0.2
    rule = get_rule("coupled")
    ones = Randomness(torch.zeros(1, 2), torch.ones(1, 5, dtype=torch.float64))
    whole = rule.verify_chain(torch.tensor([[1, 2]]), p, None, ones, torch.tensor([2]))
    assert whole.output_tokens.tolist() == [[1, 2, 4]] and whole.num_accepted.tolist() == [2]
    stop = rule.verify_chain(torch.tensor([[1, 3]]), p, None, ones, torch.tensor([2]))
    assert stop.output_tokens.tolist() == [[1, 2, -1]]
    tree = chain_as_tree(torch.tensor([[1, 3]]), torch.tensor([0]))
    assert rule.verify_tree(tree, p, ones).output_tokens.tolist() == [[1, 2, -1]]
    noise = KeyedNoise(torch.arange(200))  # keyed: each row emits the race of p at its index's own noise
    draft = torch.tensor([[1, 2]]).expand(200, -1)
    keyed = Randomness.keyed(noise, torch.full((200,), 7), ChainDraft(draft), 5)
    out = rule.verify_chain(draft, p.expand(200, -1, -1), None, keyed, torch.full((200,), 2))
    race = (p[0, 0].double() / noise.exponentials(torch.full((200, 1), 7), "sample", 5)[:, 0]).argmax(-1)  # index 7
    assert torch.equal(out.output_tokens[:, 0], race)
    assert 0.8 < float((race == 1).double().mean()) < 0.97  # (p_0(1) = 0.9: the first draft is accepted so often)

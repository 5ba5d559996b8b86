"""Token Recycling (`mmspec.recycle`, the VLM's `recycle` kind): the adjacency table keeps each token's latest
ranking, trees follow the ranks and never hold banned tokens, and the table learns across calls, so a second greedy
call on the same target accepts its drafts. (Exactness and the sampled law: the method contract.)"""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import DecodeState, generate
from mmspec.recycle import UNSEEN, AdjacencyTable, TokenRecyclingDrafter
from mmspec.sampling import SamplingParams
from mmspec.testing.toy import toy_model
from mmspec.tree import TreeShape


def test_the_table_keeps_each_tokens_latest_ranking_and_scores_by_rank():
    table = AdjacencyTable(vocab_size=6, candidates=2)
    probs = torch.tensor([[0.1, 0.5, 0.0, 0.4, 0.0, 0.0], [0.0, 0.0, 0.2, 0.0, 0.0, 0.8]])
    table.update(torch.tensor([3, 4]), probs)
    assert table.next_tokens[3].tolist() == [1, 3] and table.next_tokens[4].tolist() == [5, 2]
    assert (table.next_tokens[0] == -1).all()
    scores = table.scores(torch.tensor([[3, 0]]), 6, torch.tensor([5]))  # [1, 2, 6]
    assert scores[0, 0, 1] == 0.0 and scores[0, 0, 3] == pytest.approx(-0.6931, abs=1e-4)  # ranks 0 and 1
    assert scores[0, 0, 0] == UNSEEN and (scores[0, 1, :5] == UNSEEN).all()  # an unseen token: nothing known
    assert scores[0, 0, 5] == float("-inf") and scores[0, 1, 5] == float("-inf")  # banned


def test_trees_follow_the_table_and_shapes_stay_inside_the_full_one():
    table = AdjacencyTable(vocab_size=8, candidates=3)
    table.update(torch.tensor([1, 2, 3]), torch.eye(8)[[2, 3, 4]] * 0.9 + 0.1 / 8)  # 1 -> 2 -> 3 -> 4 first
    drafter = TokenRecyclingDrafter(table, top_k=2, depth=3, total_tokens=6, banned_tokens=[7])
    state = DecodeState.new(1, 8, "cpu")
    state.last_token[:] = 1
    drafter.begin(None, state)
    tree = drafter.propose(state)
    path = tree.tokens[0, tree.depths[0] > 0][: 3]  # the best child at each level comes first by depth
    assert tree.tokens[0, 0] == 1 and 2 in tree.tokens[0].tolist() and 7 not in tree.tokens[0].tolist()
    assert path[0] == 2
    drafter.set_draft_size(TreeShape(1, 3, 4))  # a chain of 3: 2, 3, 4
    chain = drafter.propose(state)
    assert chain.tokens[0].tolist() == [1, 2, 3, 4]
    with pytest.raises(InputError, match="must fit"):
        drafter.set_draft_size(TreeShape(3, 3, 6))
    with pytest.raises(InputError, match="candidates"):
        TokenRecyclingDrafter(table, top_k=4)


def test_the_table_learns_across_calls_and_greedy_stays_exact():
    model = toy_model(seed=2, vocab_size=32, dim=32)
    params = SamplingParams(temperature=0.0)
    prompts = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(0))

    def run(drafter):
        target = LMTarget(model, params, 24, max_draft_nodes=getattr(drafter, "max_draft_nodes", 1))
        return generate(target, drafter, "greedy", prompts, batch_size=3, max_new_tokens=24)

    vanilla = run(NoDrafter())
    table = AdjacencyTable(32, 4)
    first = run(TokenRecyclingDrafter(table, 4, 4, 12))
    second = run(TokenRecyclingDrafter(table, 4, 4, 12))  # the same table: it knows the target's rankings now
    assert torch.equal(first.tokens, vanilla.tokens) and torch.equal(second.tokens, vanilla.tokens)
    assert (table.next_tokens[:, 0] >= 0).sum() > 10
    assert second.stats.num_accepted_tokens > first.stats.num_accepted_tokens
    assert second.stats.num_target_forwards < vanilla.stats.num_target_forwards

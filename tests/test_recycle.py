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
from mmspec.tree import TreeShape, expand_eagle2


def test_the_table_keeps_each_tokens_latest_ranking_and_scores_by_rank():
    table = AdjacencyTable(vocab_size=6, candidates=2)
    probs = torch.tensor([[0.1, 0.5, 0.0, 0.4, 0.0, 0.0], [0.0, 0.0, 0.2, 0.0, 0.0, 0.8]])
    table.update(torch.tensor([3, 4]), probs)
    assert table.next_tokens[3].tolist() == [1, 3] and table.next_tokens[4].tolist() == [5, 2]
    assert (table.next_tokens[0] == -1).all()
    table.update(torch.tensor([[3, 0]]), probs.flip(-1).unsqueeze(0), torch.tensor([[False, True]]))  # token 0 only
    assert table.next_tokens[0].tolist() == [0, 3] and table.next_tokens[3].tolist() == [1, 3]
    table.next_tokens[0] = -1
    banned = torch.tensor([5])
    children = table.children(torch.tensor([[3, 0]]), table.fillers(3, banned))  # [1, 2, C + M] each
    best, at = children.logp.topk(3, dim=-1)  # [1, 2, 3]
    tokens = children.tokens.gather(-1, at)
    assert tokens[0, 0, :2].tolist() == [1, 3] and best[0, 0, 1] == pytest.approx(-0.6931, abs=1e-4)  # ranks 0, 1
    assert tokens[0, 0, 2] == 0 and best[0, 0, 2] == pytest.approx(UNSEEN)  # then the lowest other id, unseen
    assert tokens[0, 1].tolist() == [0, 1, 2] and (best[0, 1] < UNSEEN + 1).all()  # an unseen token: nothing known
    assert 5 not in children.tokens[children.logp > float("-inf")].tolist()  # banned


def dense_scorer(table: AdjacencyTable, banned: list[int]):
    """The table's scores as a [B, F, V] tensor (what `children` spares): candidates by rank, the rest UNSEEN."""
    def score(tokens, ids, parents, level):
        out = torch.full((*tokens.shape, table.next_tokens.shape[0]), UNSEEN)  # [B, F, V]
        ranked = table.next_tokens[tokens]  # [B, F, C]
        ranks = -torch.log1p(torch.arange(table.candidates, dtype=torch.float32)).expand_as(ranked)
        out.scatter_(-1, ranked.clamp_min(0), torch.where(ranked >= 0, ranks, UNSEEN))
        out[..., banned] = float("-inf")
        return out
    return score


@pytest.mark.parametrize("top_k,depth,total", [(4, 4, 16), (1, 5, 6), (3, 3, 10)])
def test_drafts_from_candidates_equal_drafts_from_dense_scores(top_k, depth, total):
    """`children` drafts the tree a [B, F, V] scorer would: the same node scores (ties at a level's cut may keep
    either of two equal nodes), every node a candidate of its parent's token, no banned token, and below an unseen
    token only fillers."""
    vocab, banned = 64, [7, 9]
    g = torch.Generator().manual_seed(top_k)
    table = AdjacencyTable(vocab, candidates=4)
    allowed = torch.tensor([t for t in range(vocab) if t not in banned])
    table.next_tokens[allowed] = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:4]]
                                              for _ in allowed])
    drafter = TokenRecyclingDrafter(table, top_k, depth, total, banned_tokens=banned)
    state = DecodeState.new(5, 16, "cpu")
    state.last_token[:] = torch.tensor([3, 11, 20, 41, 63])
    drafter.begin(None, state)
    sparse = drafter.propose(state)
    dense = expand_eagle2(state.last_token, dense_scorer(table, banned), top_k=top_k, depth=depth, total_tokens=total)
    assert torch.allclose(sparse.scores.sort(-1).values, dense.scores.sort(-1).values)
    assert (sparse.scores > UNSEEN / 2).all() and not set(sparse.tokens.flatten().tolist()) & set(banned)
    child, parent = sparse.tokens[:, 1:], sparse.tokens.gather(1, sparse.parents[:, 1:])  # [B, N - 1] each
    assert (table.next_tokens[parent] == child.unsqueeze(-1)).any(-1).all()
    table.next_tokens[11] = -1  # an unseen root: its children are the lowest ids, below every known score
    row = drafter.propose(state)
    assert (row.scores[1, 1:] < UNSEEN / 2).all() and (row.scores[0] > UNSEEN / 2).all()


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

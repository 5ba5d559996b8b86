"""Draft trees: layouts (paths, masks, retrieve indices) and EAGLE-2 expansion against a brute-force reference."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.tree import Children, DraftTree, chain_as_tree, expand_chain, expand_eagle2, expand_tree

V = 12


def small_tree() -> DraftTree:
    # 0 -> 1 -> 3 ; 0 -> 2 ; 1 -> 4 -> 5
    return DraftTree(tokens=torch.tensor([[0, 5, 6, 7, 8, 9]]), parents=torch.tensor([[-1, 0, 0, 1, 1, 4]]),
                     depths=torch.tensor([[0, 1, 1, 2, 2, 3]]), valid=torch.ones(1, 6, dtype=torch.bool),
                     max_depth=3, max_children=2)


def test_paths_mask_leaves_and_positions():
    tree = small_tree()
    tree.validate(V)
    assert tree.paths()[0].tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1],
                                        [0, 1, 4, -1], [0, 1, 4, 5]]
    mask = tree.attention_mask()[0]
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert mask[2].nonzero().flatten().tolist() == [0, 2]
    assert tree.is_leaf()[0].tolist() == [False, False, True, True, False, True]
    leaves = tree.retrieve_indices()[0]
    assert leaves[3].tolist() == [0, 1, 3, -1] and (leaves[1] == -1).all()
    assert tree.position_ids(torch.tensor([10]))[0].tolist() == [10, 11, 11, 12, 12, 13]


def test_padding_nodes_are_invisible():
    tree = small_tree()
    tree.valid[0, 5] = False
    tree.tokens[0, 5] = -1
    assert not tree.attention_mask()[0, 5].any()
    assert not tree.attention_mask()[0, :, 5].any()
    assert tree.is_leaf()[0].tolist() == [False, False, True, True, True, False]


def test_chain_as_tree_is_a_single_branch():
    tree = chain_as_tree(torch.tensor([[4, 5, 6]]), torch.tensor([1]))
    assert tree.tokens.tolist() == [[1, 4, 5, 6]]
    assert tree.attention_mask()[0].int().tolist() == torch.ones(4, 4).tril().int().tolist()


def test_validate_rejects_bad_structure():
    tree = small_tree()
    tree.depths[0, 3] = 1
    with pytest.raises(InputError, match="depth"):
        tree.validate()
    tree = small_tree()
    tree.tokens[0, 2] = V
    with pytest.raises(InputError, match="token ids"):
        tree.validate(V)


# --------------------------------------------------------------------------------------------- EAGLE-2
def reference_eagle2(logp_table, top_k, depth, total):
    """Plain-Python EAGLE-2 for one row: logp_table[pool_id] -> log-probs of that candidate's children."""
    pool = [dict(token=None, parent=-1, score=0.0, depth=0)]
    frontier = [0]
    for d in range(1, depth + 1):
        level = []
        for f in frontier:
            lp = logp_table[f]
            top = torch.topk(lp, top_k)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                pool.append(dict(token=token, parent=f, score=pool[f]["score"] + value, depth=d))
                level.append(len(pool) - 1)
        level.sort(key=lambda i: (-pool[i]["score"], i))
        frontier = level[:top_k]
    kept = sorted(range(1, len(pool)), key=lambda i: (-pool[i]["score"], i))[: total - 1]

    def path(i):
        out = []
        while i > 0:
            out.append(pool[i]["token"])
            i = pool[i]["parent"]
        return tuple(reversed(out))

    return {path(i) for i in kept}


@pytest.mark.parametrize("top_k, depth, total", [(3, 3, 8), (4, 4, 20), (2, 5, 10), (5, 2, 30)])
def test_expand_eagle2_matches_brute_force(top_k, depth, total):
    b = 3
    gen = torch.Generator().manual_seed(top_k * 100 + depth)
    max_pool = 1 + top_k + (depth - 1) * top_k * top_k
    table = torch.log_softmax(torch.randn(b, max_pool, V, generator=gen) * 2, -1)  # per (row, pool id)
    calls = []

    def score(tokens, ids, parent_ids, d):
        calls.append((d, ids.shape[1]))
        return table[torch.arange(b).unsqueeze(-1), ids]

    tree = expand_eagle2(torch.zeros(b, dtype=torch.long), score, top_k=top_k, depth=depth, total_tokens=total)
    tree.validate(V)
    assert tree.tokens.shape == (b, total)
    assert [c[0] for c in calls] == list(range(depth))
    paths = tree.paths()
    for r in range(b):
        got = {tuple(tree.tokens[r, n].item() for n in paths[r, i].tolist()[1:] if n >= 0)
               for i in range(1, total)}
        assert got == reference_eagle2(table[r], top_k, depth, total)
    assert (tree.depths[:, 1:] >= tree.depths[:, :-1]).all()  # nodes ordered by depth


@pytest.mark.parametrize("depth", [1, 4])
def test_a_chain_is_expanded_without_the_pool_into_the_pools_own_tree(depth):
    """top_k 1, every node kept: `expand_chain` gives the tree the candidate pool gives (tokens, parents, depths,
    scores) from the same scorer calls (level, pool ids, parents' ids); ties included (equal log-probs)."""
    b = 3
    gen = torch.Generator().manual_seed(depth)
    table = torch.log_softmax(torch.randn(b, depth + 1, V, generator=gen), -1)
    table[1] = 0.0  # a row of ties
    trees, calls = [], []
    for expand in (expand_chain, lambda *a: expand_tree(*a[:2], 1, depth, depth + 1)):
        seen = []

        def score(tokens, ids, parent_ids, d, seen=seen):
            seen.append((d, ids.tolist(), parent_ids.tolist(), tokens.tolist()))
            return table[torch.arange(b).unsqueeze(-1), ids]

        trees.append(expand(torch.tensor([5, 6, 7]), score, depth))
        calls.append(seen)
    chain, tree = trees
    assert calls[0] == calls[1] and chain.is_chain and tree.is_chain and chain.max_depth == tree.max_depth
    for name in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(chain, name), getattr(tree, name)), name
    assert expand_eagle2(torch.tensor([5, 6, 7]), lambda t, i, p, d: table[torch.arange(b).unsqueeze(-1), i], top_k=1,
                         depth=depth, total_tokens=depth + 1).tokens.equal(chain.tokens)


@pytest.mark.parametrize("top_k, depth, total", [(3, 3, 8), (1, 4, 5), (4, 3, 20)])
def test_a_scorer_of_candidates_expands_the_tree_of_its_dense_scores(top_k, depth, total):
    """`Children` (a few candidates a node, e.g. Token Recycling's table) give the tree of the [B, F, V] log-probs
    that hold them and -inf elsewhere."""
    b, c = 3, 6
    gen = torch.Generator().manual_seed(top_k)
    max_pool = 1 + top_k + (depth - 1) * top_k * top_k
    logp = torch.randn(b, max_pool, c, generator=gen)  # [B, P, C] per (row, pool id)
    tokens = torch.stack([torch.stack([torch.randperm(V, generator=gen)[:c] for _ in range(max_pool)])
                          for _ in range(b)])  # [B, P, C] distinct candidates
    rows = torch.arange(b).unsqueeze(-1)

    def sparse(t, ids, parents, d):
        return Children(logp[rows, ids], tokens[rows, ids])

    def dense(t, ids, parents, d):
        return torch.full((b, ids.shape[1], V), float("-inf")).scatter(-1, tokens[rows, ids], logp[rows, ids])

    root = torch.tensor([5, 6, 7])
    got = expand_eagle2(root, sparse, top_k=top_k, depth=depth, total_tokens=total)
    want = expand_eagle2(root, dense, top_k=top_k, depth=depth, total_tokens=total)
    for name in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(InputError, match="C >= 7"):
        expand_eagle2(root, sparse, top_k=7, depth=1, total_tokens=8)


def test_expand_eagle2_parameter_errors():
    score = lambda t, i, p, d: torch.zeros(t.shape[0], t.shape[1], V)
    with pytest.raises(InputError, match="total_tokens"):
        expand_eagle2(torch.zeros(1, dtype=torch.long), score, top_k=2, depth=1, total_tokens=10)
    with pytest.raises(InputError, match="top_k"):
        expand_eagle2(torch.zeros(1, dtype=torch.long), score, top_k=0)

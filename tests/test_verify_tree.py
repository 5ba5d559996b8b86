"""Tree verification: losslessness for deterministic and sampled children, equality with chains, greedy."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.noise import KeyedNoise
from mmspec.testing import use_sequential_lossless_walk
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.tree import DraftTree, chain_as_tree
from mmspec.verify import ChainDraft, Randomness, accept, get_rule
from mmspec.verify.lossless import lossless_node_accept, lossless_node_reject
from mmspec.verify.tree_walk import walk_tree

V = 10
C = 3  # children per node
# node layout: 0 root; 1..3 depth 1; 4..12 depth 2 (children of 1, 2, 3 in order)
PARENTS = [-1, 0, 0, 0] + [1] * C + [2] * C + [3] * C
DEPTHS = [0, 1, 1, 1] + [2] * (C * C)
N = len(PARENTS)


def make_trees(n: int, seed: int, sampled: bool):
    """n rows of the same 2-level tree shape; per-node target p and draft q (context free)."""
    gen = torch.Generator().manual_seed(seed)
    p_nodes = torch.softmax(torch.randn(N, V, generator=gen) * 1.5, -1)  # [N, V]
    q_nodes = torch.softmax(torch.randn(N, V, generator=gen) * 1.5, -1)
    parents = torch.tensor(PARENTS).expand(n, N)
    if sampled:  # children of each node: C draws without replacement from q at the parent (Gumbel top-k order)
        gumbel = -torch.log(-torch.log(torch.rand(n, N, V, generator=gen).clamp(1e-12, 1 - 1e-12)))
        order = (q_nodes.log() + gumbel).argsort(-1, descending=True)[..., :C]  # [n, N, C]
    else:  # deterministic top-C children of q
        order = q_nodes.argsort(-1, descending=True)[:, :C].expand(n, N, C)
    tokens = torch.zeros(n, N, dtype=torch.long)
    for child in range(1, N):  # build-time only: fill each child with its parent's next candidate
        parent = PARENTS[child]
        rank = [c for c in range(1, N) if PARENTS[c] == parent].index(child)
        tokens[:, child] = order[:, parent, rank]
    tree = DraftTree(tokens=tokens, parents=parents.clone(), depths=torch.tensor(DEPTHS).expand(n, N).clone(),
                     valid=torch.ones(n, N, dtype=torch.bool), max_depth=2, max_children=C,
                     child_probs=q_nodes.expand(n, N, V) if sampled else None, sampled=sampled)
    return tree, p_nodes


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_verification_is_lossless(sampled):
    n = 120_000
    tree, p_nodes = make_trees(n, seed=11, sampled=sampled)
    res = accept("lossless", tree, p_nodes.expand(n, N, V), torch.Generator().manual_seed(12))
    out, nodes = res.output_tokens, res.accepted_nodes
    # first emitted token ~ p at the root
    assert tv_distance(empirical_distribution(out[:, 0], V), p_nodes[0]) < tv_tolerance(V, n)
    # after accepting depth-1 node c, the next emitted token ~ p at c (recovered or, at a leaf, bonus)
    for c in (1, 2, 3, 4, 8):
        depth = DEPTHS[c]
        rows = (nodes[:, depth] == c) if depth < nodes.shape[1] else None
        count = int(rows.sum())
        assert count > 300, f"node {c} reached by {count} rows only"
        emp = empirical_distribution(out[:, depth], V, rows)
        assert tv_distance(emp, p_nodes[c]) < tv_tolerance(V, count), f"node {c}"


def test_tree_test_catches_missing_sibling_renormalisation():
    """Negative control: trying every sibling against the ORIGINAL p (no removal) must fail the check."""
    n = 120_000
    tree, p_nodes = make_trees(n, seed=11, sampled=False)
    rand = Randomness.draw(n, N, V, torch.Generator().manual_seed(12))
    res = walk_tree(tree, p_nodes.expand(n, N, V), rand, lossless_node_accept, lambda p, q, x: (p, q))
    emp = empirical_distribution(res.output_tokens[:, 0], V)
    assert tv_distance(emp, p_nodes[0]) > 5 * tv_tolerance(V, n)


@pytest.mark.parametrize("with_q", [False, True])
def test_one_branch_tree_equals_chain_with_the_same_randomness(with_q):
    gen = torch.Generator().manual_seed(3)
    b, k = 64, 4
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(b, k, V, generator=gen) * 2, -1) if with_q else None
    x = torch.multinomial(torch.softmax(torch.randn(V, generator=gen), -1), b * k, True, generator=gen).view(b, k)
    rand = Randomness.draw(b, k + 1, V, gen)
    tree = chain_as_tree(x, torch.zeros(b, dtype=torch.long), q)
    rule = get_rule("lossless")
    tree_res = rule.verify_tree(tree, p, rand)
    chain_res = rule.verify_chain(x, p, q, Randomness(rand.uniforms[:, 1:], rand.exponentials), torch.full((b,), k))
    assert torch.equal(tree_res.output_tokens, chain_res.output_tokens)
    assert torch.equal(tree_res.accepted_nodes[:, 1:] >= 0, chain_res.accepted_flags)


def test_greedy_tree_picks_the_longest_matching_path():
    # root argmax = 5; node 1 (token 5) argmax = 7; node 3 (token 7 under node 1) argmax = 2
    tokens = torch.tensor([[0, 5, 6, 7, 1]])
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    tree = DraftTree(tokens, parents, depths, torch.ones(1, 5, dtype=torch.bool), max_depth=2, max_children=2)
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 5] = logits[0, 1, 7] = logits[0, 3, 2] = 1.0
    logits[0, 2, 3] = logits[0, 4, 4] = 1.0
    res = accept("greedy", tree, logits)
    assert res.output_tokens.tolist() == [[5, 7, 2]]
    assert res.accepted_nodes.tolist() == [[0, 1, 3]]
    assert res.num_accepted.tolist() == [2]


def test_tree_with_no_match_emits_root_argmax():
    tree = chain_as_tree(torch.tensor([[3, 4]]), torch.tensor([0]))
    logits = torch.zeros(1, 3, V)
    logits[0, 0, 9] = 1.0
    res = accept("greedy", tree, logits)
    assert res.output_tokens.tolist() == [[9, -1, -1]]


@pytest.mark.parametrize("rule_name, sampled", [("lossless", False), ("lossless", True), ("greedy", False)])
def test_tree_rules_compile_fullgraph(rule_name, sampled):
    tree, p_nodes = make_trees(4, seed=5, sampled=sampled)
    p = p_nodes.expand(4, N, V).contiguous()
    rand = Randomness.draw(4, N, V, torch.Generator().manual_seed(0))
    rule = get_rule(rule_name)

    def fn(tokens, parents, depths, valid, child_probs, p, u, e):
        t = DraftTree(tokens, parents, depths, valid, 2, C, child_probs, sampled)
        res = rule.verify_tree(t, p, Randomness(u, e))
        return res.output_tokens, res.accepted_nodes

    args = (tree.tokens, tree.parents, tree.depths, tree.valid, tree.child_probs, p, rand.uniforms, rand.exponentials)
    got = torch.compile(fn, fullgraph=True, backend="eager")(*args)
    want = fn(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_malformed_tree_is_a_clear_error():
    tree, p_nodes = make_trees(2, seed=0, sampled=False)
    tree.parents[0, 5] = 7  # parent after child
    with pytest.raises(InputError, match="parent"):
        accept("lossless", tree, p_nodes.expand(2, N, V))


def test_rule_without_tree_support_says_so():
    from mmspec.verify.base import AcceptanceRule

    class ChainOnly(AcceptanceRule):
        name = "chain-only"
        supports_tree = False

    tree, p_nodes = make_trees(2, seed=0, sampled=False)
    with pytest.raises(InputError, match="chain"):
        accept(ChainOnly(), tree, p_nodes.expand(2, N, V))


def test_chain_draft_shape_errors_are_named():
    with pytest.raises(InputError, match="num_draft"):
        accept("lossless", ChainDraft(torch.zeros(2, 3, dtype=torch.long), None, torch.tensor([4, 0])),
               torch.full((2, 4, V), 0.1))


@pytest.mark.parametrize("sampled", [False, True])
def test_gsd_tree_with_group_of_one_is_lossless_tree_verification(sampled):
    n = 512
    tree, p_nodes = make_trees(n, seed=9, sampled=sampled)
    p = p_nodes.expand(n, N, V)
    rand = Randomness.draw(n, N, V, torch.Generator().manual_seed(9))
    got = get_rule("gsd", group_size=1).verify_tree(tree, p, rand)
    want = walk_tree(tree, p, rand, lossless_node_accept, lossless_node_reject)  # the sequential lossless walk
    assert torch.equal(got.output_tokens, want.output_tokens)


def test_gsd_tree_accepts_more_than_lossless_tree():
    n = 4000
    tree, p_nodes = make_trees(n, seed=10, sampled=False)
    p = p_nodes.expand(n, N, V)
    grouped = accept("gsd", tree, p, torch.Generator().manual_seed(3), group_size=4, p_thr=0.3)
    exact = accept("lossless", tree, p, torch.Generator().manual_seed(3))
    assert grouped.num_accepted.float().mean() > exact.num_accepted.float().mean() + 0.05


def test_one_pass_deterministic_form_keeps_p_with_repeated_siblings_and_missing_nodes():
    """The lossless rule verifies deterministic children in one vectorised pass (`verify_tree_deterministic`). With
    a repeated sibling token (which must never be accepted twice over) and invalid nodes, every emitted token still
    follows p; the same trees through the sequential walk agree in distribution (both are checked against p)."""
    n = 120_000
    tree, p_nodes = make_trees(n, seed=5, sampled=False)
    tree.tokens[:, 2] = tree.tokens[:, 1]  # node 2 repeats its first sibling's token
    tree.valid[:, 3] = False  # node 3 and its children are gone
    tree.valid[:, 10:] = False
    tree.parents[:, 3] = -1  # as `cap_draft` leaves removed nodes
    p = p_nodes.expand(n, N, V)
    rand = Randomness.draw(n, N, V, torch.Generator().manual_seed(6))
    for res in (get_rule("lossless").verify_tree(tree, p, rand),
                walk_tree(tree, p, rand, lossless_node_accept, lossless_node_reject)):
        out, nodes = res.output_tokens, res.accepted_nodes
        assert not bool((nodes == 2).any()) and not bool((nodes == 3).any())
        assert tv_distance(empirical_distribution(out[:, 0], V), p_nodes[0]) < tv_tolerance(V, n)
        for c in (1, 4):
            rows = nodes[:, DEPTHS[c]] == c
            assert int(rows.sum()) > 300
            emp = empirical_distribution(out[:, DEPTHS[c]], V, rows)
            assert tv_distance(emp, p_nodes[c]) < tv_tolerance(V, int(rows.sum())), c


def test_one_pass_form_catches_a_wrong_partition(monkeypatch):
    """Negative control: if every child owned [0, p(c)) (no offset by earlier siblings), the check must fail."""
    import mmspec.verify.tree_walk as tree_walk

    n = 120_000
    tree, p_nodes = make_trees(n, seed=11, sampled=False)
    intervals = tree_walk.child_intervals
    monkeypatch.setattr(tree_walk, "child_intervals", lambda *a: (lambda lower, owned, first: (
        torch.zeros_like(lower), owned, first))(*intervals(*a)))  # every child owns [0, p(c))
    res = tree_walk.verify_tree_deterministic(tree, p_nodes.expand(n, N, V),
                                              Randomness.draw(n, N, V, torch.Generator().manual_seed(12)))
    emp = empirical_distribution(res.output_tokens[:, 0], V)
    assert tv_distance(emp, p_nodes[0]) > 5 * tv_tolerance(V, n)


@pytest.mark.parametrize("rule_name", ["lossless-deterministic", "lossless-sampled", "lantern", "lantern-code",
                                       "lantern-lambda", "lantern-sampled", "gsd", "gsd-sampled"])
def test_both_walk_schedules_give_identical_results(rule_name, monkeypatch):
    """`walk_by_rank` (every node's children at once, one static step per sibling rank: the GPU path) and
    `walk_by_depth` (each row root to leaf, leaving its loops early: the CPU path) must give identical results with
    the same randomness, for every rule that walks, on ragged trees (missing nodes), small batches, and trees whose
    bound on children is above what they hold (as EAGLE-2 trees' is)."""
    from functools import partial

    import mmspec.verify.gsd as gsd_module
    import mmspec.verify.lantern as lantern_module
    import mmspec.verify.lossless as lossless_module
    from mmspec.verify import GSDRule, LanternRule, build_neighbour_table, tree_walk

    sampled = rule_name.endswith("-sampled")
    codebook = torch.linspace(0, 1, V).unsqueeze(-1)  # [V, 1]
    neighbours = build_neighbour_table(codebook, k=4)
    rule = {"lantern": lambda: LanternRule(neighbours, k=4, delta=0.2),
            "lantern-code": lambda: LanternRule(neighbours, k=4, delta=0.2, reject="code"),
            "lantern-lambda": lambda: LanternRule(neighbours, k=4, lam=2.0),
            "lantern-sampled": lambda: LanternRule(neighbours, k=4, delta=0.2),
            "gsd": lambda: GSDRule(embeddings=torch.cat([codebook, codebook.flip(0)], -1), group_size=3),
            "gsd-sampled": lambda: GSDRule(group_size=3, p_thr=0.3)}.get(rule_name, lambda: get_rule("lossless"))()
    if rule_name == "lossless-deterministic":  # the rule's own one-pass form does not walk
        use_sequential_lossless_walk(monkeypatch)
    accepted_lengths = set()
    for seed in range(40):
        b = 1 + seed % 4
        tree, p_nodes = make_trees(b, seed=seed, sampled=sampled)
        tree.max_children = C + seed % 3  # a loose bound
        gen = torch.Generator().manual_seed(100 + seed)
        tree.valid[:, 1 + seed % (N - 1)] = bool(seed % 3)  # sometimes a node missing
        p = torch.softmax(torch.randn(b, N, V, generator=gen) * 2, -1)
        rand = Randomness.draw(b, N, V, gen)
        results = {}
        for schedule in tree_walk.WALK_SCHEDULES:
            for module in (gsd_module, lantern_module, lossless_module):
                monkeypatch.setattr(module, "walk_tree", partial(tree_walk.walk_tree, schedule=schedule))
            results[schedule] = rule.verify_tree(tree, p, rand)
        for field in ("output_tokens", "num_accepted", "accepted_flags", "num_drafted", "accepted_nodes"):
            assert torch.equal(getattr(results["by_rank"], field), getattr(results["by_depth"], field)), (seed, field)
        accepted_lengths.update(results["by_depth"].num_accepted.tolist())
    assert accepted_lengths == {0, 1, 2}  # stops at the root, at depth 1 and at the leaves all happened


def test_an_unknown_walk_schedule_is_a_clear_error():
    from mmspec.verify.tree_walk import walk_tree

    tree, p_nodes = make_trees(1, seed=0, sampled=False)
    with pytest.raises(InputError, match="by_rank, by_depth"):
        walk_tree(tree, p_nodes.expand(1, N, V), Randomness.draw(1, N, V, torch.Generator()), lossless_node_accept,
                  lossless_node_reject, schedule="sideways")


@pytest.mark.parametrize("rule_name", ["lossless", "greedy"])
def test_accept_runs_chain_trees_by_the_chain_form_with_the_tree_forms_result(rule_name):
    """`accept` verifies a one-branch tree of deterministic drafts (`is_chain`) by the rule's chain form; tokens,
    accepted lengths and the accepted path equal the tree form's from the same generator, with rows capped short."""
    from mmspec.loop import cap_draft

    b, k = 256, 5
    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen) * 3, -1)
    x = torch.where(torch.rand(b, k, generator=gen) < 0.7, p[:, :k].argmax(-1), torch.randint(0, V, (b, k),
                                                                                               generator=gen))
    tree = cap_draft(chain_as_tree(x, torch.zeros(b, dtype=torch.long)), torch.randint(0, k + 2, (b,), generator=gen))
    assert tree.is_chain and not bool(tree.valid.all())
    fast = accept(rule_name, tree, p, torch.Generator().manual_seed(9))
    rule = get_rule(rule_name)
    noise = KeyedNoise.from_generators(torch.Generator().manual_seed(9), b)  # the numbers `accept` draws
    rand = Randomness.keyed(noise, torch.zeros(b, dtype=torch.long), tree, V) if rule.uses_randomness else None
    slow = rule.verify_tree(tree, p, rand)
    for name in ("output_tokens", "num_accepted", "accepted_flags", "num_drafted", "accepted_nodes"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert 0 < int(fast.num_accepted.sum()) < int(fast.num_drafted.sum())


def test_a_chain_tree_must_be_a_chain():
    tree = chain_as_tree(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    tree.parents[0, 3] = 1  # node 3 under node 1: two children of node 1 in a max_children=1 tree
    tree.depths[0, 3] = 2
    with pytest.raises(InputError, match="max_children=1 is a chain"):
        accept("greedy", tree, torch.softmax(torch.randn(1, 4, V), -1))

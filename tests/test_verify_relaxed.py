"""LANTERN and GSD relaxed acceptance: hand-made values, TV bound, acceptance theorems, degenerate cases."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.tree import chain_as_tree
from mmspec.verify import ChainDraft, GSDRule, LanternRule, Randomness, accept, build_neighbour_table, get_rule

V = 10


def line_codebook(v: int = V) -> torch.Tensor:
    """Codebook on a line: entry i at position i, so neighbours of i are i-1, i+1, i-2, ..."""
    return torch.arange(v, dtype=torch.float32).unsqueeze(-1)


# ------------------------------------------------------------------------------------------------ LANTERN
def test_neighbour_table_sorts_by_distance_and_excludes_self():
    table = build_neighbour_table(line_codebook(6), k=5)
    assert table.dtype == torch.uint16
    assert table[0].tolist() == [1, 2, 3, 4, 5]
    assert table[3].tolist()[:2] == [2, 4]  # ties keep index order
    assert 3 not in table[3].tolist()


def test_relaxed_probability_delta_and_lambda_forms():
    table = torch.tensor([[1, 2, 3, 4, 5]] * 6)
    p = torch.tensor([0.1, 0.05, 0.04, 0.3, 0.31, 0.2])
    x = torch.tensor(0)
    p_tilde, moved = LanternRule(table, k=5, delta=0.1).relaxed(p, x)  # cumsum 0.05, 0.09, 0.39 -> 2 moved
    assert moved.item() == 2 and p_tilde.item() == pytest.approx(0.19)
    p_tilde, moved = LanternRule(table, k=5, lam=2.0).relaxed(p, x)  # budget (2 - 1) * 0.1
    assert moved.item() == 2 and p_tilde.item() == pytest.approx(0.19)
    p_tilde, moved = LanternRule(table, k=5, lam=1.5).relaxed(p, x)  # budget 0.05
    assert moved.item() == 1 and p_tilde.item() == pytest.approx(0.15)
    p_tilde, moved = LanternRule(table, k=1, delta=0.1).relaxed(p, x)  # only the nearest neighbour
    assert moved.item() == 1 and p_tilde.item() == pytest.approx(0.15)


def test_a_token_listed_as_its_own_neighbour_lends_no_mass():
    """Tables over a text + image vocabulary list a token without neighbours as itself (Emu3): those entries move
    nothing, so x's relaxed probability is its own plus its real neighbours' only."""
    p = torch.tensor([0.1, 0.05, 0.04, 0.3, 0.31, 0.2])
    x = torch.tensor(0)
    table = torch.tensor([[0, 1, 0, 2, 3]] + [[1, 2, 3, 4, 5]] * 5)  # x = 0 listed twice as itself
    p_tilde, _ = LanternRule(table, k=5, delta=0.1).relaxed(p, x)  # 0.1 + 0.05 + 0.04, never p(x) again
    assert p_tilde.item() == pytest.approx(0.19)
    alone = torch.tensor([[0, 0, 0]] + [[1, 2, 3]] * 5)  # no neighbours at all: exactly p(x)
    assert LanternRule(alone, k=3, delta=1.0).relaxed(p, x)[0].item() == pytest.approx(0.1)


def _lantern_problem(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p_rows = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
    draft_dist = torch.softmax(torch.randn(V, generator=gen), -1)
    x = torch.multinomial(draft_dist, n, replacement=True, generator=gen).view(n, 1)
    return p_rows, draft_dist, x, p_rows.expand(n, 2, V)


@pytest.mark.parametrize("delta", [0.05, 0.1, 0.2])
def test_lantern_output_stays_within_delta_of_target_and_equals_the_relaxed_mixture(delta):
    n = 200_000
    p_rows, draft_dist, x, p = _lantern_problem(n, seed=21)
    table = build_neighbour_table(line_codebook(), k=V - 1)
    rule = LanternRule(table, k=V - 1, delta=delta)
    res = accept(rule, ChainDraft(x), p, torch.Generator().manual_seed(22))
    emp = empirical_distribution(res.output_tokens[:, 0], V)
    # analytic induced distribution: sum_x r(x) p~_x, where p~_x moves the neighbours' mass onto x
    expected = torch.zeros(V, dtype=torch.float64)
    for token in range(V):
        p_tilde, moved = rule.relaxed(p_rows[0], torch.tensor(token))
        relaxed = rule.remove_rejected(p_rows[0].unsqueeze(0), torch.tensor([token]), moved.view(1))[0]
        relaxed[token] = p_tilde
        expected += draft_dist[token] * relaxed.double()
    tol = tv_tolerance(V, n)
    assert tv_distance(emp, expected) < tol
    assert tv_distance(emp, p_rows[0]) <= delta + tol  # the LANTERN bound
    assert tv_distance(expected, p_rows[0]) <= delta + 1e-6
    lossless = accept("lossless", ChainDraft(x), p, torch.Generator().manual_seed(22))
    assert res.num_accepted.float().mean() > lossless.num_accepted.float().mean()  # it does relax


def random_chain_problem(seed: int, b: int = 256, k: int = 4):
    """p [b, k+1, V], q [b, k, V], drafts x [b, k], randomness and num_draft for exactness checks."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(b, k, V, generator=gen) * 2, -1)
    x = torch.randint(0, V, (b, k), generator=gen)
    return p, q, x, Randomness.draw(b, k, V, gen), torch.full((b,), k)


def test_lantern_with_zero_delta_is_lossless_exactly():
    p, q, x, rand, nd = random_chain_problem(seed=4)
    table = build_neighbour_table(line_codebook())
    for probs in (None, q):
        got = LanternRule(table, delta=0.0).verify_chain(x, p, probs, rand, nd)
        want = get_rule("lossless").verify_chain(x, p, probs, rand, nd)
        assert torch.equal(got.output_tokens, want.output_tokens)


def test_lantern_tree_with_zero_delta_equals_lossless_tree():
    gen = torch.Generator().manual_seed(5)
    b, k = 128, 3
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen) * 2, -1)
    tree = chain_as_tree(torch.randint(0, V, (b, k), generator=gen), torch.zeros(b, dtype=torch.long))
    rand = Randomness.draw(b, k + 1, V, gen)
    got = LanternRule(build_neighbour_table(line_codebook()), delta=0.0).verify_tree(tree, p, rand)
    want = get_rule("lossless").verify_tree(tree, p, rand)
    assert torch.equal(got.output_tokens, want.output_tokens)


def test_lantern_tree_accepts_more_than_lossless():
    gen = torch.Generator().manual_seed(6)
    b, k = 4000, 3
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen), -1)
    tree = chain_as_tree(torch.randint(0, V, (b, k), generator=gen), torch.zeros(b, dtype=torch.long))
    rule = LanternRule(build_neighbour_table(line_codebook()), delta=0.2)
    relaxed = accept(rule, tree, p, torch.Generator().manual_seed(1)).num_accepted.float().mean()
    exact = accept("lossless", tree, p, torch.Generator().manual_seed(1)).num_accepted.float().mean()
    assert relaxed > exact + 0.05


def test_lantern_greedy_accepts_when_x_becomes_the_relaxed_argmax():
    table = build_neighbour_table(line_codebook(), k=V - 1)
    p = torch.zeros(1, 2, V)
    p[0, 0, 3], p[0, 0, 2], p[0, 0, 4], p[0, 0, 8] = 0.3, 0.06, 0.04, 0.6  # argmax 8
    p[0, 1, 1] = 1.0
    x = torch.tensor([[3]])
    nd = torch.tensor([1])
    strict = LanternRule(table, delta=0.05, greedy=True).verify_chain(x, p, None, None, nd)
    loose = LanternRule(table, delta=0.1, greedy=True).verify_chain(x, p, None, None, nd)
    # neighbours of 3 are 2 (0.06) then 4 (0.04). delta 0.05: cumsum 0.06 > 0.05 -> nothing moves
    assert strict.output_tokens.tolist() == [[8, -1]]
    # delta 0.1: 0.06 + 0.04 = 0.1 moves -> 0.4 < 0.6 still not argmax
    assert loose.output_tokens.tolist() == [[8, -1]]
    p[0, 0, 8], p[0, 0, 9] = 0.35, 0.25
    loose = LanternRule(table, delta=0.1, greedy=True).verify_chain(x, p, None, None, nd)
    assert loose.output_tokens.tolist() == [[3, 1]]  # 0.4 >= 0.35


def test_lantern_code_variant_zeroes_more_neighbours_on_rejection():
    table = build_neighbour_table(line_codebook(), k=V - 1)
    p = torch.full((1, V), 0.1)
    moved = torch.tensor([1])
    paper = LanternRule(table, k=3, delta=0.1).remove_rejected(p, torch.tensor([5]), moved)
    code = LanternRule(table, k=3, delta=0.1, reject="code").remove_rejected(p, torch.tensor([5]), moved)
    assert int((paper[0] == 0).sum()) == 2  # x and the one neighbour whose mass moved
    assert int((code[0] == 0).sum()) == 5  # x and its k + 1 = 4 nearest


@pytest.mark.parametrize("kwargs, word", [({"delta": -0.1}, "delta"), ({"delta": 1.5}, "delta"),
                                          ({"lam": 0.5}, "lam"), ({"k": 0}, "k"), ({"reject": "x"}, "reject")])
def test_lantern_bad_parameters_are_named(kwargs, word):
    with pytest.raises(InputError, match=word):
        LanternRule(build_neighbour_table(line_codebook()), **kwargs)


def test_lantern_table_for_another_vocabulary_is_rejected():
    rule = LanternRule(build_neighbour_table(line_codebook(6)))
    with pytest.raises(InputError, match="neighbour table"):
        accept(rule, ChainDraft(torch.zeros(1, 1, dtype=torch.long)), torch.full((1, 2, V), 0.1))


# ---------------------------------------------------------------------------------------------------- GSD
def _exact_acceptance(rule: GSDRule, p: torch.Tensor, q: torch.Tensor) -> float:
    """E_{x ~ q}[min(1, P_G(x) / Q_G(x))], computed exactly by enumerating x."""
    x = torch.arange(V)
    p_group, q_group = rule.group_masses(p.expand(V, V), q.expand(V, V), x)
    return float((q * (p_group / q_group).clamp(max=1)).sum())


def test_gsd_with_group_of_one_is_plain_speculative_sampling():
    p, q, x, rand, nd = random_chain_problem(seed=8)
    gen = torch.Generator().manual_seed(8)
    for probs in (None, q):
        got = GSDRule(group_size=1).verify_chain(x, p, probs, rand, nd)
        want = get_rule("lossless").verify_chain(x, p, probs, rand, nd)
        assert torch.equal(got.output_tokens, want.output_tokens)
    for _ in range(20):
        pp, qq = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
        assert _exact_acceptance(GSDRule(group_size=1), pp, qq) == pytest.approx(float(torch.minimum(pp, qq).sum()))


def test_gsd_acceptance_is_at_least_speculative_sampling_on_random_pairs():
    """The paper's theorem is exact for a fixed partition of the vocabulary (TV of the grouped distributions
    <= TV(p, q)). GSD's groups are windows around each x, which overlap, so a few pairs can fall slightly
    below; we check the theorem where it is exact and the mean gain on random pairs."""
    gen = torch.Generator().manual_seed(9)
    pairs = [torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1) for _ in range(300)]
    sd = torch.tensor([float(torch.minimum(p, q).sum()) for p, q in pairs])
    # fixed partition: groups {0..4} and {5..9} accept with sum_G min(P(G), Q(G)) >= sum_x min(p, q)
    for p, q in pairs[:50]:
        grouped = sum(min(float(p[s].sum()), float(q[s].sum())) for s in (slice(0, 5), slice(5, 10)))
        assert grouped >= float(torch.minimum(p, q).sum()) - 1e-7
    for g in (3, 5, 10):
        gsd = torch.tensor([_exact_acceptance(GSDRule(group_size=g), p, q) for p, q in pairs])
        assert gsd.mean() > sd.mean() + 0.05
        assert (gsd >= sd - 1e-6).float().mean() >= 0.95


def test_gsd_group_is_a_probability_rank_window_with_thresholds():
    p = torch.tensor([0.30, 0.02, 0.25, 0.01, 0.12, 0.10, 0.08, 0.05, 0.04, 0.03])
    rule = GSDRule(group_size=3, p_thr=0.05)
    members, mask = rule.group(p, torch.tensor(5))  # rank neighbours of 0.10 by probability: 0.08, 0.10, 0.12
    assert sorted(members.tolist()) == [4, 5, 6]
    assert mask.all()
    members, mask = GSDRule(group_size=3, p_thr=0.015).group(p, torch.tensor(5))
    assert dict(zip(members.tolist(), mask.tolist())) == {6: False, 5: True, 4: False}
    emb = torch.zeros(V, 2)
    emb[4] = torch.tensor([3.0, 0.0])  # far from token 5 in embedding space
    members, mask = GSDRule(group_size=3, p_thr=0.05, d_thr=0.5, embeddings=emb).group(p, torch.tensor(5))
    assert dict(zip(members.tolist(), mask.tolist())) == {6: True, 5: True, 4: False}


def test_gsd_window_stays_inside_the_vocabulary():
    p = torch.softmax(torch.randn(V), -1)
    top = p.argmax()
    members, _ = GSDRule(group_size=4, p_thr=1.0).group(p, top)
    assert len(set(members.tolist())) == 4 and top.item() in members.tolist()


def code_slice_group(p: torch.Tensor, x: int, half: int = 7) -> list[int]:
    """The public GSD code's group, written out: ascending sort, the slice [r - half : r + half] of it (Python
    slicing: truncated at the top, empty when r - half < 0), and the code's fallback to x alone when the slice is
    empty (its `.max()` raises; `except` uses p(x) / q(x))."""
    order = torch.sort(p).indices.tolist()
    r = order.index(x)
    window = order[r - half:r + half]
    return window if window else [x]


def test_gsd_reference_code_window_is_the_code_slice_at_both_ends_of_the_ranking():
    v = 40
    p = torch.softmax(torch.linspace(-3, 3, v), -1)  # ranks = token ids
    rule = GSDRule.reference_code()
    assert rule.group_window == "code" and rule.group_size == 14
    loose = GSDRule(group_size=14, p_thr=1.0, group_window="code")
    for x in (0, 3, 6, 7, 20, 33, 34, 38, 39):
        members, mask = loose.group(p, torch.tensor(x))
        assert sorted(members[mask].tolist()) == sorted(code_slice_group(p, x)), x
    top, _ = GSDRule(group_size=14, p_thr=1.0).group(p, torch.tensor(v - 1))
    assert len(top) == 14  # the default window shifts: the argmax token gets 13 neighbours, the code's 7
    members, mask = loose.group(p, torch.tensor(v - 1))
    assert mask.sum() == 8
    # below rank 7 the code falls back to plain speculative sampling: the grouped masses are p(x) and q(x)
    q = torch.softmax(torch.randn(v, generator=torch.Generator().manual_seed(3)), -1)
    p_group, q_group = loose.group_masses(p, q, torch.tensor(2))
    assert p_group.item() == pytest.approx(p[2].item()) and q_group.item() == pytest.approx(q[2].item())
    with pytest.raises(InputError, match="window"):
        GSDRule(group_window="wide")


@pytest.mark.parametrize("kwargs, word", [({"group_size": 0}, "group_size"), ({"p_thr": 0}, "p_thr"),
                                          ({"d_thr": -1.0}, "d_thr")])
def test_gsd_bad_parameters_are_named(kwargs, word):
    with pytest.raises(InputError, match=word):
        GSDRule(**kwargs)


@pytest.mark.parametrize("rule", [GSDRule(group_size=4),
                                  LanternRule(build_neighbour_table(line_codebook()), delta=0.1),
                                  LanternRule(build_neighbour_table(line_codebook()), delta=0.1, greedy=True)])
def test_relaxed_chain_rules_compile_fullgraph(rule):
    gen = torch.Generator().manual_seed(0)
    b, k = 4, 3
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(b, k, V, generator=gen), -1)
    x = torch.randint(0, V, (b, k), generator=gen)
    rand = Randomness.draw(b, k, V, gen)
    nd = torch.tensor([3, 2, 1, 0])

    def fn(x, p, q, u, e, nd):
        return rule.verify_chain(x, p, q, Randomness(u, e), nd).output_tokens

    got = torch.compile(fn, fullgraph=True, backend="eager")(x, p, q, rand.uniforms, rand.exponentials, nd)
    assert torch.equal(got, fn(x, p, q, rand.uniforms, rand.exponentials, nd))


def test_lantern_tree_compiles_fullgraph():
    gen = torch.Generator().manual_seed(0)
    b, k = 4, 3
    p = torch.softmax(torch.randn(b, k + 1, V, generator=gen), -1)
    tree = chain_as_tree(torch.randint(0, V, (b, k), generator=gen), torch.zeros(b, dtype=torch.long))
    rand = Randomness.draw(b, k + 1, V, gen)
    rule = LanternRule(build_neighbour_table(line_codebook()), delta=0.1)

    def fn(tokens, parents, depths, valid, p, u, e):
        t = type(tree)(tokens, parents, depths, valid, tree.max_depth, 1)
        return rule.verify_tree(t, p, Randomness(u, e)).output_tokens

    args = (tree.tokens, tree.parents, tree.depths, tree.valid, p, rand.uniforms, rand.exponentials)
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(*args), fn(*args))


def reference_static_tree_mixture(p: torch.Tensor, q: torch.Tensor, table: torch.Tensor, k: int, delta: float,
                                  zero_q_neighbourhood: bool) -> torch.Tensor:
    """The exact output distribution [V] of one draft x ~ q judged as the reference static-tree code does
    (jadohu/LANTERN evaluate_posterior_v1), written out independently: accept iff U <= p~(x) / q(x); on rejection
    q is zeroed at N[x][:k+1] when mass moved (if zero_q_neighbourhood), then residual norm(max(p - q, 0))."""
    p, q = p.double(), q.double()
    out = torch.zeros_like(p)
    for x in range(p.shape[0]):
        nearest = table[x, :k].long()
        cumulative = torch.cumsum(p[nearest], 0)
        within = (cumulative <= delta).nonzero()
        p_tilde = p[x] + (cumulative[within[-1, 0]] if within.numel() else 0.0)
        accept_prob = min(1.0, float(p_tilde / q[x]))
        q_rejected = q.clone()
        if zero_q_neighbourhood and within.numel():
            q_rejected[table[x, :k + 1].long()] = 0
        residual = (p - q_rejected).clamp(min=0)
        out[x] += q[x] * accept_prob
        out += q[x] * (1 - accept_prob) * residual / residual.sum()
    return out


@pytest.mark.parametrize("reject", ["moved", "code"])
def test_lantern_with_a_draft_distribution_matches_the_reference_rule(reject):
    n, k, delta = 200_000, 3, 0.3
    gen = torch.Generator().manual_seed(31)
    p_row = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    q_row = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    table = build_neighbour_table(line_codebook(), k=V - 1)
    x = torch.multinomial(q_row, n, replacement=True, generator=gen).view(n, 1)
    rule = LanternRule(table, k=k, delta=delta, reject=reject)
    rand = Randomness.draw(n, 1, V, torch.Generator().manual_seed(32))
    res = rule.verify_chain(x, p_row.expand(n, 2, V), q_row.expand(n, 1, V), rand, torch.ones(n, dtype=torch.long))
    emp = empirical_distribution(res.output_tokens[:, 0], V)
    code = reference_static_tree_mixture(p_row, q_row, table, k, delta, zero_q_neighbourhood=True)
    plain = reference_static_tree_mixture(p_row, q_row, table, k, delta, zero_q_neighbourhood=False)
    tol = tv_tolerance(V, n)
    assert tv_distance(code, plain) > 3 * tol  # the two residuals differ detectably here
    assert tv_distance(emp, code if reject == "code" else plain) < tol
    # with a draft distribution neither form keeps the per-candidate bound TV <= delta here
    assert tv_distance(code, p_row) > delta and tv_distance(plain, p_row) > delta


def test_lantern_treats_one_hot_q_rows_as_drafts_without_a_distribution():
    p, _, x, rand, nd = random_chain_problem(seed=12, b=64, k=3)
    one_hot = torch.nn.functional.one_hot(x, V).float()
    rule = LanternRule(build_neighbour_table(line_codebook()), delta=0.2)
    with_q = rule.verify_chain(x, p, one_hot, rand, nd)
    without = rule.verify_chain(x, p, None, rand, nd)
    assert torch.equal(with_q.output_tokens, without.output_tokens)



def test_neighbour_tables_stored_as_uint16_read_back_unsigned():
    """Tables of vocabularies up to 65536 are stored as uint16; ids above 32767 must come back as they were (torch
    before 2.6 indexes them through their int16 bits)."""
    ids = torch.tensor([[65535, 40000, 1], [32768, 0, 65534]], dtype=torch.int64)
    rule = LanternRule(ids.to(torch.uint16), k=3)
    assert rule._neighbours_of(torch.tensor([1, 0, -1]), 2).tolist() == [[32768, 0], [65535, 40000], [65535, 40000]]

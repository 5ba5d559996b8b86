"""Chain verification: hand-made cases, statistical losslessness, ragged batches, compile, bad input."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.noise import KeyedNoise
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.verify import ChainDraft, Randomness, accept, get_rule
from mmspec.verify.chain import verify_chain_greedy, verify_chain_lossless

V = 10


def one_hot(index: int, v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(index), v).float()


def fixed_randomness(uniforms, vocab=V, exps=None) -> Randomness:
    u = torch.tensor(uniforms, dtype=torch.float64)
    e = torch.ones(u.shape[0], vocab, dtype=torch.float64) if exps is None else exps
    return Randomness(u, e)


# ----------------------------------------------------------------------------------------- hand-made cases
def test_all_drafts_accepted_when_target_is_certain_then_bonus_from_last_position():
    x = torch.tensor([[3, 4, 5]])
    p = torch.stack([one_hot(3), one_hot(4), one_hot(5), one_hot(7)]).unsqueeze(0)  # [1, 4, V]
    rule = get_rule("lossless")
    res = rule.verify_chain(x, p, None, fixed_randomness([[0.99, 0.99, 0.99]]), torch.tensor([3]))
    assert res.output_tokens.tolist() == [[3, 4, 5, 7]]
    assert res.num_accepted.tolist() == [3]
    assert res.num_emitted.tolist() == [4]


def test_draft_with_zero_target_probability_is_rejected_and_recovered_from_residual():
    x = torch.tensor([[2, 4]])
    p = torch.stack([torch.tensor([0.0, 0.0, 0.0, 1.0] + [0.0] * 6), one_hot(4), one_hot(1)]).unsqueeze(0)
    res = get_rule("lossless").verify_chain(x, p, None, fixed_randomness([[0.0, 0.0]]), torch.tensor([2]))
    assert res.output_tokens.tolist() == [[3, -1, -1]]
    assert res.accepted_flags.tolist() == [[False, False]]


def test_acceptance_threshold_is_p_over_q():
    # p(x) = 0.3, q(x) = 0.6 -> accept iff U < 0.5
    p = torch.zeros(1, 2, V)
    p[0, 0, 0], p[0, 0, 1] = 0.3, 0.7
    p[0, 1, 5] = 1.0
    q = torch.zeros(1, 1, V)
    q[0, 0, 0], q[0, 0, 2] = 0.6, 0.4
    x = torch.tensor([[0]])
    rule = get_rule("lossless")
    accepted = rule.verify_chain(x, p, q, fixed_randomness([[0.49]]), torch.tensor([1]))
    rejected = rule.verify_chain(x, p, q, fixed_randomness([[0.51]]), torch.tensor([1]))
    assert accepted.output_tokens.tolist() == [[0, 5]]
    # residual max(p - q, 0) = [0, 0.7, 0, ...] -> the recovered token must be 1
    assert rejected.output_tokens.tolist() == [[1, -1]]


def test_ragged_num_draft_rows_in_one_call():
    x = torch.tensor([[1, 2, 3], [1, 2, -1], [-1, -1, -1]])
    p = torch.stack([one_hot(1), one_hot(2), one_hot(3), one_hot(9)]).expand(3, 4, V)
    res = get_rule("lossless").verify_chain(x, p, None, fixed_randomness([[0.5] * 3] * 3),
                                            torch.tensor([3, 2, 0]))
    assert res.output_tokens.tolist() == [[1, 2, 3, 9], [1, 2, 3, -1], [1, -1, -1, -1]]
    assert res.num_accepted.tolist() == [3, 2, 0]


def test_greedy_accepts_while_draft_equals_argmax():
    logits = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]]])
    out, acc, flags = verify_chain_greedy(torch.tensor([[1, 0, 1]]), logits, torch.tensor([3]))
    assert out.tolist() == [[1, 0, 2, -1]]
    assert acc.tolist() == [2]
    assert flags.tolist() == [[True, True, False]]


def test_empty_residual_falls_back_to_target():
    # p == q exactly: rejection has probability 0, but force it with U = 1 - tiny; the token must come from p
    p = torch.zeros(1, 2, V)
    p[0, :, 4] = 0.5
    p[0, :, 6] = 0.5
    q = p[:, :1].clone()
    res = get_rule("lossless").verify_chain(torch.tensor([[4]]), p, q, fixed_randomness([[1.0]]),
                                            torch.tensor([1]))
    assert res.output_tokens[0, 0].item() in (4, 6)


# ------------------------------------------------------------------------------ statistical losslessness
def _random_problem(n, k, seed, one_hot_drafts):
    gen = torch.Generator().manual_seed(seed)
    p_rows = torch.softmax(torch.randn(k + 1, V, generator=gen) * 1.5, -1)  # [K+1, V] one target per position
    q_rows = torch.softmax(torch.randn(k, V, generator=gen) * 1.5, -1)
    p = p_rows.expand(n, k + 1, V)
    x = torch.multinomial(q_rows, n, replacement=True, generator=gen).T  # [n, K] x_i ~ q_i
    if one_hot_drafts:
        # drafts passed without their distribution (q = one-hot at x): lossless for ANY way of choosing x
        # that is independent of the rule's randomness (p(x) accept, residual p without x)
        return p_rows, x, p, None
    return p_rows, x, p, q_rows.expand(n, k, V)


def _emitted_position_distributions(out, num_accepted, k):
    """Distribution of the token emitted at each position, among rows that emitted it."""
    dists = []
    for i in range(k + 1):
        emitted = num_accepted >= i
        dists.append((empirical_distribution(out[:, i], V, emitted), int(emitted.sum())))
    return dists


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_chain_is_lossless_in_distribution_with_ragged_drafts(one_hot_drafts):
    n, k = 200_000, 3
    p_rows, x, p, q = _random_problem(n, k, seed=1, one_hot_drafts=one_hot_drafts)
    num_draft = torch.randint(0, k + 1, (n,), generator=torch.Generator().manual_seed(2))  # ragged rows
    x = torch.where(torch.arange(k) < num_draft.unsqueeze(-1), x, -1)
    res = accept("lossless", ChainDraft(x, q, num_draft), p, torch.Generator().manual_seed(3))
    assert (res.num_accepted <= num_draft).all()
    for i, (emp, count) in enumerate(_emitted_position_distributions(res.output_tokens, res.num_accepted, k)):
        assert count > 200  # the tolerance below scales with the count
        assert tv_distance(emp, p_rows[i]) < tv_tolerance(V, count), f"position {i}"


def test_distribution_test_catches_a_wrong_residual():
    """Negative control: resampling from p instead of max(p - q, 0) must fail the same check."""
    from mmspec.verify.chain import verify_chain

    n, k = 200_000, 2
    p_rows, x, p, q = _random_problem(n, k, seed=1, one_hot_drafts=False)
    rand = Randomness.draw(n, k, V, torch.Generator().manual_seed(3))
    out, acc, _ = verify_chain(x, p, q, rand.uniforms, rand.exponentials, torch.full((n,), k),
                               residual_fn=lambda p_j, q_j, x_j: p_j)
    emp = empirical_distribution(out[:, 0], V)
    assert tv_distance(emp, p_rows[0]) > 5 * tv_tolerance(V, n)


def test_acceptance_rate_matches_theory():
    n, k = 100_000, 1
    p_rows, x, p, q = _random_problem(n, k, seed=4, one_hot_drafts=False)
    res = accept("lossless", ChainDraft(x, q), p, torch.Generator().manual_seed(5))
    expected = torch.minimum(p_rows[0], q[0, 0]).sum()  # 1 - TV(p, q)
    assert abs(res.num_accepted.double().mean() - expected) < 0.01


def test_per_row_generators_make_rows_independent_of_batch():
    n, k = 6, 4
    _, x, p, q = _random_problem(n, k, seed=6, one_hot_drafts=False)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    full = accept("lossless", ChainDraft(x, q), p, gens)
    alone = accept("lossless", ChainDraft(x[3:4], q[3:4]), p[3:4], [torch.Generator().manual_seed(103)])
    assert torch.equal(full.output_tokens[3:4], alone.output_tokens)


# -------------------------------------------------------------------------------------- compile (no sync)
@pytest.mark.parametrize("rule_name", ["lossless", "greedy"])
def test_chain_rules_compile_fullgraph(rule_name):
    n, k = 4, 3
    _, x, p, q = _random_problem(n, k, seed=7, one_hot_drafts=False)
    rule = get_rule(rule_name)
    rand = Randomness.draw(n, k, V, torch.Generator().manual_seed(0))
    num_draft = torch.tensor([3, 2, 1, 0])

    def fn(x, p, q, u, e, nd):
        res = rule.verify_chain(x, p, q, Randomness(u, e), nd)
        return res.output_tokens, res.num_accepted

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    got = compiled(x, p, q, rand.uniforms, rand.exponentials, num_draft)
    want = fn(x, p, q, rand.uniforms, rand.exponentials, num_draft)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_lossless_core_compiles_with_inductor():
    _, x, p, q = _random_problem(4, 3, seed=8, one_hot_drafts=False)
    rand = Randomness.draw(4, 3, V, torch.Generator().manual_seed(0))
    nd = torch.tensor([3, 3, 1, 0])
    compiled = torch.compile(verify_chain_lossless, fullgraph=True)
    got = compiled(x, p, q, rand.uniforms, rand.exponentials, nd)
    want = verify_chain_lossless(x, p, q, rand.uniforms, rand.exponentials, nd)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------------------------------- bad input
def test_mismatched_vocab_between_draft_and_target_is_named():
    x = torch.zeros(2, 3, dtype=torch.long)
    p = torch.full((2, 4, V), 1.0 / V)
    q = torch.full((2, 3, V + 2), 1.0 / (V + 2))
    with pytest.raises(InputError, match="vocabulary"):
        accept("lossless", ChainDraft(x, q), p)


def test_wrong_target_shape_is_named():
    with pytest.raises(InputError, match="target_probs"):
        accept("lossless", ChainDraft(torch.zeros(2, 3, dtype=torch.long)), torch.full((2, 3, V), 0.1))


def test_nan_target_probs_are_rejected():
    p = torch.full((1, 2, V), 0.1)
    p[0, 1, 3] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        accept("lossless", ChainDraft(torch.zeros(1, 1, dtype=torch.long)), p)


def test_logits_passed_as_probs_are_rejected():
    with pytest.raises(InputError, match="sum to 1|negative"):
        accept("lossless", ChainDraft(torch.zeros(1, 1, dtype=torch.long)), torch.randn(1, 2, V))


def test_out_of_vocab_draft_token_is_rejected():
    with pytest.raises(InputError, match="vocabulary"):
        accept("lossless", ChainDraft(torch.tensor([[V + 1]])), torch.full((1, 2, V), 0.1))


def test_unknown_rule_lists_the_known_ones():
    with pytest.raises(InputError, match="lossless"):
        get_rule("nope")


@pytest.mark.parametrize("rule_name", ["lossless", "gsd", "lantern"])
def test_a_step_without_drafts_is_the_rules_own_plain_sample(rule_name):
    """Rules marked `plain_step_samples_p` take the lossless rule's path on an empty chain (the loop's plain steps):
    it must give what the rule's own verify_chain gives there, token for token."""
    from mmspec.verify import LanternRule

    b, v = 64, 30
    p = torch.softmax(torch.randn(b, 1, v, generator=torch.Generator().manual_seed(0)) * 2, -1)
    neighbours = torch.randint(0, v, (v, 8), generator=torch.Generator().manual_seed(1))
    rule = LanternRule(neighbours, k=8) if rule_name == "lantern" else get_rule(rule_name)
    assert rule.plain_step_samples_p
    empty = ChainDraft(torch.empty(b, 0, dtype=torch.long))
    fast = accept(rule, empty, p, torch.Generator().manual_seed(2))
    noise = KeyedNoise.from_generators(torch.Generator().manual_seed(2), b)  # the numbers `accept` draws
    rand = Randomness.keyed(noise, torch.zeros(b, dtype=torch.long), empty, v)
    own = rule.verify_chain(empty.tokens, p, None, rand, empty.resolved_num_draft())
    assert torch.equal(fast.output_tokens, own.output_tokens) and torch.equal(fast.num_emitted, own.num_emitted)
    assert len(set(fast.output_tokens[:, 0].tolist())) > 5  # sampled, not a constant

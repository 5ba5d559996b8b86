"""Speculative Jacobi decoding (`mmspec.jacobi.JacobiDrafter`) on the toy target.

Exactness is proven the way tests/test_loop.py does it: the empirical distribution of whole generated sequences
equals the target's sequence distribution computed by enumeration (lossless rule, random and repeat_horizon
initialisation), and a drafter that misstates q fails the same bound. Greedy SJD equals greedy vanilla token for
token (with and without CFG), the tail is drafted from the right target distribution, rows are ragged and
independent of their batch, and Jacobi runs only inside its interval.
"""

import itertools

import pytest
import torch

import mmspec.jacobi as jacobi
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError
from mmspec.jacobi import (
    JacobiDrafter,
    carry_tail,
    draft_counts,
    first_column,
    horizon_tokens,
    jacobi_draft,
    jacobi_update,
    last_tail_token,
    with_one_hot_rows,
)
from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import DecodeState, generate
from mmspec.sampling import SamplingParams, logits_to_probs
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.toy import toy_model
from mmspec.verify import ChainDraft, VerifyResult

GREEDY = SamplingParams(temperature=0)


def run(model, drafter, prompt, n, rule="greedy", params=GREEDY, generator=None, callback=None):
    target = LMTarget(model, params, max_new_tokens=n)
    return generate(target, drafter, rule, prompt, batch_size=prompt.shape[0], max_new_tokens=n,
                    generator=generator, callback=callback)


@pytest.fixture(scope="module")
def target_model():
    return toy_model(seed=0, vocab_size=16)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------- the bookkeeping
def test_carry_tail_keeps_the_fresh_samples_after_the_recovered_token():
    k, v = 4, 6
    fresh = torch.tensor([[11, 12, 13, 14]] * 4)  # y_1..y_4 (column j-1 holds y_j)
    probs = torch.arange(k, dtype=torch.float32).view(1, k, 1).expand(4, k, v)  # P_j tagged by j - 1
    accepted = torch.tensor([0, 2, 4, 1])
    drafted = torch.tensor([4, 4, 4, 2])
    tokens, q, length = carry_tail(fresh, probs, accepted, drafted)
    assert length.tolist() == [4, 2, 0, 1]
    # a row that accepted n keeps y_{n+1}.. with q = P_{n+1}..: the slot right after the recovered token is
    # the fresh sample from P_{n+1}
    assert tokens[0].tolist() == [11, 12, 13, 14]
    assert tokens[1, :2].tolist() == [13, 14] and q[1, :2, 0].tolist() == [2.0, 3.0]
    assert tokens[3, :1].tolist() == [12] and q[3, 0, 0].item() == 1.0


def test_propose_uses_the_tail_then_one_hot_initialised_positions():
    b, v = 3, 5
    drafter = JacobiDrafter(v, window=4, init="repeat_horizon")
    state = DecodeState.new(b, 10, "cpu")
    state.last_token = torch.tensor([1, 2, 3])
    state.num_generated = torch.tensor([1, 1, 1])
    drafter.begin(None, state)
    drafter.tail_tokens = torch.tensor([[4, 0, 0], [4, 3, 0], [0, 0, 0]])
    drafter.tail_probs = torch.full((b, 3, v), 1.0 / v)
    drafter.tail_len = torch.tensor([1, 2, 0])
    draft = drafter.propose(state)
    # repeat_horizon: new positions copy the nearest known token on the left (last tail draft or last token)
    assert draft.tokens.tolist() == [[4, 4, 4], [4, 3, 3], [3, 3, 3]]
    assert draft.num_draft.tolist() == [3, 3, 3]
    from_tail = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    assert torch.allclose(draft.probs[from_tail], torch.full((3, v), 1.0 / v))
    one_hot = draft.probs[~from_tail]
    assert torch.equal(one_hot, torch.nn.functional.one_hot(draft.tokens[~from_tail], v).float())


def test_with_one_hot_rows_and_draft_counts():
    probs = torch.softmax(torch.randn(2, 3, 4), -1)
    tokens = torch.tensor([[0, 1, 2], [3, 3, 3]])
    keep = torch.tensor([[True, False, False], [False, True, True]])
    q = with_one_hot_rows(probs, tokens, keep)
    assert torch.equal(q[keep], probs[keep])
    assert torch.equal(q[~keep], torch.nn.functional.one_hot(tokens[~keep], 4).float())
    g = torch.tensor([0, 2, 3, 8, 12])
    assert draft_counts(g, 4, 2, 10).tolist() == [0, 4, 4, 2, 0]
    assert draft_counts(g, 4, 0, None).tolist() == [4, 4, 4, 4, 4]


def test_horizon_inits_use_the_image_rows_and_the_left_distribution():
    state = DecodeState.new(2, 20, "cpu")
    state.last_token = torch.tensor([7, 9])
    state.num_generated = torch.tensor([3, 6])  # next token indices 3.. and 6..
    drafter = JacobiDrafter(10, window=5, init="repeat_horizon", row_width=4)
    drafter.begin(None, state)
    draft = drafter.propose(state)
    # token index 4 (row 0, slot 1) and 8 (row 1, slot 2) start an image row of width 4: random there
    keep = torch.tensor([[True, False, True, True], [True, True, False, True]])
    assert (draft.tokens[0][keep[0]] == 7).all() and (draft.tokens[1][keep[1]] == 9).all()
    sample = JacobiDrafter(10, window=3, init="sample_horizon")
    sample.begin(None, state)
    assert sample.propose(state).tokens.tolist() == [[7, 7], [9, 9]]  # before any verify: the last token
    p = torch.zeros(2, 3, 10)
    p[:, :, 5] = 1.0
    p[1, 1] = torch.nn.functional.one_hot(torch.tensor(2), 10).float()  # row 1 drafted 1: P_1 is its last
    draft = ChainDraft(torch.tensor([[1, 1], [1, -1]]), None, torch.tensor([2, 1]))
    result = VerifyResult(torch.tensor([[1, 5, -1], [2, -1, -1]]), torch.tensor([1, 0]),
                          torch.tensor([[True, False], [False, False]]), torch.tensor([2, 1]))
    sample.observe(state, draft, result, torch.tensor([True, True]), p)
    assert sample.last_mode.tolist() == [5, 2]


def test_the_drafter_tensor_work_compiles_fullgraph():
    """No host synchronisation and no data-dependent Python branch in what propose / observe compute."""
    b, k, v = 3, 4, 6
    gen = torch.Generator().manual_seed(0)
    tail_tokens, tail_len = torch.randint(0, v, (b, k), generator=gen), torch.tensor([0, 2, 4])
    tail_probs = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    g, last = torch.tensor([1, 5, 9]), torch.tensor([2, 3, 4])
    rand = torch.randint(0, v, (b, k), generator=gen)

    def propose_work(tail_tokens, tail_probs, tail_len, rand, g, last):
        known = last_tail_token(tail_tokens, tail_len, last)
        init = horizon_tokens(rand, known, first_column(g, k, 4))
        return jacobi_draft(tail_tokens, tail_probs, tail_len, init, draft_counts(g, k, 2, 12))

    args = (tail_tokens, tail_probs, tail_len, rand, g, last)
    for want, got in zip(propose_work(*args), torch.compile(propose_work, fullgraph=True, backend="eager")(*args)):
        assert torch.equal(want, got)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen), -1)
    exps = torch.empty(b, k, v, dtype=torch.float64).exponential_(generator=gen)
    args = (p, torch.tensor([0, 1, 3]), torch.tensor([4, 2, 3]), exps)
    for want, got in zip(jacobi_update(*args), torch.compile(jacobi_update, fullgraph=True, backend="eager")(*args)):
        assert torch.equal(want, got)


# ----------------------------------------------------------------------------------------------- greedy
@torch.no_grad()
def reference_greedy(model, prompt, n):
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, prompt.shape[1]:]


@pytest.mark.parametrize("init", ["random", "repeat_horizon", "sample_horizon"])
@pytest.mark.parametrize("window", [1, 3, 16])
def test_greedy_sjd_equals_greedy_vanilla(target_model, prompt, init, window):
    n = 24
    emitted = []
    out = run(target_model, JacobiDrafter(16, window, init, greedy=True, row_width=5), prompt, n,
              callback=lambda s, d, r: emitted.append(r.num_accepted.clone()))
    assert torch.equal(out.tokens, reference_greedy(target_model, prompt, n))
    assert out.stats.num_target_forwards <= n
    if window == 16:  # Jacobi converges: fewer forwards than tokens, and rows accept different numbers
        assert out.stats.num_target_forwards < n
        assert any(len(set(a.tolist())) > 1 for a in emitted)


def test_lossless_rule_at_temperature_zero_and_cfg_equal_the_cfg_reference(target_model):
    from mmspec.lm import cfg_prompt_pair
    from mmspec.sampling import cfg_combine

    cond = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(2))
    uncond = torch.zeros_like(cond)
    scale, n = 3.0, 16
    with torch.no_grad():
        seq_c, seq_u = cond, uncond
        for _ in range(n):
            nxt = cfg_combine(target_model(seq_c)[:, -1], target_model(seq_u)[:, -1], scale).argmax(-1, keepdim=True)
            seq_c, seq_u = torch.cat([seq_c, nxt], 1), torch.cat([seq_u, nxt], 1)
    target = LMTarget(target_model, GREEDY, n, guidance_scale=scale, prefill_fn=cfg_prompt_pair)
    out = generate(target, JacobiDrafter(16, 8, "random"), "lossless",
                   (cond, uncond), batch_size=3, max_new_tokens=n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, seq_c[:, cond.shape[1]:])


# ------------------------------------------------------------------------------------------- exactness
@torch.no_grad()
def exact_sequence_distribution(model, prompt, n, params):
    """Probability of every length-n continuation of one prompt, by enumeration with full forwards."""
    v = model.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n)))  # [V^n, n]
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    probs = logits_to_probs(model(full)[:, prompt.shape[1] - 1:-1], params.temperature, params.top_k, params.top_p)
    return probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)  # [V^n]


class UniformQDrafter(JacobiDrafter):
    """Negative control: samples the tail from P but claims q = uniform (a wrong draft distribution)."""

    def observe(self, state, draft, result, active, target_probs):
        super().observe(state, draft, result, active, target_probs)
        self.tail_probs = torch.full_like(self.tail_probs, 1.0 / self.vocab_size)


def sampled_sequences(drafter_cls, init, rows, coupling="none", v=4, n=4, window=3):
    """n tokens over a vocabulary of v, a window of 3 (2 drafts) by default, so carried tails are verified (6
    tokens and a window of 4 re-draft positions of a carried tail before they are verified: the couplings act);
    returns (tv, tolerance, tail stats, stats)."""
    model = toy_model(seed=3, vocab_size=v, dim=16)
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = torch.tensor([[1, 2, 0]])
    exact = exact_sequence_distribution(model, prompt, n, params)
    tail = [0, 0]  # carried drafts accepted, carried drafts verified

    def count_tail(state, draft, result):
        carried = (draft.probs.max(-1).values < 1) & (draft.tokens >= 0)  # [B, K]: q is a target P
        tail[0] += int((carried & result.accepted_flags).sum())
        tail[1] += int(carried.sum())

    gen = torch.Generator().manual_seed(6)
    out = run(model, drafter_cls(v, window, init, coupling=coupling), prompt.expand(rows, -1), n, "lossless", params,
              gen, callback=count_tail)
    codes = (out.tokens * (v ** torch.arange(n - 1, -1, -1))).sum(-1)
    emp = empirical_distribution(codes, v ** n)
    return tv_distance(emp, exact), tv_tolerance(int((exact > 1e-4).sum()), rows), tail, out.stats


@pytest.mark.parametrize("init", ["random", "repeat_horizon"])
def test_sampling_through_sjd_has_the_exact_sequence_distribution(init):
    tv, tol, tail, stats = sampled_sequences(JacobiDrafter, init, 60_000)
    assert tv < tol
    assert tail[1] > 10_000 and tail[0] > 5_000  # the carried tail is exercised, and accepted
    assert stats.num_accepted_tokens > 0


def test_maximal_coupling_keeps_the_previous_draft_as_often_as_any_coupling_can_and_samples_p():
    """maximally_coupled on 200k positions: the new draft's law is P, and it equals the previous draft (drawn from q)
    with probability 1 - TV(P, q), the most any coupling gives (independent re-drafts agree sum_x P(x) q(x))."""
    from mmspec.jacobi import maximally_coupled

    n, v = 200_000, 6
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    previous = torch.multinomial(q, n, replacement=True, generator=g)[None]  # [1, n] ~ q
    fresh = torch.multinomial(p, n, replacement=True, generator=g)[None]  # [1, n] ~ p
    exps = torch.empty(1, n, v, dtype=torch.float64).exponential_(generator=g)
    new = maximally_coupled(fresh, p.expand(1, n, v), previous, q.expand(1, n, v),
                            torch.rand(1, n, dtype=torch.float64, generator=g), exps)
    assert tv_distance(empirical_distribution(new, v), p) < tv_tolerance(v, n)
    agree = float((new == previous).double().mean())
    assert abs(agree - (1 - tv_distance(p, q))) < 0.01 and agree > float((p * q).sum()) + 0.1
    none = maximally_coupled(fresh, p.expand(1, n, v), torch.full_like(previous, -1), q.expand(1, n, v),
                             torch.rand(1, n, dtype=torch.float64, generator=g), exps)
    assert torch.equal(none, fresh)  # no previous draft: the fresh sample


def test_a_coupling_that_ignores_p_fails_the_sequence_bound(monkeypatch):
    """A 'coupling' that always keeps the previous draft (no min(1, P(x) / q(x)) test) breaks the law."""
    from mmspec import jacobi

    monkeypatch.setattr(jacobi, "maximally_coupled", lambda fresh, probs, previous, *rest: torch.where(
        previous >= 0, previous, fresh))
    tv, tol, _, _ = sampled_sequences(JacobiDrafter, "random", 20_000, "maximal", v=3, n=6, window=4)
    assert tv > 2 * tol, (tv, tol)


@pytest.mark.parametrize("init, coupling", [("random", "gumbel"), ("repeat_horizon", "maximal")])
def test_coupled_sjd_has_the_exact_sequence_distribution(init, coupling):
    """MC-SJD's couplings tie a re-drafted position's sample to its previous draft; each draft's law stays the q
    it is verified against, so the sequence law is the target's (6 tokens of 3, a window of 4: re-drafts act)."""
    tv, tol, tail, _ = sampled_sequences(JacobiDrafter, init, 30_000, coupling, v=3, n=6, window=4)
    assert tv < tol and tail[1] > 5_000


def test_a_wrong_draft_distribution_fails_the_same_bound():
    tv, tol, _, _ = sampled_sequences(UniformQDrafter, "random", 20_000)
    assert tv > 2 * tol


class PositionLM:
    """A CachedLM whose next-token distribution depends only on the position, not on the prefix."""

    def __init__(self, vocab_size: int = 8, max_positions: int = 64, seed: int = 0):
        self.vocab_size = vocab_size
        self.table = torch.randn(max_positions, vocab_size, generator=torch.Generator().manual_seed(seed))

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        return StaticKVCache(1, batch_size, 1, capacity, 1)

    def forward_cached(self, tokens, positions, cache, slots, mask):
        return self.table[positions]  # [B, S, V]


def test_the_tail_is_drafted_from_the_target_distribution_at_its_position(monkeypatch):
    """With a prefix-independent target, a carried draft's q IS the target's p at its position: a correctly
    indexed tail is always accepted. Shifting the tail by one position breaks that."""
    model, prompt, n = PositionLM(), torch.zeros(16, 2, dtype=torch.long), 30
    params = SamplingParams(temperature=1.0)

    def tail_counts():
        seen = [0, 0]

        def count(state, draft, result):
            carried = (draft.probs.max(-1).values < 1) & (draft.tokens >= 0)
            seen[0] += int((carried & result.accepted_flags).sum())
            seen[1] += int(carried.sum())

        gen = torch.Generator().manual_seed(0)
        run(model, JacobiDrafter(8, 6, "random"), prompt, n, "lossless", params, gen, callback=count)
        return seen

    accepted, carried = tail_counts()
    assert carried > 100 and accepted == carried

    def shifted(fresh, next_probs, num_accepted, num_drafted):
        return carry_tail(fresh, next_probs, (num_accepted + 1).clamp_max(next_probs.shape[1] - 1), num_drafted)

    monkeypatch.setattr(jacobi, "carry_tail", shifted)
    accepted, carried = tail_counts()
    assert accepted < 0.9 * carried


# ------------------------------------------------------------------------------------ rows and interval
def test_a_row_does_not_depend_on_its_batch(target_model, prompt):
    params = SamplingParams(temperature=1.0)

    def go(rows, init):
        gens = [torch.Generator().manual_seed(10 + r) for r in rows]
        return run(target_model, JacobiDrafter(16, 5, init), prompt[rows], 14, "lossless", params, gens)

    for init in ("random", "sample_horizon"):
        batch, single = go([0, 1, 2, 3], init), go([2], init)
        assert torch.equal(batch.tokens[2], single.tokens[0])
        assert batch.stats.num_accepted_tokens > 0


class RecordingDrafter(JacobiDrafter):
    def propose(self, state):
        self.seen_generated = state.num_generated.clone()
        return super().propose(state)


@pytest.mark.parametrize("interval", [(3, 10), (0, 5), (7, None)])
def test_jacobi_runs_only_inside_its_interval(target_model, prompt, interval):
    n, k = 20, 4
    start, end = interval
    end_ = n if end is None else end
    drafter = RecordingDrafter(16, k + 1, "random", interval=interval)
    checked = []

    def check_draft(state, draft, result):
        g, m = drafter.seen_generated, draft.resolved_num_draft()
        want = torch.where(g >= start, (end_ - g).clamp(0, k), 0).minimum((n - g - 1).clamp_min(0))
        assert torch.equal(m, want), (g, m, want)
        checked.append(bool((m > 0).any()))

    out = run(target_model, drafter, prompt, n, "lossless", SamplingParams(1.0), torch.Generator().manual_seed(1),
              callback=check_draft)
    assert any(checked) and out.stats.num_draft_tokens > 0


def test_sjd_never_needs_more_forwards_than_vanilla(target_model, prompt):
    params, n = SamplingParams(temperature=1.0, top_k=4), 20
    vanilla = run(target_model, NoDrafter(), prompt, n, "lossless", params, torch.Generator().manual_seed(0))
    sjd = run(target_model, JacobiDrafter(16, 8, "random"), prompt, n,
              "lossless", params, torch.Generator().manual_seed(0))
    assert sjd.stats.num_target_forwards <= vanilla.stats.num_target_forwards


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, "window"), ({"window": 2.5}, "window"), ({"init": "zeros"}, "init"),
    ({"interval": (5, 3)}, "interval"), ({"interval": (-1, 4)}, "interval"), ({"interval": "all"}, "interval"),
    ({"interval": (1, 2, 3)}, "interval"), ({"vocab_size": 0}, "vocab_size"), ({"row_width": 0}, "row_width"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    args = {"vocab_size": 16, **kwargs}
    with pytest.raises(InputError, match=match):
        JacobiDrafter(**args)


def test_a_target_with_another_vocabulary_is_a_clear_error(target_model, prompt):
    with pytest.raises(InputError, match="vocab"):
        run(target_model, JacobiDrafter(12, 3, greedy=True), prompt, 6)

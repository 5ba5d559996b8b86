"""The loop on the toy target: greedy speculative == greedy vanilla, exact sampling distribution, EOS, stats."""

import itertools

import pytest
import torch

from mmspec.lm import DraftModelDrafter, LMTarget, NoDrafter, TreeModelDrafter
from mmspec.loop import generate
from mmspec.sampling import SamplingParams
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.testing.drafters import RandomDrafter
from mmspec.testing.toy import toy_model

GREEDY = SamplingParams(temperature=0)


@torch.no_grad()
def reference_greedy(model, prompt, n):
    """Plain greedy decoding with full forwards and no cache: the independent reference."""
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, prompt.shape[1]:]


def run(model, drafter, prompt, n, rule="greedy", params=GREEDY, generator=None, eos=None):
    target = LMTarget(model, params, max_new_tokens=n)
    return generate(target, drafter, rule, prompt, batch_size=prompt.shape[0], max_new_tokens=n,
                    generator=generator, eos_token_id=eos)


@pytest.fixture(scope="module")
def target_model():
    return toy_model(seed=0, vocab_size=16)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make_drafter, min_len, max_len", [
    (lambda m: NoDrafter(), 1.0, 1.0),
    (lambda m: RandomDrafter(16, 5), 1.0, 2.0),  # nothing (or little) accepted
    (lambda m: DraftModelDrafter(m, 4, GREEDY), 4.0, 5.0),  # the target as its own drafter: all accepted
    (lambda m: DraftModelDrafter(toy_model(seed=7, vocab_size=16), 3, GREEDY), 1.0, 4.0),
    # EAGLE-2 keeps the global top-k by cumulative score, so even a self-drafted greedy path can be pruned
    (lambda m: TreeModelDrafter(m, top_k=3, depth=4, total_tokens=12), 4.0, 5.0),
    (lambda m: TreeModelDrafter(toy_model(seed=7, vocab_size=16), top_k=3, depth=3, total_tokens=10), 1.0, 4.0),
], ids=["vanilla", "random", "self-chain", "other-chain", "self-tree", "other-tree"])
def test_greedy_speculative_equals_greedy_vanilla(target_model, prompt, make_drafter, min_len, max_len):
    n = 24
    want = reference_greedy(target_model, prompt, n)
    drafter = make_drafter(target_model)
    out = run(target_model, drafter, prompt, n)
    assert torch.equal(out.tokens, want)
    assert (out.num_generated == n).all()
    # the last iteration drafts only what still fits, so the mean can sit below K + 1
    assert min_len - 1e-9 <= out.stats.mean_acceptance_length <= max_len + 1e-9
    if isinstance(drafter, DraftModelDrafter) and drafter.runner.model is target_model:
        assert out.stats.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("rule", ["lossless", "lantern-zero"])
def test_lossless_rule_at_temperature_zero_equals_greedy(target_model, prompt, rule):
    from mmspec.verify import LanternRule, build_neighbour_table

    if rule == "lantern-zero":
        rule = LanternRule(build_neighbour_table(torch.randn(16, 3)), delta=0.0)
    out = run(target_model, DraftModelDrafter(toy_model(seed=7, vocab_size=16), 3, GREEDY), prompt, 16, rule=rule)
    assert torch.equal(out.tokens, reference_greedy(target_model, prompt, 16))


@torch.no_grad()
def exact_sequence_distribution(model, prompt, n, params):
    """Probability of every length-n continuation of one prompt, by enumeration with full forwards."""
    v = model.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n)))  # [V^n, n]
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    from mmspec.sampling import logits_to_probs

    probs = logits_to_probs(model(full)[:, prompt.shape[1] - 1:-1], params.temperature, params.top_k, params.top_p)
    return probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)  # [V^n]


@pytest.mark.parametrize("drafter_kind", ["draft-model", "tree", "random"])
def test_sampling_through_the_loop_has_the_exact_sequence_distribution(drafter_kind):
    v, n, rows = 5, 3, 60_000
    model = toy_model(seed=3, vocab_size=v, dim=16)
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = torch.tensor([[1, 2, 3]])
    exact = exact_sequence_distribution(model, prompt, n, params)
    small = toy_model(seed=4, vocab_size=v, dim=16)
    drafter = {"draft-model": lambda: DraftModelDrafter(small, 2, SamplingParams(temperature=1.0)),
               "tree": lambda: TreeModelDrafter(small, top_k=2, depth=2, total_tokens=5),
               "random": lambda: RandomDrafter(v, 2, seed=5)}[drafter_kind]()
    out = run(model, drafter, prompt.expand(rows, -1), n, rule="lossless", params=params,
              generator=torch.Generator().manual_seed(6))
    codes = (out.tokens * torch.tensor([v * v, v, 1])).sum(-1)
    emp = empirical_distribution(codes, v ** n)
    support = int((exact > 1e-4).sum())
    assert tv_distance(emp, exact) < tv_tolerance(support, rows)
    assert out.stats.num_accepted_tokens > 0 or drafter_kind == "random"


def test_seeded_sampling_is_reproducible(target_model, prompt):
    params = SamplingParams(temperature=1.0)
    outs = [run(target_model, DraftModelDrafter(toy_model(seed=7, vocab_size=16), 3, params),
                prompt, 12, "lossless", params, torch.Generator().manual_seed(2)).tokens for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


def test_per_row_generators_make_a_row_independent_of_its_batch(target_model, prompt):
    params = SamplingParams(temperature=1.0)

    def go(rows):
        gens = [torch.Generator().manual_seed(10 + r) for r in rows]
        return run(target_model, NoDrafter(), prompt[rows], 10, "lossless", params, gens).tokens

    assert torch.equal(go([0, 1, 2, 3])[2], go([2])[0])


def test_eos_stops_a_row_and_max_new_tokens_truncates(target_model, prompt):
    want = reference_greedy(target_model, prompt, 20)
    eos = int(want[0, 3])
    out = run(target_model, DraftModelDrafter(target_model, 4, GREEDY), prompt, 20, eos=eos)
    for r in range(prompt.shape[0]):
        hits = (want[r] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 20
        assert out.num_generated[r] == stop
        assert torch.equal(out.tokens[r, :stop], want[r, :stop])
        assert (out.tokens[r, stop:] == -1).all()


def test_stats_account_for_every_token_and_forward(target_model, prompt):
    out = run(target_model, DraftModelDrafter(toy_model(seed=7, vocab_size=16), 3, GREEDY), prompt, 17)
    s = out.stats
    # the first token comes from prefill; every other token from a verify call (this run does not truncate)
    assert s.num_target_forwards == 1 + len(s.accept_lengths_per_row()[0])
    assert s.num_emitted_tokens >= prompt.shape[0] * 16
    assert s.num_accepted_tokens == sum(i * c for i, c in enumerate(s.acceptance_histogram))
    rows = prompt.shape[0]  # drafts are full (3) except when capped near the end
    assert 3 * (s.num_drafts - rows) <= s.num_draft_tokens <= 3 * s.num_drafts
    assert 0 <= s.draft_acceptance_rate <= 1
    rates = s.per_position_acceptance_rate
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))  # accepted prefix: non-increasing
    assert s.num_draft_forwards > 0


def test_cfg_target_equals_cfg_reference(target_model):
    """CFG as one 2B batch: cond prompts then uncond prompts, the same token fed to both halves."""
    from mmspec.lm import cfg_prompt_pair
    from mmspec.sampling import cfg_combine

    cond = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(2))
    uncond = torch.zeros_like(cond)
    scale, n = 3.0, 12

    with torch.no_grad():  # reference: full forwards of both halves, greedy on the combined logits
        seq_c, seq_u = cond, uncond
        for _ in range(n):
            logits = cfg_combine(target_model(seq_c)[:, -1], target_model(seq_u)[:, -1], scale)
            nxt = logits.argmax(-1, keepdim=True)
            seq_c, seq_u = torch.cat([seq_c, nxt], 1), torch.cat([seq_u, nxt], 1)
    want = seq_c[:, cond.shape[1]:]

    cfg = dict(guidance_scale=scale, prefill_fn=cfg_prompt_pair)
    for drafter in (NoDrafter(), DraftModelDrafter(target_model, 3, GREEDY, **cfg),
                    TreeModelDrafter(toy_model(seed=7, vocab_size=16), top_k=2, depth=3, total_tokens=8, **cfg)):
        target = LMTarget(target_model, GREEDY, n, **cfg)
        out = generate(target, drafter, "greedy", (cond, uncond), batch_size=3, max_new_tokens=n)
        assert torch.equal(out.tokens, want), type(drafter).__name__
        if isinstance(drafter, DraftModelDrafter):  # the target drafting for itself under CFG: all accepted
            assert out.stats.draft_acceptance_rate == 1.0


def test_drafts_are_capped_at_the_end_of_generation():
    from mmspec.loop import cap_draft
    from mmspec.tree import chain_as_tree
    from mmspec.verify import ChainDraft

    chain = cap_draft(ChainDraft(torch.tensor([[1, 2, 3], [4, 5, 6]])), torch.tensor([1, 5]))
    assert chain.tokens.tolist() == [[1, -1, -1], [4, 5, 6]] and chain.num_draft.tolist() == [1, 3]
    tree = cap_draft(chain_as_tree(torch.tensor([[1, 2, 3]]), torch.tensor([0])), torch.tensor([2]))
    assert tree.valid.tolist() == [[True, True, True, False]]


def test_a_step_without_drafts_appends_as_the_general_path_does():
    """`DecodeState.append_one` (steps without drafts) == `append`'s general path: EOS, max_new_tokens, finished
    rows."""
    from mmspec.loop import DecodeState
    from mmspec.verify import VerifyResult

    gen = torch.Generator().manual_seed(0)
    states = [DecodeState.new(6, 5, "cpu", eos_token_id=[3, 4]) for _ in range(2)]
    for step in range(7):
        token = torch.randint(0, 8, (6,), generator=gen)
        result = VerifyResult(token.unsqueeze(-1), torch.zeros(6, dtype=torch.long),
                              torch.zeros(6, 0, dtype=torch.bool), torch.zeros(6, dtype=torch.long))
        fast = states[0].append(result, ~states[0].done)
        general = result.output_tokens.new_full((6, 2), -1)  # a wider result takes the general path
        general[:, 0] = token
        slow = states[1].append(VerifyResult(general, result.num_accepted, torch.zeros(6, 1, dtype=torch.bool),
                                             result.num_drafted), ~states[1].done)
        assert torch.equal(fast, slow), step
        for name in ("output", "num_generated", "last_token", "done"):
            assert torch.equal(getattr(states[0], name), getattr(states[1], name)), (step, name)
    assert bool(states[0].done.all()) and (states[0].num_generated < 5).any()  # some rows stopped at EOS


def test_vanilla_keeps_no_room_for_drafts(target_model, prompt):
    """A drafter that only takes plain steps (vanilla's `NoDrafter`) runs with the cache a plain call needs, as a
    call the budget runs without its drafter does: room for draft nodes nobody drafts, made in every prefill, made
    LlamaGen's vanilla 4.7% slower at batch 32 (2-core CPU, 2026-11-28). A drafting call keeps the room."""
    n = 8
    for drafter, room in ((NoDrafter(), False), (DraftModelDrafter(target_model, 4, GREEDY), True)):
        target = LMTarget(target_model, GREEDY, max_new_tokens=n, max_draft_nodes=16)
        out = generate(target, drafter, "greedy", prompt, batch_size=prompt.shape[0], max_new_tokens=n)
        assert target.draft_room is room
        capacity = target.extra_capacity if room else target.plain_capacity
        assert target.runner.cache.capacity == prompt.shape[1] + capacity
        assert torch.equal(out.tokens, reference_greedy(target_model, prompt, n))


def test_dropping_finished_rows_under_cfg_keeps_every_row(target_model):
    """`drop_finished` on a CFG target (both halves of each row leave together, per-row guidance scales follow),
    sampled with a generator per row and stopped by EOS at different steps: the
    same tokens, counts and per-row accept lengths as keeping every row, and rows did leave."""
    import mmspec.loop as loop
    from mmspec.lm import cfg_prompt_pair

    cond = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(3))
    uncond = torch.zeros_like(cond)
    scale = torch.tensor([1.0, 2.0, 3.0, 1.5, 2.5, 4.0])
    params = SamplingParams(temperature=1.0)
    outs, drops = [], []
    original = loop.drop_finished_rows

    def counted(*args, **kwargs):
        drops.append(int(args[3].sum()))
        return original(*args, **kwargs)

    loop.drop_finished_rows = counted
    try:
        for drop in (False, True):
            target = LMTarget(target_model, params, 20, guidance_scale=scale, prefill_fn=cfg_prompt_pair)
            gens = [torch.Generator().manual_seed(10 + i) for i in range(6)]
            outs.append(generate(target, NoDrafter(), "lossless", (cond, uncond), batch_size=6, max_new_tokens=20,
                                 generator=gens, eos_token_id=[2, 5], drop_finished=drop))
    finally:
        loop.drop_finished_rows = original
    kept, dropped = outs
    assert drops and torch.equal(kept.tokens, dropped.tokens) and torch.equal(kept.num_generated, dropped.num_generated)
    assert kept.stats.accept_lengths_per_row() == dropped.stats.accept_lengths_per_row()
    assert kept.num_generated.min() < kept.num_generated.max()

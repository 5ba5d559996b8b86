"""Statistics: counters from hand-made verify results, per-position rates, merging, JSON round trip."""

import json

import pytest
import torch

from mmspec.stats import SpecStats, budget_notice, budget_sizes, budget_summary
from mmspec.verify import VerifyResult


def result(accepted, drafted, k):
    acc = torch.tensor(accepted)
    flags = torch.arange(k) < acc.unsqueeze(-1)
    out = torch.full((len(accepted), k + 1), -1)
    return VerifyResult(out, acc, flags, torch.tensor(drafted))


def test_counters_and_rates():
    s = SpecStats()
    s.record(result([2, 0, 3], [3, 3, 3], 3))
    s.record(result([1, 3, 0], [3, 3, 0], 3), active=torch.tensor([True, True, False]))
    assert s.num_drafts == 5  # the finished row of the second call is not counted
    assert s.num_draft_tokens == 15
    assert s.num_accepted_tokens == 2 + 0 + 3 + 1 + 3
    assert s.num_emitted_tokens == 9 + 5
    assert s.mean_acceptance_length == 14 / 5
    assert s.draft_acceptance_rate == 9 / 15
    assert s.per_position_acceptance_rate == [4 / 5, 3 / 5, 2 / 5]
    assert s.acceptance_histogram == [1, 1, 1, 2]
    assert s.accept_lengths_per_row() == [[3, 2], [1, 4], [4]]


def plain(rows):
    """A plain step's result: no draft, one token emitted per row."""
    return result([0] * rows, [0] * rows, 0)


def test_plain_steps_count_apart_from_drafts():
    """vLLM's semantics: the mean acceptance length and the histogram are over drafting row-iterations only; plain
    steps count in num_plain_steps (and in the tokens per verify row over all steps)."""
    s = SpecStats()
    for _ in range(3):
        s.record(plain(2))
    s.record(result([3, 3], [3, 3], 3))  # every drafted position accepted
    s.record(plain(2))
    s.record(result([3, 0], [3, 0], 3))  # row 1 drafted nothing: a plain row in a drafting step
    assert (s.num_drafts, s.num_plain_steps, s.num_verify_rows) == (3, 9, 12)
    assert s.mean_acceptance_length == 1 + 3  # 1 + K, whatever the plain steps
    assert s.acceptance_histogram == [0, 0, 0, 3]
    assert s.tokens_per_verify_row == (9 + 12) / 12
    assert s.draft_acceptance_rate == 1.0
    data = s.to_dict()
    assert data["num_plain_steps"] == 9 and data["mean_acceptance_length"] == 4.0
    assert SpecStats.from_dict(json.loads(s.to_json())).to_dict() == data
    merged = s + s
    assert (merged.num_plain_steps, merged.num_drafts, merged.mean_acceptance_length) == (18, 6, 4.0)
    assert merged.acceptance_histogram == [0, 0, 0, 6]


def test_windows_without_a_bonus_count_the_tokens_they_emitted():
    """CSpD's windows emit the whole window when every draft is accepted (no bonus token): the mean acceptance length
    is the tokens a drafting step emitted, not 1 + accepted."""
    from mmspec.verify.cspd import ContinuousVerifyResult

    accepted = torch.tensor([3, 1])
    window = ContinuousVerifyResult(torch.zeros(2, 3, 4), accepted, torch.arange(3) < accepted.unsqueeze(-1),
                                    torch.tensor([3, 3]), emitted=torch.tensor([3, 2]))
    s = SpecStats()
    s.record(window)
    s.record(plain(2))
    assert s.mean_acceptance_length == (3 + 2) / 2 and s.num_plain_steps == 2 and s.acceptance_histogram == [0, 1, 0, 1]


def test_vanilla_and_empty_runs():
    vanilla = SpecStats()
    vanilla.record(plain(3))
    assert vanilla.mean_acceptance_length == 1.0 and vanilla.acceptance_histogram == []
    assert (vanilla.num_drafts, vanilla.num_plain_steps, vanilla.tokens_per_verify_row) == (0, 3, 1.0)
    assert SpecStats().mean_acceptance_length == 0.0 and SpecStats().tokens_per_verify_row == 0.0


def test_files_without_plain_steps_are_read_with_them_derived():
    """A file written before num_plain_steps: plain = verify rows - drafts, taken out of its histogram's bin 0."""
    s = SpecStats()
    s.record(plain(2))
    s.record(result([2, 0], [2, 2], 2))
    data = s.to_dict()
    old = {k: v for k, v in data.items() if k != "num_plain_steps"}
    old["acceptance_histogram"] = [3, 0, 1]  # the old fold counted the 2 plain rows at 0 accepted
    again = SpecStats.from_dict(old)
    assert again.num_plain_steps == 2 and again.acceptance_histogram == [1, 0, 1]
    assert again.to_dict() == data


def budget_run(drafted_steps: int, plain_steps: int, calls_without: int | None = None) -> SpecStats:
    """A batch-1 run whose draft budget chose `drafted_steps` chains of 2 and `plain_steps` plain steps."""
    s = SpecStats()
    for _ in range(drafted_steps):
        s.record(result([1], [2], 2))
        s.add_extra("budget_2", 1)
    for _ in range(plain_steps):
        s.record(plain(1))
        s.add_extra("budget_0", 1)
    if calls_without is not None:
        s.add_extra("calls_without_drafter", calls_without)
    return s


def test_budget_notice_says_the_counts_why_and_how_to_draft():
    line = budget_notice(budget_run(8, 118, calls_without=2), "sjd")
    assert line.startswith("note: sjd drafted on 8 of 126 verify steps")
    assert "118 plain steps" in line and "2 calls wholly without the drafter" in line and "--budget fixed" in line
    assert "\n" not in line
    line = budget_notice(budget_run(0, 5, calls_without=1), "eagle", hint='budget="fixed"')
    assert "drafted on 0 of 5" in line and "1 call wholly" in line and 'budget="fixed" drafts every step' in line
    assert "without the drafter" not in budget_notice(budget_run(1, 5), "eagle")


@pytest.mark.parametrize("stats", [
    budget_run(10, 10),  # drafted on half the steps
    budget_run(10, 0, calls_without=0),  # drafted every step
    SpecStats(),  # nothing recorded
], ids=["half", "every-step", "empty"])
def test_budget_notice_is_none_when_the_budget_drafted_enough(stats):
    assert budget_notice(stats, "sjd") is None


def test_a_run_that_accepted_no_draft_says_so_with_or_without_a_budget():
    """Drafting every step and accepting nothing (MAR's CSpD with the paper's criterion and the world's draft) costs
    more than plain decoding: one line says so; one accepted draft is enough to say nothing."""
    rejected = SpecStats()
    for _ in range(7):
        rejected.record(result([0], [4], 4))
    assert budget_notice(rejected, "cspd") is None  # 7 drafting steps: too few to say
    rejected.record(result([0], [4], 4))
    line = budget_notice(rejected, "cspd")
    assert line.startswith("note: cspd accepted none of the 32 tokens it drafted on 8 of 8 verify steps")
    assert "--budget auto" in line and "\n" not in line
    rejected.add_extra("budget_4", 8)  # the same under a budget that drafted every step
    assert budget_notice(rejected, "cspd", hint='budget="fixed"').endswith('budget="auto" runs plain steps where '
                                                                           "drafting does not pay.")
    rejected.record(result([1], [4], 4))
    assert budget_notice(rejected, "cspd") is None


def test_budget_notice_is_none_without_a_budget():
    vanilla = SpecStats()
    for _ in range(4):
        vanilla.record(plain(1))
    assert budget_notice(vanilla, "vanilla") is None  # plain by design: no budget counters
    fixed = SpecStats()
    fixed.record(result([1], [2], 2))
    for _ in range(3):  # plain rows the budget did not choose (e.g. drafts capped at the end)
        fixed.record(plain(1))
    assert budget_notice(fixed, "sjd") is None
    fixed.add_extra("budget_2", 4)
    assert budget_notice(fixed, "sjd") is None  # a budget that chose no plain step and ran every call with drafts


def test_budget_summary_lists_the_sizes_chosen():
    stats = budget_run(3, 5, calls_without=1)
    assert budget_sizes(stats) == {"plain": 5, "2": 3}
    assert budget_summary(stats) == ("draft budget: drafted on 3 of 8 verify steps (counted per row); sizes chosen "
                                     "(steps): plain ×5, 2 ×3; 1 call without the drafter")
    assert budget_summary(budget_run(2, 0)).endswith("sizes chosen (steps): 2 ×2")
    no_budget = SpecStats()
    no_budget.record(plain(1))
    assert budget_summary(no_budget) is None and budget_sizes(no_budget) == {}


def test_positions_grow_with_longer_drafts_and_merge():
    a = SpecStats(num_target_forwards=3)
    a.record(result([1], [2], 2))
    a.record(result([4], [5], 5))
    b = SpecStats(num_target_forwards=2, wall_time=1.5)
    b.record(result([0], [1], 1))
    b.add_extra("fallbacks", 2)
    merged = a + b
    assert merged.num_target_forwards == 5 and merged.wall_time == 1.5
    assert merged.per_position_acceptance_rate == [2 / 3, 1 / 2, 1.0, 1.0, 0.0]
    assert merged.extra == {"fallbacks": 2}
    assert merged.accept_lengths_per_row() == [[2, 5], [1]]  # each run's rows, in order (a pipeline's batches)
    assert (merged + a).accept_lengths_per_row() == [[2, 5], [1], [2, 5]]
    again = SpecStats.from_dict(json.loads(merged.to_json()))
    assert again.to_dict() == merged.to_dict()


def test_stats_files_hold_public_names_and_old_files_still_read():
    s = SpecStats(num_target_forwards=2)
    s.record(result([1, 2], [2, 2], 2))
    data = s.to_dict()
    assert not [k for k in data if k.startswith("_")]
    assert data["accepted_per_position"] == [2, 1] and data["num_verify_rows"] == 2
    old = {("_verify_rows" if k == "num_verify_rows" else "_" + k if k.endswith("_per_position") else k): v
           for k, v in data.items()}
    assert SpecStats.from_dict(old).to_dict() == data


def test_counters_fold_the_same_past_the_fold_interval():
    """Steps are kept and folded when read (and every FOLD_EVERY steps): the counters equal a step-by-step sum."""
    from mmspec.stats import FOLD_EVERY

    gen = torch.Generator().manual_seed(0)
    s, emitted, hist, per_row = SpecStats(), 0, [0] * 7, [[], [], []]
    for step in range(FOLD_EVERY + 37):
        k = 2 + step % 5
        acc = torch.randint(0, k + 1, (3,), generator=gen)
        active = torch.rand(3, generator=gen) < 0.8
        s.record(result(acc.tolist(), [k] * 3, k), active=active)
        emitted += int(((acc + 1) * active).sum())
        for row, (a, m) in enumerate(zip(acc.tolist(), active.tolist())):
            hist[a] += m
            per_row[row] += [a + 1] if m else []
        if step == 40:
            assert s.num_emitted_tokens == emitted  # a read mid-way folds what is kept, recording goes on
    assert s.num_emitted_tokens == emitted and s.acceptance_histogram == hist
    assert s.accept_lengths_per_row() == per_row

"""Statistics: counters from hand-made verify results, per-position rates, merging, JSON round trip."""

import json

import torch

from mmspec.stats import SpecStats
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

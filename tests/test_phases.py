"""`mmspec.phases`: the opt-in split of the loop's wall time, and `mmspec bench --phase-times`."""

from __future__ import annotations

import json
import time

from mmspec.cli import main
from mmspec.phases import PHASES, PhaseTimes, phase, record_phases

SMALL_TOY = ["--threads", "1", "--family-option", "dim=16", "--family-option", "num_layers=2",
             "--family-option", "num_heads=2", "--family-option", "vocab_size=32"]


def test_phases_are_recorded_only_inside_a_record_block():
    with phase("verify"):  # nothing is recording: a no-op
        pass
    with record_phases() as times:
        for _ in range(3):
            with phase("verify"):
                time.sleep(0.002)
        with phase("draft"):
            pass
    with phase("verify"):  # the block has ended: not counted
        time.sleep(0.002)
    assert times.calls == {"verify": 3, "draft": 1}
    assert times.seconds["verify"] >= 0.006 and times.seconds["draft"] < times.seconds["verify"]
    merged = times + PhaseTimes({"verify": 1.0}, {"verify": 2})
    assert merged.calls["verify"] == 5 and abs(merged.seconds["verify"] - times.seconds["verify"] - 1.0) < 1e-9


def test_nested_records_restore_the_outer_one():
    with record_phases() as outer:
        with record_phases() as inner:
            with phase("accept"):
                pass
        with phase("commit"):
            pass
    assert inner.calls == {"accept": 1} and outer.calls == {"commit": 1}


def test_bench_phase_times_split_every_configuration(tmp_path):
    """Every loop phase runs; one prefill per batch and one verify per target forward after it; the shares (with
    'other') add up to the wall time; the markdown gets the 'where the time goes' table only when asked."""
    out = tmp_path / "phases"
    argv = ["bench", "--methods", "vanilla,tree", "--batch-sizes", "2", "--num-samples", "3",
            "--max-new-tokens", "6", "--repeats", "2", "--warmup", "0", "--no-plots", "--device", "cpu",
            "--quiet", "--phase-times", *SMALL_TOY, "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "--phase-times" in summary["command"]
    rows = {row["method"]: row for row in summary["batch_sizes"][0]["methods"]}
    for row in rows.values():
        p = row["phases"]
        assert set(p["calls"]) == set(PHASES)
        batches = 2 * 2  # 3 samples in batches of 2, 2 recorded passes
        assert p["calls"]["prefill"] == batches
        assert p["calls"]["verify"] == 2 * row["target_forwards"] - batches  # target_forwards: median per pass
        assert abs(sum(p["share"].values()) - 1.0) < 1e-6 and all(0 <= v <= 1 for v in p["share"].values())
        assert p["share"]["verify"] > 0 and p["verify_ms"] > 0
    assert rows["tree"]["phases"]["draft_ms"] > rows["vanilla"]["phases"]["draft_ms"]  # the tree drafter works
    markdown = (out / "summary.md").read_text()
    assert "Where the time goes" in markdown and "| verify ms/call |" not in markdown.split("Where")[0]

    plain = tmp_path / "plain"
    assert main([a if a != str(out) else str(plain) for a in argv if a != "--phase-times"]) == 0
    summary = json.loads((plain / "summary.json").read_text())
    assert all(row["phases"] is None for row in summary["batch_sizes"][0]["methods"])
    assert "Where the time goes" not in (plain / "summary.md").read_text()


def test_counting_ops_attributes_work_and_syncs_to_phases():
    """count_ops counts the ops that do work (not views) and the host syncs, by phase, 'other' outside them."""
    import torch

    from mmspec.phases import OUTSIDE

    with record_phases(count_ops=True) as times:
        a = torch.ones(4) + 1  # 2 ops outside every phase
        with phase("verify"):
            b = (a * 2).sum()  # mul, sum
            a.view(2, 2).t()  # views: not counted
            bool(b > 0)  # gt + one host sync
        with phase("accept"):
            torch.equal(a, a)  # a sync too
    assert times.ops == {OUTSIDE: 2, "verify": 4, "accept": 1}
    assert times.syncs == {"verify": 1, "accept": 1}
    with record_phases() as plain:  # not asked: nothing counted
        with phase("verify"):
            torch.ones(2).sum()
    assert plain.ops == {} and plain.calls == {"verify": 1}
    merged = times + times
    assert merged.ops["verify"] == 8 and merged.syncs["accept"] == 2


def test_bench_phase_ops_counts_per_target_forward(tmp_path):
    """--phase-ops: ops and syncs per target forward by phase; the tree method dispatches more per forward (its
    drafter and tree bookkeeping); the table is in summary.md. The counts do not depend on timing: a second run
    gives the same numbers."""
    argv = ["bench", "--methods", "vanilla,tree", "--batch-sizes", "2", "--num-samples", "2",
            "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--no-plots", "--device", "cpu",
            "--quiet", "--phase-ops", *SMALL_TOY]
    counts = []
    for name in ("ops1", "ops2"):
        assert main([*argv, "--out", str(tmp_path / name)]) == 0
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert "--phase-ops" in summary["command"]
        rows = {row["method"]: row for row in summary["batch_sizes"][0]["methods"]}
        counts.append({m: row["phases"]["ops_per_forward"] for m, row in rows.items()})
        vanilla, tree = rows["vanilla"]["phases"], rows["tree"]["phases"]
        assert vanilla["ops_per_forward"]["verify"] > 0 and vanilla["ops_per_forward"]["draft"] < 20
        assert tree["ops_per_forward"]["draft"] > 5 * vanilla["ops_per_forward"]["draft"], (tree, vanilla)
        total = tree["ops_per_forward"]["total"]
        assert abs(total - sum(v for k, v in tree["ops_per_forward"].items() if k != "total")) < 1e-6
        assert vanilla["syncs_per_forward"]["total"] >= 1  # the loop's one test per iteration
        markdown = (tmp_path / name / "summary.md").read_text()
        assert "Tensor operations per target forward" in markdown and "Where the time goes" not in markdown
    assert counts[0] == counts[1]

"""The paired call-by-call timing (`mmspec.bench.paired`, `scripts/paired_calls.py`): configurations, the rounds and
the report."""

from __future__ import annotations

import pytest

from mmspec.bench.paired import PairedTimes, main, paired_times, parse_paired, report_lines
from mmspec.bench.registry import BenchSettings, get_family
from mmspec.budget import BudgetConfig
from mmspec.errors import InputError


def test_configurations_set_the_budget_as_written():
    family, settings = get_family("llamagen"), BenchSettings()
    fixed = parse_paired("eagle@fixed:top_k=1:depth=2:total_tokens=3", family, settings)
    assert fixed.config.given == {"budget": "fixed", "top_k": 1, "depth": 2, "total_tokens": 3}
    assert fixed.label == "eagle@fixed:top_k=1:depth=2:total_tokens=3" and fixed.forced is None
    auto = parse_paired("sjd:window=8@auto:decay=0.8:retime=false", family, settings)
    assert auto.config.given == {"window": 8, "budget": BudgetConfig(decay=0.8, retime=False)}
    assert parse_paired("eagle@forced:chain2", family, settings).forced.steps == ("chain2",)
    assert parse_paired("lantern@auto", family, settings).config.given["budget"] == "auto"  # (its default: fixed)
    assert parse_paired("sjd:budget=auto-no-retime", family, settings).config.given == {"budget": "auto-no-retime"}


@pytest.mark.parametrize("text, says", [
    ("eagle@auto:nonsense=1", "nonsense"), ("eagle@sometimes", "after '@'"), ("eagle@forced:", "one step"),
    ("eagle@forced:sideways", "option names"), ("eagle@auto:decay=2", "decay"),
    ("vanilla@auto:decay=0.8", "no draft budget"), ("eagle@auto:decay", "KEY=VALUE"),
    ("eagle@auto:decay=0.8:decay=0.9", "given twice"), ("eagle:depth", "KEY=VALUE"),
])
def test_a_bad_configuration_is_refused_before_any_call(text, says):
    with pytest.raises(InputError, match=says):
        parse_paired(text, get_family("llamagen"), BenchSettings())


def test_main_refuses_bad_input_in_one_line(capsys):
    assert main(["--family", "toy", "--methods", "draft-model@auto:decay=0.8", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no draft budget" in err
    assert main(["--family", "toy", "--rounds", "0"]) == 2


def test_each_configuration_runs_once_a_round_and_is_reported():
    family = get_family("toy")
    settings = BenchSettings(num_samples=6, max_new_tokens=8)
    configs = [parse_paired(text, family, settings) for text in ("vanilla", "draft-model", "draft-model:k=2")]
    times = paired_times(family, family.build(settings), settings, configs, batch_size=2, rounds=3)
    assert {label: len(s) for label, s in times.seconds.items()} == {c.label: 3 for c in configs}
    assert all(s > 0 for seconds in times.seconds.values() for s in seconds)
    assert not any(g for gated in times.gated.values() for g in gated)  # (the toy's methods have no budget)
    lines = report_lines(times)
    assert [line.split(":")[0] for line in lines] == ["draft-model", "draft-model"]
    assert all("over 3 calls; 3 drafting" in line for line in lines)


def test_the_report_splits_calls_without_the_drafter_from_those_that_drafted():
    times = PairedTimes({"vanilla": [1.0, 1.0, 2.0, 2.0], "sjd": [1.0, 2.0, 2.0, 1.0]},
                        {"vanilla": [False] * 4, "sjd": [True, False, True, False]})
    (line,) = report_lines(times)
    # all calls: 6 / 6; without the drafter (calls 0, 2): 3 / 3; drafting (calls 1, 3): 3 / 3
    assert line.startswith("sjd: 1.000x of vanilla (95% ")
    assert line.endswith("over 4 calls; 2 without the drafter: 1.000x; 2 drafting: 1.000x")
    times.seconds["sjd"] = [0.5, 2.0, 1.0, 1.0]  # without the drafter 3 / 1.5, drafting 3 / 3
    assert report_lines(times)[0].endswith("2 without the drafter: 2.000x; 2 drafting: 1.000x")

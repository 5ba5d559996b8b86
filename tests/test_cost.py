"""`mmspec.profiling`: forward-time tables (interpolation, measuring, the JSON cache) and `mmspec profile` on a family
record's profile hook."""

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.errors import InputError
from mmspec.families import FamilyRecord, register_family, unregister_family
from mmspec.profile_runners import lm_forward_runner
from mmspec.profiling import ForwardTimes, cached_profile, measure_forward_times, profile_key
from mmspec.testing.toy import toy_model


@pytest.fixture(autouse=True)
def full_profiles(monkeypatch):
    """These tests measure and cache as users do: without the suite's quick profiles (tests/conftest.py)."""
    monkeypatch.delenv("MMSPEC_PROFILE_REPEATS", raising=False)


def test_quick_profiles_replace_the_repeats_and_are_cached_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setenv("MMSPEC_PROFILE_REPEATS", "2")
    measure_forward_times(lambda b, w: calls.append((b, w)), [1], [1, 4], repeats=7, warmup=3)
    assert len(calls) == 2 * (2 + 1)  # two widths, each: one warm-up call and two timed repeats
    cached_profile("k", lambda: ForwardTimes([1], [1], [[0.1]]))
    assert (tmp_path / "profiles" / "k.quick2.json").is_file() and not (tmp_path / "profiles" / "k.json").exists()
    monkeypatch.setenv("MMSPEC_PROFILE_REPEATS", "many")
    with pytest.raises(InputError, match="MMSPEC_PROFILE_REPEATS must be a positive integer"):
        measure_forward_times(lambda b, w: None, [1], [1])


def test_tables_interpolate_between_and_extrapolate_beyond_the_measured_points():
    times = ForwardTimes([1, 8], [1, 4, 16], [[1.0, 2.0, 5.0], [2.0, 4.0, 10.0]])
    assert times.seconds_at(1, 4) == 2.0 and times.seconds_at(8, 16) == 10.0
    assert times.seconds_at(1, 10) == pytest.approx(3.5)  # halfway between widths 4 and 16
    assert times.seconds_at(1, 28) == pytest.approx(8.0)  # the last segment's slope
    assert times.seconds_at(1, 0) == 1.0 and times.seconds_at(0, 4) == 2.0  # clamped below
    assert times.seconds_at(4.5, 1) == pytest.approx(1.5)  # between batch sizes
    assert times.relative() == [[1.0, 2.0, 5.0], [1.0, 2.0, 5.0]]


def test_measuring_calls_every_cell_and_keeps_the_median():
    calls = []

    def run(batch, width):
        calls.append((batch, width))

    times = measure_forward_times(run, [2, 1], [4, 1, 4], repeats=3, warmup=1)
    assert times.batch_sizes == [1, 2] and times.widths == [1, 4]
    assert len(calls) == 2 * 2 * (3 + 1) and set(calls) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(s >= 0 for row in times.seconds for s in row)


def test_tables_are_cached_per_key_and_measured_again_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    made = []

    def measure():
        made.append(1)
        return ForwardTimes([1], [1, 2], [[0.5, 0.75]])

    first = cached_profile("k", measure)
    assert cached_profile("k", measure) == first and len(made) == 1
    assert json.loads((tmp_path / "profiles" / "k.json").read_text())["seconds"] == [[0.5, 0.75]]
    cached_profile("k", measure, refresh=True)
    (tmp_path / "profiles" / "k.json").write_text("{broken")
    cached_profile("k", measure)
    assert len(made) == 3
    model = toy_model(seed=0)
    assert profile_key(model, "cpu") == profile_key(model, "cpu") != profile_key(toy_model(seed=0, dim=16), "cpu")


def test_a_new_costs_revision_times_the_tables_again(monkeypatch):
    """A change to mmspec that makes forwards cheaper or dearer bumps COSTS_REVISION: tables timed before it are
    not read again."""
    import mmspec.profiling

    model = toy_model(seed=0)
    before = profile_key(model, "cpu")
    monkeypatch.setattr(mmspec.profiling, "COSTS_REVISION", "a later revision")
    assert profile_key(model, "cpu") != before


def test_the_key_ignores_where_a_model_was_loaded_from_and_config_bookkeeping(tmp_path):
    """The same model loaded from two paths, in two processes (this one and another with its own string hashing),
    gets one key: diffusers' `_use_default_values` is a list in set order (string hashing differs per process) and
    `_name_or_path` is the path it was loaded from; neither is what a timing depends on (they made every process
    time its tables again)."""
    import os
    import subprocess
    import sys

    from mmspec.llama_drafter import LlamaFeatureDrafter

    drafter = LlamaFeatureDrafter(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=50,
                                  max_position_embeddings=64)
    drafter.save_pretrained(tmp_path / "a")
    drafter.save_pretrained(tmp_path / "b")
    code = ("import sys, torch; from mmspec.profiling import profile_key; from mmspec.llama_drafter import "
            "LlamaFeatureDrafter; torch.set_num_threads(int(sys.argv[2]));  # threads are in the key: this process's\n"
            "print(profile_key(LlamaFeatureDrafter.from_pretrained(sys.argv[1]), 'cpu'))")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # another string hashing than this process's
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"), str(torch.get_num_threads())],
                           capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
    here = profile_key(LlamaFeatureDrafter.from_pretrained(tmp_path / "a"), "cpu")
    assert here == other and here.startswith("llamafeaturedrafter-")


def test_the_lm_runner_scores_new_tokens_without_committing_them():
    model = toy_model(seed=0, max_positions=64)
    run = lm_forward_runner(model, lambda b: torch.zeros(b, 3, dtype=torch.long), max_width=8)
    for width in (1, 8, 4):
        run(2, width)  # the same prefix every time: nothing is committed
    with pytest.raises(Exception, match="exceeds the profile's room"):
        run(2, 9)


def test_mmspec_profile_prints_the_tables_of_a_family_hook(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    model = toy_model(seed=0, max_positions=64)
    record = FamilyRecord("scratch-profile", load=lambda path, device: model, profile=lambda pipe: {
        "target": (pipe, lm_forward_runner(pipe, lambda b: torch.zeros(b, 2, dtype=torch.long), max_width=8))})
    register_family(record)
    try:
        args = ["profile", "--family", "scratch-profile", "--batch-sizes", "1,2", "--widths", "1,4", "--repeats", "1"]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "target: ms per forward" in out and "| 2 |" in out and "(1.00x)" in out
        assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
        assert main([*args[:-2], "--widths", "0"]) == 2
        assert "--widths must be comma-separated positive integers" in capsys.readouterr().err
        assert main(["profile", "--family", "toy"]) == 2
        assert "has no profile hook; families with one: " in capsys.readouterr().err
        assert main([*args, "--family-option", "size=B"]) == 2  # options build through a bench family
        assert "has no bench family to build it with options" in capsys.readouterr().err
        assert main([*args, "--model", "x", "--family-option", "size=B"]) == 2
        assert "give the folder as --family-option model=PATH" in capsys.readouterr().err
    finally:
        unregister_family("scratch-profile")


def test_mmspec_profile_builds_official_sizes_as_the_bench_does(tmp_path, monkeypatch, capsys):
    """`--family-option` builds the models as `mmspec bench` does: LlamaGen-B with random weights."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    args = ["profile", "--family", "llamagen", "--batch-sizes", "1", "--widths", "1,2", "--repeats", "1"]
    assert main([*args, "--family-option", "size=B", "--family-option", "decode=false"]) == 0
    out = capsys.readouterr().out
    assert "transformer: ms per forward" in out and "eagle" in out
    assert main(["profile", "--family", "mar", "--family-option", "size=XL"]) == 2
    assert "unknown MAR size 'XL'; official sizes: B, L, H" in capsys.readouterr().err

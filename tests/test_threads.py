"""Thread counts from what the process may use (`mmspec.threads`): cgroup v1 / v2 quotas, affinity, the model size
rule, --threads parsing, and the commands restoring torch's thread count."""

from __future__ import annotations

import os

import pytest
import torch

from mmspec.errors import InputError
from mmspec.threads import PARAMETERS_PER_THREAD, auto_threads, cgroup_cpu_limit, parse_threads, usable_cpus


def test_cgroup_quotas(tmp_path):
    assert cgroup_cpu_limit(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2  # 1.5 CPUs of time: 2 threads may run
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 3
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    assert usable_cpus(tmp_path) <= 2  # the quota caps what the machine's count says


def test_auto_threads_follow_model_size(monkeypatch):
    monkeypatch.setattr("mmspec.threads.usable_cpus", lambda root=None: 8)
    assert auto_threads(6_500_000) == 1  # the world models
    assert auto_threads(3 * PARAMETERS_PER_THREAD) == 3
    assert auto_threads(7_000_000_000) == 8
    assert auto_threads(None) == 8
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.undo()
        assert usable_cpus() <= len(os.sched_getaffinity(0))


def test_parse_threads():
    assert parse_threads("auto") is None and parse_threads(None) is None and parse_threads("3") == 3
    for bad in ("0", "-2", "many"):
        with pytest.raises(InputError, match="--threads"):
            parse_threads(bad)


def test_generate_sets_threads_and_restores_them(tmp_path, capsys):
    from mmspec.cli import main

    before = torch.get_num_threads()
    assert main(["generate", "--family", "var", "--classes", "0", "--num-images", "1", "--threads", "1",
                 "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert torch.get_num_threads() == before
    assert main(["generate", "--family", "var", "--threads", "zero", "--out", str(tmp_path / "x")]) == 2
    assert "--threads" in capsys.readouterr().err and not (tmp_path / "x").exists()

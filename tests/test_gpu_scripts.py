"""The GPU scripts (`scripts/*_gpu.sh`) run their benches with arguments the current bench accepts: each script runs
with a stand-in Python that records every `mmspec bench` and `scripts/paired_calls.py` command, and each recorded
command goes through the bench's own parser and the checks `mmspec bench` makes before it loads a model (batch
sizes, settings, the family, every method configuration, the forcing profile). A script is run on a device machine
with a few minutes of device time, so a renamed option or method must fail here, not there."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmspec.bench.cli import add_arguments, parse_int_list, parse_options
from mmspec.bench.configs import parse_method_list
from mmspec.bench.paired import parse_arguments
from mmspec.bench.registry import BenchSettings, get_family
from mmspec.bench.runner import check_run_args
from mmspec.forced import parse_forcing

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*_gpu.sh"))
RECORDER = """#!{python}
import json, os, sys
command = sys.argv[3:] if sys.argv[1:3] == ["-m", "mmspec"] else None
if sys.argv[1:2] == ["scripts/paired_calls.py"]:
    command = ["paired", *sys.argv[2:]]
if command is not None:
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps(command) + "\\n")
"""


def recorded_benches(script: str, tmp_path: Path) -> list[list[str]]:
    """The `mmspec ...` argument lists `script` runs, with a Python that records them and does nothing else."""
    python = tmp_path / "python"
    python.write_text(RECORDER.format(python=sys.executable))
    python.chmod(0o755)
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PYTHON": str(python), "RECORD": str(record), "OUT": str(tmp_path / "out"),
           "DEVICE": "cpu"}  # (the checks refuse cuda where torch sees none)
    done = subprocess.run(["bash", f"scripts/{script}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def check_bench_command(argv: list[str]) -> None:
    """What `mmspec bench` checks before it loads a model (`mmspec.bench.cli.run`), without running anything; a
    paired-call run (`scripts/paired_calls.py`) its own checks (`mmspec.bench.paired.parse_arguments`)."""
    if argv[0] == "paired":
        parse_arguments(argv[1:])
        return
    assert argv[0] == "bench", argv
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[1:])
    settings = BenchSettings(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, seed=args.seed, device=args.device or "cpu",
                             options=parse_options(args.family_option))
    check_run_args(parse_int_list("--batch-sizes", args.batch_sizes), args.repeats, args.warmup, settings)
    if args.force_acceptance is not None and not args.force_acceptance.endswith(".json"):
        parse_forcing(args.force_acceptance)  # (a profile file is written by the script's earlier bench)
    assert parse_method_list(args.methods, get_family(args.family), settings)


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_scripts_run_benches_the_bench_accepts(script, tmp_path):
    benches = recorded_benches(script, tmp_path)
    assert benches, f"{script} ran no bench"
    for argv in benches:
        check_bench_command(argv)
    assert (tmp_path / "out" / "log.txt").is_file()


def test_the_check_refuses_a_method_the_family_lacks():
    """The check above could fail: a method no family declares is refused before any model loads."""
    from mmspec.errors import InputError

    with pytest.raises(InputError, match="no-such-method"):
        check_bench_command(["bench", "--family", "llamagen", "--methods", "vanilla,no-such-method", "--out", "x"])

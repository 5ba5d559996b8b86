"""The `mmspec` command line: help, selfcheck, clear errors."""

import subprocess
import sys

from mmspec.cli import main


def test_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "selfcheck" in out and "bench" in out and "train" in out


def test_selfcheck_passes_on_this_machine(capsys):
    assert main(["selfcheck"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "[  ok] greedy speculative == greedy vanilla" in out


def test_unknown_command_is_an_argparse_error():
    proc = subprocess.run([sys.executable, "-m", "mmspec", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr

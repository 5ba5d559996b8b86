"""Where the shipped assets live, and atomic writing of an output folder for the training commands.

`atomic_output_dir(out)` yields a temporary sibling folder; when the block finishes without error it replaces
`out` by that folder in one rename (an existing `out` is moved aside first and deleted after), so a crashed or
interrupted training run never leaves a half-written asset.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmspec.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS_DIR = REPO_ROOT / "assets"


@contextmanager
def atomic_output_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `out`; on success it becomes `out` (replacing any old one)."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder; pass a folder path.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; an asset folder should be readable like any other
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def explicit_command(words: str, args: argparse.Namespace, options: list[str]) -> str:
    """The full command that reproduces a run: `words` then every option in `options` with its parsed value.

    `options` are argparse destinations ("vocab_size" is written `--vocab-size`); paths are written as given.
    """
    parts = [words]
    for dest in options:
        value = getattr(args, dest)
        parts.append(f"--{dest.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(parts)


def machine_summary() -> str:
    """One line: CPU count, OS, Python and torch versions."""
    import torch

    return (
        f"{os.cpu_count()} CPU cores ({platform.machine()}), {platform.system()}, Python "
        f"{platform.python_version()}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )

"""Output files of a bench run: the writable-directory check done before any work, and atomic writes.

Every file is written to a temporary name in the same directory and renamed over the target
(`os.replace`), so a reader never sees a half-written results.jsonl, summary or plot.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

from mmspec.errors import InputError


def prepare_output_dir(path: str | os.PathLike) -> Path:
    """Create `path` if needed and prove it is writable; InputError naming the problem otherwise."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} exists and is not a directory; pass a directory path.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".mmspec-write-check-", delete=True) as probe:
            probe.write(b"ok")
    except OSError as err:
        raise InputError(f"--out {str(out)!r} is not a writable directory ({err.strerror or err}); "
                         "pass a directory you can write to.") from err
    return out


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> Path:
    """Call `write(file)` on a temporary file next to `path`, then rename it to `path`."""
    target = Path(path)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        # mode "x": a fresh file with the usual permissions (umask), unlike mkstemp's 0600
        with open(tmp, "xb" if binary else "x", **({} if binary else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return atomic_write(path, lambda handle: handle.write(text))

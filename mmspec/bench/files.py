"""Output files of a bench run: the writable-directory check done before any work, and atomic writes.

Every file is written to a temporary name in the same directory and renamed over the target
(`os.replace`), so a reader never sees a half-written results.jsonl, summary or plot.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

from mmspec.errors import InputError

# the temporary names `atomic_write` gives: .NAME.PID.HEX8.tmp
_TEMP_NAME = re.compile(r"\..+\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


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


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_write` left in `folder` when its process was killed mid-write.

    Only files whose writer (the pid in the name) is no longer running are removed, so a live writer in
    another process on this machine keeps its file. Returns the removed paths."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        match = _TEMP_NAME.fullmatch(tmp.name)
        if match is None or int(match["pid"]) == os.getpid() or _process_running(int(match["pid"])):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return atomic_write(path, lambda handle: handle.write(text))

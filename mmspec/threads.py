"""How many CPU threads torch should use: what the process may really run on and what the model can use.

`os.cpu_count()` (torch's default) counts the machine's cores, not the ones this process may use: a container
with a CPU quota of 2 on a 64-core host, or a process pinned to 2 cores, still sees 64. Tiny models then pay
OpenMP barriers across threads that wait for CPU time (measured on this project's 2-core machine under load:
a 24-image LlamaGen job 2 min 07 s with default threading, 9.6 s with one thread). So:

- `usable_cpus()`: the smallest of the CPU affinity mask, the cgroup CPU quota (v2 `cpu.max`, v1
  `cpu.cfs_quota_us` / `cpu.cfs_period_us`) and `os.cpu_count()`.
- `auto_threads(parameters)`: one thread per `PARAMETERS_PER_THREAD` (20M) of the models that run, at least 1,
  at most `usable_cpus()`: the small world models get 1, a 7B model every usable core.
- `parse_threads(value)`: `--threads N` or "auto" checked (before any model loads); `set_threads(threads,
  parameters)` sets them (None = auto) and returns what it set.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from mmspec.errors import check

PARAMETERS_PER_THREAD = 20_000_000
CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> int | None:
    """CPUs the cgroup quota allows (rounded up), or None without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 without a quota
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = CGROUP) -> int:
    """CPUs this process may run on (affinity, cgroup quota, cpu_count: the smallest)."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        counts.append(limit)
    return max(1, min(counts))


def auto_threads(parameters: int | None) -> int:
    """Threads for models of `parameters` in all (None: every usable CPU)."""
    cpus = usable_cpus()
    if parameters is None:
        return cpus
    return max(1, min(cpus, parameters // PARAMETERS_PER_THREAD))


def count_parameters(*models) -> int:
    """Parameters of the torch modules given (pipelines: their components that are modules)."""
    import torch  # (here, not at the top: the command line parses --threads before torch loads)

    total = 0
    for model in models:
        modules = [model] if isinstance(model, torch.nn.Module) else [
            c for c in getattr(model, "components", {}).values() if isinstance(c, torch.nn.Module)]
        total += sum(p.numel() for m in modules for p in m.parameters())
    return total


def parse_threads(value: str | int | None) -> int | None:
    """`--threads`: "auto" or None -> None (chosen by `auto_threads`), else a positive int (InputError)."""
    if value in (None, "auto"):
        return None
    check(str(value).isdigit() and int(value) >= 1, f"--threads must be a positive integer or 'auto', got {value!r}.")
    return int(value)


def set_threads(threads: int | None, parameters: int | None = None) -> int:
    """Set torch's intra-op threads (None: `auto_threads(parameters)`); returns what it set."""
    import torch

    threads = auto_threads(parameters) if threads is None else threads
    torch.set_num_threads(threads)
    return threads

"""Where a generation's time goes: an opt-in wall-clock split of the loop's phases.

The one loop (`mmspec.loop.generate`) marks its phases with `phase(name)`: `prefill`, `draft` (the drafter's
`propose`), `verify` (the target forward over the draft), `accept` (the acceptance rule), `commit` (the target's
KV cache bookkeeping) and `observe` (the drafter's bookkeeping). Outside a `record_phases()` block `phase` does
nothing (one context-variable read), so normal runs pay nothing. Inside one, every phase is timed with
`time.perf_counter`, with a device synchronisation on both sides on CUDA (which removes the overlap of host and
device work, so a GPU run is slower with phases recorded: read the shares, not the totals).

    with record_phases("cpu") as times:
        pipe(class_labels=[0, 1], method="sjd")
    times.seconds   # {"prefill": ..., "draft": ..., "verify": ..., "accept": ..., "commit": ..., "observe": ...}
    times.calls     # how many times each phase ran (verify calls = target forwards after the prefill)

`mmspec bench --phase-times` records them per configuration (docs/benchmarks.md, "Where the time goes").

`record_phases(device, count_ops=True)` also counts, per phase ("other" outside every phase), the tensor operations
dispatched (aten ops that do work: views and other metadata-only ops are not counted) and the host syncs among them
(`item()` / `bool()` / `int()` reads of a tensor, `torch.equal`). The counts are the same on every device, so a CPU
run shows the launch overhead and the syncs a GPU step will pay (`mmspec bench --phase-ops`). Counting goes through
a `TorchDispatchMode`, which slows every op: read timings from another run. A `.tolist()` of a CPU tensor reads
memory without dispatching and is not seen.

    with record_phases("cpu", count_ops=True) as times:
        pipe(class_labels=[0, 1], method="eagle")
    times.ops["accept"], times.syncs["other"]
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("prefill", "draft", "verify", "accept", "commit", "observe")
OUTSIDE = "other"  # ops dispatched outside every phase (the pipeline around the loop, the loop's own bookkeeping)
SYNC_OPS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})  # ops that read a value back to the host


@dataclass
class PhaseTimes:
    """Seconds spent in, and number of calls of, each phase (names from `PHASES`)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ops: dict[str, int] = field(default_factory=dict)  # with count_ops: tensor operations per phase (+ OUTSIDE)
    syncs: dict[str, int] = field(default_factory=dict)  # with count_ops: host syncs per phase (+ OUTSIDE)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def __add__(self, other: PhaseTimes) -> PhaseTimes:
        merged = PhaseTimes(dict(self.seconds), dict(self.calls), self.device, dict(self.ops), dict(self.syncs))
        for name, seconds in other.seconds.items():
            merged.seconds[name] = merged.seconds.get(name, 0.0) + seconds
            merged.calls[name] = merged.calls.get(name, 0) + other.calls.get(name, 0)
        for mine, theirs in ((merged.ops, other.ops), (merged.syncs, other.syncs)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count
        return merged


_ACTIVE: ContextVar[PhaseTimes | None] = ContextVar("mmspec_phase_times", default=None)
_CURRENT: ContextVar[str] = ContextVar("mmspec_current_phase", default=OUTSIDE)
_NOTHING = nullcontext()


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that do work (not views / metadata) and the host syncs, by the current phase."""

    def __init__(self, times: PhaseTimes) -> None:
        super().__init__()
        self.times = times

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in ("detach", "alias", "lift_fresh")):
            where = _CURRENT.get()
            self.times.ops[where] = self.times.ops.get(where, 0) + 1
            if name in SYNC_OPS:
                self.times.syncs[where] = self.times.syncs.get(where, 0) + 1
        return func(*args, **(kwargs or {}))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU. Timers call it on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def record_phases(device: torch.device | str = "cpu", count_ops: bool = False) -> Iterator[PhaseTimes]:
    """Record the phases of every loop run inside the block into the yielded `PhaseTimes`; count_ops: also count
    the tensor operations and host syncs of each phase (see the module docstring)."""
    times = PhaseTimes(device=torch.device(device))
    token = _ACTIVE.set(times)
    try:
        with _OpCounter(times) if count_ops else nullcontext():
            yield times
    finally:
        _ACTIVE.reset(token)


@contextmanager
def _timed(times: PhaseTimes, name: str) -> Iterator[None]:
    synchronize(times.device)
    current = _CURRENT.set(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize(times.device)
        times.add(name, time.perf_counter() - start)
        _CURRENT.reset(current)


def phase(name: str):
    """A context manager timing phase `name` when phases are being recorded, else a no-op."""
    times = _ACTIVE.get()
    return _NOTHING if times is None else _timed(times, name)

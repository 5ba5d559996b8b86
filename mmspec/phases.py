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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

PHASES = ("prefill", "draft", "verify", "accept", "commit", "observe")


@dataclass
class PhaseTimes:
    """Seconds spent in, and number of calls of, each phase (names from `PHASES`)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def __add__(self, other: PhaseTimes) -> PhaseTimes:
        merged = PhaseTimes(dict(self.seconds), dict(self.calls), self.device)
        for name, seconds in other.seconds.items():
            merged.seconds[name] = merged.seconds.get(name, 0.0) + seconds
            merged.calls[name] = merged.calls.get(name, 0) + other.calls.get(name, 0)
        return merged


_ACTIVE: ContextVar[PhaseTimes | None] = ContextVar("mmspec_phase_times", default=None)
_NOTHING = nullcontext()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU. Timers call it on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def record_phases(device: torch.device | str = "cpu") -> Iterator[PhaseTimes]:
    """Record the phases of every loop run inside the block into the yielded `PhaseTimes`."""
    times = PhaseTimes(device=torch.device(device))
    token = _ACTIVE.set(times)
    try:
        yield times
    finally:
        _ACTIVE.reset(token)


@contextmanager
def _timed(times: PhaseTimes, name: str) -> Iterator[None]:
    synchronize(times.device)
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize(times.device)
        times.add(name, time.perf_counter() - start)


def phase(name: str):
    """A context manager timing phase `name` when phases are being recorded, else a no-op."""
    times = _ACTIVE.get()
    return _NOTHING if times is None else _timed(times, name)

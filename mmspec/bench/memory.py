"""Peak memory of one timed run: CUDA max-allocated on a GPU, else peak process RSS sampled by a thread.

    meter = PeakMemory("cpu")      # starts the sampler thread (CPU only)
    meter.reset()                  # before the run
    ...                            # the run
    peak = meter.peak()            # bytes
    meter.close()

On CUDA the figure is `torch.cuda.max_memory_allocated` (tensors only, reset before each run). On CPU it is the
largest resident set size of the whole process seen by a background thread (psutil, every `interval` seconds,
plus one reading at reset and at read time): it includes the interpreter, libraries and the models, and
allocators rarely return memory to the OS, so it can only show what a run added on top of everything before it.
"""

from __future__ import annotations

import threading

import psutil
import torch


class PeakMemory:
    """Measures peak memory between `reset()` and `peak()`; use as a context manager or `close()` it."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.005):
        self.device = torch.device(device)
        self.interval = interval
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.device.type != "cuda":
            self._thread = threading.Thread(target=self._sample_loop, name="mmspec-bench-rss", daemon=True)
            self._thread.start()

    @property
    def kind(self) -> str:
        """What `peak()` measures, for reports."""
        return "cuda_max_allocated" if self.device.type == "cuda" else "cpu_peak_rss"

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _observe(self) -> None:
        rss = self._rss()
        with self._lock:
            self._peak = max(self._peak, rss)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._observe()

    def reset(self) -> None:
        """Start a new measurement window."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with self._lock:
            self._peak = 0
        self._observe()

    def peak(self) -> int:
        """Peak bytes since the last `reset()`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        self._observe()
        with self._lock:
            return self._peak

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PeakMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

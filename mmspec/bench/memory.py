"""Peak memory of one timed run: CUDA max-allocated on a GPU, else peak process RSS sampled by a thread; or, with
`tensors=True` on any device, the peak bytes of the tensors the run itself allocates.

    meter = PeakMemory("cpu")      # starts the sampler thread (CPU only)
    meter.reset()                  # before the run
    ...                            # the run
    peak = meter.peak()            # bytes
    meter.close()

On CUDA the figure is `torch.cuda.max_memory_allocated` (tensors only, reset before each run). On CPU it is the
largest resident set size of the whole process seen by a background thread (psutil, every `interval` seconds,
plus one reading at reset and at read time): it includes the interpreter, libraries and the models, and
allocators rarely return memory to the OS, so it can only show what a run added on top of everything before it.

`tensors=True` (`mmspec bench --memory tensors`) counts instead the storages created by the run's tensor
operations while they are alive (a `TorchDispatchMode` sees every op's outputs; a storage is counted once, until
it is freed): KV caches, activations, logits, but not the weights or anything made before the run. It is the
figure for "how much memory does a method need on top of the model" on any device, exact to the byte, but the
hook slows every op: take speed from a run without it.
"""

from __future__ import annotations

import threading
import weakref

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """While active: bytes of the storages created by tensor ops that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._tracked: set[int] = set()
        self.live = 0
        self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._tracked:  # a storage of an earlier window (cleared by restart) is not this window's
                self._tracked.discard(key)
                self.live -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._tracked:
                return
            nbytes = storage.nbytes()
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)  # storages keep one Python object while alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # views and in-place results share an input's storage: only storages the op made are new memory
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for value in tree_flatten(out)[0]:
            if (isinstance(value, torch.Tensor) and value.device.type != "meta"
                    and id(value.untyped_storage()) not in inputs):
                self._track(value)
        return out

    def restart(self) -> None:
        with self._lock:
            self.peak = self.live = 0
            self._tracked.clear()


class PeakMemory:
    """Measures peak memory between `reset()` and `peak()`; use as a context manager or `close()` it."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.005, tensors: bool = False):
        self.device = torch.device(device)
        self.interval = interval
        self._tensors: LiveTensorBytes | None = LiveTensorBytes() if tensors else None
        self._active = False
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.device.type != "cuda" and not tensors:
            self._thread = threading.Thread(target=self._sample_loop, name="mmspec-bench-rss", daemon=True)
            self._thread.start()

    @property
    def kind(self) -> str:
        """What `peak()` measures, for reports."""
        if self._tensors is not None:
            return "tensor_peak"
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
        if self._tensors is not None:
            self._stop_tensors()
            self._tensors.restart()
            self._tensors.__enter__()
            self._active = True
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with self._lock:
            self._peak = 0
        self._observe()

    def peak(self) -> int:
        """Peak bytes since the last `reset()` (with tensors=True this also ends the window)."""
        if self._tensors is not None:
            self._stop_tensors()
            return int(self._tensors.peak)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        self._observe()
        with self._lock:
            return self._peak

    def _stop_tensors(self) -> None:
        if self._active:
            self._tensors.__exit__(None, None, None)
            self._active = False

    def close(self) -> None:
        if self._tensors is not None:
            self._stop_tensors()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PeakMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

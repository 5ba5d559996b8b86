"""What a forward costs on this device: measured tables of seconds per forward of a cached model, for B rows of n new
tokens each after a prefix, so a draft budget can weigh drafting k tokens (the drafter's steps plus a verify of
k + 1 positions) against a plain one-token step (tokens/s = E[tokens per step] / (T_draft + T_verify(B, n)), the cost
model of docs/budgets.md; on this 2-core CPU a 64-token verify costs 1.7-4x a one-token step, on a GPU about one
step until it is compute-bound: measure, never assume).

    times = measure_forward_times(run, batch_sizes=(1, 8), widths=(1, 2, 4, 8, 16))   # run(batch, width) = 1 fwd
    times.seconds_at(8, 12)                                  # interpolated between the measured widths
    table = cached_profile(profile_key(model, device="cpu"), lambda: times)   # JSON under the cache folder

Tables are cached per (model fingerprint, device, dtype, torch threads, torch version) under `MMSPEC_CACHE`
(default `~/.cache/mmspec`) in `profiles/<key>.json`, written atomically; `mmspec profile --family NAME` measures a
family's models and prints the tables (docs/benchmarks.md, "What a forward costs").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mmspec.errors import check, check_positive_int
from mmspec.phases import synchronize

# run_forward(batch, width): one forward of `batch` rows with `width` new tokens each (timed by the caller)
RunForward = Callable[[int, int], None]


@dataclass
class ForwardTimes:
    """Median seconds of one forward [len(batch_sizes)][len(widths)], measured at every (batch, width) pair."""

    batch_sizes: list[int]
    widths: list[int]
    seconds: list[list[float]]

    def seconds_at(self, batch: int, width: int) -> float:
        """Seconds of one forward of `batch` rows x `width` tokens: linear between measured widths (and batch sizes),
        extrapolated linearly beyond the largest, clamped at the smallest."""
        return _interpolate(self.batch_sizes, [self._at_width(i, width) for i in range(len(self.batch_sizes))],
                            batch)

    def _at_width(self, row: int, width: int) -> float:
        return _interpolate(self.widths, self.seconds[row], width)

    def relative(self) -> list[list[float]]:
        """Each entry over the one-token forward of its batch size: what a verify of n costs in plain steps."""
        return [[s / row[0] for s in row] for row in self.seconds]


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing): clamped below the first point, the last segment's
    slope beyond the last."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            return float(max(ys[i - 1] + slope * (x - xs[i - 1]), 0.0))
    return float(ys[-1])


def measure_forward_times(run_forward: RunForward, batch_sizes: Sequence[int], widths: Sequence[int],
                          repeats: int = 5, warmup: int = 2, device: torch.device | str = "cpu",
                          progress: Callable[[str], None] | None = None) -> ForwardTimes:
    """Time `run_forward(batch, width)` (median of `repeats` after `warmup` calls) at every pair, interleaving the
    widths of a batch size so that a change of the machine's load touches them all alike. A wider forward never
    costs less than a narrower one, so a median below a narrower width's (noise on a busy machine) is raised to
    it. `MMSPEC_PROFILE_REPEATS` replaces `repeats` (`quick_repeats`)."""
    batch_sizes, widths = sorted(set(batch_sizes)), sorted(set(widths))
    for value in (*batch_sizes, *widths):
        check_positive_int("batch size / width", value)
    check_positive_int("repeats", repeats)
    quick = quick_repeats()
    if quick is not None:
        repeats, warmup = quick, min(warmup, 1)
    device = torch.device(device)
    table = []
    for batch in batch_sizes:
        if progress is not None:
            progress(f"batch {batch}: widths {', '.join(map(str, widths))}")
        for width in widths:
            for _ in range(warmup):
                run_forward(batch, width)
        samples: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(repeats):
            for width in widths:
                synchronize(device)
                start = time.perf_counter()
                run_forward(batch, width)
                synchronize(device)
                samples[width].append(time.perf_counter() - start)
        medians = [sorted(samples[w])[len(samples[w]) // 2] for w in widths]
        table.append([max(medians[: i + 1]) for i in range(len(medians))])  # wider never costs less: noise if so
    return ForwardTimes(list(batch_sizes), list(widths), table)


QUICK_ENV = "MMSPEC_PROFILE_REPEATS"


def quick_repeats() -> int | None:
    """`MMSPEC_PROFILE_REPEATS=N`: every measurement times N repeats after at most one warm-up call, whatever its
    own setting: quick, noisier profiles for smoke runs and CI (the test suite sets 2). They are cached apart from
    full ones (`profile_path`). None when unset."""
    text = os.environ.get(QUICK_ENV, "").strip()
    if not text:
        return None
    check(text.isdigit() and int(text) >= 1, f"{QUICK_ENV} must be a positive integer (timed repeats of every "
                                             f"profile), got {text!r}; unset it for full profiles.")
    return int(text)


# ------------------------------------------------------------------------------------------------- caching
def cache_dir() -> Path:
    return Path(os.environ.get("MMSPEC_CACHE", Path.home() / ".cache" / "mmspec"))


def profile_path(key: str) -> Path:
    """The file of the JSON cached under `key`: `profiles/<key>.json` under `cache_dir()`, or `<key>.quickN.json`
    for quick profiles (`quick_repeats`)."""
    quick = quick_repeats()
    return cache_dir() / "profiles" / (f"{key}.json" if quick is None else f"{key}.quick{quick}.json")


# changed whenever mmspec's forwards get cheaper or dearer, so tables timed by an earlier version are timed again
# (2026-11-25: LlamaGen's rotation and SDPA's shared additive mask made LlamaGen's target about 10% faster;
# 2026-11-27: shared-slot cache writes and the pair swap by index_select made its window steps about 7% faster;
# 2026-11-28: MAR's CSpD windows are timed on a half-known canvas, 15% dearer at batch 32 than on an empty one)
COSTS_REVISION = "2026-11-28"


def profile_key(model: torch.nn.Module, device: torch.device | str, extra: str = "") -> str:
    """A file-name key of what a measurement depends on: the model's class, size and config, the device, its dtype,
    torch's CPU threads and version, mmspec's `COSTS_REVISION` (and `extra`, e.g. the prefix length or CFG)."""
    param = next(model.parameters(), None)
    dtype = str(param.dtype) if param is not None else "none"
    config = getattr(model, "config", None) or {}
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers' or diffusers' config
    config = json.dumps(_without_metadata(config), sort_keys=True, default=str)
    size = sum(p.numel() for p in model.parameters())
    text = "|".join([type(model).__name__, str(size), config, str(torch.device(device)), dtype,
                     str(torch.get_num_threads()), torch.__version__, COSTS_REVISION, extra])
    return f"{type(model).__name__.lower()}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def _without_metadata(config):
    """A config without its libraries' bookkeeping keys (`_name_or_path`: where it was loaded from;
    `_use_default_values`: a list in set order, which differs from process to process; library versions), at any
    depth: they are not what a measurement depends on, and they made every process time its tables again."""
    if isinstance(config, dict):
        return {k: _without_metadata(v) for k, v in config.items()
                if not str(k).startswith("_") and k not in ("transformers_version", "name_or_path")}
    if isinstance(config, (list, tuple)):
        return [_without_metadata(v) for v in config]
    return config


def cached_json(key: str, measure: Callable[[], dict], refresh: bool = False) -> dict:
    """The JSON object cached under `key`, or `measure()` it and cache it (atomically) when it is missing, damaged
    or `refresh`."""
    value = None if refresh else read_cached_json(key)
    if value is not None:
        return value
    value = measure()
    path = profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
    return value


def read_cached_json(key: str) -> dict | None:
    """The JSON object cached under `key`, or None when there is none (or it is damaged): nothing is measured."""
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return None  # a damaged file reads as missing (and is measured again by `cached_json`)
    return value if isinstance(value, dict) else None


def cached_profile(key: str, measure: Callable[[], ForwardTimes], refresh: bool = False) -> ForwardTimes:
    """The table cached under `key`, or `measure()` it and cache it (atomically) when it is missing or `refresh`."""
    value = cached_json(key, lambda: asdict(measure()), refresh)
    try:
        return ForwardTimes(**value)
    except TypeError:  # a file of another shape is measured again
        return ForwardTimes(**cached_json(key, lambda: asdict(measure()), refresh=True))


def runner_per_batch(start: Callable[[int], Any], step: Callable[[Any, int], None], max_width: int) -> RunForward:
    """The skeleton of a profile's `run_forward`: per batch size, a runner made once by `start(batch)` (its cache
    holding the prefix every timed call scores after), then each timed call `step(runner, width)`, which scores
    `width` new entries per row without committing them (so every call sees the same cache)."""
    runners: dict[int, Any] = {}

    @torch.no_grad()
    def run(batch: int, width: int) -> None:
        check(width <= max_width, f"width {width} exceeds the profile's room ({max_width}).")
        if batch not in runners:
            runners[batch] = start(batch)
        step(runners[batch], width)

    return run


def feature_pairs_step(feature_dim: int) -> Callable[[Any, int], None]:
    """step(runner, width) of a feature drafter's profile (`runner_per_batch`): `width` new (token, feature) pairs a
    row after the runner's cache, uncommitted; tokens 0 and features zeros (a forward's cost does not depend on
    their values)."""

    def step(runner, width: int) -> None:
        slots = runner.slots(width)  # [B, W]
        features = torch.zeros(runner.cache.batch_size, width, feature_dim, dtype=runner.cache.k[0].dtype,
                               device=slots.device)  # [R, W, dim]
        runner.forward(torch.zeros_like(slots), slots, slots, features=features)

    return step

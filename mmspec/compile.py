"""Optional `torch.compile` of the step forwards of cached models (targets and drafters).

A speculative step dispatches hundreds of small operations (a tree verify, several drafter forwards, the
acceptance rule); at the sizes of the embedded worlds each costs more in launch and dispatch overhead than in
arithmetic. `compile_cached_lm(model, mode)` replaces the model's `forward_cached` (the one function every loop
adapter in `mmspec.lm` calls, for chains, windows and trees alike) by a compiled one:

- shapes are static (`dynamic=False`): one graph per (rows, new positions, cache capacity), which a decode has few
  of, all seen in the first image (a bench's warm-up pass compiles them);
- `mode="reduce-overhead"` also records CUDA graphs on a GPU: the cache's keys and values are then marked as
  static addresses (they are written in place every step) and kept from call to call (`CachePool`: one cache per
  shape and model, reset when handed out again, so the graphs recorded for its addresses replay instead of
  re-recording for every image; a model then runs one generation at a time), and each output is copied out of the
  graph's memory before the next replay can overwrite it (the logits and the `last_hidden` features EAGLE
  drafters read);
- the eager forward stays at `model.eager_forward_cached`; `uncompile_cached_lm` puts it back.

The compiled forward computes the same function; on a CPU it is checked token for token against the eager one
(greedy and seeded sampling) by the tests. Value checks that synchronise with the host (e.g. LlamaGen's
`check_positions`) should be off in compiled loops, as the pipelines already turn them off.

Where compiling pays is measured, not assumed: `mmspec profile --family F --compile MODE` times each model's
forwards eager and compiled at the same batch sizes and widths (`measure_compile`) and caches the verdict per model,
device, dtype, threads and mode (`mmspec.profiling`). `compile="auto"` (`mmspec generate`'s default, `compile_pipeline`,
`LlamaGenPipeline.compile_forwards`) compiles a model only where such a verdict says its compiled forwards took at
most AUTO_COMPILE_RATIO of the eager ones (the geometric mean over the measured cells), in the best such mode, and
leaves it eager otherwise, or where nothing was measured (so "auto" never pays a compilation to find out). Given the
job's size (`JobSize`: the batch size of each call and a model's forwards per call, as `mmspec generate` knows it),
"auto" also weighs the compilation against what it saves: a model stays eager where the verdict's one-token forwards
would save the job less time than compiling its shapes costs (`compile_pays_for_job`), e.g. for a few images.

    mmspec profile --family llamagen --batch-sizes 1,8,32 --widths 1,16 --threads 2 --compile default
    mmspec generate --family llamagen --threads 2 ...            # compile=auto: what that profile found
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmspec.errors import check

if TYPE_CHECKING:  # torch loads where a model is compiled: the command line reads the modes without it
    import torch

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTO = "auto"  # compile where a measured verdict says it pays (`auto_compile_mode`)
COMPILE_CHOICES = (AUTO, *COMPILE_MODES)
AUTO_COMPILE_RATIO = 0.95  # compile="auto" compiles where compiled forwards took at most this share of eager ones
# graphs one compiled forward may keep (one per static shape): batch sizes x methods x the last, partial batch
RECOMPILE_LIMIT = 64
# static shapes one call size of a job compiles per model, as "auto" estimates its compilation (`compile_pays_for_job`):
# the prefill, the one-token step and a couple of draft widths
SHAPES_PER_CALL_SIZE = 4


def compilations() -> int:
    """Frames torch.compile has compiled in this process so far (0 while dynamo is not even imported). A step or a
    call during which this changed paid a compilation: the draft budgets do not count its time."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["frames"].get("total", 0))


def check_compile_mode(mode: str, where: str = "", auto: bool = False) -> None:
    """InputError unless `mode` is a `torch.compile` mode this module knows (or "auto" where `auto`); `where` names
    the option it came from."""
    known = COMPILE_CHOICES if auto else COMPILE_MODES
    check(mode in known, f"unknown compile mode {mode!r}{where}; choose from {', '.join(known)}.")


def uses_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether `torch.compile(mode=mode)` records CUDA graphs for a model on `device`."""
    return device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")


def _raise_recompile_limit() -> None:
    import torch

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name first
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
            return


class CachePool:
    """The caches a model made, one per `new_cache` arguments, with their buffers marked as static addresses;
    asking again for the same arguments returns the same cache, reset (its entries are stale and masked, so a
    reused cache computes what a zeroed one does)."""

    def __init__(self, new_cache: Callable[..., Any]) -> None:
        self.new_cache = new_cache
        self.caches: dict[tuple, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        cache = self.caches.get(key)
        if cache is None:
            import torch

            cache = self.caches[key] = self.new_cache(*args, **kwargs)
            for buffer in list(getattr(cache, "k", [])) + list(getattr(cache, "v", [])):
                torch._dynamo.mark_static_address(buffer)
        else:
            cache.reset()
        return cache


def compile_cached_lm(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
    """Compile `model.forward_cached` in place (idempotent; a new `mode` recompiles). Returns the model."""
    check_compile_mode(mode)
    check(callable(getattr(model, "forward_cached", None)) and callable(getattr(model, "new_cache", None)),
          f"{type(model).__name__} is not a cached model (it needs forward_cached and new_cache).")
    import torch

    uncompile_cached_lm(model)
    _raise_recompile_limit()
    eager_forward, eager_new_cache = model.forward_cached, model.new_cache
    compiled = torch.compile(eager_forward, mode=mode, dynamic=False)
    device = next(model.parameters()).device
    cuda_graphs = uses_cuda_graphs(mode, device)

    @functools.wraps(eager_forward)
    def forward_cached(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not cuda_graphs:
            return compiled(*args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()
        logits = compiled(*args, **kwargs).clone()
        if isinstance(getattr(model, "last_hidden", None), torch.Tensor):
            model.last_hidden = model.last_hidden.clone()
        return logits

    model.eager_forward_cached, model.eager_new_cache = eager_forward, eager_new_cache
    model.forward_cached = forward_cached
    if cuda_graphs:
        model.new_cache = CachePool(eager_new_cache)
    model.compile_mode = mode
    return model


def has_compiled_forward(model: Any) -> bool:
    """Whether `model.forward_cached` is compiled (`compile_cached_lm`): its shapes are then static, so callers keep
    them fixed rather than trimmed to each step's need."""
    return hasattr(model, "eager_forward_cached")


def uncompile_cached_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `compile_cached_lm` (no-op on a model that is not compiled)."""
    if getattr(model, "compile_mode", None) is not None:
        model.forward_cached, model.new_cache = model.eager_forward_cached, model.eager_new_cache
        del model.eager_forward_cached, model.eager_new_cache
        model.compile_mode = None
    return model


@dataclass(frozen=True)
class JobSize:
    """What a job will run, for compile="auto" to weigh the compilation against: the batch size of each of its calls
    (images per call), and how many forwards each model runs per call (a LlamaGen image's tokens: a plain decode's
    count, an upper bound for speculative ones)."""

    call_batch_sizes: tuple[int, ...]
    forwards_per_call: int


def compile_pipeline(pipe: Any, mode: str | None, call_batch_sizes: Sequence[int] | None = None) -> Any:
    """Compile a pipeline's cached models (`pipe.compile_forwards(mode)`), or say clearly that it cannot be.
    `mode=None` leaves the pipeline as it is; "auto" compiles where a measured verdict says it pays (a pipeline
    without compiled forwards stays as it is), and with `call_batch_sizes` (the batch size of each call the job will
    run) only where the compilation pays for itself in that job (`JobSize`). Used by `mmspec generate --compile` and
    the bench's `compile` option."""
    if mode is None:
        return pipe
    check_compile_mode(mode, " (compile)", auto=True)
    if not callable(getattr(pipe, "compile_forwards", None)):
        check(mode == AUTO, f"the {type(pipe).__name__} has no compiled forwards (compile_forwards); drop the "
                            "compile option.")
        return pipe
    return pipe.compile_forwards(mode, call_batch_sizes=call_batch_sizes)


def compile_as_measured(model: torch.nn.Module, mode: str | None, job: JobSize | None = None,
                        name: str | None = None) -> torch.nn.Module:
    """`compile_cached_lm(model, mode)` for a mode, "auto" -> the mode its measured verdicts say pays
    (`auto_compile_mode`; eager where none does, and for a `job` where the compilation would cost more than it
    saves, with a line on stderr either way once a verdict says compiling pays; `name`: the model's name there,
    default its class), None -> eager."""
    if mode == AUTO:
        device = next(model.parameters()).device
        mode, ratio = auto_compile_mode(model, device)
        name = name or type(model).__name__
        if mode is not None and job is not None:
            pays, saving, cost = compile_pays_for_job(read_verdict(model, device, mode), job)
            if not pays:
                print(f"mmspec: compile=auto: leaving the {name} eager: its compiled forwards ({mode}, {ratio:.2f}x of "
                      f"eager) would save this job ~{saving:.1f} s, compiling them costs ~{cost:.0f} s (a longer job "
                      f"compiles; --compile {mode} forces it)", file=sys.stderr, flush=True)
                mode = None
        if mode is not None:
            print(f"mmspec: compile=auto: compiling the {name}'s step forwards ({mode}: `mmspec profile --compile` "
                  f"measured them at {ratio:.2f}x of eager on this device); the first batch pays the compilation",
                  file=sys.stderr, flush=True)
    if mode is None:
        return uncompile_cached_lm(model)
    return compile_cached_lm(model, mode)


def compile_pays_for_job(verdict: dict, job: JobSize) -> tuple[bool, float, float]:
    """(whether compiling pays for `job`, the seconds it would save, the seconds compiling would cost), from a
    measured verdict (`measure_compile`). Saved: per call, the forwards per call times what one compiled one-token
    forward saves at the verdict's batch size nearest the call's (the narrowest width measured); cost: the verdict's
    mean compilation per shape times SHAPES_PER_CALL_SIZE per distinct call size of the job. A verdict without those
    fields says nothing of the cost: it pays."""
    try:
        batch_sizes, eager, compiled = verdict["batch_sizes"], verdict["eager"], verdict["compiled"]
        widths, compile_seconds = verdict["widths"], float(verdict["compile_seconds"])
        per_shape = compile_seconds / (len(batch_sizes) * len(widths))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return True, math.inf, 0.0
    narrowest = widths.index(min(widths))
    saving = 0.0
    try:
        for batch in job.call_batch_sizes:
            row = min(range(len(batch_sizes)), key=lambda i: (abs(math.log(batch_sizes[i] / batch)), batch_sizes[i]))
            saving += job.forwards_per_call * (eager[row][narrowest] - compiled[row][narrowest])
    except (IndexError, TypeError, ValueError):  # a damaged verdict: the ratio alone decides, as without a job
        return True, math.inf, 0.0
    cost = per_shape * SHAPES_PER_CALL_SIZE * len(set(job.call_batch_sizes))
    return saving > cost, saving, cost


# ------------------------------------------------------------------------------------------ measured verdicts
def verdict_key(model: torch.nn.Module, device: torch.device | str, mode: str) -> str:
    """The cache key of a model's compile verdict in `mode` (per device, dtype, threads and torch: `profile_key`)."""
    from mmspec.profiling import profile_key

    return profile_key(model, device, f"compile-verdict|{mode}")


def read_verdict(model: torch.nn.Module, device: torch.device | str, mode: str) -> dict | None:
    """The model's cached compile verdict in `mode` (`measure_compile`'s dict), or None where none was measured."""
    from mmspec.profiling import read_cached_json

    return read_cached_json(verdict_key(model, device, mode))


def auto_compile_mode(model: torch.nn.Module, device: torch.device | str) -> tuple[str | None, float]:
    """(the mode whose cached verdict has the lowest compiled / eager ratio, that ratio) when that ratio is at most
    AUTO_COMPILE_RATIO, else (None, the lowest ratio or inf). Reads verdicts only: nothing is measured."""
    ratios = {}
    for mode in COMPILE_MODES:
        verdict = read_verdict(model, device, mode)
        if verdict is not None and isinstance(verdict.get("ratio"), (int, float)):
            ratios[mode] = float(verdict["ratio"])
    if not ratios:
        return None, math.inf
    best = min(ratios, key=ratios.get)
    return (best if ratios[best] <= AUTO_COMPILE_RATIO else None), ratios[best]


def measure_compile(model: torch.nn.Module, make_run: Callable[[], Callable[[int, int], None]],
                    batch_sizes: Sequence[int], widths: Sequence[int], mode: str, repeats: int = 5,
                    device: torch.device | str = "cpu", progress: Callable[[str], None] | None = None) -> dict:
    """A compile verdict: `model`'s forwards timed eager, then compiled in `mode` (`make_run()` makes a fresh
    `run_forward(batch, width)` for each, `mmspec.profiling.measure_forward_times`), at the same cells. Returns
    {"mode", "batch_sizes", "widths", "eager", "compiled" (seconds [B][W]), "compile_seconds" (the first compiled
    call of each cell, summed: what a run pays once per shape), "ratio" (the geometric mean of compiled / eager over
    the cells)}. The model is left eager."""
    from mmspec.profiling import measure_forward_times

    check_compile_mode(mode)
    say = progress or (lambda text: None)
    say("eager")
    eager = measure_forward_times(make_run(), batch_sizes, widths, repeats, device=device)
    compile_cached_lm(model, mode)
    try:
        run = make_run()
        compile_seconds = 0.0
        for batch in eager.batch_sizes:
            for width in eager.widths:
                say(f"compiling batch {batch}, width {width}")
                start = time.perf_counter()
                run(batch, width)
                compile_seconds += time.perf_counter() - start
        say("compiled")
        compiled = measure_forward_times(run, batch_sizes, widths, repeats, device=device)
    finally:
        uncompile_cached_lm(model)
    logs = [math.log(c / e) for c_row, e_row in zip(compiled.seconds, eager.seconds)
            for c, e in zip(c_row, e_row) if c > 0 and e > 0]
    return {"mode": mode, "batch_sizes": eager.batch_sizes, "widths": eager.widths, "eager": eager.seconds,
            "compiled": compiled.seconds, "compile_seconds": compile_seconds,
            "ratio": math.exp(sum(logs) / len(logs)) if logs else math.inf}

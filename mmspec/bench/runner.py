"""The interleaved benchmark run: every configuration on the same models and inputs, in one process.

For each batch size (in the given order): `warmup` unrecorded passes, then `repeats` recorded passes; pass r
runs every configuration once over all the samples in batches of that size before pass r+1 starts. Inside a pass
(`interleave="batch"`, the default) batch i of every configuration runs before batch i+1 of any: on a shared machine
whose load drifts within seconds, each method's time then comes from the same stretches of load as vanilla's,
instead of from its own few seconds (`interleave="pass"`: each configuration runs all its batches in turn). The
configurations take turns going first (the first rotates by one every pass and every batch) and, inside a batch,
follow one another in a seeded shuffled order (`round_order`), so neither a position's own cost or luck nor the
state one configuration's call leaves (caches, allocations) is always charged to the same other one. Either way,
interleaving spreads slow drifts (thermal throttling, other processes) over all methods instead of charging them to
whichever ran last, and each method's speed-up is taken against vanilla within the same pass.

Only `Method.run` is timed (with a device synchronisation on both sides); quality, records and stats
reading happen outside the timed region. The global torch seed is reset before every configuration's pass, and
each configuration's global random stream carries on from its own previous batch (batch-interleaved passes draw
what pass-by-pass ones do). A configuration that raises is reported as failed at that batch size and skipped there
(see `_run_or_fail`); the others go on.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from mmspec.bench.configs import MethodConfig, parse_method_list
from mmspec.bench.memory import PeakMemory
from mmspec.bench.records import batch_records
from mmspec.bench.registry import REFERENCE_METHOD, BenchSettings, Family, Method, MethodOutput, Sample, get_family
from mmspec.errors import InputError, check, check_device, check_nonnegative, check_positive_int
from mmspec.forced import Forcing
from mmspec.phases import PhaseTimes, record_phases, synchronize
from mmspec.stats import SpecStats

log = logging.getLogger(__name__)  # DEBUG: each configuration's batch as it starts (`mmspec bench --gate-log`)
INTERLEAVE_MODES = ("batch", "pass")  # what a pass interleaves: each batch across configurations, or whole passes


@dataclass(frozen=True)
class Step:
    """One pass of one configuration at one batch size; `repeat` counts warm-ups and recorded passes apart."""

    batch_size: int
    config: MethodConfig
    repeat: int
    warmup: bool


@dataclass
class RunResult:
    """One recorded pass of a configuration over every batch (at one batch size and repeat)."""

    config: MethodConfig
    lossless: bool
    batch_size: int
    repeat: int
    wall_times: list[float]  # per batch, seconds
    target_forwards: list[int]  # per batch
    new_tokens: list[int]  # per sample
    peak_memory_bytes: list[int]  # per batch
    stats: SpecStats  # merged over batches
    quality: dict = field(default_factory=dict)
    phases: PhaseTimes | None = None  # merged over batches, with --phase-times / --phase-ops
    forced_drafts: int | None = None  # with --force-acceptance: the drafts whose tokens the profile set
    forced_decisions: int | None = None  # ... and the verify results it decided (a rule that is not exact)

    @property
    def wall_time(self) -> float:
        return float(sum(self.wall_times))

    @property
    def nfe(self) -> int:
        return int(sum(self.target_forwards))


@dataclass
class BenchResult:
    """Everything a report needs: the settings, every recorded pass and the per-sample records."""

    family: str
    model_id: str
    settings: BenchSettings
    configs: list[MethodConfig]
    batch_sizes: list[int]
    repeats: int
    warmup: int
    memory_kind: str
    primary_quality: str | None
    environment: dict
    command: str | None = None
    interleave: str = "batch"
    phase_times: bool = False
    phase_ops: bool = False
    forcing: Forcing | None = None  # --force-acceptance: the profile and the references recorded
    runs: list[RunResult] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    completed_batch_sizes: list[int] = field(default_factory=list)
    failures: dict[int, dict[str, str]] = field(default_factory=dict)  # batch size -> label -> error

    def failure_list(self) -> list[str]:
        """'batch size B, LABEL: error' for every configuration that failed."""
        return [f"batch size {b}, {label}: {error}" for b, errors in self.failures.items()
                for label, error in errors.items()]


@dataclass
class _BatchRun:
    samples: Sequence[Sample]
    output: MethodOutput
    wall_time: float
    peak_memory_bytes: int
    phases: PhaseTimes | None = None
    forced: tuple[int, int] | None = None  # (drafts rewritten, decisions forced) with --force-acceptance


def plan_steps(batch_sizes: Sequence[int], configs: Sequence[MethodConfig], warmup: int, repeats: int) -> list[Step]:
    """The fixed run order: per batch size, warm-up passes then recorded passes, each over every config."""
    steps = []
    for batch_size in batch_sizes:
        for index in range(warmup):
            steps += [Step(batch_size, config, index, True) for config in configs]
        for index in range(repeats):
            steps += [Step(batch_size, config, index, False) for config in configs]
    return steps


def split_batches(samples: Sequence[Sample], batch_size: int) -> list[list[Sample]]:
    """Consecutive batches of `batch_size` samples (the last one may be smaller)."""
    return [list(samples[i: i + batch_size]) for i in range(0, len(samples), batch_size)]


def environment(device: torch.device) -> dict:
    """Versions and hardware, recorded with the results."""
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
           "device": str(device), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def check_run_args(batch_sizes: Sequence[int], repeats: int, warmup: int, settings: BenchSettings) -> None:
    """Validate the numbers of a bench run (InputError naming the argument)."""
    check(len(batch_sizes) > 0, "--batch-sizes is empty; give at least one batch size, e.g. 1,8.")
    for b in batch_sizes:
        check_positive_int("batch size", b)
    check(len(set(batch_sizes)) == len(batch_sizes), f"--batch-sizes lists a size twice: {list(batch_sizes)}.")
    check_positive_int("repeats", repeats)
    check(isinstance(warmup, int) and warmup >= 0, f"warmup must be an integer >= 0, got {warmup!r}.")
    check_positive_int("num_samples", settings.num_samples)
    check_positive_int("max_new_tokens", settings.max_new_tokens)
    check_nonnegative("temperature", settings.temperature)
    check_device(settings.device)


def _check_output(output: Any, batch: Sequence[Sample], label: str) -> MethodOutput:
    check(isinstance(output, MethodOutput), f"method {label!r} returned {type(output).__name__}, "
          "expected mmspec.bench.MethodOutput.")
    check(len(output.outputs) == len(batch) and len(output.new_tokens) == len(batch),
          f"method {label!r} returned {len(output.outputs)} outputs / {len(output.new_tokens)} token counts "
          f"for a batch of {len(batch)} samples.")
    return output


def timed_run(method: Method, models: Any, batch: Sequence[Sample], settings: BenchSettings,
              given: dict[str, Any]) -> tuple[MethodOutput, float]:
    """`method.run` on one batch and its wall-clock seconds, the device synchronised before and after."""
    device = torch.device(settings.device)
    synchronize(device)
    start = time.perf_counter()
    output = method.run(models, batch, settings, given)
    synchronize(device)
    return output, time.perf_counter() - start


def run_config(family: Family, models: Any, config: MethodConfig, batches: Sequence[Sequence[Sample]],
               settings: BenchSettings, meter: PeakMemory, phase_times: bool = False,
               phase_ops: bool = False, reseed: bool = True, forcing: Forcing | None = None) -> list[_BatchRun]:
    """One pass of `config` over every batch (or, `reseed=False`, the next batches of a pass whose global random
    stream is already in place); only `Method.run` is inside the timed region (with `phase_times`, the loop's
    phases inside it are timed too; with `phase_ops` their tensor operations and host syncs are counted, see
    `mmspec.phases`; with `forcing`, the drafts' tokens follow its profile, `mmspec.forced`)."""
    device = torch.device(settings.device)
    method = family.methods[config.method]
    if reseed:
        torch.manual_seed(settings.seed)
    runs = []
    for batch in batches:
        meter.reset()
        synchronize(device)
        forced = (forcing.call([s.question_id for s in batch], config.label, config.method) if forcing is not None
                  else nullcontext())
        with (record_phases(device, count_ops=phase_ops) if phase_times or phase_ops else nullcontext() as phases,
              forced as call):
            output, wall = timed_run(method, models, batch, settings, config.given)
        runs.append(_BatchRun(batch, _check_output(output, batch, config.label), wall, meter.peak(), phases,
                              None if call is None else (call.rewrites, call.decisions)))
    return runs


def _merge_stats(batch_runs: Sequence[_BatchRun]) -> SpecStats:
    merged = SpecStats()
    for run in batch_runs:
        merged = merged + run.output.stats
    return merged


def _record_pass(result: BenchResult, family: Family, models: Any, step: Step, batch_runs: list[_BatchRun],
                 reference_outputs: list[Any]) -> list[Any]:
    """Quality, RunResult and records of one recorded pass; returns the pass's outputs (in sample order)."""
    method = family.methods[step.config.method]
    lossless = method.is_lossless(step.config.params)
    outputs = [o for run in batch_runs for o in run.output.outputs]
    reference = outputs if step.config.is_reference else reference_outputs
    quality = dict(family.quality(method, step.config.params, outputs, reference, result.settings))
    if family.model_quality is not None:
        samples = [s for run in batch_runs for s in run.samples]  # in the order of `outputs`
        quality.update(family.model_quality(models, samples, outputs, result.settings))
    result.runs.append(RunResult(
        config=step.config, lossless=lossless, batch_size=step.batch_size, repeat=step.repeat,
        wall_times=[r.wall_time for r in batch_runs],
        target_forwards=[int(r.output.stats.num_target_forwards) for r in batch_runs],
        new_tokens=[int(n) for r in batch_runs for n in r.output.new_tokens],
        peak_memory_bytes=[r.peak_memory_bytes for r in batch_runs],
        stats=_merge_stats(batch_runs), quality=quality,
        phases=sum((r.phases for r in batch_runs), PhaseTimes()) if result.phase_times or result.phase_ops else None,
        forced_drafts=None if result.forcing is None else sum(r.forced[0] for r in batch_runs),
        forced_decisions=None if result.forcing is None else sum(r.forced[1] for r in batch_runs)))
    for run in batch_runs:
        result.records += batch_records(
            family=family.name, model_id=result.model_id, label=step.config.label, params=step.config.params,
            lossless=lossless, batch_size=step.batch_size, repeat=step.repeat, samples=run.samples,
            output=run.output, wall_time=run.wall_time, peak_memory_bytes=run.peak_memory_bytes,
            memory_kind=result.memory_kind, quality=quality, to_turn=family.to_turn)
    return outputs


def _format_error(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def _run_or_fail(result: BenchResult, family: Family, models: Any, step: Step, batches: list[list[Sample]],
                 meter: PeakMemory, reseed: bool = True) -> list[_BatchRun] | None:
    """run_config, except that a configuration that raised at this batch size is skipped from then on.

    A failure (any exception but InputError, which is the user's to fix) is recorded in `result.failures`
    and the configuration's recorded passes at this batch size are dropped, so a table never mixes complete
    and partial passes. The reference failing ends the bench: nothing could be compared with it.
    """
    failed = result.failures.setdefault(step.batch_size, {})
    if step.config.label in failed:
        return None
    try:
        return run_config(family, models, step.config, batches, result.settings, meter, result.phase_times,
                          result.phase_ops, reseed, result.forcing)
    except InputError:
        raise
    except Exception as err:
        if step.config.is_reference:
            raise
        failed[step.config.label] = _format_error(err)
        keep = lambda bs, label: not (bs == step.batch_size and label == step.config.label)
        result.runs = [r for r in result.runs if keep(r.batch_size, r.config.label)]
        result.records = [r for r in result.records if keep(r["batch_size"], r["method"])]
        return None


def record_references(family: Family, models: Any, configs: Sequence[MethodConfig],
                      batches: Sequence[Sequence[Sample]], settings: BenchSettings, forcing: Forcing) -> None:
    """--force-acceptance: vanilla's tokens for every sample at this batch size, untimed (the reference the forced
    drafts copy, `mmspec.forced`); InputError when the family's vanilla does not decode through the shared loop."""
    reference = next(c for c in configs if c.is_reference)
    forcing.references.clear()
    torch.manual_seed(settings.seed)
    for batch in batches:
        keys = [s.question_id for s in batch]
        with forcing.call(keys, record=True):
            family.methods[reference.method].run(models, batch, settings, reference.given)
        check(all(k in forcing.references for k in keys),
              f"--force-acceptance needs a family whose methods decode through the shared loop (mmspec.loop); "
              f"{family.name!r}'s vanilla does not: run it without --force-acceptance.")


def _random_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def run_round(result: BenchResult, family: Family, models: Any, steps: Sequence[Step],
              batches: list[list[Sample]], meter: PeakMemory, on_run: Callable[[], None] = lambda: None,
              rotate: int = 0) -> list[list[_BatchRun] | None]:
    """One pass of every configuration of `steps` (same batch size and repeat): per `result.interleave`, batch i
    of each before batch i+1 of any ("batch"), or each configuration's whole pass in turn ("pass"). The
    configurations take turns starting: the order is rotated by `rotate` (the round's index), and in "batch" passes
    by one more at every batch, so no configuration always runs first (right after another's work, or on caches the
    previous one left). Each configuration's global random stream starts from the seed and carries on from its own
    previous batch. Returns each step's batch runs (None where it failed); `on_run` is called after every
    configuration's batch."""
    device = torch.device(result.settings.device)
    runs: list[list[_BatchRun] | None] = [[] for _ in steps]
    streams: list[tuple | None] = [None] * len(steps)  # each configuration's global random state after its batch
    for i, j in round_order(len(steps), len(batches), rotate, result.interleave):
        if runs[j] is not None:
            if i:
                _set_random_state(device, streams[j])
            log.debug("%s at batch size %d", steps[j].config.label, steps[j].batch_size)
            got = _run_or_fail(result, family, models, steps[j], [batches[i]], meter, reseed=i == 0)
            runs[j] = None if got is None else runs[j] + got
            streams[j] = _random_state(device)
        on_run()
    return runs


def round_order(n: int, batches: int, rotate: int, interleave: str) -> list[tuple[int, int]]:
    """The (batch, configuration) pairs of one pass of n configurations over `batches` batches. "pass": each
    configuration's batches in turn, the configurations rotated by `rotate`. "batch": batch i of every configuration
    before batch i + 1, configuration (rotate + i) % n first and the others after it in an order shuffled per (pass,
    batch), seeded (a run repeats its order): in a cyclic order every configuration would always run right after the
    same other one, on the caches and allocator state its calls leave."""
    if interleave == "pass":
        return [(i, (j + rotate) % n) for j in range(n) for i in range(batches)]
    order = []
    for i in range(batches):
        first = (rotate + i) % n
        rest = [j for j in range(n) if j != first]
        random.Random(rotate * 1_000_003 + i).shuffle(rest)
        order += [(i, j) for j in (first, *rest)]
    return order


def _resolve(family: Family | str, methods: str | Sequence[str] | Sequence[MethodConfig] | None,
             settings: BenchSettings | None = None) -> tuple[Family, list[MethodConfig]]:
    family = get_family(family) if isinstance(family, str) else family
    if methods is not None and not isinstance(methods, str) and all(isinstance(m, MethodConfig) for m in methods):
        configs = list(methods)
        check(any(c.is_reference for c in configs), f"configurations must include {REFERENCE_METHOD!r}.")
        return family, sorted(configs, key=lambda c: not c.is_reference)
    return family, parse_method_list(methods, family, settings)


def run_bench(family: Family | str, methods: str | Sequence[str] | Sequence[MethodConfig] | None = None, *,
              batch_sizes: Sequence[int] = (1,), repeats: int = 3, warmup: int = 1,
              settings: BenchSettings | None = None, progress: bool = False, command: str | None = None,
              on_batch_size_done: Callable[[BenchResult], None] | None = None,
              tensor_memory: bool = False, phase_times: bool = False, phase_ops: bool = False,
              interleave: str = "batch", forcing: Forcing | None = None) -> BenchResult:
    """Run every configuration interleaved (see the module docstring); returns runs and per-sample records.

    methods: "vanilla,tree:depth=6", a list of such strings, MethodConfigs, or None for all of the family's
    methods. `on_batch_size_done(result)` is called after each batch size (to write partial results).
    tensor_memory: measure the peak bytes of the tensors each batch allocates (slows every op; see
    `mmspec.bench.memory`) instead of the device's peak. phase_times: record where each configuration's time goes
    (the loop's phases, `mmspec.phases`; on CUDA each phase synchronises, which slows the run). phase_ops: count
    each phase's tensor operations and host syncs (device-independent; slows every op, so timings of such a run are
    not comparable with others). interleave: "batch" (each batch across the configurations) or "pass" (see the
    module docstring). forcing: acceptance set by a profile (`mmspec.forced`; phase times are then recorded too,
    for the ideal speed-up): vanilla's tokens are recorded once per batch size first, untimed.
    """
    check(interleave in INTERLEAVE_MODES, f"interleave must be one of {', '.join(INTERLEAVE_MODES)}, "
          f"got {interleave!r}.")
    settings = settings or BenchSettings()
    batch_sizes = list(batch_sizes)
    check_run_args(batch_sizes, repeats, warmup, settings)
    family, configs = _resolve(family, methods, settings)
    device = torch.device(settings.device)
    models = family.build(settings)
    samples = list(family.inputs(settings))
    check(len(samples) > 0, f"bench family {family.name!r} produced no inputs.")
    steps = plan_steps(batch_sizes, configs, warmup, repeats)
    with PeakMemory(device, tensors=tensor_memory) as meter:
        result = BenchResult(family=family.name, model_id=family.resolved_model_id(settings), settings=settings,
                             configs=configs, batch_sizes=batch_sizes, repeats=repeats, warmup=warmup,
                             memory_kind=meter.kind, primary_quality=family.primary_quality,
                             environment=environment(device), command=command, interleave=interleave,
                             phase_times=phase_times or forcing is not None, phase_ops=phase_ops, forcing=forcing)
        reference_outputs: dict[tuple[int, int], list[Any]] = {}
        rounds = [steps[i: i + len(configs)] for i in range(0, len(steps), len(configs))]  # one pass each
        total = sum(len(split_batches(samples, r[0].batch_size)) * len(r) for r in rounds)
        bar = tqdm(total=total, disable=not progress, desc=f"bench {family.name}", unit="run")
        try:
            for i, steps_of_round in enumerate(rounds):
                first = steps_of_round[0]
                bar.set_postfix_str(f"bs={first.batch_size} {'warmup' if first.warmup else 'repeat'} "
                                    f"{first.repeat}", refresh=False)
                batches = split_batches(samples, first.batch_size)
                if forcing is not None and (i == 0 or rounds[i - 1][0].batch_size != first.batch_size):
                    record_references(family, models, configs, batches, settings, forcing)
                passes = run_round(result, family, models, steps_of_round, batches, meter, lambda: bar.update(1),
                                   rotate=i)
                for step, batch_runs in zip(steps_of_round, passes):  # the reference first
                    if batch_runs is not None and not step.warmup:
                        key = (step.batch_size, step.repeat)
                        outputs = _record_pass(result, family, models, step, batch_runs,
                                               reference_outputs.get(key, []))
                        if step.config.is_reference:
                            reference_outputs[key] = outputs
                last_of_size = i + 1 == len(rounds) or rounds[i + 1][0].batch_size != first.batch_size
                if last_of_size:
                    reference_outputs.clear()
                    result.completed_batch_sizes.append(first.batch_size)
                    if on_batch_size_done is not None:
                        on_batch_size_done(result)
        finally:
            bar.close()
    return result

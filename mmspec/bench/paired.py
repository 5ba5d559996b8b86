"""Paired call-by-call timing on any bench family: vanilla and each configuration alternated call by call (one batch a
call) in a seeded shuffled order, in one process, after two warm-up rounds. Prints each configuration's time against
vanilla's over all its calls (with a bootstrap 95% interval over rounds), and apart over the calls its draft budget
ran without the drafter (the call gate) and those that drafted: what a default-path call costs where drafting does
not pay, which a bench cell of a few calls cannot separate from the machine's noise.

A configuration is a bench configuration (`eagle`, `eagle:budget=fixed:top_k=1:depth=2:total_tokens=3`,
`sjd:budget=auto-no-retime`), optionally followed by `@auto:KEY=VALUE:..` (the default budget with `BudgetConfig`
fields changed: `eagle@auto:decay=0.97`), `@forced:STEP` (the default budget made to draft STEP at every step,
`mmspec.testing.budgets.forced_budget`: `eagle@forced:chain2`; its own work runs as usual, so against the fixed size
it times what the budget itself costs) or `@fixed:KEY=VALUE:..` (short for `:budget=fixed:KEY=VALUE:..`).

    python scripts/paired_calls.py --family llamagen --temperature 1 --family-option top_k=64 \
        --family-option decode=false --batch-size 8 --rounds 40 --methods sjd,eagle,draft-model --threads 2
    python scripts/paired_calls.py --family vlm --batch-size 32 --rounds 12 --methods eagle,pld --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmspec.bench.cli import parse_options, show_gate_verdicts
from mmspec.bench.configs import MethodConfig, parse_config, parse_value
from mmspec.bench.registry import REFERENCE_METHOD, BenchSettings, Family, available_families, get_family
from mmspec.bench.runner import timed_run
from mmspec.budget import BudgetConfig
from mmspec.errors import InputError, check, check_positive_int
from mmspec.testing.budgets import CallScript, forced_budget

log = logging.getLogger("mmspec.bench.paired")
WARMUP_ROUNDS = 2  # rounds run before timing: the budgets' tables are timed and cached in the first calls


@dataclass(frozen=True)
class PairedConfig:
    """One configuration of a paired run: the bench configuration, the script `@forced:STEP` runs (or None)."""

    label: str
    config: MethodConfig
    forced: CallScript | None = None


@dataclass
class PairedTimes:
    """Each configuration's seconds per timed call, and whether its budget ran that call without the drafter."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    gated: dict[str, list[bool]] = field(default_factory=dict)


def parse_paired(text: str, family: Family, settings: BenchSettings) -> PairedConfig:
    """A configuration as the module docstring writes it; a bad one fails here, before any call."""
    bench_text, _, budget = text.strip().partition("@")
    mode, *pairs = budget.split(":") if budget else [""]
    check(mode in ("", "auto", "fixed", "forced"),
          f"{text!r}: after '@' give auto:KEY=VALUE, fixed:KEY=VALUE or forced:STEP, got {mode!r}.")
    if mode == "fixed":
        return PairedConfig(text, parse_config(":".join([bench_text, "budget=fixed", *pairs]), family, settings))
    config = parse_config(bench_text, family, settings)
    check(not mode or "budget" in config.params,
          f"{text!r}: method {config.method!r} has no draft budget to set with '@{mode}'.")
    if mode == "forced":
        check(len(pairs) == 1 and pairs[0] != "", f"{text!r}: give one step, e.g. @forced:chain2.")
        try:
            return PairedConfig(text, config, forced=CallScript(steps=(pairs[0],)))
        except ValueError as err:
            raise InputError(f"{text!r}: {err}") from None
    if mode == "auto":  # (a method whose default is fixed, a relaxed rule's, runs the budget too)
        check(all("=" in pair for pair in pairs), f"{text!r}: every BudgetConfig field after @auto must be KEY=VALUE.")
        values = dict(pair.split("=", 1) for pair in pairs)
        check(len(values) == len(pairs), f"{text!r}: a BudgetConfig field is given twice after @auto.")
        try:
            budget = BudgetConfig(**{k: parse_value(v) for k, v in values.items()}) if values else "auto"
        except TypeError as err:
            raise InputError(f"{text!r}: {err} (the fields of mmspec.budget.BudgetConfig).") from None
        config = MethodConfig(config.label, config.method, {**config.params, "budget": budget},
                              {**config.given, "budget": budget})
    return PairedConfig(text, config)


def paired_times(family: Family, models: Any, settings: BenchSettings, configs: Sequence[PairedConfig],
                 batch_size: int, rounds: int, seed: int = 0) -> PairedTimes:
    """Time every configuration once a round on the round's batch (the family's inputs, `batch_size` a call, taken
    in turn), in a shuffled order seeded by `seed`, after `WARMUP_ROUNDS` untimed rounds."""
    samples = family.inputs(settings)
    times = PairedTimes({c.label: [] for c in configs}, {c.label: [] for c in configs})
    order, rng = list(configs), random.Random(seed)
    for r in range(rounds + WARMUP_ROUNDS):
        batch = [samples[(r * batch_size + i) % len(samples)] for i in range(batch_size)]
        rng.shuffle(order)
        for paired in order:
            method = family.methods[paired.config.method]
            forcing = forced_budget(paired.forced) if paired.forced else contextlib.nullcontext()
            log.debug("%s, round %d", paired.label, r)
            with forcing:
                out, seconds = timed_run(method, models, batch, settings, paired.config.given)
            if r >= WARMUP_ROUNDS:
                times.seconds[paired.label].append(seconds)
                times.gated[paired.label].append(bool(out.stats.extra.get("calls_without_drafter", 0)))
    return times


def speed_ratio(vanilla: Sequence[float], method: Sequence[float], calls: Sequence[int]) -> float:
    """Vanilla's seconds over the method's, summed over `calls` (> 1: the method is faster)."""
    return sum(vanilla[i] for i in calls) / sum(method[i] for i in calls)


def report_lines(times: PairedTimes, seed: int = 1) -> list[str]:
    """One line per configuration: its speed against vanilla's over every round (bootstrap 95% over rounds), then
    over the calls run without the drafter and those that drafted."""
    vanilla = times.seconds[REFERENCE_METHOD]
    rounds = len(vanilla)
    boot = random.Random(seed)
    samples = [[boot.randrange(rounds) for _ in range(rounds)] for _ in range(2000)]
    lines = []
    for label, seconds in times.seconds.items():
        if label == REFERENCE_METHOD:
            continue
        spread = sorted(speed_ratio(vanilla, seconds, s) for s in samples)
        line = (f"{label}: {speed_ratio(vanilla, seconds, range(rounds)):.3f}x of vanilla "
                f"(95% {spread[50]:.3f}-{spread[1950]:.3f}) over {rounds} calls")
        for name, want in (("without the drafter", True), ("drafting", False)):
            calls = [i for i, g in enumerate(times.gated[label]) if g == want]
            if calls:
                line += f"; {len(calls)} {name}: {speed_ratio(vanilla, seconds, calls):.3f}x"
        lines.append(line)
    return lines


def parse_arguments(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, BenchSettings, Family,
                                                               list[PairedConfig]]:
    """The command line, checked as a run needs it before any model is built (InputError otherwise): the arguments,
    the bench settings, the family and the configurations (vanilla first)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--family", default="llamagen",
                        help=f"a bench family (default llamagen; families: {', '.join(available_families())})")
    parser.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--methods", default="sjd,eagle,draft-model", help="configurations, comma-separated")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (each configuration once a round)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="(families whose calls take it: vlm, toy)")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' seed and the rounds' order")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gate-log", action="store_true", help="each budget's DEBUG line after every call")
    args = parser.parse_args(argv)
    for name in ("--batch-size", "--rounds", "--threads"):
        check_positive_int(name, getattr(args, name.removeprefix("--").replace("-", "_")))
    settings = BenchSettings(num_samples=args.batch_size * (args.rounds + WARMUP_ROUNDS),
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                             device=args.device, options=parse_options(args.family_option))
    family = get_family(args.family)
    labels = [REFERENCE_METHOD, *(m for m in args.methods.split(",") if m.strip() != REFERENCE_METHOD)]
    check(len(set(labels)) == len(labels), f"--methods names a configuration twice: {args.methods!r}.")
    return args, settings, family, [parse_paired(label, family, settings) for label in labels]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, settings, family, configs = parse_arguments(argv)
    except InputError as err:
        print(f"paired_calls: {err}", file=sys.stderr)
        return 2
    if args.gate_log:
        show_gate_verdicts()
    torch.set_num_threads(args.threads)
    times = paired_times(family, family.build(settings), settings, configs, args.batch_size, args.rounds, args.seed)
    print("\n".join(report_lines(times)))
    return 0

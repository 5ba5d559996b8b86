"""`mmspec bench`: run vanilla and speculative methods side by side in one process and write a report.

    mmspec bench --family toy --methods vanilla,draft-model,tree --batch-sizes 1,8 --repeats 3 --warmup 1 \\
        --num-samples 16 --max-new-tokens 64 --temperature 0 --seed 0 --device cpu --out runs/toy

Writes results.jsonl (Spec-Bench per-sample records), summary.md, summary.json and PNG plots into --out and
prints the summary tables. The output directory is checked (created, written to) before any model is built.
Exit status: 0, 2 for a usage error, 1 when a configuration failed at some batch size (the others are still
benchmarked and reported; the failure is in the table, in summary.json and on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys
from collections.abc import Sequence

import torch

from mmspec.bench.configs import parse_method_list
from mmspec.bench.files import prepare_output_dir
from mmspec.bench.output import RESULTS_FILE, SUMMARY_JSON, SUMMARY_MD, write_outputs
from mmspec.bench.registry import BenchSettings, get_family
from mmspec.bench.report import budget_notices, tables_markdown
from mmspec.bench.runner import INTERLEAVE_MODES, BenchResult, check_run_args, run_bench
from mmspec.errors import InputError, check_positive_int
from mmspec.families import available_families
from mmspec.forced import PROFILE_FORMS, parse_forcing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `mmspec bench` options on `parser`."""
    parser.add_argument("--family", default="toy",
                        help=f"model family to benchmark (default toy; families: {', '.join(available_families())}; "
                             "those with a bench hook run)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated configurations NAME[:KEY=VALUE...], e.g. vanilla,draft-model,"
                             "tree:depth=6 (default: every method of the family; vanilla is always added)")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes, e.g. 1,8 (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="recorded passes per batch size (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up passes per batch size (default 1)")
    parser.add_argument("--interleave", choices=INTERLEAVE_MODES, default="batch",
                        help="inside a pass, run batch i of every method before batch i+1 (batch, the default: each "
                             "method's time comes from the same stretches of load as vanilla's) or each method's "
                             "whole pass in turn (pass)")
    parser.add_argument("--num-samples", type=int, default=16, help="number of inputs (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per sample (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy rule (exactness vs vanilla is checked); > 0 = lossless sampling rule")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models, inputs and sampling (default 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (torch.set_num_threads; default: torch's choice)")
    parser.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                        help="family-specific option (repeatable), e.g. --family-option draft_layers=2")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (a module that calls mmspec.bench.register_family)")
    parser.add_argument("--memory", choices=("device", "tensors"), default="device",
                        help="peak memory figure: 'device' = CUDA max allocated / CPU process RSS (default); "
                             "'tensors' = peak bytes of the tensors each batch allocates (KV caches, activations; "
                             "weights excluded), exact on any device but slows every op: take timings from "
                             "another run")
    parser.add_argument("--phase-times", action="store_true",
                        help="also report where each configuration's time goes (shares of wall time in the loop's "
                             "prefill, draft, verify, accept, commit and observe phases; ms per verify and draft "
                             "call); on CUDA every phase synchronises, which slows the run")
    parser.add_argument("--phase-ops", action="store_true",
                        help="also count the tensor operations and host syncs per target forward in each loop phase "
                             "(the same on every device: the launch overhead a GPU step pays); counting slows every "
                             "op, so take timings from another run")
    parser.add_argument("--force-acceptance", default=None, metavar="PROFILE",
                        help="time every method at a set acceptance instead of its drafter's (for models with random "
                             "weights, e.g. official sizes): drafts copy vanilla's tokens at the profile's "
                             "per-position rates (mmspec.forced); PROFILE: " + "; ".join(PROFILE_FORMS) + ". Implies "
                             "--phase-times (the report adds each method's ideal speed-up and system efficiency)")
    parser.add_argument("--gate-log", action="store_true",
                        help="print what each draft budget did on stderr after every call: the options chosen, their "
                             "step seconds and expected tokens, the calls with and without the drafter (the "
                             "mmspec.budget logger at DEBUG)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar and no result tables on stdout (the line saying what was written stays)")


def show_gate_verdicts() -> None:
    """The draft budgets' DEBUG lines (`mmspec.budget.ThroughputBudget.end`: after each call, the options chosen and
    the estimates behind them) on stderr, each configuration's batch named as it starts (`mmspec.bench.runner`, and
    `mmspec.bench.paired`'s calls)."""
    for name in ("mmspec.budget", "mmspec.bench.runner", "mmspec.bench.paired"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if not any(getattr(h, "gate_verdicts", False) for h in logger.handlers):  # once per process
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handler.gate_verdicts = True
            logger.addHandler(handler)


def parse_int_list(name: str, text: str) -> list[int]:
    """'1,8' -> [1, 8]; InputError naming the option otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{name} must be comma-separated integers, e.g. 1,8; got {text!r}.") from None
    if not values:
        raise InputError(f"{name} is empty; give at least one integer, e.g. 1,8.")
    return values


def parse_options(items: Sequence[str]) -> dict[str, str]:
    """['k=v', ...] -> {'k': 'v'}; InputError on an item without '='."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--family-option must be KEY=VALUE, got {item!r}.")
        options[key.strip()] = value.strip()
    return options


def canonical_command(args: argparse.Namespace, methods: str, batch_sizes: Sequence[int], device: str) -> str:
    """The full command line with every default spelled out (for the report)."""
    parts = ["mmspec", "bench"]
    for module in args.imports:
        parts += ["--import", module]
    parts += ["--family", args.family, "--methods", methods, "--batch-sizes", ",".join(map(str, batch_sizes)),
              "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--interleave", args.interleave,
              "--num-samples", str(args.num_samples),
              "--max-new-tokens", str(args.max_new_tokens), "--temperature", f"{args.temperature:g}",
              "--seed", str(args.seed), "--device", device]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    for item in args.family_option:
        parts += ["--family-option", item]
    if getattr(args, "memory", "device") != "device":
        parts += ["--memory", args.memory]
    if getattr(args, "phase_times", False):
        parts.append("--phase-times")
    if getattr(args, "phase_ops", False):
        parts.append("--phase-ops")
    if getattr(args, "force_acceptance", None) is not None:
        parts += ["--force-acceptance", args.force_acceptance]
    if args.no_plots:
        parts.append("--no-plots")
    return shlex.join(parts + ["--out", str(args.out)])


def run(args: argparse.Namespace) -> int:
    """Validate everything, check --out, run the interleaved bench, write the report, print the tables."""
    batch_sizes = parse_int_list("--batch-sizes", args.batch_sizes)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = BenchSettings(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, seed=args.seed, device=device,
                             options=parse_options(args.family_option))
    check_run_args(batch_sizes, args.repeats, args.warmup, settings)
    if args.threads is not None:
        check_positive_int("--threads", args.threads)
    out = prepare_output_dir(args.out)
    if args.gate_log:
        show_gate_verdicts()
    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise InputError(f"--import {module!r} failed: {err}") from err
    forcing = None if args.force_acceptance is None else parse_forcing(args.force_acceptance)
    family = get_family(args.family)
    configs = parse_method_list(args.methods, family, settings)
    if forcing is not None:
        missing = forcing.unprofiled([(c.label, c.method) for c in configs])
        if missing:
            print(f"mmspec bench: no row of {args.force_acceptance} for {', '.join(missing)}: they run with their "
                  "own acceptance", file=sys.stderr)
    command = canonical_command(args, ",".join(c.label for c in configs), batch_sizes, device)
    written: dict = {}  # the latest summary; files are rewritten (atomically) after every batch size

    def write_partial(partial: BenchResult) -> None:
        written["summary"] = write_outputs(partial, out, plots=not args.no_plots,
                                           plot_batch_sizes=partial.completed_batch_sizes[-1:])

    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_bench(family, configs, batch_sizes=batch_sizes, repeats=args.repeats, warmup=args.warmup,
                           settings=settings, progress=not args.quiet, command=command,
                           on_batch_size_done=write_partial, tensor_memory=args.memory == "tensors",
                           phase_times=args.phase_times, phase_ops=args.phase_ops, interleave=args.interleave,
                           forcing=forcing)
    finally:
        torch.set_num_threads(threads_before)
    summary = written["summary"]
    if not args.quiet:
        print(tables_markdown(summary))
    print(f"wrote {out / RESULTS_FILE}, {out / SUMMARY_MD}, {out / SUMMARY_JSON}"
          + ("" if args.no_plots else " and plots") + f" ({len(result.records)} records)")
    for note in budget_notices(summary):  # one line per method and batch size the budget kept from drafting
        print(note, file=sys.stderr)
    failures = result.failure_list()
    for line in failures:
        print(f"mmspec bench: FAILED at {line}", file=sys.stderr)
    return 1 if failures else 0

"""`mmspec profile`: measure what one forward of a family's models costs on this device, for B rows of W new tokens
each, and cache the tables (`mmspec.profiling`) that draft budgets read.

    mmspec profile --family llamagen --batch-sizes 1,8,32 --widths 1,2,4,8,16,32,64 --threads 2
    mmspec profile --family mar --family-option size=L --batch-sizes 1 --widths 1,8 --repeats 2   # official size

Prints, per model, the milliseconds of one forward and the same in one-token forwards of its batch size (what a
verify of W tokens costs in plain steps). A table is measured once per (model, device, dtype, threads, torch) and
read back from the cache afterwards (`--refresh` measures again). Families offer their models through the `profile`
hook of their record (`mmspec.families`): llamagen (the target, the draft model, the EAGLE drafter), vlm (the
target and every saved drafter: `vlm.profile`), mar (the target's and the draft's CSpD windows). With
`--family-option`, the models are built as the family's bench builds them (`size=...`: an official size with random
weights). `--compile MODE`
also times every model compiled in MODE against eager at the same cells and caches the verdict that
`compile="auto"` reads (`mmspec.compile`): a model is compiled where its compiled forwards took at most 0.95x of
eager's (the geometric mean over the cells).
"""

from __future__ import annotations

import argparse
import sys

from mmspec.compile import COMPILE_MODES
from mmspec.errors import InputError, check
from mmspec.families import available_families, get_family


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", required=True, help=f"model family (of {', '.join(available_families())})")
    parser.add_argument("--model", default=None, help="pipeline folder (default: the family's embedded default)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--widths", default="1,2,4,8,16,32,64", help="comma-separated tokens per row")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per cell (the median is kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--refresh", action="store_true", help="measure again even if a cached table exists")
    parser.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                        help="build the models as `mmspec bench` does with this option (repeatable), e.g. "
                             "size=L for an official size with random weights")
    parser.add_argument("--compile", default=None, choices=COMPILE_MODES, metavar="MODE",
                        help="also time each model's forwards compiled in MODE (" + ", ".join(COMPILE_MODES) + ") "
                             "against eager at the same cells, and cache the verdict `compile=auto` reads")


def parse_sizes(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    check(values and values[0] >= 1, f"--{name} must be comma-separated positive integers, got {text!r}.")
    return values


def format_table(name: str, times) -> str:
    head = "| batch | " + " | ".join(f"W={w}" for w in times.widths) + " |"
    lines = [f"{name}: ms per forward (x one-token forward)", head, "|---" * (len(times.widths) + 1) + "|"]
    for batch, row, rel in zip(times.batch_sizes, times.seconds, times.relative()):
        lines.append(f"| {batch} | " + " | ".join(f"{s * 1e3:.2f} ({r:.2f}x)" for s, r in zip(row, rel)) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from mmspec.errors import check_device
    from mmspec.profiling import cached_profile, measure_forward_times, profile_key

    batch_sizes, widths = parse_sizes(args.batch_sizes, "batch-sizes"), parse_sizes(args.widths, "widths")
    device = check_device(args.device)
    if args.threads is not None:
        check(args.threads >= 1, f"--threads must be >= 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    family = get_family(args.family)
    if family.profile is None:  # (the list imports every family's record: only on this error)
        with_hook = [n for n in available_families() if get_family(n).profile is not None]
        raise InputError(f"family {args.family!r} has no profile hook; families with one: {', '.join(with_hook)}.")
    pipe = load_models(family, args, device)
    check(args.compile is None or callable(getattr(pipe, "compile_forwards", None)),
          f"the {type(pipe).__name__} of family {args.family!r} has no compiled forwards (compile_forwards), so no "
          "compile verdict would be read; drop --compile.")
    for name, (model, run_forward) in family.profile(pipe).items():
        key = profile_key(model, device, extra=f"batches={batch_sizes}|widths={widths}")

        def measure(run_forward=run_forward, name=name):
            return measure_forward_times(run_forward, batch_sizes, widths, args.repeats, device=device,
                                         progress=lambda text: print(f"{name}: {text}", file=sys.stderr))

        print(format_table(name, cached_profile(key, measure, refresh=args.refresh)) + "\n")
        if args.compile is not None:
            print(format_verdict(name, measured_verdict(family, pipe, name, model, args, batch_sizes, widths, device))
                  + "\n")
    return 0


def load_models(family, args: argparse.Namespace, device):
    """The family's pipeline: from --model (or the embedded default), or, with --family-option, as its bench family
    builds it (official sizes with random weights: `--family-option size=...`)."""
    from mmspec.bench.cli import parse_options

    options = parse_options(args.family_option)
    if not options:
        return family.load(args.model, device)
    check(args.model is None, "give the folder as --family-option model=PATH when other family options are given.")
    check(family.bench is not None, f"family {family.name!r} has no bench family to build it with options.")
    from mmspec.bench.registry import BenchSettings

    return family.bench().build(BenchSettings(device=str(device), options=options))


def measured_verdict(family, pipe, name: str, model, args: argparse.Namespace, batch_sizes: list[int],
                     widths: list[int], device) -> dict:
    """The model's compile verdict in `args.compile` at these cells (`mmspec.compile.measure_compile`), cached under
    its `verdict_key` (the latest measurement is the one `compile=auto` reads)."""
    from mmspec.compile import measure_compile, verdict_key
    from mmspec.profiling import cached_json, read_cached_json

    key = verdict_key(model, device, args.compile)
    cached = read_cached_json(key)
    if not args.refresh and cached is not None and cached.get("batch_sizes") == batch_sizes \
            and cached.get("widths") == widths:
        return cached
    return cached_json(key, lambda: measure_compile(
        model, lambda: family.profile(pipe)[name][1], batch_sizes, widths, args.compile, args.repeats, device,
        progress=lambda text: print(f"{name} ({args.compile}): {text}", file=sys.stderr, flush=True)),
        refresh=True)


def format_verdict(name: str, verdict: dict) -> str:
    """A compile verdict as a table: ms per forward compiled (x the eager forward of the same cell)."""
    from mmspec.compile import AUTO_COMPILE_RATIO

    widths = verdict["widths"]
    pays = verdict["ratio"] <= AUTO_COMPILE_RATIO
    verdict_text = "compiles" if pays else "stays eager"
    lines = [f"{name}: ms per forward compiled ({verdict['mode']}) (x eager); compilation "
             f"{verdict['compile_seconds']:.1f} s; geometric mean {verdict['ratio']:.2f}x: compile=auto "
             f"{verdict_text} (compiles at <= {AUTO_COMPILE_RATIO}x)",
             "| batch | " + " | ".join(f"W={w}" for w in widths) + " |", "|---" * (len(widths) + 1) + "|"]
    for batch, compiled, eager in zip(verdict["batch_sizes"], verdict["compiled"], verdict["eager"]):
        lines.append(f"| {batch} | " + " | ".join(f"{c * 1e3:.2f} ({c / e:.2f}x)" for c, e in zip(compiled, eager))
                     + " |")
    return "\n".join(lines)

"""`mmspec profile`: measure what one forward of a family's models costs on this device, for B rows of W new tokens
each, and cache the tables (`mmspec.cost`) that draft budgets read.

    mmspec profile --family llamagen --batch-sizes 1,8,32 --widths 1,2,4,8,16,32,64 --threads 2

Prints, per model, the milliseconds of one forward and the same in one-token forwards of its batch size (what a
verify of W tokens costs in plain steps). A table is measured once per (model, device, dtype, threads, torch) and
read back from the cache afterwards (`--refresh` measures again). Families offer their models through the `profile`
hook of their record (`mmspec.families`).
"""

from __future__ import annotations

import argparse
import sys

from mmspec.errors import check
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

    from mmspec.cost import cached_profile, measure_forward_times, profile_key
    from mmspec.errors import check_device

    batch_sizes, widths = parse_sizes(args.batch_sizes, "batch-sizes"), parse_sizes(args.widths, "widths")
    device = check_device(args.device)
    if args.threads is not None:
        check(args.threads >= 1, f"--threads must be >= 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    family = get_family(args.family)
    with_hook = [n for n in available_families() if get_family(n).profile is not None]
    check(family.profile is not None, f"family {args.family!r} has no profile hook; families with one: "
                                      f"{', '.join(with_hook)}.")
    pipe = family.load(args.model, device)
    for name, (model, run_forward) in family.profile(pipe).items():
        key = profile_key(model, device, extra=f"batches={batch_sizes}|widths={widths}")

        def measure(run_forward=run_forward, name=name):
            return measure_forward_times(run_forward, batch_sizes, widths, args.repeats, device=device,
                                         progress=lambda text: print(f"{name}: {text}", file=sys.stderr))

        print(format_table(name, cached_profile(key, measure, refresh=args.refresh)) + "\n")
    return 0

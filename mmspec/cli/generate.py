"""`mmspec generate`: class- or text-conditional image generation with any family and method, from command-line
values or a job file; resumable, multi-process, no lost work.

    mmspec generate --family llamagen --classes "red circle,blue cross" --num-images 4 --out out/ [--method M]
    mmspec generate --family llamagen-t2i --prompt "a small red circle in the center on a black background" --out out/
    mmspec generate --family llamagen-t2i --prompts captions.txt --method sjd --out out/   # one caption a line
    mmspec generate --family var --method code --job job.jsonl --out out/ [--skip-bad] [--max-batch 16]
    torchrun --nproc_per_node 2 -m mmspec generate --job job.jsonl --out out/        # or accelerate launch on GPUs

Every image is a work item with its own generator (see `mmspec.cli.jobs`), and the job is cut into fixed chunks
of --max-batch items that are always generated whole, so images do not depend on resuming or on the number of
processes (a different --max-batch may change a rare image: batched arithmetic rounds by batch shape). Each
image is written atomically (temporary file, then rename) and only
then listed in the manifest; a rerun with the same job skips what the manifest lists. Under `accelerate launch`
(or torchrun) the work items are split between the processes (accelerate's `split_between_processes`), each
writes its own manifest shard, and the main process merges them into one `manifest.jsonl`. A batch that runs out
of GPU memory is retried in halves (down to 1) without losing rows. Families plug in through their records
(`mmspec.families`): every family whose record has a `generate` hook (with `load`, `num_classes`,
`sampling_defaults` and its methods) is a `--family` here, and `--help` lists each one's methods and parameters.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmspec.cli.family_io import DTYPES
from mmspec.compile import AUTO, COMPILE_CHOICES, COMPILE_MODES
from mmspec.errors import InputError, check
from mmspec.families import available_families, get_family
from mmspec.limits import check_count, check_sampling, check_seed
from mmspec.threads import parse_threads


def help_epilog() -> str:
    """Each family's methods with their parameters and defaults, and what they keep (--help only: it imports every
    family's record)."""
    import textwrap

    lines = ["methods (--method NAME, parameters as --method-arg KEY=VALUE, defaults shown):"]
    for name in available_families("generate"):
        lines.append(f"  --family {name}:")
        for m in get_family(name).methods.values():
            kind = "lossless" if m.is_lossless() else "lossy"
            lines += textwrap.wrap(f"{m.name} ({kind}): {m.description}", 100, initial_indent="    ",
                                   subsequent_indent="      ")
            params = ", ".join(f"{k}={v!r}" for k, v in m.params.items()) or "no parameters"
            lines += textwrap.wrap(params, 100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def default_family() -> str:
    """The family `--family` defaults to: the first, alphabetically, with a generate hook and an embedded default."""
    for name in available_families():  # records import in order, up to the first that qualifies
        record = get_family(name)
        if record.generate is not None and record.default_model is not None:
            return name
    return available_families("generate")[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default=None,
                        help=f"model family: one of {', '.join(available_families())} whose record has a generate hook "
                             "(default: the first of those with an embedded default, alphabetically); --help lists "
                             "them with their methods")
    parser.add_argument("--job", default=None,
                        help="job file (.jsonl or .csv; columns id, class or prompt, count, seed), instead of "
                             "--classes / --prompt")
    parser.add_argument("--classes", default=None,
                        help="comma-separated class ids or names (e.g. '0,5' or 'red circle,blue cross'), or 'all' "
                             "(the default without --job)")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a caption, for text-to-image families (repeatable)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="a text file of captions, one a line (text-to-image families)")
    parser.add_argument("--num-images", type=int, default=4,
                        help="images per class or caption (with --classes / --prompt / --prompts)")
    parser.add_argument("--out", required=True, help="output folder (images/, manifest.jsonl, stats.json, grid.png)")
    parser.add_argument("--method", default="vanilla", help="decoding method (see the family's docs)")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a method parameter, repeatable (e.g. --method-arg num_draft_tokens=4)")
    parser.add_argument("--budget", default=None, choices=["fixed", "auto"],
                        help="draft budget of a speculative method (families whose pipeline takes one: llamagen, "
                             "mar's cspd): auto (each step's size from this device's measured costs, "
                             "docs/budgets.md; the default of lossless methods) or fixed (the configured size every "
                             "step; the default of relaxed methods: lantern, gsd, cspd)")
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded asset)")
    parser.add_argument("--seed", type=int, default=0, help="base seed of rows without their own seed")
    parser.add_argument("--max-batch", "--batch-size", dest="max_batch", type=int, default=16,
                        help="images per batch (halved automatically after a GPU out-of-memory error)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip malformed job rows (listed in the summary) instead of stopping before any work")
    parser.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (family default if unset)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="auto",
                        help="torch CPU threads: N, or auto (default: one per 20M parameters, at most the CPUs this "
                             "process may use: affinity and cgroup quota, not the machine's core count)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights and activations: float32 (default, as saved), bfloat16 or float16")
    parser.add_argument("--compile", default=AUTO, choices=(*COMPILE_CHOICES, "none"), metavar="MODE",
                        help="torch.compile the pipeline's step forwards where it has them: " + ", ".join(COMPILE_MODES)
                             + " (the first batch pays the compilation), none (eager), or auto (the default): where "
                               "`mmspec profile --compile MODE` measured that it pays on this device and thread count, "
                               "and the job's calls save more than the compilation costs, else eager")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars; the model libraries report errors only")

def parse_method_args(items: list[str]) -> dict:
    """["k=v", ...] -> {k: v} with numbers and booleans parsed."""
    out = {}
    for item in items:
        check("=" in item, f"--method-arg must look like KEY=VALUE, got {item!r}.")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out

def command_prompts(args: argparse.Namespace) -> list[str]:
    """The captions of --prompt and --prompts (one a line, blank lines skipped)."""
    prompts = list(args.prompt or [])
    check(all(p.strip() for p in prompts), "--prompt is empty; give it a caption, e.g. --prompt \"a red circle\".")
    if args.prompts is not None:
        try:
            text = Path(args.prompts).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(f"--prompts {args.prompts} is not UTF-8 text; save it as UTF-8, one caption a "
                             "line.") from None
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    check(prompts, "no captions: give --prompt TEXT or a --prompts file with one caption a line.")
    return prompts

def run(args: argparse.Namespace) -> int:

    # every check of the command line before any model loads or any folder is made
    check(args.max_batch >= 1, f"--max-batch must be >= 1, got {args.max_batch}.")
    check_count("--num-images", args.num_images)
    check_seed("--seed", args.seed)
    check_sampling(args.guidance_scale, args.temperature, args.top_k, args.top_p)
    parse_threads(args.threads)
    given = [name for name, value in (("--job", args.job), ("--classes", args.classes), ("--prompt", args.prompt),
                                      ("--prompts", args.prompts)) if value is not None]
    check(len(given) <= 1 or given == ["--prompt", "--prompts"], f"pass one of {' / '.join(given)}, not several.")
    if args.job is not None:
        check(Path(args.job).is_file(), f"--job {args.job} is not a file; pass a .jsonl or .csv job file.")
    if args.prompts is not None:
        check(Path(args.prompts).is_file(), f"--prompts {args.prompts} is not a file; pass a text file with one "
                                            "caption a line.")
    if args.model is not None:
        check(Path(args.model).exists(), f"--model {args.model} does not exist; pass a pipeline folder.")
    # captions are read before the family's code loads (seconds): an empty or unreadable one is told at once
    captions = command_prompts(args) if args.prompt is not None or args.prompts is not None else None
    args.family = args.family or default_family()
    family = get_family(args.family)
    if family.generate is None:  # (the list imports every family's record: only on this error)
        raise InputError(f"family {args.family!r} does not generate images; pick one of "
                         f"{', '.join(available_families('generate'))}.")
    text = family.condition == "prompt"
    check(not text or args.classes is None, f"family {args.family!r} is text-to-image: pass --prompt TEXT, "
                                            "--prompts FILE or a --job with a 'prompt' column, not --classes.")
    check(text or (args.prompt is None and args.prompts is None),
          f"family {args.family!r} is class-conditional: pass --classes, not --prompt / --prompts.")
    # the captions of a command-line text-to-image run, read once: an empty list fails here, before any model loads
    args.captions = captions if text and args.job is None else None
    check(not text or args.job is not None or args.captions, "no captions: give --prompt TEXT or a --prompts file "
                                                            "with one caption a line.")
    method = family.get_method(args.method)
    method_kwargs = method.check_given(parse_method_args(args.method_arg), args.family)
    from mmspec.cli.image_job import make_images  # torch and the job's modules: after every check above

    return make_images(args, family, method_kwargs)

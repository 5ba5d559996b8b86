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
import os
import sys
import time
from pathlib import Path

import torch

from mmspec.bench.files import atomic_write, atomic_write_text, prepare_output_dir, remove_stale_temporaries
from mmspec.cli.family_io import DTYPES, class_slug, resolve_class, torch_dtype
from mmspec.cli.jobs import (
    MANIFEST,
    JobRow,
    ManifestWriter,
    WorkItem,
    check_same_job,
    done_records,
    merge_manifests,
    read_job_file,
    row_seed,
    work_items,
)
from mmspec.compile import AUTO, COMPILE_CHOICES, COMPILE_MODES, compile_pipeline
from mmspec.errors import InputError, check
from mmspec.families import FamilyRecord, available_families, get_family
from mmspec.limits import check_count, check_sampling, check_seed
from mmspec.stats import SpecStats
from mmspec.threads import count_parameters, parse_threads, set_threads

GRID_LIMIT = 256  # images; larger runs get no grid.png


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
    with_default = [n for n in available_families("generate") if get_family(n).default_model is not None]
    return (with_default or available_families("generate"))[0]


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
                             "mar's cspd): auto (the pipelines' default: each step's size from this device's "
                             "measured costs, docs/budgets.md) or fixed (the configured size every step)")
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
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


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


def make_grid(images: list, columns: int):
    import PIL.Image

    w, h = images[0].size
    rows = (len(images) + columns - 1) // columns
    grid = PIL.Image.new("RGB", (columns * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * w, (i // columns) * h))
    return grid


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


# ------------------------------------------------------------------------------------------------------ rows
def class_rows(args: argparse.Namespace, n_classes: int) -> list[JobRow]:
    """The rows of a command-line run: one per class, --num-images each (checked by `run`), ids from the class
    names."""
    spec = "all" if args.classes is None else args.classes.strip()
    if spec == "all":
        classes = list(range(n_classes))
    else:
        classes = [resolve_class(part.strip(), n_classes) for part in spec.split(",") if part.strip()]
    check(classes, "--classes is empty; give class ids or names, or 'all'.")
    return command_rows(args, [(class_slug(label, n_classes), {"class": label}) for label in classes])


def command_rows(args: argparse.Namespace, entries: list[tuple[str, dict]]) -> list[JobRow]:
    """One row per (id, inputs) of a command-line run, --num-images each, seeded by position; an id that repeats
    gets its position appended."""
    rows, used = [], set()
    for position, (row_id, inputs) in enumerate(entries):
        row_id = row_id if row_id not in used else f"{row_id}-{position}"
        used.add(row_id)
        rows.append(JobRow(row_id, position + 1, inputs, args.num_images, row_seed(args.seed, position)))
    return rows


def prompt_slug(prompt: str) -> str:
    """The file-name part of a caption: its first words, lower-case, joined by '-' (at most 40 characters)."""
    words = "".join(c if c.isalnum() else " " for c in prompt.lower()).split()
    return "-".join(words)[:40].strip("-") or "prompt"


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


def prompt_rows(args: argparse.Namespace, prompts: list[str]) -> list[JobRow]:
    """The rows of a command-line text-to-image run: one per caption (`command_prompts`), --num-images each."""
    return command_rows(args, [(prompt_slug(prompt), {"prompt": prompt}) for prompt in prompts])


def job_rows(args: argparse.Namespace, n_classes: int | None) -> tuple[list[JobRow], list[str]]:
    def parse_inputs(fields: dict) -> dict:
        if n_classes is None:  # a text-to-image family
            if "class" in fields:
                raise ValueError("a text-to-image family takes 'prompt', not 'class'")
            if not isinstance(fields.get("prompt"), str) or not fields["prompt"].strip():
                raise ValueError("missing 'prompt' (a caption)")
            return {"prompt": fields["prompt"]}
        if "class" not in fields:
            raise ValueError("missing 'class'")
        if "prompt" in fields:
            raise ValueError("a class-conditional family takes 'class', not 'prompt'")
        return {"class": resolve_class(str(fields["class"]), n_classes)}

    rows, bad = read_job_file(args.job, args.seed, parse_inputs)
    if bad and not args.skip_bad:
        shown = "\n  ".join(bad[:20]) + (f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise InputError(f"job file {args.job} has {len(bad)} malformed row(s); nothing was generated:\n  {shown}\n"
                         "Fix them, or pass --skip-bad to generate the other rows.")
    check(rows, f"job file {args.job} has no usable rows.")
    return rows, bad


# ------------------------------------------------------------------------------------------------- the work
def halves(chunk: list, limit: int) -> list[list]:
    """Split a chunk in halves (recursively) until every piece holds at most `limit` items."""
    if len(chunk) <= limit:
        return [chunk]
    half = (len(chunk) + 1) // 2
    return halves(chunk[:half], limit) + halves(chunk[half:], limit)


class Runner:
    """Makes chunks of work items with one family and pipeline; writes each missing image, then its manifest line.

    A chunk is always generated whole (its done images are regenerated and not rewritten), so every image is made
    in the same batch as in an uninterrupted run: batched matrix products round differently for different batch
    shapes, which can flip a rare sample, so this is what makes resumed and sharded runs byte-identical. After an
    out-of-memory error the chunks are halved (deterministically) until they fit."""

    def __init__(self, family: FamilyRecord, pipe, options: dict, out: Path, manifest: ManifestWriter, max_batch: int,
                 settings: dict, done: set) -> None:
        self.family, self.pipe, self.options, self.out = family, pipe, options, out
        self.manifest, self.limit, self.settings, self.done = manifest, max_batch, settings, done
        self.stats, self.backoffs, self.made = SpecStats(), 0, 0

    def make(self, chunks: list[list[WorkItem]], bar) -> None:
        for chunk in chunks:
            queue = halves(chunk, self.limit)
            while queue:
                piece = queue.pop(0)
                if len(piece) > self.limit:  # cut before an earlier piece ran out of memory
                    queue = halves(piece, self.limit) + queue
                    continue
                try:
                    images, stats = self.family.generate(self.pipe, [it.row.inputs[self.family.condition]
                                                                     for it in piece],
                                                         [it.generator() for it in piece], self.options)
                except Exception as err:
                    if not is_out_of_memory(err) or len(piece) == 1:
                        raise
                    self.limit = (len(piece) + 1) // 2  # retry the same items, in halves
                    self.backoffs += 1
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    bar.write(f"out of memory: retrying with batches of at most {self.limit}")
                    queue = halves(piece, self.limit) + queue
                    continue
                self.stats = self.stats + stats
                self._write(piece, images, stats.to_dict(), bar)

    def _write(self, piece: list[WorkItem], images: list, batch_stats: dict, bar) -> None:
        for item, image in zip(piece, images):
            if item.key in self.done:
                continue
            path = self.out / "images" / item.file_name
            atomic_write(path, lambda handle, image=image: image.save(handle, format="PNG"), binary=True)
            self.manifest.append({"id": item.row.id, "index": item.index, "inputs": item.row.inputs,
                                  "seed": item.row.seed, "settings": self.settings,
                                  "output": f"images/{item.file_name}", "batch_stats": batch_stats})
            self.made += 1
            bar.update(1)


def _process_state(device: str):
    """accelerate's PartialState when launched with several processes (accelerate launch / torchrun), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=device == "cpu")


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
    state = _process_state(args.device)
    rank = 0 if state is None else state.process_index
    created = not Path(args.out).exists()
    out = prepare_output_dir(args.out)  # fails before any work if the folder is not writable
    (out / "images").mkdir(exist_ok=True)
    threads_before = torch.get_num_threads()  # --threads is set once the models are loaded; restored after
    try:
        return _generate(args, family, method_kwargs, state, rank, out)
    except BaseException:  # a run that wrote nothing leaves nothing behind (images already made stay)
        remove_if_empty(out / "images")
        if created:
            remove_if_empty(out)
        raise
    finally:
        torch.set_num_threads(threads_before)


def remove_if_empty(folder: Path) -> None:
    """Remove `folder` if it holds nothing (the write probe and temporaries never stay)."""
    try:
        folder.rmdir()
    except OSError:
        pass


def _generate(args: argparse.Namespace, family: FamilyRecord, method_kwargs: dict, state, rank: int,
              out: Path) -> int:
    """The run after its arguments are checked and `out` exists: load, plan, make the images, write the summary."""
    from tqdm.auto import tqdm


    if args.quiet:  # diffusers' "Loading pipeline components" bar
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        from transformers.utils import logging as transformers_logging  # its "Loading weights" bar (text encoders)

        transformers_logging.disable_progress_bar()
    device = args.device if state is None or args.device == "cpu" else str(state.device)
    pipe = family.load(args.model, device, torch_dtype(args.dtype))
    set_threads(parse_threads(args.threads), count_parameters(pipe))
    n_classes = family.num_classes(pipe) if family.condition == "class" else None
    if args.job is not None:
        rows, bad = job_rows(args, n_classes)
    else:
        rows, bad = (class_rows(args, n_classes) if n_classes is not None else prompt_rows(args, args.captions)), []
    options = {k: getattr(args, k) for k in ("guidance_scale", "temperature", "top_k", "top_p")
               if getattr(args, k) is not None}
    options = {**family.defaults(pipe), **options, "method": args.method, "method_kwargs": method_kwargs}
    if args.budget is not None:
        import inspect

        check("budget" in inspect.signature(type(pipe).__call__).parameters,
              f"--budget: the {args.family} pipeline has no draft budget; drop --budget.")
        options["budget"] = args.budget
    reproducible_budget(options, family.get_method(args.method), default_budget(pipe), args.budget is not None,
                        rank == 0)

    items = work_items(rows)
    if rank == 0:  # leftovers of an earlier, interrupted run: per-process figures, half-written images
        for stale in out.glob(".stats.rank*.json"):
            stale.unlink()
        remove_stale_temporaries(out / "images")
        remove_stale_temporaries(out)
    settings = {"family": args.family, "model": args.model or "embedded default",
                **{k: options[k] for k in ("method", "method_kwargs", "guidance_scale", "temperature", "top_k",
                                           "top_p")},
                "budget": options.get("budget", default_budget(pipe)), "dtype": args.dtype,
                "device": torch.device(device).type, "max_batch": args.max_batch}
    done = done_records(out)
    check_same_job(done, items, settings, out)
    # fixed chunks of the job (the same in every run with this --max-batch); only those with missing images
    chunks = [items[i:i + args.max_batch] for i in range(0, len(items), args.max_batch)]
    todo = [c for c in chunks if any(it.key not in done for it in c)]
    if state is not None:
        state.wait_for_everyone()  # every process has read the manifests before any writes its shard
        with state.split_between_processes(todo) as mine:
            todo = list(mine)
    # compile="auto": only models whose compilation pays for itself in the calls this process will run (none left
    # after a finished run: nothing to compile)
    if todo and args.compile != "none":
        pipe = compile_pipeline(pipe, args.compile, call_batch_sizes=[len(chunk) for chunk in todo])
    shard = out / (MANIFEST if state is None else f"manifest.rank{rank}.jsonl")
    manifest = ManifestWriter(shard)
    runner = Runner(family, pipe, options, out, manifest, args.max_batch, settings, set(done))
    start = time.perf_counter()
    bar = tqdm(total=sum(it.key not in done for c in todo for it in c),
               desc=f"{args.family}/{args.method}" + (f" [rank {rank}]" if state else ""),
               unit="img", disable=args.quiet or rank != 0)
    try:
        runner.make(todo, bar)
    finally:
        bar.close()
        manifest.close()
    seconds = time.perf_counter() - start
    atomic_write_text(out / f".stats.rank{rank}.json", json.dumps(
        {"made": runner.made, "seconds": seconds, "backoffs": runner.backoffs, "stats": runner.stats.to_dict()}))
    if state is not None:
        state.wait_for_everyone()
    if rank != 0:
        return 0
    return _finish(args, out, rows, items, bad, done, options, seconds)


def reproducible_budget(options: dict, method, default: str | None, given: bool, say: bool) -> None:
    """A job's budget: where a seed's images depend on the draft sizes (`MethodRecord.seed_fixes_output`: sampled
    speculative sampling, relaxed rules), the default is "fixed", so a resumed job gives an uninterrupted run's
    images; a given --budget auto is honoured with a note that resumes then differ. Sets options["budget"]."""
    budget = options.get("budget", default)
    if budget != "auto" or method.seed_fixes_output(options["method_kwargs"], options["temperature"]):
        return
    why = (f"{method.name}'s sampled images depend on the draft sizes, which budget auto picks from measured "
           "times")
    if given:
        if say:
            print(f"note: {why}; a resumed job will not give an uninterrupted run's images (--budget fixed does).",
                  file=sys.stderr)
        return
    options["budget"] = "fixed"
    if say:
        print(f"budget: fixed ({why}; a resumed job gives an uninterrupted run's images). --budget auto to pick "
              "sizes anyway.", file=sys.stderr)


def default_budget(pipe) -> str | None:
    """The draft budget a pipeline's call uses when none is given ("auto" where it takes one), None without one."""
    import inspect

    parameter = inspect.signature(type(pipe).__call__).parameters.get("budget")
    return None if parameter is None else parameter.default


def _finish(args: argparse.Namespace, out: Path, rows: list[JobRow], items: list[WorkItem], bad: list[str],
            done: set, options: dict, seconds: float) -> int:
    """Main process: merge the manifests, write stats.json (and grid.png for small runs), print a summary. A rerun
    that made nothing keeps the stats.json of the run that made the images."""
    records = merge_manifests(out, [it.key for it in items])
    per_rank = []
    for path in sorted(out.glob(".stats.rank*.json")):
        per_rank.append(json.loads(path.read_text()))
        path.unlink()
    stats = SpecStats()
    for part in per_rank:
        stats = stats + SpecStats.from_dict(part["stats"])
    made = sum(p["made"] for p in per_rank)
    if made == 0 and (out / "stats.json").is_file() and all(it.key in done for it in items):
        print(f"nothing to make: all {len(items)} images of this job are in {out / 'images'} (manifest.jsonl); "
              "stats.json keeps the figures of the run that made them.")
        return 0
    if len(items) <= GRID_LIMIT:
        import PIL.Image

        wanted = {it.key for it in items}
        paths = [out / r["output"] for r in records if (r["id"], int(r["index"])) in wanted]
        if paths:
            per_row = max(r.count for r in rows)
            grid = make_grid([PIL.Image.open(p).convert("RGB") for p in paths],
                             columns=per_row if 1 < per_row <= 16 else 8)
            atomic_write(out / "grid.png", lambda handle: grid.save(handle, format="PNG"), binary=True)
    summary = {
        "family": args.family, "method": args.method, "method_kwargs": options["method_kwargs"],
        "model": args.model or "embedded default", "job": args.job, "seed": args.seed, "rows": len(rows),
        "num_images": len(items), "made_this_run": made, "already_done": len(set(done) & {it.key for it in items}),
        "manifest_records": len(records), "processes": len(per_rank), "max_batch": args.max_batch,
        "oom_backoffs": sum(p["backoffs"] for p in per_rank), "skipped_bad_rows": bad,
        "sampling": {k: options[k] for k in ("guidance_scale", "temperature", "top_k", "top_p")},
        "wall_time": seconds, "images_per_second": made / seconds if seconds > 0 else 0.0,
        "stats": stats.to_dict(),
    }
    atomic_write_text(out / "stats.json", json.dumps(summary, indent=2))
    counts = (f"target forwards {stats.num_target_forwards}, mean acceptance length {stats.mean_acceptance_length:.2f}"
              if stats.num_drafts else f"transformer forwards {stats.num_target_forwards + stats.num_draft_forwards}")
    skipped = f"; skipped {len(bad)} malformed row(s)" if bad else ""
    print(f"made {made} of {len(items)} images in {out / 'images'} ({summary['already_done']} already done, "
          f"{made / seconds if seconds > 0 else 0:.2f} img/s){skipped}; manifest.jsonl, stats.json; {counts}")
    return 0

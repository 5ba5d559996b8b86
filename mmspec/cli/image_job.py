"""The work of `mmspec generate` once its command line is checked (`mmspec.cli.generate`): the rows of the run, the
fixed chunks of work items, the runner that writes each image atomically and then its manifest line, and the
summary (stats.json, grid.png). Kept apart from the command line so that a bad argument is told before torch loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mmspec.bench.files import atomic_write, atomic_write_text, prepare_output_dir, remove_stale_temporaries
from mmspec.budget import default_mode
from mmspec.cli.family_io import class_slug, resolve_class, torch_dtype
from mmspec.cli.jobs import (
    MANIFEST,
    JobRow,
    ManifestWriter,
    WorkItem,
    check_same_job,
    done_records,
    job_budget,
    merge_manifests,
    read_job_file,
    row_seed,
    work_items,
)
from mmspec.compile import compile_pipeline
from mmspec.errors import InputError, check
from mmspec.families import FamilyRecord
from mmspec.hf_loading import library_output
from mmspec.processes import process_state
from mmspec.stats import SpecStats, budget_notice
from mmspec.threads import count_parameters, parse_threads, set_threads

GRID_LIMIT = 256  # images; larger runs get no grid.png


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


def make_images(args: argparse.Namespace, family: FamilyRecord, method_kwargs: dict) -> int:
    """Make the images of a checked command line: its output folder, then `_generate` (a run that wrote nothing
    leaves no folder behind); torch's thread count is restored after."""
    state = process_state(cpu=args.device == "cpu")
    rank = 0 if state is None else state.process_index
    created = not Path(args.out).exists()
    out = prepare_output_dir(args.out)  # fails before any work if the folder is not writable
    (out / "images").mkdir(exist_ok=True)
    threads_before = torch.get_num_threads()  # --threads is set once the models are loaded; restored after
    try:
        with quiet_libraries(args.quiet):
            return _generate(args, family, method_kwargs, state, rank, out)
    except BaseException:  # a run that wrote nothing leaves nothing behind (images already made stay)
        remove_if_empty(out / "images")
        if created:
            remove_if_empty(out)
        raise
    finally:
        torch.set_num_threads(threads_before)


def quiet_libraries(quiet: bool):
    """With `quiet`: diffusers' and transformers' progress bars ("Loading pipeline components", "Loading weights")
    and notices (e.g. an image processor's backend fallback) off for the block, errors still shown; as before after."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    return library_output([diffusers_logging, transformers_logging], bars=not quiet, errors_only=quiet)


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
        check(takes_budget(pipe), f"--budget: the {args.family} pipeline has no draft budget; drop --budget.")
        options["budget"] = args.budget
    budget = None
    if takes_budget(pipe):
        method = family.get_method(args.method)
        default = default_mode(method.is_lossless(method_kwargs))
        budget = job_budget(args.budget, default, not method.seed_fixes_output(method_kwargs, options["temperature"]),
                            "images", rank == 0)
        if args.budget is not None or budget != default:
            options["budget"] = budget
    items = work_items(rows)
    if rank == 0:  # leftovers of an earlier, interrupted run: per-process figures, half-written images
        for stale in out.glob(".stats.rank*.json"):
            stale.unlink()
        remove_stale_temporaries(out / "images")
        remove_stale_temporaries(out)
    settings = {"family": args.family, "model": args.model or "embedded default",
                **{k: options[k] for k in ("method", "method_kwargs", "guidance_scale", "temperature", "top_k",
                                           "top_p")},
                "budget": budget, "dtype": args.dtype,
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


def takes_budget(pipe) -> bool:
    """Whether a pipeline's call takes a draft budget."""
    import inspect

    return "budget" in inspect.signature(type(pipe).__call__).parameters


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
    note = budget_notice(stats, args.method)
    if note:
        print(note, file=sys.stderr)
    return 0


def make_grid(images: list, columns: int):
    """The images pasted into a grid of `columns` columns (row by row)."""
    import PIL.Image

    w, h = images[0].size
    rows = (len(images) + columns - 1) // columns
    grid = PIL.Image.new("RGB", (columns * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * w, (i // columns) * h))
    return grid

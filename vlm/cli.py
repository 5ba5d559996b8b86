"""`mmspec vlm`: answer questions about images with a LLaVA target, with a speculative drafter or without.

    mmspec vlm --image cat.png --prompt "Describe the image. Answer in detail." [--drafter eagle|none] [--model DIR]
    mmspec vlm --job questions.jsonl --out answers/ [--batch-size 8]          # rows: id, image, prompt

One question prints the answer (streamed as it is verified, with --stream) and the run's figures. A job file
(.jsonl or .csv; columns id, image, prompt, seed; image paths relative to the job file; a chunk of
--batch-size rows is sampled with the seed of its first row) writes
`answers.jsonl` (one line per finished row, flushed: a rerun skips the rows it lists) and `stats.json`. The
model defaults to the embedded world LLaVA (`assets/vlm`, made by `mmspec train vlm`); `--model` takes any
transformers VLM folder (LLaVA-1.5, Qwen2-VL / Qwen2.5-VL) with its processor (drafters in `DIR/drafters/<kind>`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mmspec.bench.files import atomic_write_text, prepare_output_dir
from mmspec.cli.family_io import DTYPES, torch_dtype
from mmspec.cli.jobs import ManifestWriter, read_job_file
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check
from mmspec.stats import SpecStats
from mmspec.threads import count_parameters, parse_threads, set_threads

JOB_COLUMNS = ("id", "image", "prompt", "seed", "count")
ANSWERS = "answers.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image", default=None, help="an image file (PNG, JPEG, ...)")
    parser.add_argument("--prompt", default=None, help="the question (wrapped as 'USER: <image>\\n... ASSISTANT:')")
    parser.add_argument("--job", default=None, help="a .jsonl / .csv job file with columns id, image, prompt")
    parser.add_argument("--out", default=None, help="output folder of a job (answers.jsonl, stats.json)")
    parser.add_argument("--model", default=None, help="target folder (default: the embedded assets/vlm)")
    from vlm.family import DRAFTER_KINDS  # the VLM family record's methods

    parser.add_argument("--drafter", default="auto", choices=[*DRAFTER_KINDS, "none", "auto"],
                        help="drafter kind in MODEL/drafters, 'none' (vanilla), or 'auto' (default: the first of "
                             f"{', '.join(DRAFTER_KINDS)} found, else none)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--tree", default=None,
                        help="EAGLE-2 tree: depth,top_k,total_tokens, depth in drafted levels (EAGLE's code's "
                             "depth + 1); default: the drafter's paper setting (vispec 4,8,30; msd 6,10,59; eagle "
                             "and specvlm 8,10,60)")
    parser.add_argument("--budget", default="auto", choices=["fixed", "auto"],
                        help="auto (default): pick each step's shape inside --tree (chains, smaller trees, plain "
                             "steps) from this device's timed costs and the acceptance seen so far "
                             "(docs/budgets.md); fixed: draft the --tree every step")
    parser.add_argument("--batch-size", type=int, default=8, help="rows generated together (job files)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="auto",
                        help="torch CPU threads: N, or auto (default: one per 20M parameters, at most the usable CPUs)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="target and drafter weights: float32 (default, as saved), bfloat16 or float16")
    parser.add_argument("--stream", action="store_true", help="print the answer as it is verified")


def load_image(path: str | Path):
    """An RGB PIL image; InputError for a missing or unreadable file."""
    import PIL.Image

    path = Path(path)
    check(path.is_file(), f"image {path} does not exist.")
    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except (PIL.Image.UnidentifiedImageError, OSError):
        raise InputError(f"{path} is not an image file PIL can read (PNG, JPEG, BMP, ...).") from None


def parse_tree(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        depth, top_k, total = (int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--tree must be depth,top_k,total_tokens (e.g. 4,8,30), got {text!r}.") from None
    return depth, top_k, total


def load_vlm(args: argparse.Namespace):
    from vlm.pipeline import SpeculativeVLM

    folder = Path(args.model) if args.model else ASSETS_DIR / "vlm"
    if args.model is None and not (folder / "config.json").is_file():
        raise InputError(f"no embedded VLM at {folder}; make it with `mmspec train vlm` (and a drafter with "
                         "`mmspec train vlm-drafter --kind eagle`), or pass --model DIR.")
    drafter = None if args.drafter == "none" else args.drafter
    if args.drafter == "auto":
        from vlm.family import drafter_kinds_in

        found = drafter_kinds_in(folder)
        drafter = found[0] if found else None
        print(f"drafter: {drafter or 'none (the target alone)'}", file=sys.stderr)
    threads = parse_threads(args.threads)  # checked before the model loads
    vlm = SpeculativeVLM.from_pretrained(folder, drafter, device=args.device, dtype=torch_dtype(args.dtype))
    set_threads(threads, count_parameters(*(m for m in (vlm.model, vlm.drafter) if m is not None)))
    return vlm


def figures(stats: SpecStats, seconds: float, tokens: int) -> dict:
    return {"seconds": round(seconds, 3), "new_tokens": tokens, "tokens_per_second": round(tokens / seconds, 2)
            if seconds > 0 else None, "target_forwards": stats.num_target_forwards,
            "mean_acceptance_length": round(stats.mean_acceptance_length, 3) if stats.num_drafts else None}


def run(args: argparse.Namespace) -> int:
    import torch

    threads_before = torch.get_num_threads()  # --threads is set once the models are loaded; restored after
    try:
        return answer(args)
    finally:
        torch.set_num_threads(threads_before)


def answer(args: argparse.Namespace) -> int:
    """One question, or a job file (after `run` saved the thread count)."""
    import torch

    tree = parse_tree(args.tree)
    single = args.image is not None or args.prompt is not None
    check(single != (args.job is not None), "pass either --image and --prompt, or --job (with --out).")
    if single:
        check(args.image is not None and args.prompt, "a single question needs both --image and --prompt.")
        image = load_image(args.image)
        vlm = load_vlm(args)
        stream = (lambda row, text, ids: print(text, end="", flush=True)) if args.stream else None
        start = time.perf_counter()
        out = vlm.generate([image], [args.prompt], args.max_new_tokens, args.temperature, args.top_p,
                           tree=tree, generator=torch.Generator().manual_seed(args.seed), stream=stream,
                           budget=args.budget)
        seconds = time.perf_counter() - start
        print("" if args.stream else out.texts[0])
        print(json.dumps(figures(out.stats, seconds, len(out.token_ids[0]))), file=sys.stderr)
        return 0
    return run_job(args, tree)


def run_job(args: argparse.Namespace, tree: tuple[int, int, int]) -> int:
    import torch

    check(args.out is not None, "--job needs --out (the folder for answers.jsonl).")
    job = Path(args.job)

    def parse_inputs(fields: dict) -> dict:
        for name in ("image", "prompt"):
            if not str(fields.get(name, "")).strip():
                raise ValueError(f"missing '{name}'")
        path = Path(str(fields["image"]))
        path = path if path.is_absolute() else job.parent / path
        if not path.is_file():
            raise ValueError(f"image {path} does not exist")
        return {"image": str(path), "prompt": str(fields["prompt"])}

    rows, bad = read_job_file(job, args.seed, parse_inputs, columns=JOB_COLUMNS)
    if bad:
        raise InputError(f"job file {job} has {len(bad)} malformed row(s); nothing was answered:\n  "
                         + "\n  ".join(bad[:20]))
    out = prepare_output_dir(args.out)
    done = set()
    if (out / ANSWERS).is_file():
        done = {json.loads(line)["id"] for line in (out / ANSWERS).read_text().splitlines() if line.strip()}
    todo = [row for row in rows if row.id not in done]
    vlm = load_vlm(args)
    writer, stats, start = ManifestWriter(out / ANSWERS), SpecStats(), time.perf_counter()
    made = tokens = 0
    from tqdm.auto import tqdm

    try:
        for first in tqdm(range(0, len(todo), args.batch_size), desc="vlm", unit="batch"):
            chunk = todo[first:first + args.batch_size]
            images = [load_image(row.inputs["image"]) for row in chunk]
            result = vlm.generate(images, [row.inputs["prompt"] for row in chunk], args.max_new_tokens,
                                  args.temperature, args.top_p, tree=tree, batch_size=args.batch_size,
                                  generator=torch.Generator().manual_seed(chunk[0].seed), budget=args.budget)
            stats = stats + result.stats
            for row, text, ids in zip(chunk, result.texts, result.token_ids):
                writer.append({"id": row.id, "image": row.inputs["image"], "prompt": row.inputs["prompt"],
                               "answer": text, "num_tokens": len(ids)})
                made, tokens = made + 1, tokens + len(ids)
    finally:
        writer.close()
    seconds = time.perf_counter() - start
    summary = {"job": str(job), "rows": len(rows), "answered_this_run": made,
               "already_done": len(done & {r.id for r in rows}), "drafter": args.drafter, "tree": list(tree),
               "temperature": args.temperature, **figures(stats, seconds, tokens)}
    atomic_write_text(out / "stats.json", json.dumps(summary, indent=2))
    print(f"answered {made} of {len(rows)} rows ({summary['already_done']} already done) in {seconds:.1f} s; "
          f"{out / ANSWERS}, stats.json")
    return 0

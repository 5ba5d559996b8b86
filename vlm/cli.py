"""`mmspec vlm`: answer questions about images with a LLaVA target, with a speculative drafter or without.

    mmspec vlm --image cat.png --prompt "Describe the image. Answer in detail." [--drafter eagle|none] [--model DIR]
    mmspec vlm --job questions.jsonl --out answers/ [--batch-size 8]          # rows: id, image, prompt

One question prints the answer (streamed as it is verified, with --stream) and the run's figures. A job file
(.jsonl or .csv; columns id, image, prompt, seed; image paths relative to the job file; each row sampled with its
own seed, in fixed chunks of --batch-size rows) writes `answers.jsonl` (one line per finished row, flushed: a rerun
with the same options resumes where it stopped and gives the answers an uninterrupted run gives; other options are
refused, naming them) and `stats.json`. The
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
from mmspec.cli.jobs import ManifestWriter, job_budget, read_job_file
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check, why_not_a_file
from mmspec.limits import check_sampling, check_seed
from mmspec.sampling import EXACT_MODES
from mmspec.stats import SpecStats, budget_notice
from mmspec.threads import count_parameters, parse_threads, set_threads

JOB_COLUMNS = ("id", "image", "prompt", "seed")
ANSWERS = "answers.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image", action="append", default=None,
                        help="an image file (PNG, JPEG, ...); repeat it for a question about several images")
    parser.add_argument("--prompt", default=None, help="the question (wrapped as 'USER: <image>\\n... ASSISTANT:')")
    parser.add_argument("--job", default=None, help="a .jsonl / .csv job file with columns id, image, prompt "
                                                    "(a JSON Lines row's image may be a list of files)")
    parser.add_argument("--out", default=None, help="output folder of a job (answers.jsonl, stats.json)")
    parser.add_argument("--model", default=None, help="target folder or a hub id in the local Hugging Face cache "
                                                      "(default: the embedded assets/vlm)")
    from vlm.family import DRAFTER_KINDS, TRAINING_FREE_KINDS  # the VLM family record's methods

    parser.add_argument("--drafter", default="auto", choices=[*DRAFTER_KINDS, *TRAINING_FREE_KINDS, "none", "auto"],
                        help="drafter kind in MODEL/drafters, a training-free one (pld, sam, recycle: any target), "
                             "'none' (vanilla), or 'auto' (default: the first of "
                             f"{', '.join(DRAFTER_KINDS)} found, else none)")
    parser.add_argument("--drafter-path", default=None, metavar="DIR",
                        help="a drafter folder of --drafter's kind elsewhere than MODEL/drafters (e.g. one trained "
                             "by `mmspec train vlm-drafter --out DIR`)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--tree", default=None,
                        help="EAGLE-2 tree: depth,top_k,total_tokens, depth in drafted levels (EAGLE's code's "
                             "depth + 1); default: the drafter's paper setting (vispec 4,8,30; msd 6,10,59; eagle "
                             "and specvlm 8,10,60)")
    parser.add_argument("--budget", default=None, choices=["fixed", "auto"],
                        help="auto (default): pick each step's shape inside --tree (chains, smaller trees, plain "
                             "steps) from this device's timed costs and the acceptance seen so far "
                             "(docs/budgets.md); fixed: draft the --tree every step (the default of a job with "
                             "--accept lossless at temperature > 0, whose answers depend on the shapes drafted)")
    parser.add_argument("--accept", default=EXACT_MODES[1], choices=EXACT_MODES,
                        help="coupled (default): the target's own sample at every token, so a seed gives the answer "
                             "the target alone gives, whatever the drafter or the budget draft; lossless: "
                             "speculative sampling (docs/verify.md); both greedy at temperature 0")
    parser.add_argument("--batch-size", type=int, default=8, help="rows generated together (job files)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="job files: skip malformed rows and rows whose image cannot be read (listed in "
                             "stats.json) instead of stopping before any work")
    parser.add_argument("--seed", type=int, default=0, help="the question's seed, or a job's base seed (rows "
                                                            "without their own)")
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
    check(path.is_file(), f"image {path} {why_not_a_file(path)}.")
    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except (PIL.Image.UnidentifiedImageError, OSError):
        raise InputError(f"{path} is not an image file PIL can read (PNG, JPEG, BMP, ...).") from None


def load_images(paths: str | Path | list):
    """`load_image` of one path, or a list of them for a row of several images."""
    return [load_image(p) for p in paths] if isinstance(paths, list) else load_image(paths)


def parse_tree(text: str | None) -> tuple[int, int, int] | None:
    """--tree depth,top_k,total_tokens, checked as every tree drafter checks it (before the model loads)."""
    if text is None:
        return None
    try:
        depth, top_k, total = (int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--tree must be depth,top_k,total_tokens (e.g. 4,8,30), got {text!r}.") from None
    from mmspec.feature_drafter import check_tree_params

    check_tree_params(top_k, depth, total)
    return depth, top_k, total


def model_folder(args: argparse.Namespace) -> Path:
    """The target folder: --model (a folder, or a hub id in the local Hugging Face cache), or the embedded world
    LLaVA (InputError when it has not been made)."""
    from mmspec.hf_loading import resolve_model_folder

    folder = resolve_model_folder(args.model, "--model") if args.model else ASSETS_DIR / "vlm"
    if args.model is None and not (folder / "config.json").is_file():
        raise InputError(f"no embedded VLM at {folder}; make it with `mmspec train vlm` (and a drafter with "
                         "`mmspec train vlm-drafter --kind eagle`), or pass --model DIR.")
    return folder


def resolve_drafter(args: argparse.Namespace) -> None:
    """--drafter auto -> the first kind found in the target folder's drafters/, else "none", said in one line (a
    job records the kind it used, so a drafter added later does not change a resumed job)."""
    if args.drafter != "auto":
        return
    check(args.drafter_path is None, "--drafter-path needs its kind: give --drafter eagle (or vispec, msd, specvlm).")
    from vlm.family import drafter_kinds_in

    found = drafter_kinds_in(model_folder(args))
    args.drafter = found[0] if found else "none"
    print(f"drafter: {found[0] if found else 'none (the target alone)'}", file=sys.stderr)


def load_vlm(args: argparse.Namespace):
    from vlm.pipeline import SpeculativeVLM

    folder = model_folder(args)
    resolve_drafter(args)
    drafter = None if args.drafter == "none" else args.drafter
    threads = parse_threads(args.threads)  # checked before the model loads
    check(args.drafter_path is None or drafter is not None, "--drafter none takes no --drafter-path.")
    vlm = SpeculativeVLM.from_pretrained(folder, drafter, drafter_path=args.drafter_path, device=args.device,
                                         dtype=torch_dtype(args.dtype))
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
    check_seed("--seed", args.seed)
    check_sampling(temperature=args.temperature, top_p=args.top_p)
    check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}.")
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    single = args.image is not None or args.prompt is not None
    check(single != (args.job is not None), "pass either --image and --prompt, or --job (with --out).")
    if single:
        check(args.image is not None and args.prompt, "a single question needs both --image and --prompt.")
        image = load_images(args.image if len(args.image) > 1 else args.image[0])
        vlm = load_vlm(args)
        stream = (lambda row, text, ids: print(text, end="", flush=True)) if args.stream else None
        start = time.perf_counter()
        out = vlm.generate([image], [args.prompt], args.max_new_tokens, args.temperature, args.top_p,
                           tree=tree, generator=torch.Generator().manual_seed(args.seed), stream=stream,
                           budget=args.budget or "auto", accept=args.accept)
        seconds = time.perf_counter() - start
        print("" if args.stream else out.texts[0])
        say_budget_notice(out.stats, args.drafter)
        print(json.dumps(figures(out.stats, seconds, len(out.token_ids[0]))), file=sys.stderr)  # the last line
        return 0
    return run_job(args, tree)


def say_budget_notice(stats: SpecStats, drafter: str) -> None:
    """Print on stderr the line saying the draft budget kept the drafter from drafting on most steps, if it did."""
    note = budget_notice(stats, drafter)
    if note:
        print(note, file=sys.stderr)


def job_settings(args: argparse.Namespace, tree) -> dict:
    """What an answer depends on besides its row: a resumed job must use the same (`check_same_answers`)."""
    return {"model": args.model or "embedded default", "drafter": args.drafter,
            **({"drafter_path": args.drafter_path} if args.drafter_path else {}), "tree": None if tree is None
            else list(tree), "budget": args.budget, "accept": args.accept, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "batch_size": args.batch_size, "dtype": args.dtype,
            "device": args.device}


def done_answers(path: Path) -> dict[str, dict]:
    """Row id -> record of every complete line of answers.jsonl (a torn last line lists nothing)."""
    from mmspec.cli.jobs import read_manifest

    if not path.is_file():
        return {}
    return {str(r["id"]): r for r in read_manifest(path, keys=("id",))}


def check_same_answers(done: dict[str, dict], rows, settings: dict, out: Path) -> None:
    """InputError naming the first differing input or setting when `out` holds an answer made otherwise."""
    for row in rows:
        record = done.get(row.id)
        if record is None:
            continue
        mine = {"image": row.inputs["image"], "prompt": row.inputs["prompt"], "seed": row.seed, **settings}
        theirs = {"image": record.get("image"), "prompt": record.get("prompt"), "seed": record.get("seed"),
                  **(record.get("settings") or {})}
        changed = [k for k in mine if json.loads(json.dumps(mine[k])) != theirs.get(k)]
        if changed:
            what = ", ".join(f"{k} ({theirs.get(k)!r} there, {mine[k]!r} now)" for k in changed[:4])
            raise InputError(f"{out} already holds the answer of row {row.id!r} made with another {what}; rerun "
                             "with the same job and options to resume, or pick another --out.")


def readable_rows(rows, skip_bad: bool) -> tuple[list, list[str]]:
    """The rows whose image opens (`load_image`), and the others as "id: what is wrong" (InputError naming them
    unless `skip_bad`): checked before the model loads."""
    good, bad = [], []
    for row in rows:
        try:
            load_images(row.inputs["image"])
            good.append(row)
        except InputError as err:
            bad.append(f"{row.id}: {err}")
    if bad and not skip_bad:
        raise InputError(f"{len(bad)} row(s) of the job have no readable image, e.g. {bad[0]}; fix them, or pass "
                         "--skip-bad to answer the other rows.")
    return good, bad


def fitting_rows(vlm, rows, max_new_tokens: int, skip_bad: bool) -> tuple[list, list[str]]:
    """The rows whose prompt (image tokens included) and max_new_tokens fit the target's positions, and the others
    as "id: what is wrong" (InputError naming the first unless `skip_bad`): checked before any row is answered."""
    good, bad = [], []
    for row in rows:
        inputs = vlm.encode([load_images(row.inputs["image"])], [row.inputs["prompt"]])
        try:
            vlm.check_room(inputs, max_new_tokens)
            good.append(row)
        except InputError as err:
            if not skip_bad:
                raise InputError(f"row {row.id}: {err} Or pass --skip-bad to answer the other rows.") from None
            bad.append(f"{row.id}: {err}")
    return good, bad


def run_job(args: argparse.Namespace, tree: tuple[int, int, int] | None) -> int:
    """Answer a job file. Rows are cut into fixed chunks of --batch-size (the same in every run); a chunk with a
    missing answer is answered whole, each row with the generator of its own seed, so a resumed job's answers are
    an uninterrupted run's (batched arithmetic rounds by batch shape); the rows already answered are not rewritten."""
    import torch

    check(args.out is not None, "--job needs --out (the folder for answers.jsonl).")
    job = Path(args.job)

    def parse_inputs(fields: dict) -> dict:
        for name in ("image", "prompt"):
            if not fields.get(name) or not str(fields.get(name, "")).strip():
                raise ValueError(f"missing '{name}'")
        given = fields["image"] if isinstance(fields["image"], list) else [fields["image"]]
        paths = []
        for image in given:
            path = Path(str(image))
            path = path if path.is_absolute() else job.parent / path
            if not path.is_file():
                raise ValueError(f"image {path} {why_not_a_file(path)}")
            paths.append(str(path))
        return {"image": paths if isinstance(fields["image"], list) else paths[0], "prompt": str(fields["prompt"])}

    resolve_drafter(args)
    args.budget = job_budget(args.budget, "auto", args.accept != "coupled" and args.temperature > 0
                             and args.drafter != "none", "answers", True)
    rows, bad = read_job_file(job, args.seed, parse_inputs, columns=JOB_COLUMNS)
    if bad and not args.skip_bad:
        raise InputError(f"job file {job} has {len(bad)} malformed row(s), e.g. {bad[0]}; nothing was answered. Fix "
                         "them, or pass --skip-bad to answer the other rows.")
    rows, unreadable = readable_rows(rows, args.skip_bad)
    bad += unreadable
    check(rows, f"job file {job} has no usable rows.")
    settings = job_settings(args, tree)
    out_existed = Path(args.out).exists()
    out = prepare_output_dir(args.out)
    done = done_answers(out / ANSWERS)
    try:
        check_same_answers(done, rows, settings, out)
    except InputError:
        if not out_existed:
            out.rmdir()
        raise
    if all(row.id in done for row in rows) and (out / "stats.json").is_file():
        print(f"nothing to answer: all {len(rows)} rows are in {out / ANSWERS}; stats.json keeps the figures of "
              "the run that answered them.")
        return 0
    vlm = load_vlm(args)
    rows, too_long = fitting_rows(vlm, rows, args.max_new_tokens, args.skip_bad)
    bad += too_long
    chunks = [rows[i:i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    todo = [c for c in chunks if any(row.id not in done for row in c)]
    writer, stats, start = ManifestWriter(out / ANSWERS), SpecStats(), time.perf_counter()
    made = tokens = 0
    from tqdm.auto import tqdm

    try:
        for chunk in tqdm(todo, desc="vlm", unit="batch"):
            images = [load_images(row.inputs["image"]) for row in chunk]
            result = vlm.generate(images, [row.inputs["prompt"] for row in chunk], args.max_new_tokens,
                                  args.temperature, args.top_p, tree=tree, batch_size=len(chunk),
                                  generator=[torch.Generator().manual_seed(row.seed) for row in chunk],
                                  budget=args.budget, accept=args.accept)
            stats = stats + result.stats
            for row, text, ids in zip(chunk, result.texts, result.token_ids):
                if row.id in done:
                    continue
                writer.append({"id": row.id, "image": row.inputs["image"], "prompt": row.inputs["prompt"],
                               "seed": row.seed, "answer": text, "num_tokens": len(ids), "settings": settings})
                made, tokens = made + 1, tokens + len(ids)
    finally:
        writer.close()
    seconds = time.perf_counter() - start
    summary = {"job": str(job), "rows": len(rows), "answered_this_run": made,
               "already_done": len(set(done) & {r.id for r in rows}), "skipped_bad_rows": bad, **settings,
               **figures(stats, seconds, tokens)}
    atomic_write_text(out / "stats.json", json.dumps(summary, indent=2))
    skipped = f"; skipped {len(bad)} bad row(s) (stats.json lists them)" if bad else ""
    print(f"answered {made} of {len(rows)} rows ({summary['already_done']} already done) in {seconds:.1f} s; "
          f"{out / ANSWERS}, stats.json{skipped}")
    say_budget_notice(stats, args.drafter)
    return 0

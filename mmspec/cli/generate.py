"""`mmspec generate`: class-conditional image generation with any family and method; writes PNGs, a grid and stats.

    mmspec generate --family llamagen --classes "red circle,blue cross" --num-images 4 --out out/ [--method M]
                    [--model PATH] [--seed S]

Images are seeded one by one (image i of a run with seed S uses its own generator, seeded from (S, i)), so an
image does not depend on the batch it was generated in. Every file is written atomically (temporary file, then
rename). Families plug in through `GENERATE_FAMILIES`: an adapter module with `METHODS`, `DEFAULTS`,
`load(model_path, device)`, `resolve_class(text)` and `generate(pipe, labels, generators, options)`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

import torch

from mmspec.errors import InputError, check
from mmspec.stats import SpecStats

GENERATE_FAMILIES = {"llamagen": "image_ar.llamagen.generate"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="llamagen", choices=sorted(GENERATE_FAMILIES), help="model family")
    parser.add_argument("--classes", default="all",
                        help="comma-separated class ids or names (e.g. '0,5' or 'red circle,blue cross'), or 'all'")
    parser.add_argument("--num-images", type=int, default=4, help="images per class")
    parser.add_argument("--out", required=True, help="output folder (images/, grid.png, stats.json)")
    parser.add_argument("--method", default="vanilla", help="decoding method (see the family's docs)")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a method parameter, repeatable (e.g. --method-arg num_draft_tokens=4)")
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded asset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (family default if unset)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--device", default="cpu")
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


def image_generator(seed: int, index: int) -> torch.Generator:
    """The generator of image `index` in a run seeded with `seed` (independent of batching)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def atomic_save_image(image, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_grid(images: list, columns: int):
    import PIL.Image

    w, h = images[0].size
    rows = (len(images) + columns - 1) // columns
    grid = PIL.Image.new("RGB", (columns * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * w, (i // columns) * h))
    return grid


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    check(args.num_images >= 1, f"--num-images must be >= 1, got {args.num_images}.")
    check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}.")
    family = importlib.import_module(GENERATE_FAMILIES[args.family])
    check(args.method in family.METHODS,
          f"unknown method {args.method!r} for {args.family}; available: {', '.join(family.METHODS)}.")
    out = Path(args.out)
    try:  # fail before any work if the output folder is not writable
        (out / "images").mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise InputError(f"cannot write to --out {out}: {err.strerror}. Choose a writable folder.") from None

    if args.quiet:  # diffusers' "Loading pipeline components" bar
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    pipe = family.load(args.model, args.device)
    if args.classes.strip() == "all":
        classes = list(range(family.num_classes(pipe)))
    else:
        classes = [family.resolve_class(part.strip(), pipe) for part in args.classes.split(",") if part.strip()]
    check(classes, "--classes is empty; give class ids or names, or 'all'.")
    labels = [c for c in classes for _ in range(args.num_images)]
    options = {k: getattr(args, k) for k in ("guidance_scale", "temperature", "top_k", "top_p")
               if getattr(args, k) is not None}
    options = {**family.DEFAULTS, **options, "method": args.method, "method_kwargs": parse_method_args(args.method_arg)}

    stats, images, names = SpecStats(), [], []
    start = time.perf_counter()
    bar = tqdm(total=len(labels), desc=f"{args.family}/{args.method}", unit="img", disable=args.quiet)
    for first in range(0, len(labels), args.batch_size):
        batch = labels[first:first + args.batch_size]
        gens = [image_generator(args.seed, first + i) for i in range(len(batch))]
        batch_images, batch_stats = family.generate(pipe, batch, gens, options)
        stats = stats + batch_stats
        for i, (image, label) in enumerate(zip(batch_images, batch)):
            name = f"{first + i:05d}_{family.class_slug(label, pipe)}.png"
            atomic_save_image(image, out / "images" / name)
            images.append(image)
            names.append(name)
        bar.update(len(batch))
    bar.close()
    seconds = time.perf_counter() - start

    atomic_save_image(make_grid(images, columns=args.num_images if args.num_images > 1 else 8), out / "grid.png")
    summary = {
        "family": args.family, "method": args.method, "method_kwargs": options["method_kwargs"],
        "model": args.model or "embedded default", "seed": args.seed, "classes": classes,
        "images_per_class": args.num_images, "num_images": len(labels), "batch_size": args.batch_size,
        "sampling": {k: options[k] for k in ("guidance_scale", "temperature", "top_k", "top_p")},
        "wall_time": seconds, "images_per_second": len(labels) / seconds, "files": names,
        "stats": stats.to_dict(),
    }
    atomic_write_text(json.dumps(summary, indent=2), out / "stats.json")
    s = stats
    print(f"wrote {len(labels)} images to {out / 'images'} ({len(labels) / seconds:.2f} img/s), grid.png, stats.json; "
          f"target forwards {s.num_target_forwards}, mean acceptance length {s.mean_acceptance_length:.2f}")
    return 0

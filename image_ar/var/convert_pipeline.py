"""`mmspec convert var`: official VAR files -> a pipeline folder (`VARPipeline`, or `CoDePipeline` with --small).

    mmspec convert var --transformer var_d30.pth --vqvae vae_ch160v4096z32.pth --out var-d30
    mmspec convert var --transformer var_d30.pth --small var_d16.pth --vqvae vae_ch160v4096z32.pth --out code-d30-d16

Loading is safe by default (weights-only torch.load); configs are inferred from the files (official 10-scale
schedule unless --patch-nums is given). With --small the folder is a training-free CoDe pipeline: the large
model drafts, the small one refines, both on the shared VQVAE.
"""

from __future__ import annotations

import argparse

from image_ar.var.code import CoDePipeline
from image_ar.var.convert import load_var_transformer
from image_ar.var.convert_vqvae import load_var_vqvae
from image_ar.var.pipeline import VARPipeline
from mmspec.data.artifacts import atomic_output_dir
from mmspec.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transformer", required=True, help="official var_d*.pth (the large model with --small)")
    parser.add_argument("--vqvae", required=True, help="official vae_ch160v4096z32.pth")
    parser.add_argument("--small", default=None, help="a smaller official var_d*.pth: write a CoDe pipeline")
    parser.add_argument("--patch-nums", default=None,
                        help="comma-separated scale schedule for non-official models (default 1,2,3,4,5,6,8,10,13,16)")
    parser.add_argument("--out", required=True, help="pipeline folder to write")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read checkpoints with full pickle (runs code from them: only for files you trust)")


def _patch_nums(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        return {"patch_nums": tuple(int(p) for p in text.split(","))}
    except ValueError:
        raise InputError(f"--patch-nums must be comma-separated integers, got {text!r}.") from None


def run(args: argparse.Namespace) -> int:
    schedule = _patch_nums(args.patch_nums)
    large = load_var_transformer(args.transformer, allow_pickle=args.allow_pickle, **schedule)
    vqvae = load_var_vqvae(args.vqvae, allow_pickle=args.allow_pickle, **schedule)
    if args.small:
        small = load_var_transformer(args.small, allow_pickle=args.allow_pickle, **schedule)
        pipe = CoDePipeline(drafter=large, refiner=small, vqvae=vqvae)
    else:
        pipe = VARPipeline(transformer=large, vqvae=vqvae)
    with atomic_output_dir(args.out) as tmp:
        pipe.save_pretrained(tmp)
    print(f"wrote {args.out} ({type(pipe).__name__})")
    return 0

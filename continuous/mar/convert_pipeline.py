"""`mmspec convert mar`: official MAR files -> a pipeline folder (`MARPipeline`, or `CSpDPipeline` with --draft).

    mmspec convert mar --target mar_huge/checkpoint-last.pth --vae kl16.ckpt --out mar-h
    mmspec convert mar --target mar_huge/checkpoint-last.pth --draft mar_base/checkpoint-last.pth --vae kl16.ckpt \
        --out cspd-h-b

Loading is safe by default (weights-only torch.load with `argparse.Namespace` allow-listed for the files' 'args';
--allow-pickle opts in to full pickle for trusted files). The EMA weights are used unless --weights model; configs
are read from the weights and the files' training args (`continuous.mar.convert`, `continuous.mar.convert_vae`).
With --draft the folder is a CSpD pipeline: the smaller MAR drafts, the target verifies, both on the VAE.
"""

from __future__ import annotations

import argparse

from continuous.mar.convert import WEIGHTS, load_mar_checkpoint
from continuous.mar.convert_vae import load_kl16_vae
from continuous.mar.cspd import CSpDPipeline
from continuous.mar.pipeline import MARPipeline
from mmspec.data.artifacts import atomic_output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="official MAR checkpoint-last.pth (the target with --draft)")
    parser.add_argument("--vae", required=True, help="official kl16.ckpt (LDM-layout KL VAE)")
    parser.add_argument("--draft", default=None, help="a smaller MAR's checkpoint-last.pth: write a CSpD pipeline")
    parser.add_argument("--weights", choices=sorted(WEIGHTS), default="ema",
                        help="which weights of the MAR files: 'ema' (model_ema, the official sampler's) or 'model'")
    parser.add_argument("--num-heads", type=int, default=None,
                        help="the target's attention heads, for non-official widths without an official args.model")
    parser.add_argument("--draft-num-heads", type=int, default=None, help="the same for the draft")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load the files with full pickle (runs code from them: only for files you trust)")
    parser.add_argument("--out", required=True, help="pipeline folder to write")


def _heads(value: int | None) -> dict:
    return {} if value is None else {"num_heads": value}


def run(args: argparse.Namespace) -> int:
    target = load_mar_checkpoint(args.target, weights=args.weights, allow_pickle=args.allow_pickle,
                                 **_heads(args.num_heads))
    vae = load_kl16_vae(args.vae, allow_pickle=args.allow_pickle, sample_size=target.config.img_size)
    if args.draft:
        draft = load_mar_checkpoint(args.draft, weights=args.weights, allow_pickle=args.allow_pickle,
                                    **_heads(args.draft_num_heads))
        pipe = CSpDPipeline(target=target, draft=draft, vae=vae)
    else:
        pipe = MARPipeline(transformer=target, vae=vae)
    with atomic_output_dir(args.out) as tmp:
        pipe.save_pretrained(tmp)
    print(f"wrote {args.out} ({type(pipe).__name__})")
    return 0

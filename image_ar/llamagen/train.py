"""`mmspec train llamagen`: make the embedded LlamaGen default from the procedural world, on a CPU, in stages.

    mmspec train llamagen --out assets/llamagen

Stages (each saved atomically; a rerun skips finished stages unless --force):
1. `vq`: a LlamaGen VQ tokenizer (4x downsampling: a 32x32 world image is 8x8 = 64 tokens) trained on fresh world
   images every step (object-weighted L2 + L1 + gradient reconstruction, codebook and commitment losses); or
   `--vq-from FOLDER`, a trained one saved as it is (the tokenizer is convolutional: any image size it downsamples).
2. `target`: a class-conditional LlamaGen GPT on the VQ tokens of world images (labels dropped 10% for CFG).
3. `draft`: a smaller LlamaGen with the same tokenizer, for speculative decoding.
4. `eval`: writes the pipeline folder (`model_index.json`) and the card (README.md) with the commands, seeds,
   times, and quality measured by the world judge at the pipeline's default sampling settings.

`--image-size 64` makes the same world at 64x64 pixels: 16x16 = 256 tokens an image (the GPTs' block size), e.g.
to measure a method on longer token sequences with the embedded tokenizer:

    mmspec train llamagen --out runs/llamagen-64 --image-size 64 --vq-from assets/llamagen/vqvae --stages vq,target,eval
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.llamagen.vq import LlamaGenVQ
from image_ar.llamagen.vq_train import VQLossWeights, vq_loss
from mmspec.data import IMAGE_SIZES, NUM_CLASSES
from mmspec.data.artifacts import explicit_command
from mmspec.errors import check
from mmspec.model_card import with_metadata
from mmspec.world_training import (
    IMAGE_SIZE,
    add_recon_eval_argument,
    add_runtime_arguments,
    add_staged_arguments,
    cached_tensors,
    judge_card_line,
    judge_generation,
    object_weights,
    open_training,
    optimizer_step,
    recon_card_line,
    size_tag,
    world_images,
)

STAGES = ("vq", "target", "draft", "eval")
WORLD_VQ = dict(codebook_size=512, codebook_embed_dim=8, encoder_ch_mult=(1, 2, 2), decoder_ch_mult=(1, 2, 2),
                z_channels=64, ch=32, num_res_blocks=1, norm_num_groups=8, entropy_loss_ratio=0.0)
WORLD_GPT_COMMON = dict(num_classes=NUM_CLASSES, class_dropout_prob=0.1, multiple_of=32,
                        token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
WORLD_GPT = {"target": dict(dim=192, n_layer=8, n_head=6), "draft": dict(dim=96, n_layer=3, n_head=3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_staged_arguments(parser, "llamagen", STAGES, "scratch folder (token cache)")
    parser.add_argument("--image-size", type=int, choices=IMAGE_SIZES, default=IMAGE_SIZE,
                        help="world image side in pixels (default 32: 8x8 = 64 tokens an image; 64: 16x16 = 256)")
    parser.add_argument("--vq-from", default=None, metavar="FOLDER",
                        help="copy this trained LlamaGen VQ tokenizer folder (e.g. assets/llamagen/vqvae) instead "
                             "of training one in the 'vq' stage")
    parser.add_argument("--vq-steps", type=int, default=1500)
    parser.add_argument("--object-weight", type=float, default=10.0,
                        help="extra weight of high-contrast (object) pixels in the VQ's L2 loss; small shapes are a "
                             "few percent of the pixels and get blurred into blobs without it")
    parser.add_argument("--vq-batch-size", type=int, default=64)
    parser.add_argument("--vq-lr", type=float, default=1e-3)
    parser.add_argument("--num-train-images", type=int, default=100_000, help="world images tokenized for the GPTs")
    parser.add_argument("--target-steps", type=int, default=3500)
    parser.add_argument("--draft-steps", type=int, default=3000)
    parser.add_argument("--gpt-batch-size", type=int, default=64)
    parser.add_argument("--gpt-lr", type=float, default=1e-3)
    parser.add_argument("--eval-images-per-class", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the GPT training step")
    add_recon_eval_argument(parser, "VQ tokenizer")
    add_runtime_arguments(parser)


# ------------------------------------------------------------------------------------------------------ VQ
def train_vq(steps: int, batch_size: int, lr: float, seed: int, quiet: bool,
             object_weight: float = 10.0, image_size: int = IMAGE_SIZE) -> tuple[LlamaGenVQ, dict]:
    torch.manual_seed(seed)
    model = LlamaGenVQ(**WORLD_VQ).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    weights = VQLossWeights(l2=0.0, l1=1.0, gradient=1.0, quantizer=1.0)  # L2 is object-weighted below
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="vq", disable=quiet)
    for step in bar:
        images, _ = world_images(batch_size, seed, "train", start=step * batch_size, image_size=image_size)
        out = model(images)
        loss, logs = vq_loss(out, images, weights)
        loss = loss + (object_weights(images, object_weight) * (out.sample - images) ** 2).mean()
        optimizer_step(opt, loss, step, steps, lr)
        if step % 50 == 0:
            bar.set_postfix(l2=f"{float(logs['l2']):.4f}", commit=f"{float(logs['commit_loss']):.4f}")
    return model.eval(), {"steps": steps, "batch_size": batch_size, "lr": lr, "object_weight": object_weight,
                          "seconds": time.perf_counter() - start}


@torch.no_grad()
def tokenize(vq: LlamaGenVQ, n: int, seed: int, split: str = "train", chunk: int = 500,
             image_size: int = IMAGE_SIZE) -> tuple[torch.Tensor, ...]:
    """VQ token ids [n, (image_size / 4)^2] (int16) and labels [n] of n world images."""
    ids, labels = [], []
    for start in range(0, n, chunk):
        images, lab = world_images(min(chunk, n - start), seed, split, start=start, image_size=image_size)
        ids.append(vq.quantize_ids(images).short())
        labels.append(lab)
    return torch.cat(ids), torch.cat(labels)


@torch.no_grad()
def evaluate_vq(vq: LlamaGenVQ, n: int, seed: int, image_size: int = IMAGE_SIZE) -> dict:
    from mmspec.metrics import class_accuracy, world_fid

    images, labels = world_images(n, seed, "test", image_size=image_size)
    ids = vq.quantize_ids(images)
    recon = ((vq.decode_code(ids) + 1) / 2).clamp(0, 1)
    real = (images + 1) / 2
    return {"n": n, "mse": float(((recon - real) ** 2).mean()), "codes_used": int(ids.unique().numel()),
            "judge_accuracy_recon": class_accuracy(recon, labels), "judge_accuracy_real": class_accuracy(real, labels),
            "world_fid_recon": world_fid(recon, real).fid}


# ----------------------------------------------------------------------------------------------------- GPT
def world_gpt(kind: str, vocab_size: int, block_size: int = 64) -> LlamaGenGPT:
    return LlamaGenGPT(vocab_size=vocab_size, block_size=block_size, **WORLD_GPT_COMMON, **WORLD_GPT[kind])


def train_gpt(kind: str, ids: torch.Tensor, labels: torch.Tensor, vocab_size: int, steps: int, batch_size: int,
              lr: float, seed: int, quiet: bool, compile_step: bool = True) -> tuple[LlamaGenGPT, dict]:
    torch.manual_seed(seed)
    model = world_gpt(kind, vocab_size, ids.shape[1]).train()  # block size: the images' token count
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)

    def loss_of(idx: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return model(idx, cond, targets=idx).loss

    # compiling the forward + loss roughly halves a CPU step (fused RMSNorm, RoPE and SwiGLU elementwise work)
    forward = torch.compile(loss_of) if compile_step else loss_of
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=kind, disable=quiet)
    for step in bar:
        rows = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        idx = ids[rows].long()  # [B, T]
        loss = forward(idx, labels[rows])
        optimizer_step(opt, loss, step, steps, lr)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "final_loss": loss.item(),
            "seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters())}
    return model.eval(), info


def evaluate_pipeline(pipe: LlamaGenPipeline, per_class: int, seed: int, use_draft: bool = False) -> dict:
    """Judge accuracy and world-FID of images generated at the pipeline's default sampling settings."""
    if use_draft:  # judge the draft model alone, as a target
        pipe = LlamaGenPipeline(transformer=pipe.draft_transformer, vqvae=pipe.vqvae)
    pipe.set_progress_bar_config(disable=True)
    return judge_generation(lambda labels, gens: pipe(class_labels=labels, generator=gens, output_type="pt").images,
                            per_class, seed)


# ----------------------------------------------------------------------------------------------------- run
def _card(command: str, info: dict, pipe: LlamaGenPipeline) -> str:
    vq, tgt, dr = info.get("vq", {}), info.get("target", {}), info.get("draft", {})
    ev, size, tokens = info.get("eval", {}), pipe.image_size(), pipe.transformer.config.block_size
    vq_training = (f"copied from {vq['copied_from']}" if "copied_from" in vq else
                   f"{vq.get('steps')} steps x {vq.get('batch_size')} images | {vq.get('seconds', 0):.0f} s")
    lines = [
        "# Embedded LlamaGen default (world)",
        "",
        "A class-conditional LlamaGen (GPT + VQ tokenizer) trained on mmspec's procedural world (16 classes: 4 shapes",
        f"x 4 colours, {size}x{size} images, {tokens} VQ tokens each), plus a small draft LlamaGen sharing "
        "the tokenizer. Made by:",
        "",
        f"    {command}",
        "",
        f"Machine: {info.get('machine', '')}.",
        "",
        "| component | architecture | training | time |",
        "|---|---|---|---|",
        f"| vqvae | LlamaGenVQ {json.dumps(WORLD_VQ)} | {vq_training} |",
        f"| transformer | LlamaGen GPT {json.dumps(WORLD_GPT['target'])}, "
        f"{tgt.get('parameters', 0) / 1e6:.2f}M params | "
        f"{tgt.get('steps')} steps x {tgt.get('batch_size')}, final loss {tgt.get('final_loss', 0):.3f} | "
        f"{tgt.get('seconds', 0):.0f} s |",
        f"| draft_transformer | LlamaGen GPT {json.dumps(WORLD_GPT['draft'])}, {dr.get('parameters', 0) / 1e6:.2f}M "
        f"params | {dr.get('steps')} steps x {dr.get('batch_size')}, final loss {dr.get('final_loss', 0):.3f} | "
        f"{dr.get('seconds', 0):.0f} s |",
        "",
        "## Quality (world judge)",
        "",
    ]
    if "recon" in info:
        lines.append(recon_card_line("VQ", info["recon"], WORLD_VQ["codebook_size"]))
    for key, name in (("target", "transformer, vanilla decoding"), ("draft", "draft_transformer, vanilla decoding")):
        if key in ev:
            lines.append(judge_card_line(name, ev[key]))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.vq_from is not None:
        check((Path(args.vq_from) / "config.json").is_file(),
              f"--vq-from {args.vq_from} holds no config.json; pass a LlamaGen VQ folder, e.g. assets/llamagen/vqvae.")
    stages, folder, work = open_training(args, STAGES)
    check(args.vq_from is None or "vq" in stages, "--vq-from gives the 'vq' stage its tokenizer: add vq to --stages.")
    out, info = folder.out, folder.info

    size = args.image_size
    if "vq" in stages and not folder.done("vqvae"):
        if args.vq_from is not None:
            vq, info["vq"] = LlamaGenVQ.from_pretrained(args.vq_from).eval(), {"copied_from": str(args.vq_from)}
        else:
            vq, info["vq"] = train_vq(args.vq_steps, args.vq_batch_size, args.vq_lr, args.seed, args.quiet,
                                      args.object_weight, size)
        folder.save(vq, "vqvae")
        info["vq"]["image_size"] = size
        info["recon"] = evaluate_vq(vq, args.recon_eval_images, args.seed, size)
        folder.record()
    check((out / "vqvae" / "config.json").is_file(), f"no VQ tokenizer in {out}/vqvae: run the 'vq' stage first.")
    vq = LlamaGenVQ.from_pretrained(out / "vqvae").eval()

    cache, data = work / f"tokens-{args.num_train_images}-seed{args.seed}{size_tag(size)}.pt", None
    for kind, component, steps in (("target", "transformer", args.target_steps),
                                   ("draft", "draft_transformer", args.draft_steps)):
        if kind not in stages or folder.done(component):
            continue
        data = data or cached_tensors(cache, args.force, lambda: dict(zip(
            ("ids", "labels"), tokenize(vq, args.num_train_images, args.seed, image_size=size))))
        model, info[kind] = train_gpt(kind, data["ids"], data["labels"], vq.config.codebook_size, steps,
                                      args.gpt_batch_size, args.gpt_lr, args.seed, args.quiet, not args.no_compile)
        folder.save(model, component)
        folder.record()

    if "eval" in stages:
        pipe = LlamaGenPipeline.from_pretrained(out) if (out / "model_index.json").is_file() else None
        if pipe is None or args.force:
            draft = None
            if (out / "draft_transformer" / "config.json").is_file():
                draft = LlamaGenGPT.from_pretrained(out / "draft_transformer")
            pipe = LlamaGenPipeline(transformer=LlamaGenGPT.from_pretrained(out / "transformer"), vqvae=vq,
                                    draft_transformer=draft)
            pipe.save_pretrained(out)
        info["eval"] = {"target": evaluate_pipeline(pipe, args.eval_images_per_class, args.seed)}
        if pipe.draft_transformer is not None:
            info["eval"]["draft"] = evaluate_pipeline(pipe, args.eval_images_per_class, args.seed, use_draft=True)
        folder.record()
        command = explicit_command("mmspec train llamagen", args, [
            "out", "seed", "image_size", "vq_from", "vq_steps", "vq_batch_size", "vq_lr", "object_weight",
            "recon_eval_images", "num_train_images", "target_steps", "draft_steps", "gpt_batch_size", "gpt_lr",
            "eval_images_per_class", "threads"])
        card_text = with_metadata(
            _card(command, info, pipe),
            pipeline_tag="unconditional-image-generation", tags=["llamagen", "class-conditional", "world"])
        (out / "README.md").write_text(card_text)
        print(json.dumps(info.get("eval", {}), indent=2))
    print(f"wrote {out}")
    return 0


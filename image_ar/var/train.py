"""`mmspec train var`: make the embedded VAR default (a multi-scale VQVAE, a large and a small VAR) from the
procedural world, on a CPU, in stages.

    mmspec train var --out assets/var

Stages (each saved atomically; a rerun skips finished stages unless --force):
1. `vqvae`: a multi-scale VQVAE (4x downsampling: a 32x32 world image is an 8x8 feature map, quantised on the
   scales WORLD_PATCH_NUMS = 1, 2, 3, 4, 5, 6, 8 = 155 tokens) trained on fresh world images every step
   (object-weighted L2 + L1 + edge reconstruction, the official VQ loss).
2. `large`: the large VAR (CoDe's drafter) on the code pyramids of world images (labels dropped 10% for CFG;
   cross-entropy over every position of every scale, uniform weights as the official trainer).
3. `small`: the small VAR (CoDe's refiner), trained the same way, independently (CoDe's training-free mode).
4. `eval`: writes the pipeline folder (`CoDePipeline`: drafter = large, refiner = small, vqvae) and the card with
   the commands, times and the world judge's verdict on the large model, the small one and CoDe at its default
   split, all at the pipelines' default sampling settings.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from image_ar.var.code import CoDePipeline, default_draft_steps
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.data import NUM_CLASSES
from mmspec.data.artifacts import explicit_command
from mmspec.errors import check
from mmspec.model_card import with_metadata
from mmspec.world_training import (
    add_recon_eval_argument,
    add_runtime_arguments,
    add_staged_arguments,
    cached_tensors,
    card_head,
    drop_labels,
    gradient_loss,
    judge_card_line,
    judge_generation,
    object_weights,
    open_training,
    optimizer_step,
    recon_card_line,
    world_images,
)

STAGES = ("vqvae", "large", "small", "eval")
WORLD_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8)
WORLD_VQVAE = dict(vocab_size=512, z_channels=16, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, norm_num_groups=8,
                   patch_nums=WORLD_PATCH_NUMS)
WORLD_VAR_COMMON = dict(vocab_size=512, cvae=16, num_classes=NUM_CLASSES, cond_drop_rate=0.1,
                        patch_nums=WORLD_PATCH_NUMS)
# drop-path 0.1 d / 24 as the official models
WORLD_VAR = {"large": dict(depth=6, embed_dim=192, num_heads=6, drop_path_rate=0.025),
             "small": dict(depth=3, embed_dim=96, num_heads=4, drop_path_rate=0.0125)}
COMPONENT = {"large": "drafter", "small": "refiner"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_staged_arguments(parser, "var", STAGES, "scratch folder (code-pyramid cache)")
    parser.add_argument("--vqvae-steps", type=int, default=1500)
    parser.add_argument("--vqvae-batch-size", type=int, default=64)
    parser.add_argument("--vqvae-lr", type=float, default=1e-3)
    parser.add_argument("--restart-every", type=int, default=100,
                        help="move unused codes onto residual vectors every N VQVAE steps (first 80%% of the steps; "
                             "0 = never); without it most of the codebook stays unused")
    parser.add_argument("--object-weight", type=float, default=10.0,
                        help="extra weight of high-contrast (object) pixels in the VQVAE's L2 loss")
    parser.add_argument("--num-train-images", type=int, default=50_000, help="world images encoded for the VARs")
    parser.add_argument("--large-steps", type=int, default=3000)
    parser.add_argument("--small-steps", type=int, default=3000)
    parser.add_argument("--var-batch-size", type=int, default=32)
    parser.add_argument("--var-lr", type=float, default=1e-3)
    parser.add_argument("--eval-images-per-class", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the VAR training step")
    add_recon_eval_argument(parser, "VQVAE")
    add_runtime_arguments(parser)


# --------------------------------------------------------------------------------------------------- VQVAE
def train_vqvae(steps: int, batch_size: int, lr: float, seed: int, quiet: bool,
                object_weight: float = 10.0, restart_every: int = 100) -> tuple[VARVQVAE, dict]:
    torch.manual_seed(seed)
    model = VARVQVAE(**WORLD_VQVAE).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    restarted = 0
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="vqvae", disable=quiet)
    for step in bar:
        images, _ = world_images(batch_size, seed, "train", start=step * batch_size)  # [B, 3, 32, 32]
        recon, quant_loss = model(images)
        l1 = (recon - images).abs().mean()
        l2 = (object_weights(images, object_weight) * (recon - images) ** 2).mean()
        loss = l2 + l1 + gradient_loss(recon, images) + quant_loss
        optimizer_step(opt, loss, step, steps, lr)
        if restart_every and step % restart_every == restart_every - 1 and step < 0.8 * steps:
            probe, _ = world_images(4 * batch_size, seed + 1, "train", start=step * 4 * batch_size)
            with torch.no_grad():
                restarted += model.quantize.restart_dead_codes(model.features(probe), gen)
        if step % 50 == 0:
            bar.set_postfix(l1=f"{l1.item():.4f}", vq=f"{quant_loss.item():.4f}", restarted=restarted)
    return model.eval(), {"steps": steps, "batch_size": batch_size, "lr": lr, "object_weight": object_weight,
                          "restart_every": restart_every, "codes_restarted": restarted,
                          "seconds": time.perf_counter() - start}


@torch.no_grad()
def encode_world(vqvae: VARVQVAE, n: int, seed: int, split: str = "train",
                 chunk: int = 500) -> tuple[torch.Tensor, ...]:
    """Code pyramids of n world images, flattened scale after scale: [n, L] (int16), and labels [n]."""
    codes, labels = [], []
    for start in range(0, n, chunk):
        images, lab = world_images(min(chunk, n - start), seed, split, start=start)
        codes.append(torch.cat(vqvae.encode(images), 1).short())
        labels.append(lab)
    return torch.cat(codes), torch.cat(labels)


@torch.no_grad()
def evaluate_vqvae(vqvae: VARVQVAE, n: int, seed: int) -> dict:
    from mmspec.metrics import class_accuracy, world_fid

    images, labels = world_images(n, seed, "test")
    pyramid = vqvae.encode(images)
    recon = ((vqvae.decode(pyramid) + 1) / 2).clamp(0, 1)
    real = (images + 1) / 2
    return {"n": n, "mse": float(((recon - real) ** 2).mean()),
            "codes_used": int(torch.cat(pyramid, 1).unique().numel()),
            "judge_accuracy_recon": class_accuracy(recon, labels), "judge_accuracy_real": class_accuracy(real, labels),
            "world_fid_recon": world_fid(recon, real).fid}


# ----------------------------------------------------------------------------------------------------- VAR
def world_var(kind: str) -> VARTransformer:
    return VARTransformer(**WORLD_VAR_COMMON, **WORLD_VAR[kind])


def cross_entropy_loss(model: VARTransformer, code: torch.Tensor, labels: torch.Tensor,
                       inputs: torch.Tensor) -> torch.Tensor:
    """Next-scale cross-entropy over every position of every scale (uniform weights, as the official trainer)."""
    logits = model(labels, inputs, drop_condition=False)  # [B, L, V]
    return F.cross_entropy(logits.flatten(0, 1), code.flatten())


def fit_var(model: VARTransformer, codes: torch.Tensor, labels: torch.Tensor, vqvae: VARVQVAE, steps: int,
            batch_size: int, lr: float, seed: int, quiet: bool, desc: str, loss=cross_entropy_loss,
            compile_step: bool = True) -> tuple[VARTransformer, dict]:
    """Teacher-forced training of `model` on code pyramids codes [N, L] with labels [N]: the inputs of scales 1..
    come from the image's own pyramid; labels dropped to the null class at the model's cond_drop_rate;
    loss(model, code [B, L], labels [B], inputs [B, L - 1, Cvae]) -> scalar."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    bounds, null = model.bounds, model.config.num_classes
    forward = torch.compile(loss) if compile_step else loss
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, disable=quiet)
    for step in bar:
        rows = torch.randint(0, codes.shape[0], (batch_size,), generator=gen)
        code = codes[rows].long()  # [B, L]
        with torch.no_grad():
            inputs = vqvae.quantize.teacher_inputs([code[:, b:e] for b, e in bounds])  # [B, L - 1, Cvae]
        label = drop_labels(labels[rows], model.config.cond_drop_rate, null, gen)
        value = forward(model, code, label, inputs)
        optimizer_step(opt, value, step, steps, lr)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{value.item():.3f}")
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "final_loss": value.item(),
            "seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters())}
    return model.eval(), info


def train_var(kind: str, codes: torch.Tensor, labels: torch.Tensor, vqvae: VARVQVAE, steps: int, batch_size: int,
              lr: float, seed: int, quiet: bool, compile_step: bool = True) -> tuple[VARTransformer, dict]:
    """A fresh world VAR of `kind` (large / small) trained with next-scale cross-entropy."""
    torch.manual_seed(seed)
    return fit_var(world_var(kind), codes, labels, vqvae, steps, batch_size, lr, seed, quiet, kind,
                   compile_step=compile_step)


def evaluate(pipe: CoDePipeline, which: str, per_class: int, seed: int, draft_steps: int | None = None) -> dict:
    """Judge accuracy and world-FID at the pipelines' default sampling settings; which: large, small or code (at
    `draft_steps`, default the pipeline's default split)."""
    call = pipe if which == "code" else pipe.as_var_pipeline(COMPONENT[which])
    call.set_progress_bar_config(disable=True)
    split = {"draft_steps": draft_steps} if which == "code" else {}
    return judge_generation(lambda labels, gens: call(class_labels=labels, generator=gens, output_type="pt",
                                                      **split).images, per_class, seed)


# ----------------------------------------------------------------------------------------------------- run
def _card(command: str, info: dict) -> str:
    vq, ev = info.get("vqvae", {}), info.get("eval", {})
    n_scales = len(WORLD_PATCH_NUMS)
    lines = card_head("Embedded VAR default (world)", [
        "A multi-scale VQVAE and two class-conditional VAR transformers trained independently on mmspec's procedural",
        f"world (16 classes, 32x32 images, scales {WORLD_PATCH_NUMS} = 155 tokens): the large one is CoDe's drafter,",
        "the small one its refiner (training-free CoDe). `CoDePipeline.from_pretrained(folder)` loads all three;",
        "`.as_var_pipeline('drafter')` is the large model alone (vanilla VAR). Made by:"], command,
        info.get("machine", ""))
    lines.append(f"| vqvae | VARVQVAE {json.dumps(WORLD_VQVAE)} | {vq.get('steps')} steps x {vq.get('batch_size')} "
                 f"images | {vq.get('seconds', 0):.0f} s |")
    for kind in ("large", "small"):
        t = info.get(kind, {})
        lines.append(f"| {COMPONENT[kind]} ({kind}) | VARTransformer {json.dumps(WORLD_VAR[kind])}, "
                     f"{t.get('parameters', 0) / 1e6:.2f}M params | {t.get('steps')} steps x {t.get('batch_size')}, "
                     f"final loss {t.get('final_loss', 0):.3f} | {t.get('seconds', 0):.0f} s |")
    lines += ["", "## Quality (world judge)", ""]
    if "recon" in info:
        lines.append(recon_card_line("VQVAE", info["recon"], WORLD_VQVAE["vocab_size"]))
    names = {"large": "large VAR alone", "small": "small VAR alone",
             "code": f"CoDe, draft_steps {default_draft_steps(n_scales)} (default)"}
    for key, name in names.items():
        if key in ev:
            lines.append(judge_card_line(name, ev[key]))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    stages, folder, work = open_training(args, STAGES)
    out, info = folder.out, folder.info

    if "vqvae" in stages and not folder.done("vqvae"):
        vqvae, info["vqvae"] = train_vqvae(args.vqvae_steps, args.vqvae_batch_size, args.vqvae_lr, args.seed,
                                           args.quiet, args.object_weight, args.restart_every)
        folder.save(vqvae, "vqvae")
        info["recon"] = evaluate_vqvae(vqvae, args.recon_eval_images, args.seed)
        folder.record()
    check((out / "vqvae" / "config.json").is_file(), f"no VQVAE in {out}/vqvae: run the 'vqvae' stage first.")
    vqvae = VARVQVAE.from_pretrained(out / "vqvae").eval().requires_grad_(False)

    cache, data = work / f"codes-{args.num_train_images}-seed{args.seed}.pt", None
    for kind, steps in (("large", args.large_steps), ("small", args.small_steps)):
        if kind not in stages or folder.done(COMPONENT[kind]):
            continue
        data = data or cached_tensors(cache, args.force, lambda: dict(zip(
            ("codes", "labels"), encode_world(vqvae, args.num_train_images, args.seed))))
        model, info[kind] = train_var(kind, data["codes"], data["labels"], vqvae, steps, args.var_batch_size,
                                      args.var_lr, args.seed, args.quiet, not args.no_compile)
        folder.save(model, COMPONENT[kind])
        folder.record()

    if "eval" in stages:
        pipe = CoDePipeline(drafter=VARTransformer.from_pretrained(out / "drafter"),
                            refiner=VARTransformer.from_pretrained(out / "refiner"), vqvae=vqvae)
        pipe.save_pretrained(out)
        info["eval"] = {key: evaluate(pipe, key, args.eval_images_per_class, args.seed)
                        for key in ("large", "small", "code")}
        folder.record()
        command = explicit_command("mmspec train var", args, [
            "out", "seed", "vqvae_steps", "vqvae_batch_size", "vqvae_lr", "restart_every", "object_weight",
            "recon_eval_images", "num_train_images",
            "large_steps", "small_steps", "var_batch_size", "var_lr", "eval_images_per_class", "threads"])
        card_text = with_metadata(
            _card(command, info),
            pipeline_tag="unconditional-image-generation", tags=["var", "class-conditional", "world"])
        (out / "README.md").write_text(card_text)
        print(json.dumps(info["eval"], indent=2))
    print(f"wrote {out}")
    return 0


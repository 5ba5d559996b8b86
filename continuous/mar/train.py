"""`mmspec train mar`: make the embedded MAR default (a KL VAE, a target MAR and a smaller draft MAR for CSpD) from
the procedural world, in stages, on a CPU (or the MAR stages on a GPU: `--device cuda`).

    mmspec train mar --out assets/mar

Stages (each saved atomically; a rerun skips finished stages unless --force):
1. `vae`: a diffusers `AutoencoderKL` (32 x 32 -> 8 x 8 x 16) trained on fresh world images (object-weighted L2 +
   L1 + edge reconstruction + a small KL term); its `scaling_factor` is then set to 1 / std of the latents (the
   role of the official 0.2325).
2. `target`: the target MAR on VAE posterior samples of world images (MAR's masking-rate distribution, random
   orders, labels dropped 10% for CFG, diffusion loss on the masked tokens x diffusion_batch_mul, AdamW,
   EMA weights saved, as the official trainer).
3. `draft`: the draft MAR, trained the same way, independently.
4. `eval`: writes the pipeline folder (`CSpDPipeline`: target, draft, vae) and the card with the commands, times
   and the world judge's verdict on the target and the draft alone (vanilla MAR at the pipeline defaults).

The world models sample with `timestep_spacing="leading"` (top step t = 990) instead of the official "linspace"
(top step t = 999): with the cosine schedule the official first step multiplies the eps error by ~316, and the
world target's eps error there (MSE 2.9e-4 after 4000 steps) blew its samples up (token std 73 instead of 0.98);
from t = 990 they match the data (std 0.98). Measured on the trained target; see docs/mar.md. The world recipe
also departs from the official one in two measured ways (docs/mar.md): MaskGIT's cosine masking rates
(`--mask-rates cosine`, default here) and position embeddings started from a 2D sin-cos table
(`pos_embed_init="sincos"`); and the world models sample with the official code's constant CFG schedule at
scale 2.0 by default (`default_cfg_schedule`, `default_guidance_scale`): measured on the world target, judge accuracy
0.801 -> 0.881 over 512 images against the linear schedule at 3.0 (docs/mar.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from continuous.mar.model import MARModel, cosine_mask_rate
from continuous.mar.vae import world_vae
from mmspec.data import NUM_CLASSES
from mmspec.data.artifacts import explicit_command
from mmspec.errors import check, check_device, check_positive_int
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
    world_images,
)

STAGES = ("vae", "target", "draft", "eval")
WORLD_MAR_COMMON = dict(img_size=32, vae_stride=4, patch_size=1, vae_embed_dim=16, num_classes=NUM_CLASSES,
                        buffer_size=16, label_drop_prob=0.1, mask_ratio_min=0.7, attn_dropout=0.0,
                        proj_dropout=0.0, num_sampling_steps=100, diffusion_batch_mul=4, timestep_spacing="leading",
                        pos_embed_init="sincos", default_guidance_scale=2.0, default_cfg_schedule="constant")
# set on the saved models by the eval stage (sampling settings, not weights: older folders get them too)
WORLD_SAMPLING = ("timestep_spacing", "default_guidance_scale", "default_cfg_schedule")
WORLD_MAR = {"target": dict(embed_dim=128, num_heads=4, encoder_depth=3, decoder_depth=3, diffloss_d=3,
                            diffloss_w=192),
             "draft": dict(embed_dim=64, num_heads=4, encoder_depth=2, decoder_depth=2, diffloss_d=2,
                           diffloss_w=128)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_staged_arguments(parser, "mar", STAGES, "scratch folder (latent cache, resumable training states)")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--vae-batch-size", type=int, default=64)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-5, help="weight of the per-element KL term")
    parser.add_argument("--object-weight", type=float, default=10.0,
                        help="extra weight of high-contrast (object) pixels in the VAE's L2 loss")
    parser.add_argument("--vae-scale-images", type=int, default=2000,
                        help="world images whose latents' spread sets the VAE's scaling factor")
    add_recon_eval_argument(parser, "VAE")
    parser.add_argument("--num-train-images", type=int, default=30_000, help="world images encoded for the MARs")
    parser.add_argument("--target-steps", type=int, default=3500)
    parser.add_argument("--draft-steps", type=int, default=3000)
    parser.add_argument("--mar-batch-size", type=int, default=32)
    parser.add_argument("--mar-lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.999, help="EMA rate of the saved MAR weights")
    parser.add_argument("--mask-rates", choices=("official", "cosine"), default="cosine",
                        help="masking-rate distribution of MAR training: official (truncated normal on [0.7, 1]) or "
                             "cosine (cos(pi/2 u), covers the context-rich late generation steps)")
    parser.add_argument("--checkpoint-every", type=int, default=500,
                        help="save a resumable training state in --work-dir every N MAR steps (0 = never)")
    parser.add_argument("--init-target", default=None,
                        help="warm-start the target from this MAR folder (e.g. OUT/target) and retrain it for "
                             "--target-steps more steps")
    parser.add_argument("--target-arch", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field of the target's architecture (repeatable; integer fields of "
                             f"{sorted(WORLD_MAR['target'])}), e.g. --target-arch embed_dim=192")
    parser.add_argument("--eval-images-per-class", type=int, default=16)
    parser.add_argument("--eval-sampling-steps", type=int, default=100,
                        help="diffusion steps per token of the eval stage's images (100: the models' own default; "
                             "fewer for a quick check)")
    parser.add_argument("--eval-num-iter", type=int, default=None,
                        help="MAR steps of the eval stage's images (default the token count: one token a step; "
                             "fewer for a quick check)")
    parser.add_argument("--device", default="cpu",
                        help="device of the MAR training and the eval stage (cpu or cuda; the VAE trains on CPU)")
    add_runtime_arguments(parser)


def parse_arch(pairs: list[str], kind: str = "target") -> dict[str, int]:
    """`--target-arch KEY=VALUE` pairs -> the world architecture of `kind` with those integer fields replaced."""
    arch = dict(WORLD_MAR[kind])
    for pair in pairs:
        key, sep, value = pair.partition("=")
        check(sep == "=" and key in arch, f"--target-arch {pair!r}: expected KEY=VALUE with KEY one of {sorted(arch)}.")
        check(value.strip().isdigit() and int(value) > 0, f"--target-arch {pair!r}: VALUE must be a positive integer.")
        arch[key] = int(value)
    check(arch["embed_dim"] % arch["num_heads"] == 0,
          f"--target-arch: embed_dim {arch['embed_dim']} must be a multiple of num_heads {arch['num_heads']}.")
    return arch


# ----------------------------------------------------------------------------------------------------- VAE
def train_vae(steps: int, batch_size: int, lr: float, kl_weight: float, seed: int, quiet: bool,
              object_weight: float = 10.0, scale_images: int = 2000):
    torch.manual_seed(seed)
    vae = world_vae().train()
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="vae", disable=quiet)
    for step in bar:
        images, _ = world_images(batch_size, seed, "train", start=step * batch_size)  # [B, 3, 32, 32]
        posterior = vae.encode(images).latent_dist
        recon = vae.decode(posterior.sample(gen)).sample
        l1 = (recon - images).abs().mean()
        l2 = (object_weights(images, object_weight) * (recon - images) ** 2).mean()
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = l2 + l1 + gradient_loss(recon, images) + kl_weight * kl
        optimizer_step(opt, loss, step, steps, lr)
        if step % 50 == 0:
            bar.set_postfix(l1=f"{l1.item():.4f}", kl=f"{kl.item():.2f}")
    vae.eval()
    with torch.no_grad():  # scaling factor: unit-variance latents (the role of the official 0.2325)
        images, _ = world_images(scale_images, seed + 7, "train")
        std = float(vae.encode(images).latent_dist.sample(gen).std())
    vae.register_to_config(scaling_factor=1.0 / std)
    return vae, {"steps": steps, "batch_size": batch_size, "lr": lr, "kl_weight": kl_weight,
                 "object_weight": object_weight, "latent_std": std, "scale_images": scale_images,
                 "seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate_vae(vae, n: int, seed: int) -> dict:
    from mmspec.metrics import class_accuracy, world_fid

    images, labels = world_images(n, seed, "test")
    recon = ((vae.decode(vae.encode(images).latent_dist.mean).sample + 1) / 2).clamp(0, 1)
    real = (images + 1) / 2
    return {"n": n, "mse": float(((recon - real) ** 2).mean()), "judge_accuracy_recon": class_accuracy(recon, labels),
            "judge_accuracy_real": class_accuracy(real, labels), "world_fid_recon": world_fid(recon, real).fid}


@torch.no_grad()
def encode_world(vae, n: int, seed: int, chunk: int = 500) -> dict[str, torch.Tensor]:
    """Posterior means and stds (scaled) of n world images as MAR tokens [n, L, C], and labels [n] (on CPU; the
    VAE encodes on its own device)."""
    means, stds, labels = [], [], []
    scale = vae.config.scaling_factor
    for start in range(0, n, chunk):
        images, lab = world_images(min(chunk, n - start), seed, "train", start=start)
        dist = vae.encode(images.to(vae.device)).latent_dist
        means.append((dist.mean * scale).flatten(2).transpose(1, 2).cpu())
        stds.append((dist.std * scale).flatten(2).transpose(1, 2).cpu())
        labels.append(lab)
    return {"means": torch.cat(means), "stds": torch.cat(stds), "labels": torch.cat(labels)}


# ----------------------------------------------------------------------------------------------------- MAR
# loss_fn(model, tokens [B, L, C], labels [B], generator, mask rate or None) -> scalar loss
MARLoss = Callable[[MARModel, torch.Tensor, torch.Tensor, torch.Generator, "float | None"], torch.Tensor]


def mar_training_loss(model: MARModel, tokens: torch.Tensor, labels: torch.Tensor, generator: torch.Generator,
                      mask_rate: float | None) -> torch.Tensor:
    """MAR's own diffusion loss (`MARModel.training_loss`)."""
    return model.training_loss(tokens, labels, generator, mask_rate=mask_rate)


def world_mar(kind: str, arch: dict[str, int] | None = None) -> MARModel:
    """A fresh world MAR of `kind` ("target" or "draft"), with `arch` in place of its WORLD_MAR fields if given."""
    return MARModel(**WORLD_MAR_COMMON, **(arch or WORLD_MAR[kind]))


def train_mar(kind: str, data: dict[str, torch.Tensor], steps: int, batch_size: int, lr: float, ema_rate: float,
              seed: int, quiet: bool, state_path: Path | None = None, checkpoint_every: int = 500,
              init_from: Path | None = None, mask_rates: str = "official", arch: dict[str, int] | None = None,
              device: str = "cpu", loss_fn: MARLoss | None = None) -> tuple[MARModel, dict]:
    """A world MAR of `kind` trained on posterior samples of the cached latents; returns its EMA copy. Resumes
    from state_path (model, EMA, optimiser, step, generator) when it exists and saves it every checkpoint_every
    steps; init_from: a saved MARModel folder to start from (warm start: model and EMA) instead of fresh weights;
    mask_rates: "official" (truncated normal on [mask_ratio_min, 1]) or "cosine" (`cosine_mask_rate`); arch: the
    architecture fields (default WORLD_MAR[kind]; a warm start takes its folder's); device: where the model trains
    (the random draws stay on a CPU generator, so a run's sequence of batches does not depend on the device);
    loss_fn(model, tokens, labels, generator, mask_rate): the loss (default MAR's own `training_loss`; CSpD's draft
    distillation passes `continuous.mar.distill.distillation_loss(target)`)."""
    torch.manual_seed(seed)
    if init_from is not None:
        model = MARModel.from_pretrained(init_from).train()
    else:
        model = world_mar(kind, arch).train()
    model.to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.02)
    gen = torch.Generator().manual_seed(seed)
    first, seconds = 0, 0.0
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"].cpu())
        first, seconds = int(state["step"]), float(state["seconds"])
    means, stds, labels = data["means"], data["stds"], data["labels"]
    null = model.config.num_classes
    start = time.perf_counter() - seconds
    bar = tqdm(range(first, steps), desc=kind, disable=quiet, initial=first, total=steps)
    loss = torch.zeros(())
    for step in bar:
        rows = torch.randint(0, means.shape[0], (batch_size,), generator=gen)
        tokens = means[rows] + stds[rows] * torch.randn(means[rows].shape, generator=gen)  # [B, L, C]
        label = drop_labels(labels[rows], model.config.label_drop_prob, null, gen)
        tokens, label = tokens.to(device), label.to(device)
        rate = cosine_mask_rate(gen) if mask_rates == "cosine" else None
        loss = (loss_fn or mar_training_loss)(model, tokens, label, gen, rate)
        optimizer_step(opt, loss, step, steps, lr)
        with torch.no_grad():
            decay = min(ema_rate, (1 + step) / (10 + step))  # warm-up of the EMA rate
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if state_path is not None and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            state = {"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                     "generator": gen.get_state(), "step": step + 1, "seconds": time.perf_counter() - start}
            torch.save(state, state_path.with_suffix(".tmp"))
            os.replace(state_path.with_suffix(".tmp"), state_path)
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "ema": ema_rate, "final_loss": loss.item(),
            "seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters()),
            "init_from": str(init_from) if init_from else None, "mask_rates": mask_rates,
            "arch": {k: model.config[k] for k in WORLD_MAR[kind]}, "device": str(device)}
    if state_path is not None:
        state_path.unlink(missing_ok=True)
    return ema.cpu(), info


def evaluate(pipe, which: str, per_class: int, seed: int, num_sampling_steps: int = 100,
             num_iter: int | None = None) -> dict:
    """Judge accuracy and world-FID of vanilla MAR (the target or the draft alone) at the pipeline defaults, with
    `num_sampling_steps` diffusion steps per token and `num_iter` MAR steps (None: one token a step)."""
    call = pipe.as_mar_pipeline(which)
    call.set_progress_bar_config(disable=True)
    return judge_generation(
        lambda labels, gens: call(class_labels=labels, generator=gens, output_type="pt", num_iter=num_iter,
                                  num_sampling_steps=num_sampling_steps).images.cpu(), per_class, seed)


# ----------------------------------------------------------------------------------------------------- run
def _card(command: str, info: dict) -> str:
    vae, ev = info.get("vae", {}), info.get("eval", {})
    lines = card_head("Embedded MAR default (world)", [
        "A KL VAE (diffusers `AutoencoderKL`, 32 x 32 -> 8 x 8 x 16 latents = 64 tokens) and two class-conditional MAR",
        "models with diffusion heads trained independently on mmspec's procedural world (16 classes): the target and",
        "CSpD's draft. `CSpDPipeline.from_pretrained(folder)` loads all three; `.as_mar_pipeline('target')` is vanilla",
        "MAR. Made by:"], command, info.get("machine", ""))
    lines.append(f"| vae | AutoencoderKL, scaling_factor {1 / vae.get('latent_std', 1):.4f} | {vae.get('steps')} steps "
                 f"x {vae.get('batch_size')} images | {vae.get('seconds', 0):.0f} s |")
    for kind in ("target", "draft"):
        t = info.get(kind, {})
        arch = json.dumps(t.get("arch", WORLD_MAR[kind]))
        lines.append(f"| {kind} | MARModel {arch}, {t.get('parameters', 0) / 1e6:.2f}M params | "
                     f"{t.get('steps')} steps x {t.get('batch_size')}, EMA {t.get('ema')}, final loss "
                     f"{t.get('final_loss', 0):.3f} | {t.get('seconds', 0):.0f} s |")
    lines += ["", "## Quality (world judge)", ""]
    if "recon" in info:
        r = info["recon"]
        lines.append(f"- VAE reconstructions (posterior mean) of {r['n']} held-out images: MSE {r['mse']:.5f}, judge "
                     f"accuracy {r['judge_accuracy_recon']:.3f} (real images: {r['judge_accuracy_real']:.3f}), "
                     f"world-FID vs the originals {r['world_fid_recon']:.3f}.")
    for key in ("target", "draft"):
        if key in ev:
            num_iter = info.get("eval_num_iter") or "64 tokens"
            lines.append(judge_card_line(f"{key} MAR alone", ev[key], f"num_iter = {num_iter}, "
                                         f"{info.get('eval_sampling_steps', 100)} diffusion steps, cfg "
                                         f"{WORLD_MAR_COMMON['default_guidance_scale']} "
                                         f"{WORLD_MAR_COMMON['default_cfg_schedule']}, temperature 1.0, leading "
                                         "timestep spacing"))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    for option in ("eval_sampling_steps", "vae_scale_images", "eval_num_iter"):
        if getattr(args, option) is not None:
            check_positive_int(f"--{option.replace('_', '-')}", getattr(args, option))
    stages, folder, work = open_training(args, STAGES)
    device = check_device(args.device)
    arch = parse_arch(args.target_arch)
    check(not (args.target_arch and args.init_target),
          "--target-arch and --init-target: a warm start keeps its folder's architecture; drop one of them.")
    out, info = folder.out, folder.info
    from diffusers import AutoencoderKL

    if "vae" in stages and not folder.done("vae"):
        vae, info["vae"] = train_vae(args.vae_steps, args.vae_batch_size, args.vae_lr, args.kl_weight, args.seed,
                                     args.quiet, args.object_weight, args.vae_scale_images)
        folder.save(vae, "vae")
        info["recon"] = evaluate_vae(vae, args.recon_eval_images, args.seed)
        folder.record()
    check((out / "vae" / "config.json").is_file(), f"no VAE in {out}/vae: run the 'vae' stage first.")
    vae = AutoencoderKL.from_pretrained(out / "vae").eval().requires_grad_(False).to(device)

    cache, data = work / f"latents-{args.num_train_images}-seed{args.seed}.pt", None
    for kind, steps in (("target", args.target_steps), ("draft", args.draft_steps)):
        init = Path(args.init_target) if kind == "target" and args.init_target else None
        if kind not in stages or (folder.done(kind) and init is None):
            continue
        data = data or cached_tensors(cache, args.force, lambda: encode_world(vae, args.num_train_images, args.seed))
        previous = info.get(kind) if init is not None else None
        model, info[kind] = train_mar(kind, data, steps, args.mar_batch_size, args.mar_lr, args.ema, args.seed,
                                      args.quiet, work / f"{kind}-state.pt", args.checkpoint_every, init,
                                      args.mask_rates, arch if kind == "target" else None, device)
        if previous:
            info[kind]["previous"] = previous
        folder.save(model, kind)
        folder.record()

    if "eval" in stages:
        from continuous.mar.cspd import CSpDPipeline

        models = {kind: MARModel.from_pretrained(out / kind) for kind in ("target", "draft")}
        for model in models.values():  # the world models' sampler settings (see WORLD_MAR_COMMON)
            model.register_to_config(**{key: WORLD_MAR_COMMON[key] for key in WORLD_SAMPLING})
        pipe = CSpDPipeline(target=models["target"], draft=models["draft"], vae=vae)
        pipe.save_pretrained(out)
        pipe.to(device)
        info["eval_sampling_steps"], info["eval_num_iter"] = args.eval_sampling_steps, args.eval_num_iter
        info["eval"] = {key: evaluate(pipe, key, args.eval_images_per_class, args.seed, args.eval_sampling_steps,
                                      args.eval_num_iter)
                        for key in ("target", "draft")}
        folder.record()
        command = explicit_command("mmspec train mar", args, [
            "out", "seed", "vae_steps", "vae_batch_size", "vae_lr", "kl_weight", "object_weight", "vae_scale_images",
            "recon_eval_images", "num_train_images",
            "target_steps", "draft_steps", "mar_batch_size", "mar_lr", "ema", "mask_rates", "eval_images_per_class",
            "eval_sampling_steps", "threads", "device"])
        command += "".join(f" --target-arch {pair}" for pair in args.target_arch)
        if args.eval_num_iter is not None:
            command += f" --eval-num-iter {args.eval_num_iter}"
        card_text = with_metadata(
            _card(command, info),
            pipeline_tag="unconditional-image-generation", tags=["mar", "class-conditional", "world"])
        (out / "README.md").write_text(card_text)
        print(json.dumps(info["eval"], indent=2))
    print(f"wrote {out}")
    return 0

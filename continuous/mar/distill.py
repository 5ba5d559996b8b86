"""`mmspec train mar-draft`: a CSpD draft MAR distilled from its target, so that on a shared denoising trajectory it
lands where the target does (what CSpD's acceptance measures).

    mmspec train mar-draft --distill-from assets/mar --out runs/mar-distilled

CSpD accepts a draft token when it lies close to the target's last-step Gaussian for the SAME x_T and per-step noise,
and its variance-ratio factor compares the two heads' variances at every step (mmspec/verify/cspd.py). Sampling is a
deterministic function of the head's (eps, variance) predictions once the noise is shared, so the draft is trained to
reproduce the target's head outputs, not the data:
```
masked  = MAR's random mask (cosine masking rates)           known tokens: posterior samples of world images
z_p, z_q = target(tokens, known, c), draft(tokens, known, c)  for c = the label AND the null class (both CFG halves)
x_t     = sqrt(a_t) x0 + sqrt(1 - a_t) noise, t uniform over the 1000 training steps, at the masked positions
loss    = || eps_q(x_t, t, z_q) - eps_p(x_t, t, z_p) ||^2 + variance_weight || v_q - v_p ||^2     (target frozen)
```
(v: the learned-range variance interpolation of the head's second output half). The draft keeps its own, smaller
architecture (it must stay cheap: CSpD runs it gamma times per target pass) and starts from the source folder's draft
unless `--draft-arch` asks for a fresh one. Training reuses `continuous.mar.train.train_mar` (AdamW, EMA, resumable
state in --work-dir, progress bar); the output folder is a complete `CSpDPipeline` (the source's target and VAE, the
distilled draft) with a card.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from continuous.mar.model import MARModel
from continuous.mar.train import WORLD_MAR, encode_world, parse_arch, train_mar
from mmspec.data.artifacts import explicit_command
from mmspec.errors import check, check_device
from mmspec.model_card import with_metadata
from mmspec.world_training import (
    TrainingFolder,
    add_runtime_arguments,
    cached_tensors,
    card_head,
    judge_card_line,
)


def head_outputs_at(model: MARModel, tokens: torch.Tensor, known: torch.Tensor, labels: torch.Tensor,
                    x_t: torch.Tensor, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The diffusion head's (eps, v) [N, 2C] at the flattened positions [N] of z = model(tokens, known, labels)."""
    z = model(tokens, known, labels).flatten(0, 1)[positions]  # [N, D]
    return model.diffloss.net(x_t, t, z)


def distillation_loss(target: MARModel, variance_weight: float = 1.0):
    """A `train_mar` loss_fn: the draft's head outputs against the frozen target's at the same noised masked tokens,
    for the label and the null class (see the module docstring)."""
    target.eval().requires_grad_(False)

    def loss(model: MARModel, tokens: torch.Tensor, labels: torch.Tensor, generator: torch.Generator,
             mask_rate: float | None) -> torch.Tensor:
        b, seq, c = tokens.shape
        masked = model.random_mask(b, mask_rate, generator, tokens.device)  # [B, L]
        tokens, known = tokens.repeat(2, 1, 1), (~masked).repeat(2, 1)  # [2B, L, C]: both CFG halves
        labels = torch.cat([labels, torch.full_like(labels, model.config.num_classes)])
        positions = masked.repeat(2, 1).flatten().nonzero().squeeze(-1).repeat(model.config.diffusion_batch_mul)
        x0 = tokens.flatten(0, 1)[positions]  # [N, C]
        chain = model.diffloss.train_diffusion.training_chain
        t = torch.randint(0, chain.alphas_cumprod.shape[0], (x0.shape[0],), generator=generator).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device, x0.dtype)
        alpha_bar = chain.alphas_cumprod.to(x0.device, x0.dtype)[t].unsqueeze(-1)
        x_t = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
        with torch.no_grad():
            teacher = head_outputs_at(target, tokens, known, labels, x_t, t, positions)  # [N, 2C]
        student = head_outputs_at(model, tokens, known, labels, x_t, t, positions)
        eps_error = (student[:, :c] - teacher[:, :c]).pow(2).mean()
        return eps_error + variance_weight * (student[:, c:] - teacher[:, c:]).pow(2).mean()

    return loss


# ----------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distill-from", required=True,
                        help="a CSpD pipeline folder (target, draft, vae; e.g. assets/mar) or a MAR pipeline folder")
    parser.add_argument("--out", required=True, help="pipeline folder to write (target, distilled draft, vae)")
    parser.add_argument("--work-dir", default="runs/mar-draft-distill",
                        help="scratch folder (latent cache, resumable training state)")
    parser.add_argument("--draft-arch", action="append", default=[], metavar="KEY=VALUE",
                        help="train a fresh draft of the world draft architecture with this field replaced "
                             f"(repeatable; integer fields of {sorted(WORLD_MAR['draft'])}); default: start from "
                             "the source folder's draft")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--variance-weight", type=float, default=1.0,
                        help="weight of the head's variance output in the loss (CSpD's step factor compares it)")
    parser.add_argument("--num-train-images", type=int, default=30_000, help="world images encoded as contexts")
    parser.add_argument("--checkpoint-every", type=int, default=250, help="save a resumable state every N steps")
    parser.add_argument("--eval-images-per-class", type=int, default=16,
                        help="judge the distilled draft alone on this many images per class (0 = skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_runtime_arguments(parser)


def load_source(folder: Path):
    """(target MAR, draft MAR or None, VAE) of a CSpD or MAR pipeline folder."""
    from diffusers import AutoencoderKL

    index = folder / "model_index.json"
    check(index.is_file(), f"--distill-from {folder}: no model_index.json; give a folder written by `mmspec train "
                           "mar` or `mmspec convert mar`.")
    names = json.loads(index.read_text())
    target_name = "target" if "target" in names else "transformer"
    check(target_name in names and "vae" in names, f"--distill-from {folder}: expected a CSpD (target, draft, vae) "
                                                   "or MAR (transformer, vae) pipeline folder.")
    draft = MARModel.from_pretrained(folder / "draft") if "draft" in names else None
    return MARModel.from_pretrained(folder / target_name), draft, AutoencoderKL.from_pretrained(folder / "vae")


def run(args: argparse.Namespace) -> int:
    from continuous.mar.cspd import CSpDPipeline
    from continuous.mar.train import evaluate

    device = check_device(args.device)
    source, out = Path(args.distill_from), Path(args.out)
    check(source.resolve() != out.resolve(), "--out must differ from --distill-from (the source's draft is read).")
    arch = parse_arch(args.draft_arch, "draft") if args.draft_arch else None
    torch.set_num_threads(args.threads)
    target, draft, vae = load_source(source)
    check(draft is not None or arch is not None,
          f"{source} has no draft to start from; give --draft-arch KEY=VALUE (e.g. embed_dim=64) for a fresh one.")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    folder = TrainingFolder(out, force=True)
    init = None
    if arch is None:  # start from the source's draft: train_mar warm-starts from a saved folder
        init = work / "init-draft"
        draft.save_pretrained(init)
    vae.eval().requires_grad_(False).to(device)
    data = cached_tensors(work / f"latents-{args.num_train_images}-seed{args.seed}.pt", False,
                          lambda: encode_world(vae, args.num_train_images, args.seed))
    target.to(device)
    model, info = train_mar("draft", data, args.steps, args.batch_size, args.lr, args.ema, args.seed, args.quiet,
                            work / "distill-state.pt", args.checkpoint_every, init, "cosine", arch, device,
                            loss_fn=distillation_loss(target, args.variance_weight))
    info.update(distilled_from=str(source), variance_weight=args.variance_weight,
                num_train_images=args.num_train_images,
                init_from=f"{source}/draft" if init is not None else None)  # the warm start's origin, not its copy
    model.register_to_config(**{key: target.config[key] for key in ("default_guidance_scale", "default_cfg_schedule")})
    pipe = CSpDPipeline(target=target.cpu(), draft=model, vae=vae.cpu())
    pipe.save_pretrained(out)
    folder.info.update(distilled_draft=info)
    if args.eval_images_per_class:
        pipe.to(device)
        folder.info["eval"] = {"draft": evaluate(pipe, "draft", args.eval_images_per_class, args.seed)}
    folder.record()
    command = explicit_command("mmspec train mar-draft", args, [
        "distill_from", "out", "steps", "batch_size", "lr", "ema", "variance_weight", "num_train_images", "seed",
        "threads", "device"]) + "".join(f" --draft-arch {pair}" for pair in args.draft_arch)
    card_text = with_metadata(
        card(command, folder.info),
        pipeline_tag="unconditional-image-generation", tags=["mar", "class-conditional", "cspd", "world"])
    (out / "README.md").write_text(card_text)
    print(f"wrote {out}")
    return 0


def card(command: str, info: dict) -> str:
    """The card of a distilled CSpD pipeline folder."""
    d = info["distilled_draft"]
    lines = card_head("CSpD pipeline with a distilled draft (world)", [
        f"The target MAR and KL VAE of `{d['distilled_from']}` and a draft MAR distilled from that target (its",
        "diffusion head's eps and variance outputs at the same noised masked tokens, for the label and the null class;",
        "`continuous/mar/distill.py`). Made by:"], command, info.get("machine", ""))
    lines.append(f"| draft | MARModel {json.dumps(d['arch'])}, {d['parameters'] / 1e6:.2f}M params | {d['steps']} "
                 f"steps x {d['batch_size']}, EMA {d['ema']}, final distillation loss {d['final_loss']:.4f}, from "
                 f"{d['init_from'] or 'scratch'} | {d['seconds']:.0f} s |")
    if "eval" in info:
        lines += ["", judge_card_line("draft MAR alone", info["eval"]["draft"], "the target's sampling defaults, "
                                      "num_iter = 64 tokens, 100 diffusion steps, temperature 1.0")]
    return "\n".join(lines) + "\n"

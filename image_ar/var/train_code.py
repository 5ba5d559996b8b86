"""`mmspec train var-code`: CoDe's optional fine-tuning of a large/small VAR pair for one split N.

    mmspec train var-code --pipeline assets/var --out runs/var-code --draft-steps 5

Facts: CoDe (arXiv 2411.17787). Starting from a CoDe pipeline folder (two independently trained
models sharing a VQVAE, the training-free mode), three stages, each teacher-forced on the code pyramids of world
images encoded by the pipeline's VQVAE:
1. `large`: the large model (drafter) fine-tuned with cross-entropy on the positions of the scales it makes in
   CoDe (scales < N) only.
2. `distill`: the small model (refiner) distilled from the large one on every scale: cross-entropy to the large
   model's softmax (soft targets), both fed the same inputs and the same (possibly dropped) labels.
3. `refine`: the same distillation on the scales the refiner makes (scales >= N) only.
The teacher in stages 2 and 3 is the large model as it comes in (before stage 1), frozen. A stage with 0 steps is
skipped. `--small-target codes` (a named option, not CoDe's) trains the small model on the images' own codes
instead of the teacher's softmax: no teacher forward, about 3x cheaper a step on a CPU, so many more refine steps
fit the same time (the embedded default's refiner was made this way, see assets/var/README.md).

The output is a new CoDe pipeline folder: the source's card with a fine-tuning section appended (commands, stage
losses and times, the world judge's verdict of CoDe at split N before and after), and, when the refiner was
trained, the source's refiner kept in `refiner_training_free/` for the training-free comparison:

    refiner = VARTransformer.from_pretrained(folder, subfolder="refiner_training_free")
    training_free = CoDePipeline.from_pretrained(folder, refiner=refiner)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from image_ar.var.code import CoDePipeline, default_draft_steps
from image_ar.var.train import encode_world, evaluate, fit_var
from image_ar.var.transformer import VARTransformer
from mmspec.data.artifacts import ASSETS_DIR, atomic_output_dir, explicit_command, machine_summary
from mmspec.errors import InputError, check
from mmspec.model_card import strip_metadata, with_metadata
from mmspec.world_training import write_info

SMALL_TARGETS = ("teacher", "codes")
TRAINING_FREE_REFINER = "refiner_training_free"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default=str(ASSETS_DIR / "var"), help="CoDe pipeline folder to start from")
    parser.add_argument("--out", required=True, help="CoDe pipeline folder to write")
    parser.add_argument("--draft-steps", type=int, default=None, help="the split N (default: all but two scales)")
    parser.add_argument("--work-dir", default="runs/var-world", help="scratch folder (code-pyramid cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train-images", type=int, default=50_000)
    parser.add_argument("--large-steps", type=int, default=300)
    parser.add_argument("--distill-steps", type=int, default=300)
    parser.add_argument("--refine-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--small-target", choices=SMALL_TARGETS, default="teacher",
                        help="what the small model learns from in the distill and refine stages: the large model's "
                             "softmax (teacher, CoDe's distillation) or the images' own codes (codes: plain "
                             "cross-entropy, no teacher forward)")
    parser.add_argument("--eval-images-per-class", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the training step")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def scale_mask(model: VARTransformer, first: int, stop: int) -> torch.Tensor:
    """[L] bool: the positions of scales first..stop-1."""
    return (model.levels >= first) & (model.levels < stop)


def masked_cross_entropy(mask: torch.Tensor):
    """loss(model, code, labels, inputs): next-scale cross-entropy on the positions of `mask` [L] only."""

    def loss(model: VARTransformer, code: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        logits = model(labels, inputs, drop_condition=False)[:, mask]  # [B, l, V]
        return F.cross_entropy(logits.flatten(0, 1), code[:, mask].flatten())

    return loss


def distillation(teacher: VARTransformer, mask: torch.Tensor):
    """loss(student, ...): cross-entropy of the student to the teacher's softmax on the positions of `mask` [L]."""

    def loss(model: VARTransformer, code: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p = teacher(labels, inputs, drop_condition=False)[:, mask].softmax(-1)  # [B, l, V] teacher
        log_q = model(labels, inputs, drop_condition=False)[:, mask].log_softmax(-1)  # [B, l, V] student
        return -(p * log_q).sum(-1).mean()

    return loss


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    source, out = Path(args.pipeline), Path(args.out)
    if not (source / "model_index.json").is_file():
        raise InputError(f"no CoDe pipeline at {source} (model_index.json missing); make one with "
                         "`mmspec train var` or `mmspec convert var --small ...`.")
    check(source.resolve() != out.resolve(), "--out must differ from --pipeline (the fine-tuned pair is a new folder).")
    pipe = CoDePipeline.from_pretrained(source)
    n_scales = len(pipe.drafter.patch_nums)
    n = default_draft_steps(n_scales) if args.draft_steps is None else args.draft_steps
    check(0 < n < n_scales, f"--draft-steps must be in [1, {n_scales - 1}] (both models make scales), got {n}.")
    args.draft_steps = n  # the card's command names the split it was tuned for
    vqvae = pipe.vqvae.eval().requires_grad_(False)
    info = {"machine": machine_summary(), "source": str(source), "draft_steps": n, "small_target": args.small_target,
            "before": evaluate(pipe, "code", args.eval_images_per_class, args.seed, n)}

    cache = Path(args.work_dir) / f"codes-{args.num_train_images}-seed{args.seed}-{source.name}.pt"
    if not cache.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        codes, labels = encode_world(vqvae, args.num_train_images, args.seed)
        torch.save({"codes": codes, "labels": labels}, cache)
    data = torch.load(cache, weights_only=True)
    # only CoDe's distillation (--small-target teacher) reads the frozen large model
    teacher = (VARTransformer.from_pretrained(source / "drafter").eval().requires_grad_(False)
               if args.small_target == "teacher" else None)
    large, small = pipe.drafter, pipe.refiner
    common = dict(codes=data["codes"], labels=data["labels"], vqvae=vqvae, batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, quiet=args.quiet, compile_step=not args.no_compile)

    def small_loss(mask: torch.Tensor):
        return masked_cross_entropy(mask) if teacher is None else distillation(teacher, mask)

    stages = (("large", large, args.large_steps, "large (scales < N)", masked_cross_entropy(scale_mask(large, 0, n))),
              ("distill", small, args.distill_steps, f"small ({args.small_target}, all scales)",
               small_loss(scale_mask(small, 0, n_scales))),
              ("refine", small, args.refine_steps, f"small ({args.small_target}, scales >= N)",
               small_loss(scale_mask(small, n, n_scales))))
    for name, model, steps, desc, loss in stages:
        if steps > 0:
            _, info[name] = fit_var(model, steps=steps, desc=desc, loss=loss, **common)
    info["after"] = evaluate(pipe, "code", args.eval_images_per_class, args.seed, n)

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_dir(out) as tmp:
        pipe.save_pretrained(tmp)
        kept = source / TRAINING_FREE_REFINER
        if (kept / "config.json").is_file():
            shutil.copytree(kept, tmp / TRAINING_FREE_REFINER)
        elif "distill" in info or "refine" in info:
            shutil.copytree(source / "refiner", tmp / TRAINING_FREE_REFINER)
        info["kept_training_free_refiner"] = (tmp / TRAINING_FREE_REFINER).is_dir()
        source_info = source / "training.json"
        if source_info.is_file():  # the source's own provenance (how its models were trained) travels along
            info["source_training"] = json.loads(source_info.read_text())
        write_info(tmp / "training.json", info)
        command = explicit_command("mmspec train var-code", args, [
            "pipeline", "out", "draft_steps", "seed", "num_train_images", "large_steps", "distill_steps",
            "refine_steps", "batch_size", "lr", "small_target", "eval_images_per_class", "threads"])
        source_card = source / "README.md"
        card_text = with_metadata(
            _card(strip_metadata(source_card.read_text()) if source_card.is_file() else "", command, info),
            pipeline_tag="unconditional-image-generation",
            tags=["var", "class-conditional", "code", "speculative-decoding", "world"])
        (tmp / "README.md").write_text(card_text)
    print(json.dumps({k: info[k] for k in ("before", "after")}, indent=2))
    print(f"wrote {out}")
    return 0


def _card(source_card: str, command: str, info: dict) -> str:
    """The source's card (if any) with a fine-tuning section appended."""
    b, a = info["before"], info["after"]
    head = source_card.rstrip("\n").split("\n") + [""] if source_card else ["# CoDe fine-tuned VAR pair (world)", ""]
    return "\n".join([
        *head,
        f"## CoDe fine-tuning for draft_steps = {info['draft_steps']}",
        "",
        f"Fine-tuned from {info['source']} (see image_ar/var/train_code.py for the stages; the small model learned "
        f"from the {info['small_target']}). Made by:",
        "",
        f"    {command}",
        "",
        f"Machine: {info['machine']}.",
        "",
        *([f"The refiner in this folder is the fine-tuned one; the lines above describe the models before "
           f"fine-tuning, and that refiner is kept in `{TRAINING_FREE_REFINER}/`.", ""]
          if info.get("kept_training_free_refiner") else []),
        "| stage | steps | final loss | time |",
        "|---|---|---|---|",
        *[f"| {k} | {info[k]['steps']} | {info[k]['final_loss']:.3f} | {info[k]['seconds']:.0f} s |"
          for k in ("large", "distill", "refine") if k in info],
        "",
        f"CoDe at draft_steps {info['draft_steps']}, pipeline defaults, {a['n']} images: judge class accuracy "
        f"{b['judge_accuracy']:.3f} -> {a['judge_accuracy']:.3f}, world-FID {b['world_fid']:.2f} -> "
        f"{a['world_fid']:.2f} (before -> after fine-tuning).",
        "",
    ])

"""Pieces shared by the image families' `mmspec train` commands on the procedural world (LlamaGen, VAR, MAR): the
learning-rate schedule, batches of world images, the reconstruction losses' weights and edge term, CFG label
dropping, the optimiser step, the staged output folder with its atomic `training.json`, and the judge's verdict.

    images, labels = world_images(64, seed=0, split="train", start=0)   # [64, 3, 32, 32] in [-1, 1], [64]
    loss = (object_weights(images, 10.0) * (recon - images) ** 2).mean()
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.bench.files import atomic_write_text
from mmspec.data import generate_batch
from mmspec.data.artifacts import ASSETS_DIR, atomic_output_dir, machine_summary
from mmspec.errors import check, check_positive_int

IMAGE_SIZE = 32  # world images are 32x32


def lr_at(step: int, total: int, base: float, warmup: int = 100) -> float:
    """Linear warm-up then cosine decay to 10% of the base rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def length_grouped_batch(step: int, lengths: torch.Tensor, batch_size: int, seed: int,
                         group: int = 50) -> torch.Tensor:
    """Row indices [batch_size] of training step `step` when batches hold rows of similar length (Hugging Face's
    `group_by_length`): each epoch a seeded permutation of the n rows, cut into mega-batches of `group` batches, each
    sorted by length and cut into batches, taken in a seeded order; an epoch holds max(1, n // batch_size) batches
    (fewer rows than a batch repeat). A pure function of its arguments: a resumed run draws the same batches."""
    n = len(lengths)
    per_epoch = max(1, n // batch_size)
    epoch, index = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen)  # [n]
    if n < batch_size:
        return order[torch.arange(batch_size) % n]
    chunks = [chunk[torch.argsort(lengths[chunk], descending=True, stable=True)]
              for chunk in order.split(group * batch_size)]
    batches = torch.cat(chunks)[: per_epoch * batch_size].view(per_epoch, batch_size)  # [per_epoch, batch_size]
    return batches[torch.randperm(per_epoch, generator=gen)[index]]


def prompt_list(path: str | None, n: int, split: str, seed: int) -> list[str]:
    """n prompts for an image trainer's `--prompts`: the file's lines cycled (InputError when there is no file or it
    holds none), or world captions of `split`."""
    if path is None:
        return list(generate_batch(n, seed, split=split, image_size=IMAGE_SIZE).captions)
    check(Path(path).is_file(), f"--prompts {path}: no such file (one prompt a line).")
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    check(len(lines) > 0, f"--prompts {path} holds no prompt.")
    return [lines[i % len(lines)] for i in range(n)]


def size_tag(image_size: int) -> str:
    """A token cache's name tag for the world image size: none at the default 32 (the names before sizes existed),
    else "-64px"."""
    return "" if image_size == IMAGE_SIZE else f"-{image_size}px"


def world_images(n: int, seed: int, split: str, start: int = 0,
                 image_size: int = IMAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """n single-object world images as float [-1, 1] [n, 3, S, S] (S = image_size, 32 by default; a scene is the
    same picture at every size) and their class labels [n]."""
    batch = generate_batch(n, seed, split=split, start=start, image_size=image_size, with_text=False)
    return batch.float_images() * 2 - 1, batch.labels.long()


def object_weights(images: torch.Tensor, strength: float) -> torch.Tensor:
    """Per-pixel loss weights [B, 1, H, W]: 1 + strength x local contrast (|x - 7x7 box blur|, scaled to [0, 1] per
    image). Backgrounds are smooth gradients, so the weight concentrates on the shapes and their edges."""
    padded = F.pad(images, (3, 3, 3, 3), mode="replicate")
    contrast = (images - F.avg_pool2d(padded, 7, stride=1)).abs().mean(1, keepdim=True)
    return 1 + strength * contrast / contrast.amax((2, 3), keepdim=True).clamp_min(1e-6)


def gradient_loss(reconstruction: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Mean L1 distance between the finite differences along W and along H of the two [B, C, H, W] tensors."""
    dx = (reconstruction[..., :, 1:] - reconstruction[..., :, :-1]) - (images[..., :, 1:] - images[..., :, :-1])
    dy = (reconstruction[..., 1:, :] - reconstruction[..., :-1, :]) - (images[..., 1:, :] - images[..., :-1, :])
    return 0.5 * (dx.abs().mean() + dy.abs().mean())  # [] (dx [B, C, H, W-1], dy [B, C, H-1, W])


def drop_labels(labels: torch.Tensor, rate: float, null_class: int, generator: torch.Generator) -> torch.Tensor:
    """labels [B] with each replaced by the null class with probability `rate` (CFG training)."""
    drop = torch.rand(labels.shape[0], generator=generator) < rate
    return torch.where(drop, torch.full_like(labels, null_class), labels)


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, step: int, total_steps: int, base_lr: float,
                   max_grad_norm: float = 1.0, after_backward: Callable[[], None] | None = None) -> None:
    """One training step of the world trainers: the `lr_at` rate for `step`, backward, `after_backward` (data
    parallelism averages the gradients there), gradient clipping over the optimiser's parameters, update."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, total_steps, base_lr)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if after_backward is not None:
        after_backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], max_grad_norm)
    opt.step()


def write_info(path: Path, info: dict) -> None:
    """Write a training record atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(info, indent=2))


@torch.no_grad()
def judge_generation(generate, per_class: int, seed: int, chunk: int = 64) -> dict:
    """Judge accuracy and world-FID of `per_class` images of every world class made by
    generate(labels: list[int], generators: list[torch.Generator]) -> images [n, 3, H, W] in [0, 1]
    (one seeded generator per image, so the images do not depend on the chunking)."""
    from mmspec.data import NUM_CLASSES
    from mmspec.metrics import class_accuracy, world_fid, world_reference_stats

    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(len(labels))]
    images = torch.cat([generate(labels[s:s + chunk].tolist(), gens[s:s + chunk])
                        for s in range(0, len(labels), chunk)])
    reference = world_reference_stats(n=2000, seed=seed, image_size=IMAGE_SIZE)
    return {"n": len(labels), "judge_accuracy": class_accuracy(images, labels),
            "world_fid": world_fid(images, reference).fid, "fid_reference_n": reference.n}


def add_staged_arguments(parser: argparse.ArgumentParser, name: str, stages: tuple[str, ...],
                         work_dir_help: str) -> None:
    """The options every staged world trainer starts with: --out (default assets/NAME), --work-dir
    (runs/NAME-world), --stages, --force, --seed."""
    parser.add_argument("--out", default=str(ASSETS_DIR / name), help="pipeline folder to write")
    parser.add_argument("--work-dir", default=f"runs/{name}-world", help=work_dir_help)
    parser.add_argument("--stages", default=",".join(stages), help=f"comma-separated subset of {','.join(stages)}")
    parser.add_argument("--force", action="store_true", help="retrain stages whose output already exists")
    parser.add_argument("--seed", type=int, default=0)


def add_recon_eval_argument(parser: argparse.ArgumentParser, tokenizer: str) -> None:
    """--recon-eval-images: how many test images the trainer's reconstruction check of its image tokenizer (MSE,
    judge accuracy, world-FID) encodes and decodes (default 1000; fewer for a quick check)."""
    parser.add_argument("--recon-eval-images", type=int, default=1000,
                        help=f"test images of the {tokenizer}'s reconstruction check (MSE, judge accuracy, world-FID)")


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """--threads and --quiet."""
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def open_training(args: argparse.Namespace, allowed: tuple[str, ...]) -> tuple[list[str], TrainingFolder, Path]:
    """A staged trainer's start: its checked --stages (and --recon-eval-images where it has one), torch's thread
    count, the --out folder and the --work-dir."""
    stages = parse_stages(args.stages, allowed)
    if hasattr(args, "recon_eval_images"):
        check_positive_int("--recon-eval-images", args.recon_eval_images)
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return stages, TrainingFolder(args.out, args.force), work


def cached_tensors(path: Path, refresh: bool, make: Callable[[], dict]) -> dict:
    """The tensors saved at `path`; make() them and save them first when the file is missing or `refresh`."""
    if refresh or not path.is_file():
        torch.save(make(), path)
    return torch.load(path, weights_only=True)


def parse_stages(text: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated --stages of a staged training command, checked."""
    stages = [s.strip() for s in text.split(",") if s.strip()]
    check(all(s in allowed for s in stages), f"--stages must be a subset of {','.join(allowed)}, got {text!r}.")
    return stages


class TrainingFolder:
    """The output folder of a staged `mmspec train` command: its training record (`info`, kept in training.json),
    which components are finished (a rerun skips them unless `force`), and atomic saves of components."""

    def __init__(self, out: str | Path, force: bool) -> None:
        self.out, self.force = Path(out), force
        self.info_path = self.out / "training.json"
        self.info = json.loads(self.info_path.read_text()) if self.info_path.is_file() else {}
        self.info["machine"] = machine_summary()

    def done(self, component: str) -> bool:
        return (self.out / component / "config.json").is_file() and not self.force

    def save(self, model, component: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with atomic_output_dir(self.out / component) as tmp:
            model.save_pretrained(tmp)

    def record(self) -> None:
        write_info(self.info_path, self.info)


def card_head(title: str, intro: list[str], command: str, machine: str) -> list[str]:
    """The first lines of an embedded default's card: title, what it is, the command that made it, the machine,
    and the header of the components table (| component | architecture | training | time |)."""
    return [f"# {title}", "", *intro, "", f"    {command}", "", f"Machine: {machine}.", "",
            "| component | architecture | training | time |", "|---|---|---|---|"]


def judge_card_line(name: str, figures: dict,
                    settings: str = "guidance 4.0, temperature 1.0, no top-k/top-p") -> str:
    """A card's line for `judge_generation` figures at the pipelines' default sampling `settings`."""
    from mmspec.data import NUM_CLASSES

    return (f"- {name}, at the pipeline defaults ({settings}), {figures['n']} "
            f"images ({figures['n'] // NUM_CLASSES} per class): judge class accuracy {figures['judge_accuracy']:.3f}, "
            f"world-FID {figures['world_fid']:.2f} (vs {figures['fid_reference_n']} held-out real images).")


def recon_card_line(what: str, figures: dict, vocab_size: int) -> str:
    """A card's line for a tokenizer's reconstruction figures."""
    return (f"- {what} reconstructions of {figures['n']} held-out images: MSE {figures['mse']:.5f}, judge accuracy "
            f"{figures['judge_accuracy_recon']:.3f} (real images: {figures['judge_accuracy_real']:.3f}), world-FID vs "
            f"the originals {figures['world_fid_recon']:.3f}, {figures['codes_used']} of {vocab_size} codes used.")


# ------------------------------------------------------------------------------- resumable drafter training
def resume_training(path: Path, settings: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    generator: torch.Generator, force: bool) -> tuple[int, float, list]:
    """(first step, seconds so far, loss history) of a run: 0, 0.0, [] unless `path` holds a checkpoint of a run
    with the same `settings` (restored into model, optimiser and generator); another run's is an InputError."""
    if not path.is_file() or force:
        return 0, 0.0, []
    state = torch.load(path, weights_only=True)
    check(state["settings"] == settings, f"{path} was made with other options ({state['settings']}, now "
                                         f"{settings}); rerun with those, or pass --force to start over.")
    model.load_state_dict(state["drafter"])
    opt.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    return state["step"], state["seconds"], state["history"]


def record_training_step(path: Path, every: int, step: int, total: int, losses: tuple, bar, settings: str,
                         model: torch.nn.Module, opt: torch.optim.Optimizer, generator: torch.Generator,
                         seconds: float, history: list) -> None:
    """Append a step's (feature loss, soft CE, top-1 agreement) to history, show them every 25 steps, and save the
    resumable state atomically every `every` steps (not after the last)."""
    vloss, ploss, agree = (float(x) for x in losses)
    history.append([vloss, ploss, agree])
    if step % 25 == 0:
        bar.set_postfix(vloss=f"{vloss:.4f}", ploss=f"{ploss:.3f}", top1=f"{agree:.3f}")
    if every and (step + 1) % every == 0 and step + 1 < total:
        torch.save({"drafter": model.state_dict(), "optimizer": opt.state_dict(), "generator": generator.get_state(),
                    "step": step + 1, "settings": settings, "seconds": seconds, "history": history},
                   path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

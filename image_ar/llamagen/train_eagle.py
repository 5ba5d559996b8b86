"""`mmspec train llamagen-drafter`: train an EAGLE drafter (LANTERN's recipe) for a LlamaGen pipeline.

    mmspec train llamagen-drafter --pipeline assets/llamagen --out assets/llamagen/eagle_drafter

    mmspec train llamagen-drafter --pipeline my-t2i --prompts captions.txt   # on your captions (the target's samples)

Data: image token sequences (`--data world`: world images tokenized by the pipeline's VQ with
`image_ar.llamagen.train.tokenize`; `--data target`: the target's own samples (LANTERN's recipe), for targets not
trained on the world: c2i on uniform random classes, t2i on `--prompts FILE` captions (one a line, cycled; the world's
train captions without it), sample i drawn with its own generator seeded seed * 1000003 + i), cached in the work dir
under a fingerprint of the transformer's weights. A text-to-image pipeline's captions are tokenized by its
tokenizer and encoded by its text_encoder as `pipe(prompt)` does. Each step teacher-forces
the frozen target on a batch (no grad), with 10% of the class labels (captions) replaced by the null class (the
learned null caption; `--null-prob`), and reads its final normed features f_0..f_{T-1}
(`last_hidden`; f_i predicts token i) and logits. The drafter sees the pairs (f_i + noise, token_i),
i < T - 1, and is trained to predict f_{i+1}:

    loss = SmoothL1(h_i, f_{i+1}) + 0.1 * CE(softmax(target logits_{i+1}), log_softmax(output(h_i)))

LANTERN's optimiser: AdamW (betas 0.9, 0.95), linear warm-up over 3% of the steps then linear decay, gradient
clipping by value at 0.5, uniform feature noise U(-0.1, 0.1) (width `--noise` 0.2). The reference scales the
noise width by 512 / sequence length (EAGLE's data code); here the width is used as given. The learning rate
default (3e-3) is higher than the reference's 1e-4 because this run is minutes on a CPU, not 20 epochs on GPUs.

Several processes (`torchrun --nproc_per_node N -m mmspec train llamagen-drafter ...` or `accelerate launch`;
gloo on the CPU, `--device cuda` one GPU each): each samples its share of the sequences (the same per-sample
generators as one process), and every step each draws the same batch, null-condition mask and noise, teacher-forces
its share of the rows and weighs its loss by its share; the averaged gradients are one process's
(`mmspec.processes`). The first process writes checkpoints, the drafter and the card, and measures acceptance.

The run is resumable: the drafter, optimiser and data-sampler state are saved to the work dir every
`--checkpoint-every` steps and picked up by a rerun (`--force` starts over). At the end the drafter is saved
to `--out` with a card (README.md: command, seed, time, final losses, and the mean acceptance length of method
`eagle` measured on `--eval-images` images at temperature 0 and at the pipeline's default sampling). When
`--out` is `PIPELINE/eagle_drafter`, the component is registered in `PIPELINE/model_index.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from image_ar.llamagen.eagle import LlamaGenEagleDrafter
from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.data.artifacts import ASSETS_DIR, atomic_output_dir, explicit_command, machine_summary
from mmspec.errors import InputError, check, check_positive_int
from mmspec.feature_drafter import feature_drafter_loss
from mmspec.hf_loading import folder_fingerprint
from mmspec.model_card import with_metadata
from mmspec.processes import (
    average_gradients,
    gather_shards,
    process_state,
    rank_and_count,
    shard,
    wait_for_everyone,
    weigh_share,
)
from mmspec.world_training import prompt_list

COMPONENT = "eagle_drafter"
COMPONENT_ENTRY = ["image_ar.llamagen.eagle", "LlamaGenEagleDrafter"]
DATA_KINDS = ("world", "target")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default=str(ASSETS_DIR / "llamagen"), help="LlamaGen pipeline folder (target)")
    parser.add_argument("--out", default=None, help="drafter folder to write (default: PIPELINE/eagle_drafter)")
    parser.add_argument("--work-dir", default="runs/llamagen-drafter", help="scratch folder (data, checkpoints)")
    parser.add_argument("--data", choices=DATA_KINDS, default=None,
                        help="world: world images tokenized by the pipeline's VQ; target: the target's own samples "
                             "(default: target with --prompts, else world)")
    parser.add_argument("--prompts", default=None,
                        help="text-to-image: your captions, a text file, one a line (the target samples them)")
    parser.add_argument("--num-train-sequences", type=int, default=20_000, help="token sequences to train on")
    parser.add_argument("--data-guidance", type=float, default=4.0, help="--data target: CFG scale of the samples")
    parser.add_argument("--data-temperature", type=float, default=1.0, help="--data target: sampling temperature")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=float, default=0.03, help="warm-up fraction of the steps")
    parser.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise on input features")
    parser.add_argument("--p-weight", type=float, default=0.1, help="weight of the soft cross-entropy")
    parser.add_argument("--grad-clip", type=float, default=0.5, help="clip gradients by value")
    parser.add_argument("--null-prob", type=float, default=0.1, help="fraction of labels replaced by the null class")
    parser.add_argument("--input-norm", action="store_true", help="RMSNorm on the layer input (SpecVLM's variant)")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--eval-images", type=int, default=64, help="images for the acceptance measurement (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (several processes under accelerate launch / torchrun: one GPU each)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the drafter's loss")
    parser.add_argument("--force", action="store_true", help="ignore a checkpoint in the work dir; start over")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    """Linear warm-up over `warmup` * total steps, then linear decay to 0 (LANTERN's schedule)."""
    warm = max(1, math.ceil(warmup * total))
    if step < warm:
        return base * (step + 1) / warm
    return base * max(0.0, (total - step) / max(1, total - warm))


# ------------------------------------------------------------------------------------------------------ data
def world_sequences(pipe: LlamaGenPipeline, n: int, seed: int, quiet: bool = True) -> dict[str, torch.Tensor]:
    """World images tokenized by the pipeline's VQ: {"ids": tokens [n, block_size] int16, "labels": [n]}, or for a
    t2i pipeline {"ids", "text_ids" [n, L], "masks" [n, L]} (the captions as its tokenizer gives them)."""
    from image_ar.llamagen.train import tokenize
    from image_ar.llamagen.train_t2i import caption_data
    from mmspec.data import IMAGE_SIZES

    target, size = pipe.transformer, pipe.image_size()
    if size not in IMAGE_SIZES:
        raise InputError(f"--data world tokenizes world images of {' or '.join(map(str, IMAGE_SIZES))} pixels, but "
                         f"this pipeline makes {size}x{size} images ({target.config.block_size} tokens, VQ factor "
                         f"{pipe.vqvae.downsample_factor}); use --data target (the target's own samples).")
    if target.config.model_type == "t2i":
        return caption_data(pipe.vqvae, pipe.tokenizer, n, seed, max_length=target.config.cls_token_num, quiet=quiet,
                            image_size=size)
    return dict(zip(("ids", "labels"), tokenize(pipe.vqvae, n, seed, image_size=size)))


@torch.no_grad()
def target_sequences(pipe: LlamaGenPipeline, n: int, args: argparse.Namespace,
                     state=None) -> dict[str, torch.Tensor]:
    """The target's own samples (vanilla decoding at --data-guidance / --data-temperature), sample i with its own
    generator (seed * 1000003 + i), each process its `shard`: c2i {"ids": tokens [n, block_size] int16, "labels":
    uniform random labels [n]}; t2i {"ids", "text_ids" [n, L], "masks" [n, L]} of the captions
    (`mmspec.world_training.prompt_list`)."""
    from image_ar.llamagen.text import tokenize_captions

    config = pipe.transformer.config
    t2i = config.model_type == "t2i"
    if t2i:
        captions = prompt_list(args.prompts, n, "train", args.seed)
        calls = [{"prompt": c} for c in captions]
    else:
        labels = torch.randint(0, config.num_classes, (n,), generator=torch.Generator().manual_seed(args.seed))
        calls = [{"class_labels": int(c)} for c in labels]
    pipe.set_progress_bar_config(disable=True)
    mine, ids = shard(range(n), state), []
    for start in tqdm(range(0, len(mine), 64), desc="sampling the target",
                      disable=args.quiet or rank_and_count(state)[0] > 0):
        chunk = mine[start:start + 64]
        key = "prompt" if t2i else "class_labels"
        out = pipe(**{key: [calls[i][key] for i in chunk]}, guidance_scale=args.data_guidance,
                   temperature=args.data_temperature, output_type="latent",
                   generator=[torch.Generator().manual_seed(args.seed * 1_000_003 + i) for i in chunk])
        ids += list(out.tokens.short().cpu())
    ids = torch.stack(gather_shards(ids, state))  # [n, block_size]
    if not t2i:
        return {"ids": ids, "labels": labels}
    text_ids, masks = tokenize_captions(pipe.tokenizer, captions, config.cls_token_num)
    return {"ids": ids, "text_ids": text_ids.short(), "masks": masks.bool()}


def training_data(pipe: LlamaGenPipeline, args: argparse.Namespace, work: Path,
                  state=None) -> dict[str, torch.Tensor]:
    """Token sequences "ids" [n, T] and their conditions ("labels" [n], or "text_ids" / "masks" [n, L] for a t2i
    pipeline), cached in the work dir under the transformer's fingerprint (and the captions' content)."""
    name = (f"{args.data}-{pipe.transformer.config.model_type}-{args.num_train_sequences}-seed{args.seed}-"
            f"{folder_fingerprint(Path(args.pipeline) / 'transformer')}")
    if args.data == "target":
        name += f"-g{args.data_guidance}-t{args.data_temperature}"
        if args.prompts is not None:
            text = "\n".join(prompt_list(args.prompts, args.num_train_sequences, "train", args.seed))
            name += "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    cache = work / f"sequences-{name}.pt"
    first = rank_and_count(state)[0] == 0
    if not cache.is_file() or args.force:
        if args.data == "target":  # every process samples its share
            data = target_sequences(pipe, args.num_train_sequences, args, state)
        elif first:  # the world's images tokenized once, by the first process
            data = world_sequences(pipe, args.num_train_sequences, args.seed, args.quiet)
        if first:
            torch.save(data, cache.with_suffix(".tmp"))
            os.replace(cache.with_suffix(".tmp"), cache)
        wait_for_everyone(state)
    return torch.load(cache, weights_only=True)


@torch.no_grad()
def batch_condition(pipe: LlamaGenPipeline, data: dict[str, torch.Tensor],
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conditions of `rows`: (labels [B], None), or a t2i pipeline's caption condition (features [B, L, D],
    mask [B, L]) from its text_encoder, as `pipe(prompt)` computes it."""
    if "labels" in data:
        return data["labels"][rows].long(), None
    from image_ar.llamagen.text import caption_condition

    device = next(pipe.text_encoder.parameters()).device
    return caption_condition(pipe.text_encoder, data["text_ids"][rows].to(device), data["masks"][rows].to(device))

# ----------------------------------------------------------------------------------------------------- steps
@torch.no_grad()
def teacher_features(target: LlamaGenGPT, idx: torch.Tensor, cond: torch.Tensor, drop: torch.Tensor,
                     cond_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced target on idx [B, T]: features [B, T, dim] (feature i predicts idx[:, i]) and logits
    [B, T, V] (logits i = output(feature i)); cond: labels [B] or caption features [B, L, D] (cond_mask [B, L]),
    with drop [B] bool -> the null class / the null caption (under the caption's mask, as at sampling)."""
    logits = target(idx, cond, drop_mask=drop, cond_mask=cond_mask).logits  # [B, T, V]
    features = target.last_hidden[:, target.config.cls_token_num - 1:]  # [B, T, dim]
    return features, logits


def drafter_loss(drafter: LlamaGenEagleDrafter, features: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor,
                 noise: torch.Tensor, p_weight: float) -> tuple[torch.Tensor, ...]:
    """EAGLE loss on pairs (features_i + noise, idx_i), i < T - 1, predicting features_{i+1}.

    features [B, T, dim], logits [B, T, V], idx [B, T], noise [B, T-1, dim]. Returns (loss, feature SmoothL1,
    soft CE, top-1 agreement of the drafter's and the target's next token), the last three detached.
    """
    pred = drafter(features[:, :-1] + noise, idx[:, :-1])  # [B, T-1, dim]
    return feature_drafter_loss(pred, features[:, 1:], logits[:, 1:], drafter.head, p_weight)


def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def train_drafter(pipe: LlamaGenPipeline, data: dict[str, torch.Tensor], args: argparse.Namespace,
                  work: Path, state=None) -> tuple[LlamaGenEagleDrafter, dict]:
    """Train (or resume) the drafter of pipe.transformer on `data` (`training_data`); returns it in eval mode and
    its training record. With several processes (`state`) each runs its share of every batch (module docstring)."""
    target, ids = pipe.transformer, data["ids"]
    device = next(target.parameters()).device
    rank, count = rank_and_count(state)
    torch.manual_seed(args.seed)
    drafter = LlamaGenEagleDrafter.for_target(target, input_norm=args.input_norm).to(device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt_path = work / "drafter-checkpoint.pt"
    start, elapsed, history = 0, 0.0, []
    if ckpt_path.is_file() and not args.force:
        ckpt = torch.load(ckpt_path, weights_only=True, map_location=device)
        check(ckpt["steps"] == args.steps and ckpt["batch_size"] == args.batch_size,
              f"{ckpt_path} was made with --steps {ckpt['steps']} --batch-size {ckpt['batch_size']}; rerun with "
              "those, or pass --force to start over.")
        drafter.load_state_dict(ckpt["drafter"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"].cpu())
        start, elapsed, history = ckpt["step"], ckpt["seconds"], ckpt["history"]

    def loss_fn(features, logits, idx, noise):
        return drafter_loss(drafter, features, logits, idx, noise, args.p_weight)

    step_loss = loss_fn if args.no_compile else torch.compile(loss_fn)
    share = slice(rank, None, count)  # this process's rows of every batch (all of them in one process)
    t0 = time.perf_counter() - elapsed
    bar = tqdm(range(start, args.steps), desc="eagle drafter", initial=start, total=args.steps,
               disable=args.quiet or rank > 0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        rows = torch.randint(0, ids.shape[0], (args.batch_size,), generator=gen)  # the same in every process
        drop = torch.rand(args.batch_size, generator=gen) < args.null_prob  # [B]
        rows, drop = rows[share], drop[share]
        idx = ids[rows].long().to(device)  # [b, T] this share's
        cond, cond_mask = batch_condition(pipe, data, rows)  # [b] labels, or [b, L, D] captions and [b, L]
        cond = cond.to(device)
        cond_mask = None if cond_mask is None else cond_mask.to(device)
        features, logits = teacher_features(target, idx, cond, drop.to(device), cond_mask)
        t, dim = features.shape[1:]
        noise = (torch.rand((args.batch_size, t - 1, dim), generator=gen) - 0.5) * args.noise  # the whole batch's
        loss, *losses = step_loss(features, logits, idx, noise[share].to(device, features.dtype))
        loss, (vloss, ploss, agree) = weigh_share(loss, tuple(losses), torch.tensor(float(len(idx))), state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(drafter.parameters(), state)
        torch.nn.utils.clip_grad_value_(drafter.parameters(), args.grad_clip)
        opt.step()
        history.append([float(vloss), float(ploss), float(agree)])
        if step % 25 == 0:
            bar.set_postfix(vloss=f"{vloss:.4f}", ploss=f"{ploss:.3f}", top1=f"{agree:.3f}")
        if rank == 0 and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            _save_checkpoint(ckpt_path, {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
                                         "generator": gen.get_state(), "step": step + 1, "steps": args.steps,
                                         "batch_size": args.batch_size, "seconds": time.perf_counter() - t0,
                                         "history": history})
    seconds = time.perf_counter() - t0
    last = torch.tensor(history[-50:]).mean(0).tolist() if history else [float("nan")] * 3
    info = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seconds": seconds,
            "final_feature_smoothl1": last[0], "final_soft_ce": last[1], "final_top1_agreement": last[2],
            "first_feature_smoothl1": history[0][0] if history else None,
            "first_soft_ce": history[0][1] if history else None,
            "parameters": sum(p.numel() for p in drafter.parameters()), "processes": count}
    wait_for_everyone(state)  # (every process has read the checkpoint before the first removes it)
    return drafter.eval(), info


# -------------------------------------------------------------------------------------------------- measure
def is_world_pipeline(pipe: LlamaGenPipeline) -> bool:
    """True when the pipeline makes world images (a world image size, 32 or 64 px; c2i: the world's classes), which
    the world judge can score (it resizes to its own input size)."""
    from mmspec.data import IMAGE_SIZES, NUM_CLASSES

    target = pipe.transformer.config
    return pipe.image_size() in IMAGE_SIZES and (target.model_type == "t2i" or target.num_classes == NUM_CLASSES)


def eval_conditions(pipe: LlamaGenPipeline, n: int, seed: int,
                    prompts: str | None = None) -> tuple[dict, Callable[[torch.Tensor], float] | None]:
    """The call arguments of n eval images (c2i: classes round-robin; t2i: captions of n held-out world scenes, or
    the first n of the user's `prompts` file, cycled) and the judge's score of their images (class accuracy; t2i: the
    rate at which every caption attribute agrees; None for the user's captions)."""
    from mmspec.data import generate_batch
    from mmspec.metrics import attribute_agreement, class_accuracy
    from mmspec.world_training import IMAGE_SIZE

    if prompts is not None:
        return {"prompt": prompt_list(prompts, n, "train", seed)}, None
    if pipe.transformer.config.model_type == "t2i":
        batch = generate_batch(n, seed, split="val", image_size=IMAGE_SIZE)  # the captions: the same at any size
        return {"prompt": batch.captions}, lambda images: attribute_agreement(images, batch)["all_attributes"]
    labels = torch.arange(n) % pipe.transformer.config.num_classes  # [n]
    return {"class_labels": labels.tolist()}, lambda images: class_accuracy(images, labels)


@torch.no_grad()
def measure_acceptance(pipe: LlamaGenPipeline, n: int, seed: int, prompts: str | None = None) -> dict:
    """Mean acceptance length (emitted tokens per row and verify call, bonus included), target forwards, wall
    time and (world pipelines) the world judge's score (`eval_conditions`) of vanilla / eagle / lantern on n images
    (one generator per image), one batch each, at temperature 0 and at the pipeline's default sampling (guidance
    4.0, temperature 1.0, no top-k / top-p). The trees are the configured ones (`budget="fixed"`): what the drafter
    accepts, not what this device's budget would choose."""
    check_positive_int("eval images", n)
    pipe.set_progress_bar_config(disable=True)
    conditions, score = eval_conditions(pipe, n, seed, prompts)
    judge = score is not None and is_world_pipeline(pipe)
    runs = {"vanilla, temperature 0": ("vanilla", 0.0), "eagle, temperature 0": ("eagle", 0.0),
            "vanilla, default sampling": ("vanilla", 1.0), "eagle, default sampling": ("eagle", 1.0),
            "lantern, temperature 0": ("lantern", 0.0), "lantern, default sampling": ("lantern", 1.0)}
    out = {}
    for name, (method, temperature) in runs.items():
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]
        result = pipe(**conditions, temperature=temperature, method=method, generator=gens, budget="fixed",
                      output_type="pt" if judge else "latent")
        stats = result.stats
        out[name] = {"mean_acceptance_length": stats.mean_acceptance_length,
                     "target_forwards": stats.num_target_forwards, "seconds": stats.wall_time,
                     "judge_accuracy": score(result.images) if judge else None}
    where = ("the first captions of --prompts (trained on; fresh samples)" if prompts is not None else
             "held-out world captions" if pipe.transformer.config.model_type == "t2i" else "classes round-robin")
    return {"n": n, "conditions": where, "runs": out}


# ------------------------------------------------------------------------------------------------------ run
def register_component(pipeline_dir: Path, out: Path) -> bool:
    """Add eagle_drafter to PIPELINE/model_index.json when out is PIPELINE/eagle_drafter; True if it did."""
    index = pipeline_dir / "model_index.json"
    if out.resolve() != (pipeline_dir / COMPONENT).resolve() or not index.is_file():
        return False
    data = json.loads(index.read_text())
    data[COMPONENT] = COMPONENT_ENTRY
    tmp = index.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(index)
    return True


def _card(command: str, info: dict) -> str:
    tr, cfg = info["train"], info["config"]
    lines = [
        "# EAGLE drafter (eagle_drafter)",
        "",
        "LANTERN's LlamaGen drafter (EAGLE-1/2 style) for this pipeline's transformer: fc([token embedding ; target",
        "feature]) -> one LlamaGen decoder layer (2D RoPE at the target's positions) -> the target's frozen head.",
        "The token embeddings and head are the target's (shared, not stored here). Used by the methods `eagle` and",
        "`lantern` (EAGLE-2 dynamic trees; see docs/eagle_lantern.md). Made by:",
        "",
        f"    {command}",
        "",
        f"Machine: {info['machine']}.",
        "",
        f"- Architecture: {json.dumps(cfg)}; {tr['parameters'] / 1e6:.3f}M trained parameters.",
        f"- Data: {info['data']}.",
        f"- Training: {tr['steps']} steps x {tr['batch_size']} sequences, AdamW lr {tr['lr']} (betas 0.9, 0.95), "
        f"seed {info['seed']}, {tr['seconds']:.0f} s of training; the whole command (data, training, measurement) "
        f"took {info['command_seconds']:.0f} s.",
        f"- Losses (mean of the last 50 steps): feature SmoothL1 {tr['final_feature_smoothl1']:.4f} (first step "
        f"{tr['first_feature_smoothl1']:.4f}), soft cross-entropy {tr['final_soft_ce']:.3f} (first step "
        f"{tr['first_soft_ce']:.3f}), top-1 agreement with the target's next token "
        f"{tr['final_top1_agreement']:.3f} (teacher-forced, training batches).",
    ]
    if "acceptance" in info:
        acc = info["acceptance"]
        lines += ["", f"## Measured acceptance ({acc['n']} images, one batch, default tree "
                  f"top_k {info['tree']['top_k']}, depth {info['tree']['depth']}, total_tokens "
                  f"{info['tree']['total_tokens']})", "",
                  f"Conditions: {acc.get('conditions', 'see training.json')}.",
                  "Mean acceptance length = emitted tokens per row and verify call (bonus included; vanilla = 1).",
                  "Target forwards = verify calls for the whole batch, prefill included (vanilla: one per token).",
                  "Default sampling = the pipeline's defaults: guidance 4.0, temperature 1.0, no top-k / top-p;",
                  "lantern uses k 1000, delta 0.1. Wall times are this CPU's, for orientation only.", "",
                  "Judge accuracy = the world judge's class accuracy on these images (t2i: the rate at which every",
                  "attribute of the caption agrees; a small sample; `mmspec bench` measures quality properly).", "",
                  "| run | mean acceptance length | target forwards | wall time (s) | judge accuracy |",
                  "|---|---|---|---|---|"]
        for name, r in acc["runs"].items():
            judge = "-" if r["judge_accuracy"] is None else f"{r['judge_accuracy']:.3f}"
            lines.append(f"| {name} | {r['mean_acceptance_length']:.3f} | {r['target_forwards']} | "
                         f"{r['seconds']:.1f} | {judge} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from image_ar.llamagen.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS

    for name in ("num_train_sequences", "steps", "batch_size", "checkpoint_every"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    check(args.eval_images >= 0, f"--eval-images must be >= 0, got {args.eval_images}.")
    if args.data is None:
        args.data = "target" if args.prompts is not None else "world"
    check(args.prompts is None or args.data == "target",
          "--prompts are sampled by the target: use --data target (or leave --data out).")
    if args.prompts is not None:
        prompt_list(args.prompts, 1, "train", args.seed)  # a bad file fails before the model loads
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    pipeline_dir = Path(args.pipeline)
    check((pipeline_dir / "model_index.json").is_file(),
          f"--pipeline {pipeline_dir} is not a LlamaGen pipeline folder (no model_index.json); make one with "
          "`mmspec train llamagen` or `mmspec convert llamagen`.")
    out = Path(args.out) if args.out is not None else pipeline_dir / COMPONENT
    args.out = str(out)  # the card's command names the folder it wrote
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    config = pipeline_dir / "transformer" / "config.json"
    kind = json.loads(config.read_text()).get("model_type", "c2i") if config.is_file() else None
    check(args.prompts is None or kind in (None, "t2i"), "--prompts are captions for a text-to-image pipeline; this "
          "one is class-conditional (--data target samples uniform random classes).")
    state = process_state(cpu=args.device == "cpu")  # several processes: accelerate launch / torchrun
    pipe = LlamaGenPipeline.from_pretrained(pipeline_dir)
    pipe.eagle_drafter = None  # train a fresh one (an existing component is replaced at the end)
    pipe.to(args.device if state is None or args.device == "cpu" else state.device)
    target = pipe.transformer.eval().requires_grad_(False)
    t2i = target.config.model_type == "t2i"
    data = training_data(pipe, args, work, state)
    drafter, train_info = train_drafter(pipe, data, args, work, state)
    if rank_and_count(state)[0] > 0:  # the first process measures and writes
        return 0
    ids = data["ids"]
    captions = "your captions (--prompts)" if args.prompts is not None else "world captions"

    info = {"machine": machine_summary(), "seed": args.seed, "train": train_info,
            "config": {k: v for k, v in drafter.config.items() if not k.startswith("_")},
            "data": (f"{ids.shape[0]} world images tokenized by the pipeline's VQ" if args.data == "world" else
                     f"{ids.shape[0]} samples of the target (guidance {args.data_guidance}, temperature "
                     f"{args.data_temperature}" + (f", on {captions}" if t2i else "") + ")") +
                    (f" with their captions, {args.null_prob:.0%} of them replaced by "
                                                     "the null caption" if t2i else
                                                     f", {args.null_prob:.0%} of labels replaced by the null class"),
            "tree": {"top_k": DEFAULT_TOP_K, "depth": DEFAULT_DEPTH, "total_tokens": DEFAULT_TOTAL_TOKENS}}
    if args.eval_images > 0:
        pipe.eagle_drafter = drafter
        info["acceptance"] = measure_acceptance(pipe, args.eval_images, args.seed, args.prompts)
    info["command_seconds"] = time.perf_counter() - start
    command = explicit_command("mmspec train llamagen-drafter", args, [
        "pipeline", "out", "data", *(["prompts"] if args.prompts else []), "num_train_sequences", "steps",
        "batch_size", "lr", "noise", "seed", "threads"])
    with atomic_output_dir(out) as tmp:
        drafter.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        card_text = with_metadata(
            _card(command, info),
            pipeline_tag="text-to-image" if t2i else "unconditional-image-generation",
            tags=["llamagen", "eagle", "speculative-decoding", *(["world"] if args.prompts is None else [])])
        (tmp / "README.md").write_text(card_text)
    registered = register_component(pipeline_dir, out)
    ckpt = work / "drafter-checkpoint.pt"
    if ckpt.is_file():
        ckpt.unlink()  # finished: a rerun trains afresh instead of resuming a completed run
    print(json.dumps({k: info[k] for k in ("train", "acceptance") if k in info}, indent=2))
    print(f"wrote {out}" + (f" (registered in {pipeline_dir / 'model_index.json'})" if registered else ""))
    return 0

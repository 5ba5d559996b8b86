"""`mmspec train image-ar-drafter`: train an EAGLE drafter (LANTERN's recipe) for a transformers AR image generator.

    mmspec train image-ar-drafter --model Janus-Pro-1B --prompts prompts.txt   # writes Janus-Pro-1B/drafters/eagle

Stages (a rerun skips finished ones unless --force):
1. `data`: the target's own samples: --num-train prompts (a text file, one prompt a line, cycled; default the
   world's train captions) each generated once by the target alone at its default CFG scale and sampling
   (`--data-temperature`, `--data-top-k`), as LANTERN trains on the target's outputs. Cached in --work-dir under a
   fingerprint of the model's weights (`mmspec.hf_loading.folder_fingerprint`) and of the prompts.
2. `drafter`: each step teacher-forces the frozen target on a batch (its CFG rows too: the drafter drafts both
   halves) and reads its final normed features f_0..f_{T-1} (f_j predicts image token j) and logits; the drafter
   sees the pairs (tok_j, f_j + noise), j < T - 1, and learns f_{j+1}:

       loss = SmoothL1(h_j, f_{j+1}) + --p-weight * CE(softmax(head(f_{j+1})), log_softmax(head(h_j)))

   (`mmspec.feature_drafter.feature_drafter_loss`). Uniform feature noise of width --noise, AdamW (0.9, 0.95),
   warm-up then linear decay, gradient-norm clipping at 0.5 (`mmspec.world_training.optimizer_step`). Resumable state
   in --work-dir every --checkpoint-every steps.
3. `eval`: on --eval-prompts held-out prompts (the world's val captions, or the file's first lines), greedy `eagle`
   vs the target alone: token-for-token equality, mean acceptance length, step compression; at the model's
   default sampling, the mean acceptance length. Written to training.json and the card README.md.

The drafter (`image_ar.transformers_ar.eagle.ImageAREagleDrafter`) is saved in MODEL/drafters/eagle (or --out),
where the pipelines' `from_pretrained` finds it.

Several processes (`torchrun --nproc_per_node N -m mmspec train image-ar-drafter ...` or `accelerate launch`; gloo
on the CPU, `--device cuda` one GPU each): each samples its share of the prompts (every prompt with its own seeded
generator, as in one process), and every step each draws the same batch and noise, teacher-forces its share of the
rows and weighs its loss by its share of the rows; the averaged gradients are one process's (`mmspec.processes`).
The first process writes checkpoints, the drafter and the card, and runs the eval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from image_ar.transformers_ar.eagle import ImageAREagleDrafter
from image_ar.transformers_ar.pipeline import EAGLE_FOLDER, TransformersImagePipeline
from mmspec.data.artifacts import atomic_output_dir, explicit_command, machine_summary
from mmspec.errors import check, check_positive_int
from mmspec.feature_drafter import feature_drafter_loss
from mmspec.hf_loading import folder_fingerprint
from mmspec.lm import GuidedRunner
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
from mmspec.world_training import (
    card_head,
    optimizer_step,
    prompt_list,
    record_training_step,
    resume_training,
    write_info,
)

STAGES = ("data", "drafter", "eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a local Janus, Emu3 or Lumina-mGPT folder in transformers' layout")
    parser.add_argument("--prompts", "--data", dest="prompts", default=None,
                        help="your captions: a text file, one prompt a line (default: world captions)")
    parser.add_argument("--out", default=None, help=f"drafter folder (default: MODEL/{EAGLE_FOLDER.as_posix()})")
    parser.add_argument("--work-dir", default="runs/image-ar-drafter", help="scratch folder (samples, checkpoints)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of data,drafter,eval")
    parser.add_argument("--num-train", type=int, default=256, help="images the target samples to train on")
    parser.add_argument("--data-temperature", type=float, default=1.0, help="sampling temperature of the samples")
    parser.add_argument("--data-top-k", type=int, default=None, help="top-k of the samples (default: the family's)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise on input features")
    parser.add_argument("--p-weight", type=float, default=0.1, help="weight of the soft cross-entropy")
    parser.add_argument("--input-norm", action="store_true", help="RMSNorm on the layer input (SpecVLM's variant)")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the acceptance measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (several processes under accelerate launch / torchrun: one GPU each)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="redo finished stages; ignore a checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


# ------------------------------------------------------------------------------------------------------ data
def family_top_k(pipe: TransformersImagePipeline) -> int:
    """The top-k a call of this pipeline samples at by default: the pipeline's own where it depends on the model
    (Lumina-mGPT: 2000 for 1.0, 4096 for 2.0), else its family's."""
    from image_ar.transformers_ar.family import DEFAULTS

    own = getattr(pipe, "default_top_k", None)
    return own if own is not None else DEFAULTS[pipe.model_type]["top_k"]


@torch.no_grad()
def sample_data(pipe: TransformersImagePipeline, args: argparse.Namespace, work: Path,
                state=None) -> dict[str, Any]:
    """The target's own samples of --num-train prompts: {"prompts": [N], "tokens": [N, T]}, cached in work; with
    several processes (`state`) each samples its `shard` of the prompts (prompt i with seed seed * 1000003 + i)."""
    top_k = family_top_k(pipe) if args.data_top_k is None else args.data_top_k
    prompts = prompt_list(args.prompts, args.num_train, "train", args.seed)
    text = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:12]  # the prompts' content, not their file's name
    path = work / (f"samples-{folder_fingerprint(args.model)}-{text}-seed{args.seed}-t{args.data_temperature:g}"
                   f"-k{top_k}.pt")
    if path.is_file() and not args.force:
        return torch.load(path, weights_only=True)
    tokens, mine = [], shard(range(len(prompts)), state)
    for start in tqdm(range(0, len(mine), 16), desc="sampling the target",
                      disable=args.quiet or rank_and_count(state)[0] > 0):
        chunk = mine[start:start + 16]
        gens = [torch.Generator().manual_seed(args.seed * 1_000_003 + i) for i in chunk]
        tokens += list(pipe([prompts[i] for i in chunk], temperature=args.data_temperature, top_k=top_k,
                            generator=gens, output_type="latent").tokens.cpu())
    data = {"prompts": prompts, "tokens": torch.stack(gather_shards(tokens, state)).to(torch.int32)}
    if rank_and_count(state)[0] == 0:
        work.mkdir(parents=True, exist_ok=True)
        torch.save(data, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    wait_for_everyone(state)
    return data


@torch.no_grad()
def teacher_features(pipe: TransformersImagePipeline, prompts: list[str], tokens: torch.Tensor) -> torch.Tensor:
    """The target's final normed features [R, T, H] over finished tokens [B, T] (R = 2B with CFG, the rows as the
    pipeline's call builds them): column j is the feature that predicts token j (the prompt's last, then token
    j - 1's)."""
    lm = pipe.lm
    inputs, prefill, scale, _ = pipe.scoring_inputs(prompts, None)
    guided = scale != 1.0
    runner = GuidedRunner(lm, scale if guided else None, prefill(guided))
    runner.prefill(inputs, extra_capacity=tokens.shape[1])
    last = (lm.prompt_lengths - 1).view(-1, 1, 1).expand(-1, -1, lm.last_hidden.shape[-1])
    first = lm.last_hidden.gather(1, last)  # [R, 1, H] f_0
    slots = runner.slots(tokens.shape[1] - 1)  # [B, T-1]
    runner.forward(tokens[:, :-1].to(lm.device), slots, slots)  # lm.last_hidden [R, T-1, H]
    return torch.cat([first, lm.last_hidden], dim=1)  # [R, T, H]


# ------------------------------------------------------------------------------------------------------ train
def drafter_step_loss(drafter: ImageAREagleDrafter, pipe: TransformersImagePipeline, prompts: list[str],
                      tokens: torch.Tensor, noise: float, p_weight: float, generator: torch.Generator,
                      share: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """LANTERN's loss on one batch (see the module docstring): (loss, feature SmoothL1, soft CE, top-1 agreement).
    `share`: the rows of the batch this process runs (the noise is drawn for the whole batch, this share taken)."""
    batch = tokens.shape[0]
    prompts, tokens = prompts[share], tokens[share]
    features = teacher_features(pipe, prompts, tokens).float()  # [R, T, H]
    rows = features.shape[0] // tokens.shape[0]  # 2 with CFG: both halves see the same tokens
    tokens = tokens.to(features.device).repeat(rows, 1)  # [R, T]
    with torch.no_grad():
        embeds = pipe.lm.embed_tokens(tokens[:, :-1]).float()  # [R, T-1, H]
        next_logits = pipe.lm.head(features[:, 1:]).float()  # [R, T-1, V]
    t, h = features.shape[1:]
    jitter = (torch.rand((rows * batch, t - 1, h), generator=generator) - 0.5) * noise  # the whole batch's draws
    jitter = jitter.view(rows, batch, t - 1, h)[:, share].reshape(-1, t - 1, h)  # [R, T-1, H] this share's
    pred = drafter(embeds, features[:, :-1] + jitter.to(features.device))  # [R, T-1, H]
    return feature_drafter_loss(pred, features[:, 1:], next_logits, drafter.head, p_weight)


def train_drafter(pipe: TransformersImagePipeline, data: dict, args: argparse.Namespace, work: Path,
                  state=None) -> tuple[ImageAREagleDrafter, dict]:
    torch.manual_seed(args.seed)
    drafter = ImageAREagleDrafter.for_target(pipe.lm, input_norm=args.input_norm).float().train()
    rank, count = rank_and_count(state)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    settings = json.dumps({k: getattr(args, k) for k in ("num_train", "steps", "batch_size", "lr", "noise",
                                                          "p_weight", "input_norm", "seed")}, sort_keys=True)
    state_path = work / f"eagle-{folder_fingerprint(args.model)}-state.pt"
    first, seconds, history = resume_training(state_path, settings, drafter, opt, gen, args.force)
    start = time.perf_counter() - seconds
    bar = tqdm(range(first, args.steps), desc="eagle drafter", initial=first, total=args.steps,
               disable=args.quiet or rank > 0)
    for step in bar:
        rows = torch.randint(0, len(data["prompts"]), (args.batch_size,), generator=gen).tolist()
        share = slice(rank, None, count)  # this process's rows (all of them in one process)
        loss, *losses = drafter_step_loss(drafter, pipe, [data["prompts"][r] for r in rows],
                                          data["tokens"][rows].long(), args.noise, args.p_weight, gen, share)
        loss, losses = weigh_share(loss, tuple(losses), torch.tensor(float(len(rows[share]))), state)
        optimizer_step(opt, loss, step, args.steps, args.lr, max_grad_norm=0.5,
                       after_backward=lambda: average_gradients(drafter.parameters(), state))
        record_training_step(state_path, args.checkpoint_every if rank == 0 else 0, step, args.steps, losses, bar,
                             settings, drafter, opt, gen, time.perf_counter() - start, history)
    last = torch.tensor(history[-50:]).mean(0).tolist() if history else [float("nan")] * 3
    info = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "noise": args.noise,
            "p_weight": args.p_weight, "input_norm": args.input_norm, "num_train": len(data["prompts"]),
            "seconds": time.perf_counter() - start, "final_feature_smoothl1": last[0], "final_soft_ce": last[1],
            "final_top1_agreement": last[2], "first_top1_agreement": history[0][2] if history else None,
            "parameters": sum(p.numel() for p in drafter.parameters()), "processes": count}
    wait_for_everyone(state)  # (every process has read the state before the first removes it)
    if rank == 0:
        state_path.unlink(missing_ok=True)
    return drafter.eval(), info


# ------------------------------------------------------------------------------------------------------ eval
@torch.no_grad()
def evaluate(pipe: TransformersImagePipeline, args: argparse.Namespace) -> dict:
    """Greedy eagle vs the target alone on held-out prompts; eagle's acceptance at the default sampling."""
    prompts = prompt_list(args.prompts, args.eval_prompts, "val", args.seed)
    vanilla = pipe(prompts, temperature=0.0, output_type="latent")
    eagle = pipe(prompts, temperature=0.0, method="eagle", budget="fixed", output_type="latent")
    sampled = pipe(prompts, method="eagle", budget="fixed", top_k=family_top_k(pipe), output_type="latent",
                   generator=[torch.Generator().manual_seed(args.seed + i) for i in range(len(prompts))])
    return {"n": len(prompts), "greedy_equal_to_vanilla": torch.equal(eagle.tokens, vanilla.tokens),
            "mean_acceptance_length": eagle.stats.mean_acceptance_length,
            "step_compression": vanilla.stats.num_target_forwards / max(1, eagle.stats.num_target_forwards),
            "sampled_mean_acceptance_length": sampled.stats.mean_acceptance_length}


def _card(command: str, info: dict, model_type: str) -> str:
    d, ev = info["drafter"], info.get("eval")
    lines = card_head(f"EAGLE drafter for a {model_type} model",
                      ["An EAGLE feature drafter (fc + one Llama decoder layer over the target's features and "
                       "embeddings; the target's own head) trained on the target's own samples (LANTERN's recipe)."],
                      command, machine_summary())
    lines.append(f"| drafter | fc + 1 decoder layer, input norm {d['input_norm']}, {d['parameters'] / 1e6:.2f}M "
                 f"parameters | {d['steps']} steps x batch {d['batch_size']} on {d['num_train']} samples | "
                 f"{d['seconds']:.0f} s |")
    lines += ["", f"Final top-1 agreement with the target (training batches, last 50 steps): "
                  f"{d['final_top1_agreement']:.3f}."]
    if ev:
        lines.append(f"Held-out prompts ({ev['n']}), greedy: mean acceptance length {ev['mean_acceptance_length']:.2f} "
                     f"(bonus included), step compression {ev['step_compression']:.2f}x, token-for-token equal to the "
                     f"target alone: {ev['greedy_equal_to_vanilla']}; at the default sampling: mean acceptance "
                     f"length {ev['sampled_mean_acceptance_length']:.2f}.")
    return "\n".join(lines) + "\n"


def load_pipeline(folder: str, device: str | torch.device = "cpu") -> TransformersImagePipeline:
    """The Janus, Emu3 or Lumina-mGPT pipeline of a model folder (one-line refusal of anything else, before weights
    load; a Lumina-mGPT folder's processor is its tokenizer)."""
    import image_ar.transformers_ar as pipelines
    from image_ar.transformers_ar.support import check_image_generator
    from mmspec.hf_loading import PROCESSOR_FILES, read_folder_config

    config = read_folder_config(folder, "Janus, Emu3 or Lumina-mGPT model",
                                processor_files=(*PROCESSOR_FILES, "tokenizer_config.json"))
    found = check_image_generator(config, f"the model in {folder}")
    cls = {"janus": pipelines.JanusPipeline, "emu3": pipelines.Emu3Pipeline,
           "lumina-mgpt": pipelines.LuminaMGPTPipeline}[found]
    pipe = cls.from_pretrained(folder).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(args: argparse.Namespace) -> int:
    for name in ("num_train", "steps", "batch_size", "eval_prompts"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    check(stages and not set(stages) - set(STAGES), f"--stages takes a subset of {','.join(STAGES)}, got "
                                                    f"{args.stages!r}.")
    if args.prompts is not None:
        prompt_list(args.prompts, 1, "train", args.seed)  # a bad file fails before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else Path(args.model) / EAGLE_FOLDER
    work = Path(args.work_dir)
    state = process_state(cpu=args.device == "cpu")  # several processes: accelerate launch / torchrun
    pipe = load_pipeline(args.model, args.device if state is None or args.device == "cpu" else state.device)
    pipe.model.requires_grad_(False)
    info = json.loads((out / "training.json").read_text()) if (out / "training.json").is_file() else {}
    if "drafter" in stages and (args.force or not (out / "config.json").is_file()):
        data = sample_data(pipe, args, work, state)
        drafter, info["drafter"] = train_drafter(pipe, data, args, work, state)
        if rank_and_count(state)[0] == 0:
            with atomic_output_dir(out) as tmp:
                drafter.save_pretrained(tmp)
                write_info(tmp / "training.json", info)
    elif "data" in stages:
        sample_data(pipe, args, work, state)
    wait_for_everyone(state)
    if rank_and_count(state)[0] > 0:  # the first process evaluates and writes the card
        return 0
    if "eval" in stages:
        check((out / "config.json").is_file(), f"no drafter in {out} to evaluate: run the drafter stage first.")
        pipe.load_eagle_drafter(out)
        info["eval"] = evaluate(pipe, args)
        write_info(out / "training.json", info)
        if "drafter" in info:
            command = explicit_command("mmspec train image-ar-drafter", args, [
                "model", *(["prompts"] if args.prompts else []), *(["out"] if args.out else []), "num_train",
                "data_temperature", "steps", "batch_size", "lr", "noise", "p_weight", "seed", "threads"])
            (out / "README.md").write_text(with_metadata(_card(command, info, pipe.model_type),
                                                         pipeline_tag="text-to-image",
                                                         tags=[pipe.model_type, "speculative-decoding", "eagle"]))
        print(json.dumps(info["eval"], indent=2))
    print(f"wrote {out}")
    return 0

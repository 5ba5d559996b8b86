"""`mmspec train vlm-drafter`: train a VLM drafter (EagleVLM, ViSpec, MSD, SpecVLM or EAGLE-3) for a VLM target on long
answers (the target's own, or the dataset's for MSD, as each method's code does).

    mmspec train vlm-drafter --kind eagle --target assets/vlm          # writes assets/vlm/drafters/eagle

    mmspec train vlm-drafter --target MODEL --data rows.jsonl --image-folder images/   # on your own rows

Stages (a rerun skips finished ones unless --force):
1. `data`: the target answers --num-train world questions (train split, the long-answer prompt, greedy,
   up to --answer-max-tokens tokens), or with `--data` the rows of a user's JSON Lines / LLaVA JSON / `datasets`
   folder (`vlm.user_data`; --eval-prompts of them held out for the eval; a row of several exchanges gives one
   example per exchange, the exchanges before it in its prompt, unless `--turns first`): drafters learn the target's own
   outputs (self-distillation), as ViSpec, SpecVLM and EAGLE-3 prescribe (a drafter trained on reference texts
   drafts what the target would not say); `--answers dataset` (MSD's default) takes the data's own answers
   instead. Cached in --work-dir under a fingerprint of the target's weights (`mmspec.hf_loading.folder_fingerprint`)
   and of the data, so another target or data never reuses them.
2. `drafter`: each step runs the frozen target over a batch of (prompt + answer) sequences
   (`vlm.target.prefill_vlm`: merged input embeddings e and final normed features f) and trains the drafter on
   the pairs (e_{i+1}, f_i + noise) to predict f_{i+1} on the positions that draft answer tokens. `--kind eagle`
   (EagleVLM): EAGLE's loss `SmoothL1 + --p-weight * soft CE` (`mmspec.feature_drafter.feature_drafter_loss`).
   Uniform feature noise of width --noise * 512 / L for a row of L tokens (EAGLE's code; `--noise-scaling
   fixed` for width --noise), AdamW (0.9, 0.95), the world trainers' schedule, gradients clipped at 0.5.
   `--kind vispec`: the official two stages (`vlm.vispec`): the first --text-only-fraction of the steps on text
   alone (the target runs them with no image): a `--text-data FILE` corpus as the official code trains it
   (`vlm.text_data`), else the training sequences without their image (a deviation), then multimodal steps with the
   L1-of-distributions loss over the plain and the anti-shortcut pass. `--kind msd`: MSD's decoupled inputs and
   its schedule (`vlm.msd.msd_visual_probability`; text steps as vispec's) on the dataset's answers. `--kind
   specvlm`: the elastic compressor and its gate (straight-through Gumbel-softmax) trained with the target as
   online teacher on every batch (`vlm.specvlm`). `--kind eagle3`: EAGLE-3's training-time test over the fused
   layer inputs (`mmspec.eagle3.ttt_loss`, `--ttt-steps`, `--draft-vocab`), over ViSpec's compressed layout with
   `--vision-adaptor` (`vlm.eagle3`). Layer 0's input norm follows the kind (`--input-norm`).
   `--group-by-length` draws batches of rows of similar length (`mmspec.world_training.length_grouped_batch`):
   less padding on data whose answers differ in length.
   Resumable state in --work-dir every --checkpoint-every steps (per kind and target; removed once the drafter is
   saved). Learning rates are the world's (1e-3 for these small drafters; the papers use 3e-6 (ViSpec) and 5e-5
   (MSD) for 7B-scale ones).
3. `eval`: on held-out test scenes (or the held-out --data rows), greedy EagleVLM vs the target alone
   (`SpeculativeVLM`): token-for-token equality, mean acceptance length, step compression; written to
   training.json and the card README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mmspec.data.artifacts import ASSETS_DIR, atomic_output_dir, explicit_command, machine_summary
from mmspec.eagle3 import TTT_STEPS, draft_vocabulary
from mmspec.errors import check, check_positive_int
from mmspec.hf_loading import folder_fingerprint
from mmspec.model_card import with_metadata
from mmspec.processes import (
    average_gradients,
    process_state,
    rank_and_count,
    wait_for_everyone,
    weigh_share,
)
from mmspec.tree import MAX_CHAIN_DEPTH
from mmspec.world_training import (
    card_head,
    length_grouped_batch,
    optimizer_step,
    record_training_step,
    resume_training,
    write_info,
)
from vlm.drafter_data import answer_cache, answer_source, training_rows
from vlm.drafter_data import data_id as data_identity
from vlm.drafter_losses import LOSSES, feature_noise
from vlm.family import DRAFTER_KINDS, drafter_model
from vlm.msd import msd_visual_probability
from vlm.pipeline import SpeculativeVLM, load_drafter
from vlm.target import VLMInputs, prefill_vlm
from vlm.text_data import read_text_conversations, text_corpus
from vlm.user_data import TURNS, VLMData
from vlm.world import world_vqa_examples

STAGES = ("data", "drafter", "eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", default="eagle", choices=sorted(DRAFTER_KINDS), help="drafter method")
    parser.add_argument("--target", default=str(ASSETS_DIR / "vlm"), help="the target's folder (mmspec train vlm)")
    parser.add_argument("--out", default=None, help="drafter folder (default: TARGET/drafters/KIND)")
    parser.add_argument("--work-dir", default="runs/vlm-drafter", help="scratch: answer cache, resumable state")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--force", action="store_true", help="redo finished stages")
    parser.add_argument("--data", default=None, metavar="DATA",
                        help="your own rows: JSON Lines, a LLaVA-style JSON list or a datasets folder of (image, "
                             "conversation) rows (vlm.user_data); default: the embedded world's questions")
    parser.add_argument("--turns", default="all", choices=TURNS,
                        help="--data rows of several exchanges: all = one training example per exchange (the "
                             "exchanges before it in its prompt), first = the first exchange only")
    parser.add_argument("--image-folder", default=None, metavar="DIR",
                        help="where --data's relative image paths start (default: the data file's folder)")
    parser.add_argument("--num-train", type=int, default=None,
                        help="training rows: world questions (default 2000), or the first N of --data's training "
                             "rows (default all)")
    parser.add_argument("--answer-max-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.2, help="uniform noise on input features: width noise * "
                        "512 / L for a row of L tokens (EAGLE's), or noise itself with --noise-scaling fixed")
    parser.add_argument("--noise-scaling", default="eagle", choices=("eagle", "fixed"),
                        help="eagle: width noise * 512 / L (EAGLE's code); fixed: width noise")
    parser.add_argument("--p-weight", type=float, default=0.1, help="weight of the soft cross-entropy")
    parser.add_argument("--text-only-fraction", type=float, default=0.5,
                        help="vispec: the first fraction of the steps trains on text alone (stage 1; the official "
                             "code runs two trainings of equal length)")
    parser.add_argument("--text-data", default=None, metavar="FILE",
                        help="vispec / msd: a JSON Lines text corpus (ShareGPT conversations or prompt / answer rows, "
                             "`vlm.text_data`) for the text-only stage, as the official code trains it; default: the "
                             "multimodal sequences with the image removed")
    parser.add_argument("--input-norm", default="auto", choices=("auto", "on", "off"),
                        help="layer 0's input norm: auto = the kind's (off for eagle, vispec, msd as their code; on "
                             "for specvlm, whose EagleVLM adds it)")
    parser.add_argument("--answers", default="auto", choices=("auto", "target", "dataset"),
                        help="training answers: the target's own greedy long answers, or the dataset's long answers; "
                             "auto = dataset for msd (its code), target for the others (ViSpec, SpecVLM)")
    parser.add_argument("--init-from", default=None, metavar="FOLDER",
                        help="start from this saved drafter of the same kind and target width (fine-tuning, e.g. a "
                             "world- or officially-trained drafter on your --data); default: a fresh drafter")
    parser.add_argument("--group-by-length", action="store_true",
                        help="batches of rows of similar length (less padding on data of mixed lengths)")
    parser.add_argument("--ttt-steps", type=int, default=TTT_STEPS,
                        help="eagle3: steps the training-time test unrolls (EAGLE-3 / SpecForge: 7)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="eagle3: a draft vocabulary of the N most frequent answer tokens (EAGLE-3's 32k for "
                             "Llama 3's 128k); default: the target's whole vocabulary")
    parser.add_argument("--vision-adaptor", action="store_true",
                        help="eagle3: ViSpec's vision adaptor on EAGLE-3's fusion (one compressed image token and a "
                             "global image feature; served by mmspec, not in the official EAGLE-3 format)")
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--eval-prompts", type=int, default=32,
                        help="held-out eval questions: world test scenes, or rows held out of --data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (several processes under accelerate launch / torchrun: one GPU each)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


# --------------------------------------------------------------------------------------------------- training
def default_arguments() -> argparse.Namespace:
    """The command's options at their defaults (what a run left unset)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def row_lengths(vlm: SpeculativeVLM, data: dict, rows: torch.Tensor, text_only: bool) -> torch.Tensor:
    """[B] tokens of each chosen row as `training_batch` lays it out (without its image tokens when text_only)."""
    lengths = data["lengths"][rows]
    if text_only:
        lengths = lengths - (data["ids"][rows, : int(lengths.max())] == vlm.lm.image_token_id).sum(-1)
    return lengths


def training_batch(vlm: SpeculativeVLM, data: dict, rows: torch.Tensor, text_only: bool = False,
                   batch_rows: torch.Tensor | None = None) -> tuple[VLMInputs, torch.Tensor]:
    """VLMInputs of the chosen sequences (trimmed to the longest of `batch_rows`, default `rows`: a process's share
    of a data-parallel batch keeps the whole batch's width) on the target's device, and the loss mask of their pairs
    [B, T-1]: pair i (position i + 1) counts when it predicts an answer token (i + 2 >= prompt length) inside the
    row. `text_only`: the same sequences without their image tokens and without pixels (a text corpus for the
    target: its features never see an image)."""
    batch_rows = rows if batch_rows is None else batch_rows
    image = vlm.lm.image_token_id
    width = int(row_lengths(vlm, data, batch_rows, text_only).max())
    lengths, prompt_lengths = data["lengths"][rows], data["prompt_lengths"][rows]
    ids = data["ids"][rows, : int(data["lengths"][batch_rows].max())]
    pixels, extras = None, {}
    if text_only:  # each row without its image tokens (rows of other image sizes hold other counts), re-padded
        keep = ids != image  # [B, T]
        dropped = (~keep).sum(-1)  # [B]
        lengths, prompt_lengths = lengths - dropped, prompt_lengths - dropped
        kept = torch.full((ids.shape[0], width), vlm.processor.tokenizer.pad_token_id, dtype=ids.dtype)
        for b in range(ids.shape[0]):
            kept[b, : int(lengths[b])] = ids[b][keep[b]][: int(lengths[b])]
        ids = kept
    else:  # the processor's image inputs: pixel_values and what else the target reads (Qwen2-VL's image_grid_thw)
        per_row = [data["images"][int(i)] for i in rows]  # an image, or a list for a row of several
        images = vlm.processor.image_processor([im for row in per_row for im in (row if isinstance(row, list) else
                                                                                 [row])], return_tensors="pt")
        pixels = images.pop("pixel_values")
        extras = {k: v for k, v in images.items() if isinstance(v, torch.Tensor)}
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    pair = torch.arange(width - 1)
    loss_mask = (pair + 2 >= prompt_lengths.unsqueeze(-1)) & (pair + 1 < lengths.unsqueeze(-1))  # [B, T-1]
    device = vlm.lm.device
    pixels = None if pixels is None else pixels.to(device)
    extras = {k: v.to(device) for k, v in extras.items()}
    return VLMInputs(ids.to(device), mask.long().to(device), pixels, extras), loss_mask.to(device)


KIND_TEXT = {"eagle": "EagleVLM feature drafter (one Llama decoder layer over [input embedding ; target feature])",
             "msd": "MSD drafter (EAGLE fusion at text positions, raw visual embeddings at image positions; "
                    "two-stage text-then-multimodal schedule)",
             "specvlm": "SpecVLM drafter (EagleVLM + elastic visual compressor picked per input by a "
                        "question-aware gate; online logit distillation)",
             "vispec": "ViSpec drafter (EagleVLM + vision adaptor: one compressed image token, a global image "
                       "feature fused into later text; anti-shortcut training)",
             "eagle3": "EAGLE-3 drafter (three target layers fused by fc, one Llama decoder layer over [embedding ; "
                       "feature], its own head; training-time test)"}


def answer_token_counts(data: dict, vocab_size: int) -> torch.Tensor:
    """[V] how often each token appears in the training answers (after each row's prompt)."""
    positions = torch.arange(data["ids"].shape[1])  # [T]
    answer = (positions >= data["prompt_lengths"].unsqueeze(-1)) & (positions < data["lengths"].unsqueeze(-1))
    return torch.bincount(data["ids"][answer], minlength=vocab_size)[:vocab_size]


def drafter_state_path(args: argparse.Namespace, work: Path, data_id: str | None = None) -> Path:
    """Where the resumable training state of this kind of drafter for this target (and --data) lives."""
    data = "" if data_id is None else f"-data{data_id}"
    return work / f"{args.kind}-{folder_fingerprint(args.target)}{data}-state.pt"


TEXT_STAGE_KINDS = ("vispec", "msd")  # the kinds whose schedule has a text-only stage (`--text-data`)


def text_data_fingerprint(path: str | None) -> str | None:
    """The --text-data file's path and content hash (a resumed run must train on the same corpus)."""
    if path is None:
        return None
    import hashlib

    return f"{path}:{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}"


def train_drafter(vlm: SpeculativeVLM, data: dict, args: argparse.Namespace, work: Path,
                  text: dict | None = None, data_id: str | None = None, state=None) -> tuple[Any, dict]:
    """Train the drafter (see the module docstring); `text`: the --text-data corpus (`vlm.text_data.text_corpus`)
    the text-only steps draw from, else they take `data`'s sequences without their image; `data_id`: the --data
    fingerprint (a resumed run must train on the same rows). With several processes (`state`, `mmspec.processes`)
    every process draws the same batch and noise, runs the target and the drafter on its share of the rows, and
    weighs its loss by its share of the batch's positions; the averaged gradients are then one process's (eagle,
    msd: up to float order; vispec's and specvlm's layouts and eagle3's later TTT steps and draft vocabulary count
    their own positions, and specvlm's gates draw from a generator per process and step)."""
    torch.manual_seed(args.seed)
    lm = vlm.lm
    norm = {} if args.input_norm == "auto" else {"input_norm": args.input_norm == "on"}
    if args.init_from is None and args.kind == "eagle3":  # its draft vocabulary: the answers' most frequent tokens
        adaptor = {"num_queries": 2} if args.vision_adaptor else {}  # ViSpec's default: 1 token + the global one
        drafter = drafter_model(args.kind).for_target(lm, draft_vocab_size=args.draft_vocab, **adaptor).train()
        if args.draft_vocab:
            drafter.set_draft_vocabulary(draft_vocabulary(answer_token_counts(data, lm.vocab_size), args.draft_vocab))
    elif args.init_from is None:
        drafter = drafter_model(args.kind).for_target(lm, **norm).train()
    else:  # the saved drafter's own config (its input norm included), checked against the target by `attach`
        drafter = load_drafter(args.init_from, args.kind).placed_like(lm.model.lm_head.weight).attach(lm).train()
    loss_fn = LOSSES[args.kind]
    text_steps = int(args.steps * args.text_only_fraction) if args.kind == "vispec" else 0
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    state_path = drafter_state_path(args, work, data_id)
    settings = json.dumps({**{name: getattr(args, name) for name in (
        "kind", "num_train", "answer_max_tokens", "steps", "batch_size", "lr", "noise", "p_weight",
        "text_only_fraction", "input_norm", "noise_scaling", "answers", "seed")},
        "text_data": text_data_fingerprint(args.text_data), "data": data_id, "init_from": args.init_from,
        **({"ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab, "vision_adaptor": args.vision_adaptor}
           if args.kind == "eagle3" else {}),
        "group_by_length": args.group_by_length}, sort_keys=True)
    first, seconds, history = resume_training(state_path, settings, drafter, opt, gen, args.force)
    start = time.perf_counter() - seconds
    rank, count = rank_and_count(state)
    bar = tqdm(range(first, args.steps), desc=f"{args.kind} drafter", initial=first, total=args.steps,
               disable=args.quiet or rank > 0)
    for step in bar:
        if args.group_by_length:
            rows = length_grouped_batch(step, data["lengths"], args.batch_size, args.seed)
        else:
            rows = torch.randint(0, data["ids"].shape[0], (args.batch_size,), generator=gen)
        if args.kind == "msd":  # MSD's schedule: text-only, then visual with a growing probability
            visual = float(torch.rand((), generator=gen)) < msd_visual_probability(step, args.steps)
            stage = "multimodal" if visual else "text"
        else:
            stage = "text" if step < text_steps else "multimodal"
        source = text if stage == "text" and text is not None else data
        if source is text:
            rows = torch.randint(0, text["ids"].shape[0], (args.batch_size,), generator=gen)
        mine = rows[rank::count]  # this process's rows of the batch (all of them in one process)
        inputs, loss_mask = training_batch(vlm, source, mine, text_only=stage == "text", batch_rows=rows)
        with torch.no_grad():
            prefill_vlm(lm, inputs, extra_capacity=1)  # lm.last_hidden, lm.prompt_embeds [b, T, H]
        whole = torch.empty((len(rows), *lm.last_hidden.shape[1:]), dtype=lm.last_hidden.dtype, device="meta")
        noise = feature_noise(whole, row_lengths(vlm, source, rows, stage == "text"), args.noise, args.noise_scaling,
                              gen)[rank::count].to(lm.device)  # [b, T, H] the whole batch's draws, this share
        layout_gen = gen if state is None else torch.Generator().manual_seed(args.seed * 1_000_003 + step * 64 + rank)
        loss, *losses = loss_fn(drafter, lm, inputs, loss_mask, noise, args.p_weight, stage,
                                prompt_lengths=source["prompt_lengths"][mine], generator=layout_gen,
                                ttt_steps=args.ttt_steps)
        loss, losses = weigh_share(loss, tuple(losses), loss_mask.sum(), state)  # by the share's answer positions
        optimizer_step(opt, loss, step, args.steps, args.lr, max_grad_norm=0.5,
                       after_backward=lambda: average_gradients(drafter.parameters(), state))
        record_training_step(state_path, args.checkpoint_every if rank == 0 else 0, step, args.steps, losses, bar,
                             settings, drafter, opt, gen, time.perf_counter() - start, history)
    last = torch.tensor(history[-50:]).mean(0).tolist() if history else [float("nan")] * 3
    info = {"kind": args.kind, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "noise": args.noise, "noise_scaling": args.noise_scaling, "p_weight": args.p_weight,
            "input_norm": bool(getattr(drafter.config, "input_norm", False)), "answers": answer_source(args),
            "text_only_steps": text_steps, "text_data": args.text_data, "data": args.data,
            "group_by_length": args.group_by_length, "init_from": args.init_from,
            "text_data_rows": None if text is None else int(text["ids"].shape[0]),
            "num_train": int(data["ids"].shape[0]), "seconds": time.perf_counter() - start,
            "final_feature_smoothl1": last[0], "final_soft_ce": last[1], "final_top1_agreement": last[2],
            "first_feature_smoothl1": history[0][0] if history else None,
            "first_top1_agreement": history[0][2] if history else None,
            "parameters": sum(p.numel() for p in drafter.parameters()), "processes": count}
    if args.kind == "eagle3":  # its history holds (step 0's soft CE, the TTT steps' mean soft CE, step 0's top-1)
        info.update(final_feature_smoothl1=None, first_feature_smoothl1=None, final_soft_ce=last[0],
                    final_ttt_soft_ce=last[1], first_soft_ce=history[0][0] if history else None,
                    ttt_steps=args.ttt_steps, draft_vocab_size=drafter.lm_head.out_features,
                    vision_adaptor=drafter.vision_adaptor)
    return drafter.eval(), info


# ------------------------------------------------------------------------------------------------------ eval
EVAL_CHAIN = MAX_CHAIN_DEPTH  # the eval's greedy chain: the deepest a draft budget drafts (`max_chain_depth`)


def evaluate(vlm: SpeculativeVLM, n: int, seed: int, max_tokens: int,
             held_out: tuple[list, list[str]] | None = None) -> dict:
    """Greedy speculative vs vanilla on n held-out long-answer world questions, or on `held_out` (images, prompts:
    the rows held out of --data). The drafter drafts its paper tree every step (`budget="fixed"`): the card reports
    what the drafter accepts, not what this machine's draft budget would choose (under "auto" a loaded 2-core CPU at
    batch 16 ran mostly plain steps and read 1.7 tokens a step)."""
    if held_out is None:
        examples = world_vqa_examples("test", n, seed=seed, long_fraction=1.0)
        images, prompts = [ex.image for ex in examples], [ex.prompt for ex in examples]
    else:
        images, prompts = held_out
        n = len(prompts)
    spec = vlm.generate(images, prompts, max_new_tokens=max_tokens, batch_size=16, budget="fixed")
    # a paper tree of d levels emits at most d + 1 tokens a step (MSD's 6.97 of 7), so drafters also draft a greedy
    # chain deeper than any of them: what tells them apart on long, predictable answers
    chain = vlm.generate(images, prompts, max_new_tokens=max_tokens, batch_size=16, budget="fixed",
                         tree=(EVAL_CHAIN, 1, EVAL_CHAIN + 1))
    vanilla = vlm.generate(images, prompts, max_new_tokens=max_tokens, batch_size=16, use_drafter=False)
    return {"n": n, "greedy_equal_to_vanilla": spec.token_ids == vanilla.token_ids == chain.token_ids,
            "mean_acceptance_length": spec.stats.mean_acceptance_length,
            "draft_acceptance_rate": spec.stats.draft_acceptance_rate,
            "step_compression": vanilla.stats.num_target_forwards / max(1, spec.stats.num_target_forwards),
            "chain": EVAL_CHAIN, "chain_mean_acceptance_length": chain.stats.mean_acceptance_length,
            "chain_step_compression": vanilla.stats.num_target_forwards / max(1, chain.stats.num_target_forwards),
            "mean_answer_tokens": sum(len(t) for t in vanilla.token_ids) / n,
            "drafter_image_tokens_attended": vlm.drafter_image_tokens(),
            "tree": list(vlm.drafter.official_tree)}


def target_card_names(model_type: str) -> tuple[str, str]:
    """(the name, the Hub tag) a drafter card gives its target, from the target's `model_type` (the world targets'
    `vlm.train.ARCHS`; another architecture by its model type)."""
    from vlm.train import ARCHS

    arch = ARCHS.get(model_type)
    return (arch["name"], arch["tags"][0]) if arch else (model_type, model_type.replace("_", "-"))


def _card(command: str, info: dict, target_name: str) -> str:
    d = info["drafter"]
    article = "An" if d["kind"] in ("eagle", "msd", "eagle3") else "A"
    own = d.get("answers", "target") == "target"
    if d.get("data"):
        title = f"VLM drafter ({d['kind']}) for {target_name}"
        trained_on = (f"the target's own greedy answers to {d['num_train']} rows of {d['data']}." if own
                      else f"the answers of {d['num_train']} rows of {d['data']}.")
    else:
        title = f"VLM drafter ({d['kind']}) for the world {target_name}"
        trained_on = "the target's own greedy long answers." if own else "the world dataset's long answers."
    start = f" Fine-tuned from the drafter in {d['init_from']}." if d.get("init_from") else ""
    lines = card_head(title, [f"{article} {KIND_TEXT[d['kind']]} trained on {trained_on}{start}"], command,
                      machine_summary())
    if d["kind"] == "eagle3":
        adaptor = " + ViSpec's vision adaptor (1 compressed image token, a global image feature)" if d.get(
            "vision_adaptor") else ""
        lines.append(f"| drafter | fc over 3 target layers{adaptor} + 1 decoder layer + its own head over "
                     f"{d['draft_vocab_size']} tokens, {d['parameters'] / 1e6:.2f}M parameters | {d['steps']} steps x "
                     f"batch {d['batch_size']} on {d['num_train']} answers, training-time test of {d['ttt_steps']} "
                     f"steps | {d['seconds']:.0f} s |")
    else:
        lines.append(f"| drafter | fc + 1 decoder layer, input norm {d['input_norm']}, {d['parameters'] / 1e6:.2f}M "
                     f"parameters | {d['steps']} steps x batch {d['batch_size']} on {d['num_train']} answers, feature "
                     f"noise {d['noise']} ({d.get('noise_scaling', 'fixed')} scaling) | {d['seconds']:.0f} s |")
    lines += ["", f"Final top-1 agreement with the target (training batches, last 50 steps): "
                  f"{d['final_top1_agreement']:.3f}."]
    ev = info.get("eval")
    if ev:
        tree = ev.get("tree")
        held = f"rows of {ev['data']}" if ev.get("data") else "test scenes"
        lines.append(f"Held-out {held} ({ev['n']} long answers, greedy, {ev['mean_answer_tokens']:.1f} tokens "
                     f"on average, the paper's tree {tuple(tree) if tree else ''} as (depth in levels, top_k, "
                     f"total_tokens)): mean acceptance length {ev['mean_acceptance_length']:.2f} (bonus included), "
                     f"step compression {ev['step_compression']:.2f}x, token-for-token equal to the target alone: "
                     f"{ev['greedy_equal_to_vanilla']}; the drafter attends to "
                     f"{ev.get('drafter_image_tokens_attended', 0):g} image "
                     f"token{'' if ev.get('drafter_image_tokens_attended') == 1 else 's'} per row.")
        if ev.get("chain"):
            lines.append(f"A greedy chain of {ev['chain']} drafts on the same answers: mean acceptance length "
                         f"{ev['chain_mean_acceptance_length']:.2f}, step compression "
                         f"{ev['chain_step_compression']:.2f}x.")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    for name in ("answer_max_tokens", "steps", "batch_size", "eval_prompts"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.num_train is not None:
        check_positive_int("--num-train", args.num_train)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    check(stages and not unknown, f"--stages takes a subset of {','.join(STAGES)}, got {args.stages!r}.")
    user, data_id = None, None
    if args.data is not None:  # every row and image path checked before the model loads
        user = VLMData(args.data, args.image_folder, args.turns)
        args.num_train, data_id = len(training_rows(args, user)), data_identity(user)
        several = user.rows_with_several_images()
        one_run = (args.vision_adaptor if args.kind == "eagle3"  # (a drafter whose layout holds one image run a row)
                   else getattr(drafter_model(args.kind), "one_image_run", False))
        check(not (several and one_run), f"--data {args.data}: {several} rows hold several images, but a "
                                         f"{args.kind}{' --vision-adaptor' if args.kind == 'eagle3' else ''} drafter "
                                         "lays out one image run a row (its paper's design); train eagle, msd or "
                                         "eagle3 on them, or give one image a row.")
        if user.turns_notice() and os.environ.get("RANK", "0") == "0":  # (the first of several processes says it)
            print(user.turns_notice(), file=sys.stderr)
    else:
        check(args.image_folder is None, "--image-folder says where --data's images are; give --data too.")
        check(args.turns == "all", "--turns says which exchanges of --data's rows train; give --data too.")
        args.num_train = args.num_train or 2000
    check(args.kind != "eagle3" or args.input_norm == "auto", "--input-norm shapes EAGLE-1/2 drafters; EAGLE-3 has "
                                                               "its own input norms: leave it out.")
    defaults = vars(default_arguments())
    others = ("noise", "noise_scaling", "p_weight") if args.kind == "eagle3" else ("ttt_steps", "draft_vocab",
                                                                                  "vision_adaptor")
    changed = [name for name in others if getattr(args, name) != defaults[name]]
    check(not changed, f"--{changed[0].replace('_', '-') if changed else ''} does not apply to the {args.kind} drafter "
                       "(eagle3 trains by the training-time test's soft cross-entropy alone; --ttt-steps, "
                       "--draft-vocab and --vision-adaptor are eagle3's); leave it out.")
    check(args.init_from is None or not args.vision_adaptor, "--vision-adaptor builds a fresh drafter; one started "
                                                              "--init-from keeps its saved config: leave it out.")
    check(args.ttt_steps >= 1 and (args.draft_vocab is None or args.draft_vocab >= 1),
          "--ttt-steps and --draft-vocab take positive integers.")
    check(args.init_from is None or args.input_norm == "auto", "--input-norm builds a fresh drafter; one started "
                                                               "--init-from keeps its saved config: leave it out.")
    pairs = None
    if args.text_data is not None:  # (read before the model loads: a bad file is a one-line error at once)
        check(args.kind in TEXT_STAGE_KINDS, f"--text-data feeds the text-only stage of vispec and msd; a "
                                             f"{args.kind} drafter trains on multimodal sequences only.")
        pairs, notice = read_text_conversations(args.text_data)
        if notice and os.environ.get("RANK", "0") == "0":
            print(notice, file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else Path(args.target) / "drafters" / args.kind
    work = Path(args.work_dir)
    state = process_state(cpu=args.device == "cpu")  # several processes: accelerate launch / torchrun
    device = args.device if state is None or args.device == "cpu" else state.device
    vlm = SpeculativeVLM.from_pretrained(args.target, device=device)
    vlm.model.requires_grad_(False)
    info = json.loads((out / "training.json").read_text()) if (out / "training.json").is_file() else {}
    if "data" in stages or "drafter" in stages:
        data = answer_cache(vlm, args, work, user, state)
    if "drafter" in stages and (args.force or not (out / "config.json").is_file()):
        text = None if pairs is None else text_corpus(vlm, pairs, args.answer_max_tokens)
        drafter, info["drafter"] = train_drafter(vlm, data, args, work, text, data_id, state)
        if rank_and_count(state)[0] == 0:
            with atomic_output_dir(out) as tmp:
                drafter.save_pretrained(tmp)
                write_info(tmp / "training.json", info)
            drafter_state_path(args, work, data_id).unlink(missing_ok=True)  # the drafter is saved: its state is done
    wait_for_everyone(state)
    if rank_and_count(state)[0] > 0:  # the first process evaluates and writes the card
        return 0
    if "eval" in stages:
        vlm = SpeculativeVLM.from_pretrained(args.target, args.kind, drafter_path=out, device=device)
        held_out = None
        if user is not None:
            rows = user.split(args.eval_prompts, args.seed)[1]
            held_out = [user.image(i) for i in rows], [user.rows[i].question for i in rows]
        info["eval"] = {**evaluate(vlm, args.eval_prompts, args.seed, args.answer_max_tokens, held_out),
                        "data": args.data}
        write_info(out / "training.json", info)
        command = explicit_command("mmspec train vlm-drafter", args, [
            "kind", "target", *(["out"] if args.out else []), "num_train", "answer_max_tokens", "steps", "batch_size",
            "lr", *(["ttt_steps", *(["draft_vocab"] if args.draft_vocab else [])] if args.kind == "eagle3" else
                    ["noise", "noise_scaling", "p_weight"]), "answers", *(["text_data"] if args.text_data else []),
            *(["data", "eval_prompts"] if args.data else []), *(["image_folder"] if args.image_folder else []),
            *(["turns"] if args.turns != "all" else []),
            *(["init_from"] if args.init_from else []),
            "seed", "threads"]) + (" --group-by-length" if args.group_by_length else "") + (
            " --vision-adaptor" if args.vision_adaptor else "")
        if "drafter" in info:
            name, tag = target_card_names(vlm.model.config.model_type)
            card_text = with_metadata(
                _card(command, info, name),
                pipeline_tag="image-text-to-text",
                tags=[tag, "speculative-decoding", *([] if args.data else ["world"])])
            (out / "README.md").write_text(card_text)
        print(json.dumps(info["eval"], indent=2))
    print(f"wrote {out}")
    return 0

"""`mmspec train vlm`: make the embedded VLM default, a small LLaVA target (vlm/world.py) trained from scratch on the
procedural world's questions, on a CPU, in stages.

    mmspec train vlm --out assets/vlm
    mmspec train vlm --arch qwen2_vl --out assets/vlm-qwen2      # the world Qwen2-VL target (vlm/world_qwen2_vl.py)

Stages (a rerun skips a finished stage unless --force):
1. `vision`: the CLIP vision tower pretrained on the world's scene labels (vlm/vision_pretrain.py: every image token
   predicts the shape, colour, size and grid cell of the object under it; the mean feature the background;
   --vision-steps, 0 skips it), standing in for LLaVA's pretrained CLIP. Saved in --work-dir for the next stage.
2. `target`: `LlavaForConditionalGeneration(world_llava_config())` with the pretrained tower, frozen as in LLaVA
   (--train-vision fine-tunes it; --vision-steps 0 trains a fresh tower through the answer loss alone), trained with
   teacher forcing on fresh world scenes every step (one question per scene; cross-entropy on the answer tokens
   and `<eos>` only). Each batch asks either for short answers or for long ones (a fraction
   --long-fraction of the steps, evenly interleaved), so short batches are not padded to long-answer length.
   AdamW and the world trainers' schedule (`optimizer_step`). The state (model, optimiser, step) is saved in
   --work-dir every --checkpoint-every steps, and an interrupted run resumes from it. The model and the processor
   are written to --out atomically.
3. `eval`: on held-out test scenes, greedy short answers to every question of --eval-scenes scenes (exact match,
   overall and per question kind) and --eval-long long answers (exact match with the templated answer, first
   sentence exact, contains the short answer, mean length in tokens); writes training.json and the card README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from tqdm.auto import tqdm

from mmspec.data.artifacts import atomic_output_dir, explicit_command
from mmspec.errors import InputError, check, check_positive_int
from mmspec.model_card import with_metadata
from mmspec.world_training import (
    add_runtime_arguments,
    add_staged_arguments,
    card_head,
    open_training,
    optimizer_step,
    write_info,
)
from vlm.vision_pretrain import pretrain_vision_tower
from vlm.world import (
    VQAExample,
    collate_vqa,
    world_llava_config,
    world_processor,
    world_vqa_examples,
)
from vlm.world_qwen2_vl import world_qwen2_vl_config, world_qwen2_vl_processor

STAGES = ("vision", "target", "eval")
VISION_FILE = "vision-tower.pt"  # in --work-dir: the pretrained tower, read by the target stage
MODEL_CONFIG_KEYS = {"vision", "text", "projector_hidden_act", "vision_feature_layer", "multimodal_projector_bias"}
# the world target's architectures: its config and processor builders, transformers class, the vision tower (and
# which of its parts stay frozen with it: LLaVA's projector and Qwen2-VL's merger train), --model-config keys, card
# (its name, title, text and tags; the drafters' cards name their target by it: `vlm.train_drafter`)
ARCHS = {
    "llava": dict(config=world_llava_config, processor=world_processor, model="LlavaForConditionalGeneration",
                  tower=lambda model: model.model.vision_tower, frozen=lambda tower: [tower],
                  keys=MODEL_CONFIG_KEYS, fixed_vision=("image_size", "patch_size"),
                  frozen_text="The pretrained vision tower is", projector="the projector",
                  name="LLaVA", title="Embedded VLM default (world LLaVA target)",
                  about=["A small LLaVA (transformers `LlavaForConditionalGeneration`: CLIP vision tower, "
                         "Linear-GELU-Linear projector,", "Llama language model) trained from scratch on mmspec's "
                         "procedural world: 32x32 images, 64 image tokens, the", "world's questions with short (one "
                         "or two words) and long (two or three sentences) answers. Load it with",
                         "`LlavaForConditionalGeneration.from_pretrained(folder)` and "
                         "`LlavaProcessor.from_pretrained(folder)`; the", "prompt format is `vlm.world.build_prompt`. "
                         "Made by:"], tags=["llava", "world"]),
    "qwen2_vl": dict(config=world_qwen2_vl_config, processor=world_qwen2_vl_processor,
                     model="Qwen2VLForConditionalGeneration", tower=lambda model: model.model.visual,
                     frozen=lambda tower: [tower.patch_embed, tower.blocks], keys={"vision", "text"},
                     fixed_vision=("patch_size", "spatial_merge_size", "temporal_patch_size"),
                     frozen_text="The pretrained tower's patch embedding and blocks are",
                     projector="its patch merger (Qwen2-VL's projector)",
                     name="Qwen2-VL", title="World Qwen2-VL target",
                     about=["A small Qwen2-VL (transformers `Qwen2VLForConditionalGeneration`: Qwen2-VL's vision "
                            "tower with a 2x2 patch merger,", "Qwen2 language model with M-RoPE) trained from "
                            "scratch on mmspec's procedural world: 32x32 images, 16 image", "tokens on a 4x4 grid, "
                            "the world's questions with short and long answers. Load it with",
                            "`Qwen2VLForConditionalGeneration.from_pretrained(folder)` and "
                            "`AutoProcessor.from_pretrained(folder)`", "(`vlm.world_qwen2_vl`); `SpeculativeVLM."
                            "from_pretrained(folder)` formats prompts. Made by:"], tags=["qwen2-vl", "world"]),
}
SHORT_MAX_NEW_TOKENS = 6  # short answers are one or two words (at most 3 tokens with <eos>)
LONG_MAX_NEW_TOKENS = 96  # long answers are at most ~55 tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_staged_arguments(parser, "vlm", STAGES, "scratch folder (resumable training state)")
    parser.add_argument("--arch", default="llava", choices=sorted(ARCHS),
                        help="the target's architecture: LLaVA-1.5 (the embedded default) or Qwen2-VL (M-RoPE)")
    parser.add_argument("--steps", type=int, default=3000, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=32, help="scenes (one question each) per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--long-fraction", type=float, default=0.5,
                        help="fraction of the steps whose batch asks for long answers (the rest: short answers)")
    parser.add_argument("--two-objects", type=float, default=0.4, help="probability of a two-object scene")
    parser.add_argument("--vision-steps", type=int, default=2000,
                        help="pretraining steps of the vision tower on the scene labels (0: no pretraining)")
    parser.add_argument("--vision-batch-size", type=int, default=64)
    parser.add_argument("--vision-lr", type=float, default=1e-3)
    parser.add_argument("--train-vision", action="store_true",
                        help="fine-tune the pretrained vision tower with the language model (default: frozen, as in "
                             "LLaVA)")
    parser.add_argument("--checkpoint-every", type=int, default=500,
                        help="save the resumable training state in --work-dir every N steps (0 = never)")
    parser.add_argument("--eval-scenes", type=int, default=300,
                        help="held-out scenes whose every question is answered briefly in the eval stage")
    parser.add_argument("--eval-long", type=int, default=64, help="held-out questions answered in detail")
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--model-config", default="",
                        help='JSON overrides of world_llava_config, e.g. \'{"text": {"num_hidden_layers": 2}}\' '
                             "(keys vision, text, projector_hidden_act, vision_feature_layer, "
                             "multimodal_projector_bias)")
    add_runtime_arguments(parser)


def _check_args(args: argparse.Namespace) -> dict:
    """Checked numeric options; returns the parsed --model-config."""
    for name in ("steps", "batch_size", "eval_scenes", "eval_long", "eval_batch_size", "vision_batch_size"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    check_positive_int("--threads", args.threads)
    check(args.vision_steps >= 0, f"--vision-steps must be >= 0, got {args.vision_steps}.")
    check(args.vision_lr > 0, f"--vision-lr must be > 0, got {args.vision_lr}.")
    check(not (args.train_vision and args.vision_steps == 0),
          "--train-vision fine-tunes the pretrained tower: it needs --vision-steps > 0 (with --vision-steps 0 the "
          "fresh tower is always trained with the language model).")
    check(args.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {args.checkpoint_every}.")
    check(args.lr > 0, f"--lr must be > 0, got {args.lr}.")
    check(0.0 <= args.long_fraction <= 1.0, f"--long-fraction must be in [0, 1], got {args.long_fraction}.")
    check(0.0 <= args.two_objects <= 1.0, f"--two-objects must be in [0, 1], got {args.two_objects}.")
    try:
        overrides = json.loads(args.model_config) if args.model_config else {}
    except json.JSONDecodeError as err:
        raise InputError(f"--model-config is not valid JSON ({err}): {args.model_config!r}") from None
    check(isinstance(overrides, dict), f"--model-config must be a JSON object, got {args.model_config!r}.")
    arch = ARCHS[args.arch]
    unknown = sorted(set(overrides) - arch["keys"])
    check(not unknown, f"--model-config keys of --arch {args.arch} must be among {sorted(arch['keys'])}, got "
                       f"{unknown}.")
    vision = overrides.get("vision")
    check(not (isinstance(vision, dict) and set(arch["fixed_vision"]) & set(vision)),
          f"--model-config cannot change the vision {' or '.join(arch['fixed_vision'])}: the processor reads 32x32 "
          "images in 4x4 patches.")
    try:
        config = arch["config"](**overrides)
        check_heads_divide_width(config)
    except (TypeError, ValueError, StrictDataclassError) as err:
        raise InputError(f"--model-config {args.model_config!r} is not a valid world {args.arch} config: "
                         f"{err}") from None
    return overrides


def check_heads_divide_width(config) -> None:
    """ValueError unless each part's width is a multiple of its attention heads (newer transformers check it
    themselves; older ones build the model and train it with a narrower attention, silently)."""
    for part in (config.text_config, config.vision_config):
        width = getattr(part, "hidden_size", None) or getattr(part, "embed_dim", None)
        heads = getattr(part, "num_attention_heads", None) or getattr(part, "num_heads", None)
        if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads:
            raise ValueError(f"{type(part).__name__}'s width ({width}) is not a multiple of the number of attention "
                             f"heads ({heads})")


# ------------------------------------------------------------------------------------------------------- training
def is_long_step(step: int, long_fraction: float) -> bool:
    """Whether step `step` trains on long answers: a fraction `long_fraction` of the steps, evenly interleaved."""
    return int((step + 1) * long_fraction) > int(step * long_fraction)


def training_batch(processor, step: int, batch_size: int, seed: int, long_fraction: float,
                   two_objects: float) -> tuple[dict[str, torch.Tensor], bool]:
    """Step `step`'s batch (fresh train scenes step * batch_size ...; deterministic) and whether it is long."""
    long = is_long_step(step, long_fraction)
    examples = world_vqa_examples("train", batch_size, seed, start=step * batch_size,
                                  long_fraction=1.0 if long else 0.0, two_objects=two_objects)
    return collate_vqa(examples, processor), long


def train_target(steps: int, batch_size: int, lr: float, seed: int, quiet: bool, long_fraction: float = 0.5,
                 two_objects: float = 0.4, model_config: dict | None = None, processor=None,
                 state_path: Path | None = None, checkpoint_every: int = 500, vision_state: dict | None = None,
                 train_vision: bool = False, arch: str = "llava"):
    """A fresh world LLaVA trained with teacher forcing; returns (model in eval mode, info). `vision_state`: a
    pretrained vision tower (vlm/vision_pretrain.py), frozen unless `train_vision`; None trains a fresh tower with the
    rest. Resumes from state_path (model, optimiser, step) when it exists and saves it there every
    checkpoint_every steps; the data of a step depends only on the step, so a resumed run equals an uninterrupted
    one."""
    import transformers

    spec = ARCHS[arch]
    processor = processor if processor is not None else spec["processor"]()
    model_config = model_config or {}
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "long_fraction": long_fraction,
                "two_objects": two_objects, "model_config": model_config,
                "vision_pretrained": vision_state is not None, "train_vision": train_vision}
    if arch != "llava":
        settings["arch"] = arch
    torch.manual_seed(seed)
    config = spec["config"](tokenizer=processor.tokenizer, **model_config)
    model = getattr(transformers, spec["model"])(config).train()
    if vision_state is not None:
        tower = spec["tower"](model)
        tower.load_state_dict(vision_state)
        for part in spec["frozen"](tower):
            part.requires_grad_(train_vision)
            part.train(train_vision)  # a frozen tower runs in eval mode, as at inference
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    first, seconds, losses = 0, 0.0, {"short": [], "long": []}
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        saved = json.loads(state["settings"])
        check(saved == settings, f"the training state {state_path} was made with other settings ({saved}, now "
                                 f"{settings}); delete it to start afresh, or rerun with the same settings.")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first, seconds, losses = int(state["step"]), float(state["seconds"]), json.loads(state["losses"])
    start = time.perf_counter() - seconds
    bar = tqdm(range(first, steps), desc="vlm target", disable=quiet, initial=first, total=steps)
    for step in bar:
        batch, long = training_batch(processor, step, batch_size, seed, long_fraction, two_objects)
        loss = model(**batch).loss
        optimizer_step(opt, loss, step, steps, lr)
        losses["long" if long else "short"].append(round(loss.item(), 5))
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", kind="long" if long else "short")
        if state_path is not None and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                     "seconds": time.perf_counter() - start, "settings": json.dumps(settings),
                     "losses": json.dumps(losses)}
            tmp = state_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, state_path)
    tail = lambda xs: sum(xs[-50:]) / max(1, len(xs[-50:]))  # noqa: E731
    info = {**settings, "resumed_from_step": first, "seconds": time.perf_counter() - start,
            "seconds_per_step": (time.perf_counter() - start) / steps,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained_parameters": sum(p.numel() for p in trainable),
            "final_loss_short": tail(losses["short"]), "final_loss_long": tail(losses["long"])}
    if state_path is not None:
        state_path.unlink(missing_ok=True)
    return model.eval(), info


def save_target(out: Path, model, processor, info: dict) -> None:
    """Write the model (safetensors), the processor and training.json into `out`, atomically."""
    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        write_info(tmp / "training.json", info)


# ----------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def generate_answers(model, processor, examples: list[VQAExample], max_new_tokens: int,
                     batch_size: int = 64) -> list[list[int]]:
    """Greedy answers (token ids up to, not including, `<eos>`) of `examples`, batched with left padding."""
    tok = processor.tokenizer
    answers = []
    for s in range(0, len(examples), batch_size):
        batch = collate_vqa(examples[s:s + batch_size], processor, with_answers=False)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            answers.append(row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row)
    return answers


def _first_sentence(text: str) -> str:
    match = re.match(r"(.*?\.)(\s|$)", text)
    return match.group(1) if match else text


@torch.no_grad()
def evaluate(model, processor, n_scenes: int, n_long: int, seed: int, batch_size: int = 64,
             two_objects: float = 0.4) -> dict:
    """Greedy short answers to every question of n_scenes held-out (test split) scenes and long answers to n_long
    questions; exact-match figures (see the module docstring)."""
    tok = processor.tokenizer
    model.eval()
    start = time.perf_counter()
    short = world_vqa_examples("test", n_scenes, seed, long_fraction=0.0, two_objects=two_objects,
                               all_questions=True)
    answers = generate_answers(model, processor, short, SHORT_MAX_NEW_TOKENS, batch_size)
    per_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ex, ids in zip(short, answers):
        per_kind[ex.qa.kind][0] += int(tok.decode(ids, skip_special_tokens=True).strip() == ex.qa.short)
        per_kind[ex.qa.kind][1] += 1
    correct = sum(c for c, _ in per_kind.values())
    result = {"short": {"n": len(short), "scenes": n_scenes, "accuracy": correct / len(short),
                        "per_kind": {k: {"n": n, "accuracy": c / n} for k, (c, n) in sorted(per_kind.items())}}}
    long = world_vqa_examples("test", n_long, seed, long_fraction=1.0, two_objects=two_objects)
    answers = generate_answers(model, processor, long, LONG_MAX_NEW_TOKENS, batch_size)
    texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids in answers]
    reference = [len(tok(ex.qa.long, add_special_tokens=False)["input_ids"]) for ex in long]
    n = len(long)
    result["long"] = {
        "n": n,
        "exact": sum(t == ex.qa.long for t, ex in zip(texts, long)) / n,
        "first_sentence_exact": sum(_first_sentence(t) == _first_sentence(ex.qa.long)
                                    for t, ex in zip(texts, long)) / n,
        "contains_short": sum(re.search(rf"\b{re.escape(ex.qa.short)}\b", t) is not None
                              for t, ex in zip(texts, long)) / n,
        "mean_tokens": sum(len(a) for a in answers) / n, "reference_mean_tokens": sum(reference) / n,
        "ended": sum(len(a) < LONG_MAX_NEW_TOKENS for a in answers) / n,
        "examples": [{"question": ex.qa.question, "answer": t, "reference": ex.qa.long}
                     for ex, t in zip(long[:3], texts[:3])]}
    result["seconds"] = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------------------------ run
def _card(command: str, info: dict, arch: str = "llava") -> str:
    t, ev = info.get("target", {}), info.get("eval", {})
    spec = ARCHS[arch]
    lines = card_head(spec["title"], spec["about"], command, info.get("machine", ""))
    overrides = t.get("model_config") or {}
    lines.append(f"| target | {spec['config'].__name__}({json.dumps(overrides) if overrides else ''}), "
                 f"{t.get('parameters', 0) / 1e6:.2f}M params | {t.get('steps')} steps x {t.get('batch_size')} "
                 f"questions, lr {t.get('lr')}, long answers in {t.get('long_fraction')} of the steps, final loss "
                 f"{t.get('final_loss_short', 0):.3f} (short) / {t.get('final_loss_long', 0):.3f} (long) | "
                 f"{t.get('seconds', 0):.0f} s |")
    if info.get("vision"):
        v = info["vision"]
        acc = ", ".join(f"{k} {a:.3f}" for k, a in v["readout_accuracy"].items())
        where = f"hidden layer {v['feature_layer']}" if v.get("feature_layer") is not None else "the merged output"
        lines.insert(-1, f"| vision tower (pretraining) | the target's vision tower, per-token linear readout of "
                         f"patch labels from {where} | {v['steps']} steps x {v['batch_size']} "
                         f"scenes, lr {v['lr']}; held-out readout accuracy {acc} | {v['seconds']:.0f} s |")
        how = "fine-tuned with" if t.get("train_vision") else "frozen while"
        lines.append(f"\n{spec['frozen_text']} {how} {spec['projector']} and the language model train "
                     f"({t.get('trained_parameters', 0) / 1e6:.2f}M parameters trained in the target stage).")
    lines += ["", f"Seed {t.get('seed')}.", "", "## Quality (held-out test scenes, greedy decoding)", ""]
    if "short" in ev:
        s = ev["short"]
        kinds = ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in s["per_kind"].items())
        lines.append(f"- Short answers, every question of {s['scenes']} scenes ({s['n']} questions): exact-match "
                     f"accuracy {s['accuracy']:.3f}; per kind: {kinds}.")
    if "long" in ev:
        g = ev["long"]
        lines.append(f"- Long answers to {g['n']} questions: exact match with the templated answer {g['exact']:.3f}, "
                     f"first sentence exact {g['first_sentence_exact']:.3f}, contains the short answer "
                     f"{g['contains_short']:.3f}; mean length {g['mean_tokens']:.1f} tokens (reference "
                     f"{g['reference_mean_tokens']:.1f}), {g['ended']:.3f} ended with `<eos>` within "
                     f"{LONG_MAX_NEW_TOKENS} tokens.")
    return "\n".join(lines) + "\n"


def load_target(out: Path, arch: str, quiet: bool):
    """The saved target and its processor (local files), without transformers' progress bar when quiet."""
    import transformers
    from transformers.utils import logging as hf_logging

    from mmspec.hf_loading import library_output

    with library_output([hf_logging], bars=not quiet):
        model = getattr(transformers, ARCHS[arch]["model"]).from_pretrained(str(out), local_files_only=True)
        return model, transformers.AutoProcessor.from_pretrained(str(out), local_files_only=True)


def _vision_settings(args: argparse.Namespace, overrides: dict) -> dict:
    config = ARCHS[args.arch]["config"](**overrides)
    return {"objective": "patch labels", "vision_config": config.vision_config.to_diff_dict(),
            "feature_layer": getattr(config, "vision_feature_layer", None),
            "steps": args.vision_steps, "batch_size": args.vision_batch_size, "lr": args.vision_lr, "seed": args.seed,
            "two_objects": args.two_objects}


def vision_pretraining(args: argparse.Namespace, overrides: dict, path: Path) -> None:
    """The `vision` stage: pretrain the tower (vlm/vision_pretrain.py) and save it with its settings at `path`."""
    config = ARCHS[args.arch]["config"](**overrides)
    state, info = pretrain_vision_tower(config.vision_config, getattr(config, "vision_feature_layer", None),
                                        ARCHS[args.arch]["processor"](),
                                        args.vision_steps, args.vision_batch_size, args.vision_lr, args.seed,
                                        args.two_objects, args.quiet)
    acc = ", ".join(f"{k} {v:.3f}" for k, v in info["readout_accuracy"].items())
    print(f"vision tower: held-out readout accuracy {acc}")
    tmp = path.with_suffix(".tmp")
    torch.save({"state": state, "info": json.dumps(info), "settings": json.dumps(_vision_settings(args, overrides))},
               tmp)
    os.replace(tmp, path)


def saved_vision_pretraining(path: Path, args: argparse.Namespace, overrides: dict) -> dict | None:
    """What the `vision` stage saved at `path` ({"state", "info", "settings"}) when it was made with the current
    options; None when there is nothing there or it was made with other options."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    current = json.loads(json.dumps(_vision_settings(args, overrides)))  # as it reads back from the file
    return saved if json.loads(saved["settings"]) == current else None


def run(args: argparse.Namespace) -> int:
    overrides = _check_args(args)
    stages, folder, work = open_training(args, STAGES)
    out, info = folder.out, folder.info
    has_target = (out / "model.safetensors").is_file() and (out / "processor_config.json").is_file()

    vision_path = work / VISION_FILE
    if "vision" in stages and args.vision_steps and (args.force or not has_target) and (
            args.force or saved_vision_pretraining(vision_path, args, overrides) is None):
        vision_pretraining(args, overrides, vision_path)
    if "target" in stages and (args.force or not has_target):
        processor = ARCHS[args.arch]["processor"]()
        vision_state = None
        if args.vision_steps:
            saved = saved_vision_pretraining(vision_path, args, overrides)
            check(saved is not None, f"no pretrained vision tower made with these options at {vision_path}: run "
                                     "the 'vision' stage first (--stages vision,target,...; with --force if the "
                                     "options changed) or pass --vision-steps 0 to train the tower with the "
                                     "language model.")
            vision_state, info["vision"] = saved["state"], json.loads(saved["info"])
        else:
            info.pop("vision", None)
        model, info["target"] = train_target(
            args.steps, args.batch_size, args.lr, args.seed, args.quiet, args.long_fraction, args.two_objects,
            overrides, processor, work / "target-state.pt", args.checkpoint_every, vision_state, args.train_vision,
            args.arch)
        info.pop("eval", None)
        save_target(out, model, processor, info)
        has_target = True
    if "eval" in stages:
        check(has_target, f"no trained target in {out}: run the 'target' stage first.")
        model, processor = load_target(out, args.arch, args.quiet)
        info["eval"] = evaluate(model, processor, args.eval_scenes, args.eval_long, args.seed,
                                args.eval_batch_size, args.two_objects)
        folder.record()
        options = ["out", "seed", "steps", "batch_size", "lr", "long_fraction", "two_objects", "vision_steps",
                   "vision_batch_size", "vision_lr", "eval_scenes", "eval_long", "threads"] + (
            ["model_config"] if args.model_config else []) + (["train_vision"] if args.train_vision else []) + (
            ["arch"] if args.arch != "llava" else [])
        command = explicit_command("mmspec train vlm", args, options)
        card_text = with_metadata(_card(command, info, args.arch), pipeline_tag="image-text-to-text",
                                  tags=ARCHS[args.arch]["tags"])
        (out / "README.md").write_text(card_text)
        summary = {**info["eval"], "long": {k: v for k, v in info["eval"]["long"].items() if k != "examples"}}
        print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0

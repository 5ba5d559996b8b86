"""`mmspec train llamagen-t2i`: make the embedded text-to-image LlamaGen from the world's captions, on a CPU.

    mmspec train llamagen-t2i --out assets/llamagen-t2i

The image tokenizer is the class-conditional default's VQ (`--vq`, default assets/llamagen/vqvae), so both
LlamaGen defaults share their 64-token images. Stages (each saved atomically; a rerun skips finished ones unless
--force):
1. `target`: a small T5-architecture caption encoder (transformers `T5EncoderModel`, trained from scratch) and a
   t2i LlamaGen GPT, trained together on (caption, VQ tokens) pairs of world images: the caption goes through the
   pipeline's own text path (`image_ar.llamagen.text`: cleaning, padding to cls_token_num, left padding), 10% of
   the captions are replaced by the learned-null caption for CFG. The tokenizer is the world tokenizer made
   T5-style (EOS appended, no BOS; `world_t5_tokenizer`).
2. `draft`: a smaller t2i GPT on the frozen encoder's features, for method draft-model.
3. `eval`: writes the pipeline folder and the card: the world judge reads shape, colour, size, position and
   background of images generated for held-out (val split) captions at the pipeline defaults, with the rate at
   which every attribute agrees with the caption, and world-FID against the real images of the same captions.
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
from image_ar.llamagen.text import caption_condition, preprocess_caption, tokenize_captions
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.data import IMAGE_SIZES, generate_batch
from mmspec.data.artifacts import ASSETS_DIR, explicit_command
from mmspec.errors import check
from mmspec.model_card import with_metadata
from mmspec.world_training import (
    IMAGE_SIZE,
    add_runtime_arguments,
    add_staged_arguments,
    cached_tensors,
    card_head,
    open_training,
    optimizer_step,
    size_tag,
)

STAGES = ("target", "draft", "eval")
# CFG scales the eval stage tries for the model's default (7.5: the official t2i script's; 4.0: the c2i default)
GUIDANCE_GRID = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 7.5)
CAPTION_TOKENS = 16  # the longest world caption is 14 tokens with its EOS
WORLD_T5 = dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
                feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
WORLD_T2I_COMMON = dict(model_type="t2i", cls_token_num=CAPTION_TOKENS, caption_dim=128,
                        class_dropout_prob=0.1, multiple_of=32, token_dropout_p=0.0, resid_dropout_p=0.0,
                        ffn_dropout_p=0.0)
WORLD_T2I_GPT = {"target": dict(dim=192, n_layer=8, n_head=6), "draft": dict(dim=96, n_layer=3, n_head=3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_staged_arguments(parser, "llamagen-t2i", STAGES, "scratch folder (token and caption cache)")
    parser.add_argument("--vq", default=str(ASSETS_DIR / "llamagen" / "vqvae"),
                        help="the image tokenizer (a LlamaGenVQ folder); default the class-conditional default's")
    parser.add_argument("--image-size", type=int, choices=IMAGE_SIZES, default=IMAGE_SIZE,
                        help="world image side in pixels (default 32: 8x8 = 64 tokens an image; 64: 16x16 = 256, "
                             "through the same tokenizer)")
    parser.add_argument("--num-train-images", type=int, default=100_000, help="world images tokenized for training")
    parser.add_argument("--target-steps", type=int, default=3500)
    parser.add_argument("--draft-steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-captions", type=int, default=512, help="held-out captions judged at the end")
    parser.add_argument("--tune-captions", type=int, default=256,
                        help="other held-out captions (seed + 1) on which the default guidance scale is chosen")
    parser.add_argument("--guidance-grid", type=guidance_grid, default=",".join(f"{g:g}" for g in GUIDANCE_GRID),
                        metavar="G1,G2,..", help="the guidance scales that choice tries (default: %(default)s)")
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the GPT's loss")
    add_runtime_arguments(parser)


def guidance_grid(text: str) -> str:
    """--guidance-grid: comma-separated guidance scales, each >= 1, written back as "1,2.5" (argparse turns the error
    into a usage line)."""
    try:
        grid = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not grid or min(grid) < 1.0:
        raise argparse.ArgumentTypeError(f"expected guidance scales >= 1, got {text!r}")
    return ",".join(f"{g:g}" for g in grid)


def world_t5_tokenizer(max_length: int = CAPTION_TOKENS):
    """The world tokenizer (assets/tokenizer) made T5-style: the same vocabulary and pre-tokenisation, EOS
    appended instead of BOS prepended, right padding with <pad>."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(ASSETS_DIR / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<eos>")
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_max_length=max_length, padding_side="right")


def world_text_encoder(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, **WORLD_T5))


def world_t2i_gpt(kind: str, vocab_size: int, block_size: int = 64) -> LlamaGenGPT:
    return LlamaGenGPT(vocab_size=vocab_size, block_size=block_size, **WORLD_T2I_COMMON, **WORLD_T2I_GPT[kind])


# ----------------------------------------------------------------------------------------------------- data
@torch.no_grad()
def caption_data(vq: LlamaGenVQ, tokenizer, n: int, seed: int, split: str = "train", chunk: int = 500,
                 max_length: int = CAPTION_TOKENS, quiet: bool = False,
                 image_size: int = IMAGE_SIZE) -> dict[str, torch.Tensor]:
    """VQ token ids [n, (image_size / 4)^2] (int16), caption token ids [n, L] (int16) and masks [n, L] (bool) of n
    single-object world images and their captions (cleaned as the pipeline cleans prompts)."""
    ids, text_ids, masks, cleaned = [], [], [], {}
    for start in tqdm(range(0, n, chunk), desc=f"tokenize {split}", leave=False, disable=quiet):
        batch = generate_batch(min(chunk, n - start), seed, split=split, start=start, image_size=image_size)
        ids.append(vq.quantize_ids(batch.float_images() * 2 - 1).short())
        texts = [cleaned.setdefault(c, preprocess_caption(c, True)) for c in batch.captions]
        tokens, mask = tokenize_captions(tokenizer, texts, max_length, clean=False)  # cleaned above, once each
        text_ids.append(tokens.short())
        masks.append(mask.bool())
    return {"ids": torch.cat(ids), "text_ids": torch.cat(text_ids), "masks": torch.cat(masks)}


# ----------------------------------------------------------------------------------------------------- training
def train_t2i_gpt(kind: str, data: dict, vocab_size: int, text_vocab: int, args: argparse.Namespace,
                  encoder=None) -> tuple[LlamaGenGPT, object, dict]:
    """Train a t2i GPT (`kind` target: with a new caption encoder, jointly; draft: on `encoder`, frozen)."""
    torch.manual_seed(args.seed)
    model = world_t2i_gpt(kind, vocab_size, data["ids"].shape[1]).train()  # block size: the images' token count
    joint = encoder is None
    encoder = (world_text_encoder(text_vocab) if joint else encoder).train(joint)
    params = list(model.parameters()) + (list(encoder.parameters()) if joint else [])
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(args.seed)

    def gpt_loss(idx: torch.Tensor, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(idx, features, targets=idx, cond_mask=mask).loss

    forward = gpt_loss if args.no_compile else torch.compile(gpt_loss)
    steps = args.target_steps if kind == "target" else args.draft_steps
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=kind, disable=args.quiet)
    for step in bar:
        rows = torch.randint(0, data["ids"].shape[0], (args.batch_size,), generator=gen)
        with torch.set_grad_enabled(joint):
            features, mask = caption_condition(encoder, data["text_ids"][rows], data["masks"][rows])
        loss = forward(data["ids"][rows].long(), features, mask)
        optimizer_step(opt, loss, step, steps, args.lr)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    info = {"steps": steps, "batch_size": args.batch_size, "lr": args.lr, "final_loss": loss.item(),
            "seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters())}
    if joint:
        info["text_encoder_parameters"] = sum(p.numel() for p in encoder.parameters())
    return model.eval(), encoder.eval(), info


# ----------------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def judge_captions(pipe: LlamaGenPipeline, n: int, seed: int, chunk: int = 64,
                   guidance_scale: float | None = None) -> dict:
    """Images for the captions of n held-out (val) world scenes at the pipeline defaults (or `guidance_scale`), one
    seeded generator each: the judge's agreement with every caption attribute and world-FID against the scenes'
    real images."""
    from mmspec.metrics import attribute_agreement, world_fid

    batch = generate_batch(n, seed, split="val", image_size=pipe.image_size())
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]
    images = torch.cat([pipe(batch.captions[s:s + chunk], generator=gens[s:s + chunk], output_type="pt",
                             guidance_scale=guidance_scale).images
                        for s in tqdm(range(0, n, chunk), desc="judge captions", leave=False)])
    agreement = attribute_agreement(images, batch)
    return {"n": n, "guidance_scale": guidance_scale or pipe.default_guidance_scale(), **agreement,
            "world_fid": world_fid(images, batch.float_images()).fid}


def choose_guidance(pipe: LlamaGenPipeline, n: int, seed: int, grid: tuple[float, ...] = GUIDANCE_GRID) -> dict:
    """The CFG scale of `grid` whose images follow n held-out captions (val split, `seed`; not the eval set) best:
    highest every-attribute agreement, then lowest world-FID. Returns {"chosen": scale, "sweep": [...]}."""
    sweep = [judge_captions(pipe, n, seed, guidance_scale=g) for g in tqdm(grid, desc="guidance", leave=False)]
    best = max(sweep, key=lambda e: (e["all_attributes"], -e["world_fid"]))
    return {"chosen": best["guidance_scale"], "n": n, "seed": seed,
            "sweep": [{k: e[k] for k in ("guidance_scale", "all_attributes", "world_fid")} for e in sweep]}


def _card(command: str, info: dict, pipe: LlamaGenPipeline) -> str:
    tgt, dr, ev = info.get("target", {}), info.get("draft", {}), info.get("eval", {})
    lines = card_head("Embedded text-to-image LlamaGen default (world)", [
        "A text-conditional LlamaGen trained on mmspec's procedural world: a small T5-architecture caption encoder",
        "(trained from scratch with the GPT; the world tokenizer made T5-style), a t2i LlamaGen GPT reading its",
        f"features ({CAPTION_TOKENS} caption tokens, left-padded as the official pipeline does), the class-conditional",
        f"default's VQ tokenizer ({pipe.image_size()}x{pipe.image_size()} images, "
        f"{pipe.transformer.config.block_size} tokens), and a small draft GPT. Made by:"],
        command, info.get("machine", ""))
    lines += [
        f"| text_encoder | T5EncoderModel {json.dumps({k: WORLD_T5[k] for k in ('d_model', 'num_layers')})}, "
        f"{tgt.get('text_encoder_parameters', 0) / 1e6:.2f}M params | with the transformer | |",
        f"| transformer | LlamaGen GPT t2i {json.dumps(WORLD_T2I_GPT['target'])}, "
        f"{tgt.get('parameters', 0) / 1e6:.2f}M params | {tgt.get('steps')} steps x {tgt.get('batch_size')}, final "
        f"loss {tgt.get('final_loss', 0):.3f} | {tgt.get('seconds', 0):.0f} s |",
        f"| draft_transformer | LlamaGen GPT t2i {json.dumps(WORLD_T2I_GPT['draft'])}, "
        f"{dr.get('parameters', 0) / 1e6:.2f}M params | {dr.get('steps')} steps x {dr.get('batch_size')}, final loss "
        f"{dr.get('final_loss', 0):.3f} | {dr.get('seconds', 0):.0f} s |",
        "", "## Quality (world judge, held-out captions)", ""]
    for key, name in (("target", "transformer"), ("draft", "draft_transformer")):
        if key in ev:
            e = ev[key]
            per = ", ".join(f"{k} {e['attributes'][k]:.3f}" for k in e["attributes"])
            scale = e.get("guidance_scale", 4.0)
            lines.append(f"- {name}, vanilla decoding at the pipeline defaults (guidance {scale:g}, "
                         f"temperature 1.0), {e['n']} val-split captions: every attribute agrees "
                         f"{e['all_attributes']:.3f} ({per}); world-FID {e['world_fid']:.2f} vs the real images of "
                         "the same captions.")
    if "guidance" in ev:
        g = ev["guidance"]
        tried = ", ".join(f"{e['guidance_scale']:g}: {e['all_attributes']:.3f} / {e['world_fid']:.2f}"
                          for e in g["sweep"])
        lines += ["", f"The default guidance scale ({g['chosen']:g}, the transformer's `default_guidance_scale`) is "
                      f"the one whose images follow {g['n']} other val-split captions (seed {g['seed']}) best, "
                      f"every-attribute agreement / world-FID per scale: {tried}."]
    lines += ["", "Val-split scenes are new images; their caption strings (2592 combinations of size, colour, shape,",
              "position and background) also occur in training."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    stages, folder, work = open_training(args, STAGES)
    out, info = folder.out, folder.info
    check(Path(args.vq, "config.json").is_file(), f"--vq {args.vq}: no LlamaGenVQ there (config.json); train the "
                                                  "class-conditional default first: mmspec train llamagen.")
    vq = LlamaGenVQ.from_pretrained(args.vq).eval()
    tokenizer = world_t5_tokenizer()
    size = args.image_size
    cache = work / f"captions-{args.num_train_images}-seed{args.seed}{size_tag(size)}.pt"

    def make_data() -> dict[str, torch.Tensor]:
        return caption_data(vq, tokenizer, args.num_train_images, args.seed, image_size=size)

    data = None
    if "target" in stages and not folder.done("transformer"):
        data = cached_tensors(cache, args.force, make_data)
        model, encoder, info["target"] = train_t2i_gpt("target", data, vq.config.codebook_size, len(tokenizer), args)
        folder.save(encoder, "text_encoder")
        folder.save(model, "transformer")
        folder.record()
    if "draft" in stages and not folder.done("draft_transformer"):
        from transformers import T5EncoderModel

        check((out / "text_encoder" / "config.json").is_file(), "the draft needs the target's text_encoder: run the "
                                                                 "'target' stage first.")
        data = data or cached_tensors(cache, args.force, make_data)
        encoder = T5EncoderModel.from_pretrained(out / "text_encoder").eval()
        model, _, info["draft"] = train_t2i_gpt("draft", data, vq.config.codebook_size, len(tokenizer), args, encoder)
        folder.save(model, "draft_transformer")
        folder.record()
    if "eval" in stages:
        from transformers import T5EncoderModel

        draft = (LlamaGenGPT.from_pretrained(out / "draft_transformer")
                 if (out / "draft_transformer" / "config.json").is_file() else None)
        eagle = None  # a drafter trained into the folder since (mmspec train llamagen-drafter) stays in it
        if (out / "eagle_drafter" / "config.json").is_file():
            from image_ar.llamagen.eagle import LlamaGenEagleDrafter

            eagle = LlamaGenEagleDrafter.from_pretrained(out / "eagle_drafter")
        pipe = LlamaGenPipeline(transformer=LlamaGenGPT.from_pretrained(out / "transformer"), vqvae=vq,
                                draft_transformer=draft, tokenizer=tokenizer, eagle_drafter=eagle,
                                text_encoder=T5EncoderModel.from_pretrained(out / "text_encoder"))
        pipe.set_progress_bar_config(disable=True)
        tuning = choose_guidance(pipe, args.tune_captions, args.seed + 1,
                                 tuple(float(g) for g in args.guidance_grid.split(",")))
        pipe.transformer.register_to_config(default_guidance_scale=tuning["chosen"])
        pipe.save_pretrained(out)
        info["eval"] = {"guidance": tuning, "target": judge_captions(pipe, args.eval_captions, args.seed)}
        if draft is not None:
            alone = LlamaGenPipeline(transformer=draft, vqvae=vq, text_encoder=pipe.text_encoder, tokenizer=tokenizer)
            alone.set_progress_bar_config(disable=True)
            info["eval"]["draft"] = judge_captions(alone, args.eval_captions, args.seed,
                                                   guidance_scale=tuning["chosen"])
        folder.record()
        command = explicit_command("mmspec train llamagen-t2i", args, [
            "out", "seed", "vq", "image_size", "num_train_images", "target_steps", "draft_steps", "batch_size", "lr",
            "eval_captions", "tune_captions", "guidance_grid", "threads"])
        (out / "README.md").write_text(with_metadata(_card(command, info, pipe), pipeline_tag="text-to-image",
                                                     tags=["llamagen", "text-to-image", "world"]))
        print(json.dumps(info.get("eval", {}), indent=2))
    print(f"wrote {out}")
    return 0

"""`mmspec convert llamagen`: official LlamaGen files -> a pipeline folder that `--model` and `from_pretrained` take.

    mmspec convert llamagen --gpt c2i_L_256.pt --vq vq_ds16_c2i.pt [--draft-gpt c2i_B_256.pt] --out llamagen-L
    mmspec convert llamagen --gpt t2i_XL_stage1_256.pt --vq vq_ds16_t2i.pt --t5 flan-t5-xl/ --out llamagen-t2i

Loading is safe by default (safetensors or weights-only torch.load); configs are inferred from the files. `--t5` is
a local transformers folder of the caption encoder (google/flan-t5-xl for the official t2i models: its
T5EncoderModel and tokenizer); the folder written then takes prompts (`pipe("a red circle")`).
"""

from __future__ import annotations

import argparse
import json

from image_ar.llamagen.convert_gpt import load_llamagen_gpt
from image_ar.llamagen.convert_vq import load_llamagen_vq
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.data.artifacts import atomic_output_dir
from mmspec.errors import InputError, check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpt", required=True, help="official c2i_*.pt / t2i_*.pt (or a diffusers folder)")
    parser.add_argument("--vq", required=True, help="official vq_ds*.pt")
    parser.add_argument("--draft-gpt", default=None, help="optional smaller official GPT, for method draft-model")
    parser.add_argument("--gpt-config", default=None,
                        help="preset name (B, L, XL, ...) or a JSON dict of LlamaGenGPT arguments, when the file "
                             "does not say (e.g. a non-official size)")
    parser.add_argument("--vq-config", default=None,
                        help="JSON dict of LlamaGenVQ arguments the file cannot tell (e.g. {\"norm_num_groups\": 8} "
                             "for a non-official model; official files use 32)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="image tokens, (resolution/16)^2; inferred from the file name when it says 256/384/512")
    parser.add_argument("--t5", default=None, metavar="FOLDER",
                        help="t2i: a local transformers folder holding the caption encoder and its tokenizer "
                             "(flan-t5-xl for the official models); the pipeline then takes prompt strings")
    parser.add_argument("--no-clean-caption", action="store_true",
                        help="t2i: lower-case and strip prompts instead of the official caption cleaning")
    parser.add_argument("--out", required=True, help="pipeline folder to write")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read checkpoints with full pickle (runs code from them: only for files you trust)")


def _json_or_name(option: str, value: str | None):
    if value and value.strip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise InputError(f"{option} is not valid JSON: {err}") from None
    return value


def load_text_encoder(folder: str, allow_pickle: bool) -> tuple:
    """(T5EncoderModel, tokenizer) from a local transformers folder; safetensors weights unless allow_pickle."""
    from pathlib import Path

    from transformers import AutoTokenizer, T5EncoderModel

    check(Path(folder, "config.json").is_file(), f"--t5 {folder}: no config.json there; pass a local transformers "
                                                  "folder of the T5 encoder (e.g. a download of google/flan-t5-xl).")
    try:
        encoder = T5EncoderModel.from_pretrained(folder, local_files_only=True, use_safetensors=not allow_pickle)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        hint = "" if allow_pickle else " (.bin weights need --allow-pickle)"
        raise InputError(f"--t5 {folder}: cannot load the T5 encoder or its tokenizer{hint}: "
                         f"{str(err).splitlines()[0]}") from None
    return encoder.eval(), tokenizer


def run(args: argparse.Namespace) -> int:
    overrides = {} if args.block_size is None else {"block_size": args.block_size}
    config = _json_or_name("--gpt-config", args.gpt_config)
    gpt = load_llamagen_gpt(args.gpt, config, allow_pickle=args.allow_pickle, **overrides)
    vq_overrides = _json_or_name("--vq-config", args.vq_config) or {}
    check(isinstance(vq_overrides, dict), "--vq-config must be a JSON dict of LlamaGenVQ arguments.")
    # the overrides go on top of the config inferred from the weights
    vq = load_llamagen_vq(args.vq, allow_pickle=args.allow_pickle, **vq_overrides)
    check(gpt.config.vocab_size == vq.config.codebook_size,
          f"the GPT's vocabulary ({gpt.config.vocab_size}) does not match the VQ codebook ({vq.config.codebook_size}).")
    draft = (load_llamagen_gpt(args.draft_gpt, config, allow_pickle=args.allow_pickle, **overrides)
             if args.draft_gpt else None)
    if draft is not None:
        check(draft.config.vocab_size == gpt.config.vocab_size, "the draft GPT must share the target's VQ vocabulary.")
    text = {}
    if args.t5 is not None:
        check(gpt.config.model_type == "t2i", "--t5 is for text-conditional (t2i) checkpoints; this GPT is c2i.")
        encoder, tokenizer = load_text_encoder(args.t5, args.allow_pickle)
        text = {"text_encoder": encoder, "tokenizer": tokenizer, "clean_caption": not args.no_clean_caption}
    with atomic_output_dir(args.out) as tmp:
        LlamaGenPipeline(transformer=gpt, vqvae=vq, draft_transformer=draft, **text).save_pretrained(tmp)
    print(f"wrote {args.out}")
    return 0

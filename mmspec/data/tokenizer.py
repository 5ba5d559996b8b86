"""The world's text tokenizer: a small BPE (`tokenizers` library) trained on captions, questions, answers.

Layout: NFKC, then any run of whitespace becomes one space; Metaspace pre-tokenisation ("▁" marks a word
start) plus punctuation splitting; BPE over every printable ASCII character plus what the corpus adds, so
ordinary English never hits `<unk>`. Decoding restores the text exactly up to that whitespace normalisation.

Special tokens, with fixed ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, `<image>`=4 (the placeholder a VLM
replaces by image features). Encoding with `add_special_tokens=True` (transformers' default) prepends `<bos>`;
`<eos>` is never added automatically: append it where a sequence must end (e.g. training targets).

The trained tokenizer ships in `assets/tokenizer/` and loads as a transformers `PreTrainedTokenizerFast`:
`load_world_tokenizer()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError, check_positive_int

DEFAULT_TOKENIZER_PATH = ASSETS_DIR / "tokenizer"
SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "image_token": "<image>",
}
SPECIAL_TOKEN_LIST: tuple[str, ...] = tuple(SPECIAL_TOKENS.values())  # id i = position i
MODEL_MAX_LENGTH = 1024
PRINTABLE_ASCII: tuple[str, ...] = tuple(chr(c) for c in range(33, 127)) + ("▁",)


def world_corpus(n_samples: int = 5000, seed: int = 0, two_objects: float = 0.5) -> list[str]:
    """Text of `n_samples` train-split scenes: captions, questions, short and long answers, and
    class names."""
    from mmspec.data.dataset import generate_batch
    from mmspec.data.world import CLASS_NAMES

    check_positive_int("n_samples", n_samples)
    texts: list[str] = list(CLASS_NAMES)
    chunk = 2048
    for start in range(0, n_samples, chunk):
        batch = generate_batch(
            min(chunk, n_samples - start), seed, split="train", start=start, two_objects=two_objects
        )
        for cap, pairs in zip(batch.captions, batch.qa):
            texts.append(cap)
            for qa in pairs:
                texts.extend((qa.question, qa.short, qa.long))
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = 512):
    """Train a `tokenizers.Tokenizer` (BPE) on `texts`; deterministic for the same texts and vocab size."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    check_positive_int("vocab_size", vocab_size, minimum=len(SPECIAL_TOKEN_LIST) + len(PRINTABLE_ASCII))
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKEN_LIST),
        initial_alphabet=list(PRINTABLE_ASCII),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return tok


def save_world_tokenizer(tok, out: str | os.PathLike) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` that transformers 4.x and 5.x both load."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos_token"],
        "eos_token": SPECIAL_TOKENS["eos_token"],
        "unk_token": SPECIAL_TOKENS["unk_token"],
        "pad_token": SPECIAL_TOKENS["pad_token"],
        "additional_special_tokens": [SPECIAL_TOKENS["image_token"]],
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_world_tokenizer(path: str | os.PathLike | None = None):
    """The world tokenizer as a transformers `PreTrainedTokenizerFast` (local files only, never downloads).

    `path` defaults to the shipped `assets/tokenizer`. `tok.image_token` / `tok.image_token_id` name the
    `<image>` placeholder.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(DEFAULT_TOKENIZER_PATH if path is None else path)
    if not (path / "tokenizer.json").is_file():
        raise InputError(
            f"path {str(path)!r} holds no tokenizer.json; pass the folder written by "
            f"`mmspec train tokenizer --out {path}` (or run that command to make it)."
        )
    tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    tok.image_token = SPECIAL_TOKENS["image_token"]
    tok.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
    return tok

"""`mmspec train tokenizer`: train the world's BPE text tokenizer and write it (with its card) to `--out`.

    mmspec train tokenizer --out assets/tokenizer --vocab-size 512 --seed 0 --samples 5000

The corpus is the text of `--samples` train-split scenes (half of them two-object scenes): captions,
questions, short and long answers. The folder is written atomically and holds tokenizer.json,
tokenizer_config.json and README.md (the card: command, seed, corpus, wall time, vocabulary figures).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mmspec.data.artifacts import explicit_command, machine_summary
from mmspec.model_card import with_metadata


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("assets/tokenizer"), help="output folder")
    parser.add_argument(
        "--vocab-size", type=int, default=512, help="BPE vocabulary size incl. special tokens"
    )
    parser.add_argument("--seed", type=int, default=0, help="world seed of the training corpus")
    parser.add_argument("--samples", type=int, default=5000, help="number of scenes whose text is used")


def _card(args: argparse.Namespace, stats: dict) -> str:
    return f"""# World text tokenizer

BPE tokenizer (Hugging Face `tokenizers`) for the text of mmspec's embedded world: captions, questions and
short/long answers. Load it with `mmspec.data.load_world_tokenizer()` (a transformers
`PreTrainedTokenizerFast`).

| | |
|---|---|
| command | `{stats["command"]}` |
| seed (world corpus) | {args.seed} |
| corpus | {stats["n_texts"]} texts from {args.samples} train-split scenes (two-object probability 0.5), \
{stats["n_chars"]} characters |
| vocabulary | {stats["vocab_size"]} tokens (requested {args.vocab_size}) |
| special tokens | `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, `<image>`=4 |
| tokens per text (corpus mean) | {stats["mean_tokens"]:.2f} |
| distinct corpus words that are a single token | {stats["single_token_words"]} of {stats["n_words"]} |
| `<unk>` tokens in the corpus | {stats["n_unk"]} |
| training wall time | {stats["seconds"]:.1f} s (corpus generation included) |
| machine | {stats["machine"]} |

Encoding prepends `<bos>` (transformers' `add_special_tokens=True`); `<eos>` is never added automatically.
Normalisation: NFKC and whitespace runs collapsed to one space; decoding is otherwise lossless.
"""


def run(args: argparse.Namespace) -> int:
    from mmspec.data.artifacts import atomic_output_dir
    from mmspec.data.tokenizer import SPECIAL_TOKENS, build_tokenizer, save_world_tokenizer, world_corpus
    from mmspec.errors import check, check_positive_int

    check(0 <= args.seed < 2**63, f"--seed must be in [0, 2**63), got {args.seed}.")
    check_positive_int("--samples", args.samples)
    check_positive_int("--vocab-size", args.vocab_size)
    started = time.perf_counter()
    print(f"building the corpus from {args.samples} scenes (seed {args.seed}) ...")
    texts = world_corpus(args.samples, args.seed)
    print(f"training BPE (vocab {args.vocab_size}) on {len(texts)} texts ...")
    tok = build_tokenizer(texts, args.vocab_size)
    seconds = time.perf_counter() - started
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    words = sorted(
        {w for t in texts for w in t.replace(".", " ").replace(",", " ").replace("?", " ").split()}
    )
    single = sum(len(tok.encode(w, add_special_tokens=False).ids) == 1 for w in words)
    unk_id = tok.token_to_id(SPECIAL_TOKENS["unk_token"])
    stats = {
        "command": explicit_command("mmspec train tokenizer", args, ["out", "vocab_size", "seed", "samples"]),
        "n_texts": len(texts),
        "n_chars": sum(map(len, texts)),
        "vocab_size": tok.get_vocab_size(),
        "mean_tokens": sum(len(e.ids) for e in encodings) / len(encodings),
        "single_token_words": single,
        "n_words": len(words),
        "n_unk": sum(e.ids.count(unk_id) for e in encodings),
        "seconds": seconds,
        "machine": machine_summary(),
    }
    with atomic_output_dir(args.out) as tmp:
        save_world_tokenizer(tok, tmp)
        card_text = with_metadata(_card(args, stats), pipeline_tag=None, tags=["tokenizer", "world"])
        (tmp / "README.md").write_text(card_text)
    print(f"wrote {Path(args.out).resolve()} (vocab {stats['vocab_size']}, {seconds:.1f} s)")
    return 0

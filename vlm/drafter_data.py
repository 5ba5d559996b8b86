"""The `data` stage of `mmspec train vlm-drafter` (`vlm.train_drafter`): the training rows as right-padded
prompt + answer token ids, from the embedded world's questions or a user's --data rows (`vlm.user_data`), with the
target's own greedy answers (self-distillation) or the data's; made once per (target, data, options) and cached in the
work dir; with several processes each answers its share of the rows (`mmspec.processes`).

    data = answer_cache(vlm, args, work, VLMData("rows.jsonl"))   # {"ids" [n, T], "lengths", "prompt_lengths",
                                                                  #  "images"}
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mmspec.errors import check
from mmspec.hf_loading import folder_fingerprint
from mmspec.processes import gather_shards, rank_and_count, shard, wait_for_everyone
from vlm.pipeline import SpeculativeVLM
from vlm.user_data import RowImages, VLMData
from vlm.world import answer_text, world_vqa_examples


def target_answers(vlm: SpeculativeVLM, images, prompts: list[str], dataset_answers: list[str | None] | None,
                   max_tokens: int, quiet: bool, state=None) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer ids [n, T], lengths [n] and prompt lengths [n] of n (image, prompt) rows
    (`images` indexable: tensors, or `RowImages` read on demand): the target's greedy answers up to max_tokens
    (dataset_answers None), else the given answer texts (each ending in the tokenizer's eos) cut at max_tokens.
    With several processes (`state`) each answers its `shard` of the rows and every process gets them all."""
    n, rows, prompt_lengths = len(prompts), [], []
    tok = vlm.processor.tokenizer
    mine = shard(range(n), state)
    bar = tqdm(total=len(mine), desc="target answers" if dataset_answers is None else "dataset answers",
               disable=quiet or rank_and_count(state)[0] > 0)
    for start in range(0, len(mine), 64):
        chunk = mine[start:start + 64]
        chunk_images, chunk_prompts = [images[i] for i in chunk], [prompts[i] for i in chunk]
        if dataset_answers is None:
            answers = vlm.generate(chunk_images, chunk_prompts, max_new_tokens=max_tokens, batch_size=64,
                                   use_drafter=False).token_ids
        else:
            answers = [tok(dataset_answers[i], add_special_tokens=False)["input_ids"][:max_tokens] for i in chunk]
        inputs = vlm.encode(chunk_images, chunk_prompts)
        for row, answer in enumerate(answers):
            length = int(inputs.lengths[row])
            rows.append(inputs.input_ids[row, :length].tolist() + answer)
            prompt_lengths.append(length)
        bar.update(len(chunk))
    bar.close()
    rows, prompt_lengths = zip(*gather_shards(list(zip(rows, prompt_lengths)), state))
    ids = torch.full((n, max(len(r) for r in rows)), tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return {"ids": ids, "lengths": torch.tensor([len(r) for r in rows]), "prompt_lengths": torch.tensor(prompt_lengths)}


def answer_source(args: argparse.Namespace) -> str:
    """Where the training answers come from: --answers, or the kind's paper (dataset answers for MSD)."""
    return args.answers if args.answers != "auto" else ("dataset" if args.kind == "msd" else "target")


def training_rows(args: argparse.Namespace, user: VLMData) -> list[int]:
    """The --data rows a drafter trains on: those not held out for the eval, the first --num-train of them."""
    rows = user.split(args.eval_prompts, args.seed)[0]
    check(args.num_train is None or args.num_train <= len(rows),
          f"--num-train {args.num_train}: --data {user.source} has {len(rows)} training rows ({len(user)} less "
          f"--eval-prompts {args.eval_prompts} held out); lower --num-train or leave it out to train on all.")
    return rows[: args.num_train]


def data_id(user: VLMData) -> str:
    """What identifies a --data source's training examples: its fingerprint, and whether its later exchanges are
    examples too (rows of several exchanges read whole)."""
    return user.fingerprint() + ("-turns" if user.reads_later_exchanges else "")


def conversation_answers(vlm: SpeculativeVLM, user: VLMData, rows: list[int], source: str, max_tokens: int,
                         quiet: bool, state=None) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One example per exchange of each row (rows read whole, `VLMData(turns="all")`), in row order: exchange n's
    prompt holds the exchanges before it (`SpeculativeVLM.conversation_text`) and its answer is the target's greedy
    one given that history, the target's own earlier answers in it (source "target", as SpecForge regenerates
    conversations turn by turn), or the data's. Returns `target_answers`' tensors over the examples and each
    example's row."""
    tok = vlm.processor.tokenizer
    turns = {i: [(user.rows[i].question, user.rows[i].answer), *user.rows[i].later] for i in rows}
    missing = [(i, n) for i in rows for n, (_, a) in enumerate(turns[i], 1) if a is None]
    check(source == "target" or not missing, f"--answers dataset: --data row {missing[0][0] if missing else 0} "
                                             f"exchange {missing[0][1] if missing else 0} has no answer; give every "
                                             "exchange one, or let the target answer (--answers target).")
    history: dict[int, list[tuple[str, str]]] = {i: [] for i in rows}
    parts: dict[tuple[int, int], tuple[list[int], int]] = {}
    for n in range(max(len(t) for t in turns.values())):
        now = [i for i in rows if n < len(turns[i])]
        prompts = [vlm.conversation_text(history[i], turns[i][n][0], user.image_count(i)) for i in now]
        texts = None if source == "target" else [turns[i][n][1] + tok.eos_token for i in now]
        data = target_answers(vlm, RowImages(user, now), prompts, texts, max_tokens, quiet, state)
        for j, i in enumerate(now):
            length, prompt_length = int(data["lengths"][j]), int(data["prompt_lengths"][j])
            ids = data["ids"][j, :length].tolist()
            parts[i, n] = ids, prompt_length
            reply = (tok.decode(ids[prompt_length:], skip_special_tokens=True) if source == "target"
                     else turns[i][n][1])
            history[i].append((turns[i][n][0], reply))
    order = [(i, n) for i in rows for n in range(len(turns[i]))]
    ids = torch.full((len(order), max(len(parts[k][0]) for k in order)), tok.pad_token_id, dtype=torch.long)
    for row, key in enumerate(order):
        ids[row, : len(parts[key][0])] = torch.tensor(parts[key][0])
    return ({"ids": ids, "lengths": torch.tensor([len(parts[k][0]) for k in order]),
             "prompt_lengths": torch.tensor([parts[k][1] for k in order])}, [i for i, _ in order])


def answer_cache(vlm: SpeculativeVLM, args: argparse.Namespace, work: Path, user: VLMData | None = None,
                 state=None) -> dict[str, torch.Tensor]:
    """The training answers (`answer_source`) of the world's questions or of the --data rows `user`, made once per
    (target, data, options) and kept in `work`; "images" holds the examples' images (world: a tensor [n, 3, H, W];
    --data: `RowImages`, read on demand). --data rows of several exchanges read whole give one example per exchange
    (`conversation_answers`)."""
    source = answer_source(args)
    prefix = "answers" if source == "target" else "dataset-answers"
    tok = vlm.processor.tokenizer
    whole = user is not None and user.reads_later_exchanges
    if user is None:
        examples = world_vqa_examples("train", args.num_train, seed=args.seed, long_fraction=1.0)
        images = [ex.image for ex in examples]
        prompts = [ex.prompt for ex in examples]
        texts = [answer_text(ex.qa, True, tok.eos_token) for ex in examples]
        what = f"{len(examples)}-seed{args.seed}"
    else:
        rows = training_rows(args, user)
        images, prompts = RowImages(user, rows), [user.rows[i].question for i in rows]
        missing = [i for i in rows if user.rows[i].answer is None]
        check(source == "target" or whole or not missing,
              f"--answers dataset: --data row {missing[0] if missing else 0} has no answer; give every row one, or "
              "let the target answer (--answers target).")
        texts = [None if user.rows[i].answer is None else user.rows[i].answer + tok.eos_token for i in rows]
        what = f"data{data_id(user)}-{len(rows)}-seed{args.seed}"
    path = work / f"{prefix}-{folder_fingerprint(args.target)}-{what}-max{args.answer_max_tokens}.pt"
    if path.is_file() and not args.force:
        data = torch.load(path, weights_only=True)
    else:
        if whole:
            data, example_rows = conversation_answers(vlm, user, rows, source, args.answer_max_tokens, args.quiet,
                                                      state)
            data["example_rows"] = torch.tensor(example_rows)
        else:
            data = target_answers(vlm, images, prompts, None if source == "target" else texts,
                                  args.answer_max_tokens, args.quiet, state)
        if user is None:
            data["images"] = torch.stack(images)
        if rank_and_count(state)[0] == 0:
            work.mkdir(parents=True, exist_ok=True)
            torch.save(data, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        wait_for_everyone(state)
    if user is not None:
        data["images"] = RowImages(user, data.pop("example_rows").tolist()) if whole else images
    return data

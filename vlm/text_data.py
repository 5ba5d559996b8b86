"""A text corpus for the text-only stage of a VLM drafter's training (`mmspec train vlm-drafter --text-data FILE`).

ViSpec's and MSD's official code train their text-only stage on a separate text corpus run through the target with
no image (ViSpec: ShareGPT; MSD: its `datapath_t`); without one, mmspec's stage trains on the multimodal sequences
with the image removed. A corpus file is JSON Lines, one conversation a line, in either layout:

    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}   # ShareGPT
    {"prompt": "...", "answer": "..."}

(ShareGPT's `role` / `content` keys and `user` / `assistant` roles are read too.) A conversation gives its first user
turn and the reply after it; the prompt is formatted as the target's text-only prompts are (its chat template, else
LLaVA-1.5's conversation format) and the reply, its dataset answer, is what the drafter learns (as EAGLE and MSD train
on dataset answers).

    python -m vlm.text_data world-text.jsonl --num 2000     # a corpus from the embedded world: scenes in words
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmspec.errors import InputError, check, check_positive_int

USER_ROLES = ("human", "user")
REPLY_ROLES = ("gpt", "assistant", "model")


def turn_text(turn: object) -> object:
    """The text of one conversation turn: its `value` (ShareGPT) or `content`, a string or a list of chat parts whose
    `text` parts are joined (image parts carry no text)."""
    if not isinstance(turn, dict):
        return None
    content = turn.get("value", turn.get("content"))
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return " ".join(t for t in texts if isinstance(t, str)) if texts else None
    return content


def raw_exchanges(row: dict, where: str) -> list[tuple[object, object]]:
    """One row's exchanges as written, in order: (a user turn's text, the text of the reply right after it or None),
    from `conversations` (ShareGPT), `messages` (chat) or `prompt` / `answer` (one exchange); unchecked."""
    if "prompt" in row:
        return [(row["prompt"], row.get("answer"))]
    turns = row.get("conversations", row.get("messages"))
    check(isinstance(turns, list), f"{where}: a row needs 'conversations' (ShareGPT), 'messages' (chat) or "
                                   "'prompt' and 'answer'.")
    roles = [str(t.get("from", t.get("role", ""))).lower() if isinstance(t, dict) else "" for t in turns]
    users = [i for i, role in enumerate(roles) if role in USER_ROLES]
    check(users, f"{where}: no user turn ('from' human or 'role' user).")
    return [(turn_text(turns[i]), turn_text(turns[i + 1]) if i + 1 < len(turns) and roles[i + 1] in REPLY_ROLES
             else None) for i in users]


def checked_exchange(exchange: tuple[object, object], where: str, need_reply: bool) -> tuple[str, str | None]:
    """(prompt, reply) stripped; InputError naming `where` for an empty prompt or reply, or a missing needed reply."""
    prompt, reply = exchange
    check(isinstance(prompt, str) and prompt.strip(), f"{where}: the prompt must be a non-empty string.")
    check(reply is None or (isinstance(reply, str) and reply.strip()), f"{where}: the reply must be a non-empty "
                                                                        "string.")
    check(reply is not None or not need_reply,
          f"{where}: no reply after the user turn ('from' gpt or 'role' assistant, or 'answer').")
    return prompt.strip(), None if reply is None else reply.strip()


def conversation_turns(exchanges: list[tuple[object, object]], where: str) -> list[tuple[str, str | None]]:
    """A row's `raw_exchanges`, each checked as `checked_exchange` checks one (exchange n named from the second on);
    a reply may be missing (None)."""
    return [checked_exchange(e, where if n == 1 else f"{where} (exchange {n})", False)
            for n, e in enumerate(exchanges, 1)]


def turns_notice(source: str, multi_turn: int, total: int, read: bool = False) -> str | None:
    """One line saying that `multi_turn` of `total` rows of `source` hold exchanges after their first, and whether
    training reads them (`read`) or not (None when no row does)."""
    if not multi_turn:
        return None
    if read:
        return (f"{source}: {multi_turn} of {total} rows hold more than one exchange; each exchange trains as one "
                "example, the exchanges before it in its prompt (--turns first: the first exchange only).")
    return (f"{source}: {multi_turn} of {total} rows hold more than one exchange; each trains on its first user turn "
            "and the reply after it (later turns are not read).")


def read_text_conversations(path: str | Path) -> tuple[list[tuple[str, str]], str | None]:
    """Every (prompt, reply) of a corpus file and the file's `turns_notice`; InputError (one line) for a missing,
    unreadable or empty file or a bad line, naming the line."""
    path = Path(path)
    check(path.is_file(), f"--text-data {path}: no such file.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"--text-data {path}: not UTF-8 text; give a JSON Lines file.") from None
    pairs, multi_turn = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"--text-data {path} line {number}: not JSON ({err.msg}).") from None
        check(isinstance(row, dict), f"--text-data {path} line {number}: a row must be a JSON object.")
        exchanges = raw_exchanges(row, f"--text-data {path} line {number}")
        pairs.append(checked_exchange(exchanges[0], f"--text-data {path} line {number}", need_reply=True))
        multi_turn += len(exchanges) > 1
    check(pairs, f"--text-data {path}: no conversations in the file.")
    return pairs, turns_notice(f"--text-data {path}", multi_turn, len(pairs))


def text_corpus(vlm, pairs: list[tuple[str, str]], max_tokens: int) -> dict[str, torch.Tensor]:
    """Right-padded token ids of prompt + reply + eos [n, T] (the reply cut at `max_tokens`), lengths [n] and prompt
    lengths [n], as `vlm.train_drafter.target_answers` makes the multimodal ones (without images)."""
    tok = vlm.processor.tokenizer
    rows, prompt_lengths = [], []
    for prompt, reply in pairs:
        ids = tok(vlm.prompt_text(prompt, with_image=False))["input_ids"]
        answer = tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"][:max_tokens]
        rows.append(ids + answer)
        prompt_lengths.append(len(ids))
    ids = torch.full((len(rows), max(len(r) for r in rows)), tok.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return {"ids": ids, "lengths": torch.tensor([len(r) for r in rows]), "prompt_lengths": torch.tensor(prompt_lengths)}


def world_text_conversations(n: int, seed: int = 0) -> list[dict]:
    """n ShareGPT-layout conversations from the embedded world's train split: a scene told in words (its caption),
    one of its questions asking for a detailed answer, and the world's long answer."""
    from mmspec.data import generate_batch

    check_positive_int("n", n)
    batch = generate_batch(n, seed, split="train", two_objects=0.4)
    rows = []
    for i, (caption, pairs) in enumerate(zip(batch.captions, batch.qa)):
        qa = pairs[i % len(pairs)]
        rows.append({"conversations": [{"from": "human", "value": f"{caption}. {qa.question} Answer in detail."},
                                       {"from": "gpt", "value": qa.long}]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm.text_data",
                                     description="Write a text corpus of the embedded world (ShareGPT layout).")
    parser.add_argument("out", help="the JSON Lines file to write")
    parser.add_argument("--num", type=int, default=2000, help="conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = world_text_conversations(args.num, args.seed)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The world text tokenizer: shipped asset loads offline, special tokens, round trips, training CLI."""

from __future__ import annotations

import re

import pytest

from mmspec.cli import main
from mmspec.data import SPECIAL_TOKENS, generate_batch, load_world_tokenizer
from mmspec.data.tokenizer import build_tokenizer, world_corpus
from mmspec.errors import InputError


@pytest.fixture(scope="module")
def tok():
    return load_world_tokenizer()


def _world_texts(n: int = 100) -> list[str]:
    batch = generate_batch(n, seed=99, split="val", two_objects=0.5)
    texts = list(batch.captions)
    for pairs in batch.qa:
        for qa in pairs:
            texts += [qa.question, qa.short, qa.long]
    return texts


def test_special_tokens(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS.values()] == [0, 1, 2, 3, 4]
    specials = (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token)
    assert specials == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert tok.image_token == "<image>" and tok.image_token_id == 4
    assert "<image>" in tok.all_special_tokens
    assert 100 < len(tok) < 1000


def test_bos_prepended_and_image_token_atomic(tok):
    ids = tok("<image> What color is the object?")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.image_token_id in ids
    assert tok.eos_token_id not in ids


def test_world_text_round_trips_without_unk(tok):
    texts = _world_texts()
    encoded = tok(texts)["input_ids"]
    for text, ids in zip(texts, encoded):
        assert tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_world_words_are_single_tokens(tok):
    words = {w for t in _world_texts(50) for w in re.findall(r"[A-Za-z]+", t)}
    multi = [w for w in words if len(tok(w, add_special_tokens=False)["input_ids"]) > 1]
    assert len(multi) <= 2, multi  # BPE learned the whole world vocabulary as words


def test_round_trip_modulo_whitespace_and_no_unk_for_ascii(tok):
    text = "A  purple\tsquare,\nplease!  (x=1; y=2) #3 ~ok"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == " ".join(text.split())


def test_padding_batch(tok):
    out = tok(["a red circle", "a large blue square at the top"], padding=True)
    lengths = [sum(m) for m in out["attention_mask"]]
    assert lengths[0] < lengths[1] and out["input_ids"][0][-1] == tok.pad_token_id


def test_training_is_deterministic():
    texts = world_corpus(100, seed=0)
    a, b = build_tokenizer(texts, 300), build_tokenizer(texts, 300)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() <= 300


def test_train_command_writes_loadable_tokenizer(tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["train", "tokenizer", "--out", str(out), "--samples", "200", "--vocab-size", "300"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "README.md"}
    tok = load_world_tokenizer(out)
    assert tok.decode(tok("a small red cross")["input_ids"], skip_special_tokens=True) == "a small red cross"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_missing_tokenizer_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="mmspec train tokenizer"):
        load_world_tokenizer(tmp_path)

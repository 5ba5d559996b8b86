"""`mmspec train vlm-drafter --data`: a user's rows in every layout `vlm.user_data` reads give the same training rows,
bad rows are one-line errors before a model loads, a drafter trains on the target's own answers to them and is
evaluated on rows held out of them, and length-grouped batches are a pure function of the step."""

from __future__ import annotations

import json

import PIL.Image
import pytest
import torch
from vlm_dummies import save_tiny_world_llava

from mmspec.data import generate_batch
from mmspec.errors import InputError
from mmspec.world_training import length_grouped_batch
from vlm.drafter_data import answer_cache
from vlm.train_drafter import training_batch
from vlm.user_data import VLMData

QUESTIONS = ("Tell me about this picture.", "Which colors can you see here?", "Is anything round in the image?")


def write_images(folder, n: int) -> list[str]:
    """n world scenes as PNGs, every third one resized to 40 x 48 (users' images differ in size)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, image in enumerate(generate_batch(n, seed=3, split="test").images):
        picture = PIL.Image.fromarray(image.permute(1, 2, 0).numpy())
        if i % 3 == 2:
            picture = picture.resize((48, 40))
        picture.save(folder / f"scene{i}.png")
        names.append(f"scene{i}.png")
    return names


def llava_rows(names: list[str]) -> list[dict]:
    return [{"image": name, "conversations": [{"from": "human", "value": f"<image>\n{QUESTIONS[i % 3]}"},
                                              {"from": "gpt", "value": f"Scene {i} holds a shape."}]}
            for i, name in enumerate(names)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_world_llava(tmp_path_factory.mktemp("vlm-target"))


def test_every_layout_reads_the_same_rows(tmp_path):
    """LLaVA JSON Lines, a LLaVA JSON list under --image-folder, chat `messages` rows, prompt / answer rows and a
    `datasets` folder holding the images themselves: the same questions (without `<image>`), answers and pixels."""
    names = write_images(tmp_path / "images", 4)
    rows = llava_rows(names)
    (tmp_path / "images" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "llava.json").write_text(json.dumps(rows))
    chat = [{"images": [r["image"]], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[i % 3]}]},
        {"role": "assistant", "content": [{"type": "text", "text": r["conversations"][1]["value"]}]}]}
        for i, r in enumerate(rows)]
    (tmp_path / "images" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    plain = [{"image": r["image"], "prompt": QUESTIONS[i % 3]} for i, r in enumerate(rows)]
    (tmp_path / "images" / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    sources = [VLMData(tmp_path / "images" / "rows.jsonl"), VLMData(tmp_path / "llava.json", tmp_path / "images"),
               VLMData(tmp_path / "images" / "chat.jsonl")]
    import datasets  # (the dev extra's)

    folder = tmp_path / "hf"
    datasets.Dataset.from_dict({
        "image": [PIL.Image.open(tmp_path / "images" / n) for n in names],
        "conversations": [r["conversations"] for r in rows]}).save_to_disk(str(folder))
    sources.append(VLMData(folder))
    first = sources[0]
    assert [r.question for r in first.rows] == [QUESTIONS[i % 3] for i in range(4)]
    assert first.rows[1].answer == "Scene 1 holds a shape." and first.image(2).shape == (3, 40, 48)
    for data in sources[1:]:
        assert [(r.question, r.answer) for r in data.rows] == [(r.question, r.answer) for r in first.rows]
        assert all(torch.equal(data.image(i), first.image(i)) for i in range(4))
    unanswered = VLMData(tmp_path / "images" / "plain.jsonl")
    assert [r.answer for r in unanswered.rows] == [None] * 4 and unanswered.fingerprint() != first.fingerprint()
    train, held = first.split(1, seed=0)
    assert sorted(train + held) == [0, 1, 2, 3] and len(held) == 1 and first.split(1, seed=0) == (train, held)
    # rows of several exchanges: read whole or their first exchange, and the data says which in one line
    assert all(data.turns_notice() is None for data in sources)
    rows[2]["conversations"] += [{"from": "human", "value": "And the shape?"}, {"from": "gpt", "value": "A cross."}]
    (tmp_path / "images" / "turns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    turns, firsts = (VLMData(tmp_path / "images" / "turns.jsonl", turns=t) for t in ("all", "first"))
    assert turns.rows[2].later == (("And the shape?", "A cross."),) and firsts.rows[2] == first.rows[2]
    for data, says in ((turns, "each exchange trains as one example"), (firsts, "later turns are not read")):
        notice = data.turns_notice()
        assert "1 of 4 rows hold more than one exchange" in notice and says in notice and "\n" not in notice


@pytest.mark.parametrize("row, message", [
    ({"image": "nope.png", "prompt": "Hi?"}, "image .*nope.png not found; set --image-folder"),
    ({"images": [], "prompt": "Hi?"}, "an empty 'images' list"),
    ({"image": "https://x.org/a.png", "prompt": "Hi?"}, "is a URL; mmspec reads local files only"),
    ({"prompt": "Hi?"}, "no image .* text-only rows train through --text-data"),
    ({"image": "scene0.png", "conversations": [{"from": "gpt", "value": "x"}]}, "no user turn"),
    ({"image": "scene0.png", "prompt": "<image>"}, "the question is empty"),
    ("[1, 2]", "not JSON|a row must be a JSON object"),
])
def test_bad_rows_are_one_line_errors_naming_the_row(tmp_path, row, message):
    write_images(tmp_path, 2)
    good = json.dumps({"image": "scene1.png", "prompt": "Hi?"})
    (tmp_path / "rows.jsonl").write_text(good + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(InputError, match=message) as err:
        VLMData(tmp_path / "rows.jsonl")
    assert "\n" not in str(err.value) and "line 2" in str(err.value)


def test_train_on_user_rows_end_to_end(target_dir, tmp_path):
    """The target answers the training rows (not the rows' own answers), the drafter trains with length-grouped
    batches, the eval runs on the held-out rows with greedy answers equal to the target's, and the card says what
    it was trained on; too few rows for the eval, --answers dataset on unanswered rows and --image-folder without
    --data are one-line errors before the model loads."""
    from mmspec.cli import main
    from mmspec.model_card import metadata, strip_metadata
    from vlm.pipeline import SpeculativeVLM

    names = write_images(tmp_path / "images", 12)
    data_file = tmp_path / "images" / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in llava_rows(names)))
    out, work = tmp_path / "drafter", tmp_path / "work"
    common = ["train", "vlm-drafter", "--target", str(target_dir), "--work-dir", str(work), "--data", str(data_file),
              "--answer-max-tokens", "8", "--batch-size", "4", "--eval-prompts", "3", "--quiet", "--out", str(out)]
    assert main([*common, "--steps", "30", "--lr", "3e-3", "--group-by-length"]) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["drafter"]["num_train"] == 9 and info["drafter"]["data"] == str(data_file)
    assert info["eval"]["n"] == 3 and info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["drafter"]["final_feature_smoothl1"] < info["drafter"]["first_feature_smoothl1"]
    card = (out / "README.md").read_text()
    assert f"9 rows of {data_file}" in strip_metadata(card) and "--group-by-length" in card
    assert "world" not in metadata(card)["tags"]
    # `mmspec vlm` answers with the drafter from its folder (--drafter-path), and refuses the path without a kind
    image = str(tmp_path / "images" / names[0])
    assert main(["vlm", "--model", str(target_dir), "--drafter", "eagle", "--drafter-path", str(out), "--image", image,
                 "--prompt", "Hi?", "--max-new-tokens", "4", "--threads", "1"]) == 0
    assert main(["vlm", "--model", str(target_dir), "--drafter-path", str(out), "--image", image, "--prompt",
                 "Hi?"]) == 2
    # fine-tuning (--init-from) starts from the saved drafter: 3 warm-up steps later it is still next to it
    from safetensors.torch import load_file

    tuned = tmp_path / "tuned"
    assert main([*common[:-1], str(tuned), "--steps", "3", "--init-from", str(out), "--stages", "data,drafter"]) == 0
    before, after = (load_file(str(f / "diffusion_pytorch_model.safetensors")) for f in (out, tuned))
    assert all(before[k].shape == after[k].shape for k in before) and any(not torch.equal(before[k], after[k])
                                                                          for k in before)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 1e-3
    # the cached answers are the target's greedy answers to the 9 training rows, not the rows' own
    vlm = SpeculativeVLM.from_pretrained(target_dir)
    user = VLMData(data_file)
    rows = user.split(3, seed=0)[0]
    (cache,) = work.glob(f"answers-*-data{user.fingerprint()}-9-seed0-max8.pt")
    data = torch.load(cache, weights_only=True)
    answers = vlm.generate([user.image(i) for i in rows], [user.rows[i].question for i in rows],
                           max_new_tokens=8, use_drafter=False).token_ids
    for b, answer in enumerate(answers):
        start = int(data["prompt_lengths"][b])
        assert data["ids"][b, start: int(data["lengths"][b])].tolist() == answer
    for extra, message in ((["--eval-prompts", "12"], "cannot hold out 12"),
                           (["--num-train", "10"], "--num-train 10: .* has 9 training rows"),
                           (["--image-folder", str(tmp_path / "nowhere")], "--image-folder .*: no such folder"),
                           (["--init-from", str(out), "--input-norm", "on"], "keeps its saved config"),
                           (["--kind", "eagle3", "--noise", "0.3"], "--noise does not apply to the eagle3 drafter"),
                           (["--ttt-steps", "3"], "--ttt-steps does not apply to the eagle drafter")):
        with pytest.raises(InputError, match=message):
            from vlm.train_drafter import run
            run(parse([*common[2:], *extra]))
    plain = tmp_path / "images" / "plain.jsonl"
    plain.write_text("".join(json.dumps({"image": n, "prompt": "Hi?"}) + "\n" for n in names))
    with pytest.raises(InputError, match="--answers dataset: --data row .* has no answer"):
        answer_cache(vlm, parse([*common[2:], "--data", str(plain), "--answers", "dataset", "--num-train", "2"]),
                     work, VLMData(plain))
    with pytest.raises(InputError, match="give --data too"):
        from vlm.train_drafter import run
        run(parse(["--target", str(target_dir), "--image-folder", str(tmp_path)]))
    # a text-only batch of rows whose images differ in size drops each row's own image tokens
    inputs, mask = training_batch(vlm, data, torch.tensor([0, 1]), text_only=True)
    assert not (inputs.input_ids == vlm.lm.image_token_id).any() and inputs.pixel_values is None


def test_conversations_train_one_example_per_exchange(target_dir, tmp_path):
    """Rows of several exchanges read whole: one example per exchange, in row order, its prompt the conversation so
    far in the target's format with the target's own earlier answers (greedy, regenerated turn by turn), or the
    data's with --answers dataset; --turns first keeps each row's first exchange; the training runs on them."""
    from mmspec.cli import main
    from vlm.drafter_data import data_id
    from vlm.pipeline import SpeculativeVLM

    names = write_images(tmp_path / "images", 5)
    rows = llava_rows(names)
    for i in (0, 3):  # two rows of three exchanges, the last one of row 3 unanswered
        rows[i]["conversations"] += [{"from": "human", "value": "What else?"}, {"from": "gpt", "value": "A square."},
                                     {"from": "human", "value": "Is it large?"}]
        if i == 0:
            rows[i]["conversations"].append({"from": "gpt", "value": "It is small."})
    data_file = tmp_path / "images" / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    user = VLMData(data_file)
    assert user.rows[0].later == (("What else?", "A square."), ("Is it large?", "It is small."))
    assert user.rows[3].later[-1] == ("Is it large?", None) and "one example" in user.turns_notice()
    assert VLMData(data_file, turns="first").rows[0].later == () and data_id(user) != data_id(VLMData(
        data_file, turns="first"))
    vlm = SpeculativeVLM.from_pretrained(target_dir)
    tok = vlm.processor.tokenizer
    history = [("Tell me about this picture.", "Scene 0 holds a shape."), ("What else?", "A square.")]
    assert vlm.conversation_text(history, "Is it large?") == (
        vlm.prompt_text("Tell me about this picture.") + f" Scene 0 holds a shape.{tok.eos_token}USER: What else? "
        f"ASSISTANT: A square.{tok.eos_token}USER: Is it large? ASSISTANT:")  # LLaVA-1.5's format (no template)
    common = ["--target", str(target_dir), "--data", str(data_file), "--eval-prompts", "1", "--answer-max-tokens",
              "6", "--quiet"]
    held = user.split(1, seed=0)[1][0]
    train = [i for i in range(5) if i != held]
    work = tmp_path / "work"
    data = answer_cache(vlm, parse([*common, "--work-dir", str(work)]), work, user)
    exchanges = [(i, n) for i in train for n in range(1 + len(user.rows[i].later))]
    assert data["ids"].shape[0] == len(exchanges) and len(data["images"]) == len(exchanges)
    seen = 0
    for i, n in exchanges:  # each example's prompt: the conversation so far with the target's own answers
        if n == 0:
            answers = []
        length, start = int(data["lengths"][seen]), int(data["prompt_lengths"][seen])
        ids = data["ids"][seen, :length].tolist()
        asked = user.rows[i].question if n == 0 else user.rows[i].later[n - 1][0]
        prompt = vlm.encode([user.image(i)], [vlm.conversation_text(answers, asked)]).input_ids[0].tolist()
        assert ids[:start] == prompt, (i, n)
        answers.append((asked, tok.decode(ids[start:], skip_special_tokens=True)))
        seen += 1
    assert all(torch.equal(data["images"][k], user.image(i)) for k, (i, _) in enumerate(exchanges))
    dataset = answer_cache(vlm, parse([*common, "--work-dir", str(work), "--answers", "dataset", "--turns", "first"]),
                           work, VLMData(data_file, turns="first"))
    assert dataset["ids"].shape[0] == 4  # one example a row
    with pytest.raises(InputError, match="row 3 exchange 3 has no answer"):
        answer_cache(vlm, parse([*common, "--work-dir", str(work), "--answers", "dataset"]), work, user)
    assert main(["train", "vlm-drafter", *common, "--work-dir", str(work), "--out", str(tmp_path / "d"), "--steps",
                 "2", "--batch-size", "4"]) == 0
    assert json.loads((tmp_path / "d" / "training.json").read_text())["drafter"]["num_train"] == len(exchanges)


def parse(argv: list[str]):
    import argparse

    from vlm.train_drafter import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_length_grouped_batches():
    """A pure function of (step, lengths, batch size, seed); an epoch's batches cover distinct rows; rows in a batch
    are closer in length than random batches' (here: sorted within each mega-batch, so spread 3 of 1000)."""
    lengths = torch.randperm(1000)  # [1000]
    batches = [length_grouped_batch(step, lengths, 8, seed=1) for step in range(125)]
    assert all(torch.equal(b, length_grouped_batch(s, lengths, 8, seed=1)) for s, b in enumerate(batches))
    assert torch.cat(batches).unique().numel() == 1000  # one epoch: every row once
    spread = torch.stack([lengths[b].max() - lengths[b].min() for b in batches]).float().mean()
    random_spread = torch.stack([lengths[b].max() - lengths[b].min()
                                 for b in torch.randperm(1000).view(125, 8)]).float().mean()
    assert spread < random_spread / 10
    assert not torch.equal(length_grouped_batch(125, lengths, 8, seed=1), batches[0])  # the next epoch reshuffles
    assert length_grouped_batch(0, lengths[:3], 8, seed=0).numel() == 8  # fewer rows than a batch repeat


def test_a_conversation_follows_the_targets_chat_template():
    """With a chat template, a later question's prompt is the template's rendering of the conversation so far (the
    image in the first user turn alone, each answer an assistant turn, then the generation prompt), and the
    processor expands the one image."""
    from vlm.tiny import tiny_vlm

    vlm = tiny_vlm("llava")
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == "
                "'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    vlm.processor.chat_template = vlm.processor.tokenizer.chat_template = template
    text = vlm.conversation_text([("What is it?", "A cat."), ("Where?", "On a mat.")], "And the color?")
    assert text == ("<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
                    "<|im_start|>user\nWhere?<|im_end|>\n<|im_start|>assistant\nOn a mat.<|im_end|>\n"
                    "<|im_start|>user\nAnd the color?<|im_end|>\n<|im_start|>assistant\n")
    assert vlm.conversation_text([], "What is it?") == vlm.prompt_text("What is it?")
    inputs = vlm.encode([torch.zeros(3, 32, 32, dtype=torch.uint8)], [text])
    assert int((inputs.input_ids == vlm.lm.image_token_id).sum()) == vlm.image_tokens_per_image > 1

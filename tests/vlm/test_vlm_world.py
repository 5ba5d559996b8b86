"""The embedded-world LLaVA target (vlm/world.py) and `mmspec train vlm` (vlm/train.py), with tiny configs: the
processor's image tokens and offline save/load, the training batches' labels, an honest learning check on one
batch, the vision tower's pretraining labels and learning, the command end to end (pretrained tower frozen in the
target), resuming an interrupted run, and errors for bad input."""

import json

import pytest
import torch
from transformers import LlavaForConditionalGeneration, LlavaProcessor

import vlm.train as vlm_train
from mmspec.cli import main
from mmspec.data import generate_batch
from mmspec.errors import InputError
from vlm.vision_pretrain import SceneReadout, patch_targets, readout_loss, tower_features
from vlm.world import (
    IGNORE_INDEX,
    build_prompt,
    collate_vqa,
    num_image_tokens,
    world_llava_config,
    world_processor,
    world_vqa_examples,
)

TINY = {"vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
        "text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2}}
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture(scope="module")
def processor():
    return world_processor()


def tiny_model(processor, seed=0):
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(world_llava_config(tokenizer=processor.tokenizer, **TINY))


def test_config_matches_the_processor_and_the_world_tokenizer(processor):
    config = world_llava_config()
    assert config.image_token_id == processor.image_token_id == 4 and config.image_seq_length == 64
    assert config.text_config.vocab_size == len(processor.tokenizer) == 450
    assert (config.text_config.pad_token_id, config.text_config.bos_token_id, config.text_config.eos_token_id) == (
        0, 1, 2)
    assert config.vision_feature_select_strategy == "default" and config.vision_feature_layer == -2
    with torch.device("meta"):
        n = sum(p.numel() for p in LlavaForConditionalGeneration(config).parameters())
    assert 3e6 < n < 6e6


def test_processor_expands_image_token_and_round_trips_offline(processor, tmp_path, monkeypatch):
    ex = world_vqa_examples("val", 2, seed=0, long_fraction=0.5)
    texts, images = [e.prompt for e in ex], [e.image for e in ex]
    enc = processor(images=images, text=texts, return_tensors="pt", padding=True)
    assert num_image_tokens(processor) == 64
    assert (enc["input_ids"] == 4).sum(1).tolist() == [64, 64]
    assert enc["pixel_values"].shape == (2, 3, 32, 32)  # no resize or crop of 32x32 images
    x = torch.stack(images).float() / 255
    expected = (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    assert torch.allclose(enc["pixel_values"], expected, atol=1e-5)

    processor.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = LlavaProcessor.from_pretrained(tmp_path, local_files_only=True)
    again = loaded(images=images, text=texts, return_tensors="pt", padding=True)
    assert all(torch.equal(enc[k], again[k]) for k in enc)
    assert num_image_tokens(loaded) == 64 and loaded.image_token_id == 4

    model = tiny_model(processor)  # the processor's output is what the model takes
    assert model(**enc).logits.shape == (*enc["input_ids"].shape, 450)


def test_examples_are_deterministic_and_cover_both_scene_types():
    a = world_vqa_examples("train", 40, seed=3, start=80, long_fraction=0.5)
    b = world_vqa_examples("train", 40, seed=3, start=80, long_fraction=0.5)
    assert [(e.qa, e.long, e.index) for e in a] == [(e.qa, e.long, e.index) for e in b]
    assert all(torch.equal(x.image, y.image) for x, y in zip(a, b))
    assert 0 < sum(e.long for e in a) < 40
    counts = {e.qa.short for e in a if e.qa.kind == "count"} | {
        e.qa.short for e in world_vqa_examples("train", 40, seed=3, all_questions=True) if e.qa.kind == "count"}
    assert counts == {"one", "two"}
    assert not any(e.long for e in world_vqa_examples("test", 10, seed=0, long_fraction=0.0))
    assert build_prompt("What color is the object?", True) == (
        "USER: <image>\nWhat color is the object? Answer in detail. ASSISTANT:")
    with pytest.raises(InputError, match="split"):
        world_vqa_examples("dev", 4)


def test_collate_masks_prompt_and_padding(processor):
    tok = processor.tokenizer
    ex = world_vqa_examples("train", 6, seed=1, long_fraction=0.5)
    assert {e.long for e in ex} == {True, False}
    batch = collate_vqa(ex, processor)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert batch["pixel_values"].shape == (6, 3, 32, 32)
    for i, e in enumerate(ex):
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()  # right padding
        assert (labels[i, n:] == IGNORE_INDEX).all() and (ids[i, n:] == tok.pad_token_id).all()
        answer = labels[i] != IGNORE_INDEX
        assert not answer[ids[i] == 4].any()  # no loss on image tokens
        first = int(answer.nonzero()[0])
        assert answer[first:n].all() and not answer[:first].any()  # the prompt carries no loss
        assert torch.equal(labels[i, answer], ids[i, answer])
        assert tok.decode(labels[i, answer]) == e.answer + "<eos>"
        # prompt and answer tokenised apart are the full text tokenised at once (what generation continues)
        full = processor(images=[e.image], text=[f"{e.prompt} {e.answer}<eos>"])["input_ids"][0]
        assert ids[i, :n].tolist() == list(full)

    gen = collate_vqa(ex, processor, with_answers=False)  # prompts only, left-padded for generation
    assert "labels" not in gen
    for i, e in enumerate(ex):
        prompt = processor(images=[e.image], text=[e.prompt])["input_ids"][0]
        n = int(gen["attention_mask"][i].sum())
        assert gen["attention_mask"][i, -n:].all() and gen["input_ids"][i, -n:].tolist() == list(prompt)


def test_a_tiny_model_learns_a_fixed_batch(processor):
    batch = collate_vqa(world_vqa_examples("train", 8, seed=0, long_fraction=0.5), processor)
    model = tiny_model(processor).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_patch_targets_name_the_object_under_each_patch():
    params = generate_batch(64, 0, split="train", two_objects=0.5, with_text=False).params
    targets = patch_targets(params, 8)  # shape / color / size / cell [64, 64], background [64]
    for row in range(64):
        covered = 0
        for patch in range(64):
            x, y = (patch % 8) * 32 + 16, (patch // 8) * 32 + 16  # patch centre in units (1/8 px; 4 px patches)
            half = params.half[row]
            under = [o for o in range(int(params.n_objects[row]))
                     if abs(x - params.cx[row, o]) <= half[o] and abs(y - params.cy[row, o]) <= half[o]]
            assert len(under) <= 1  # objects never overlap
            got = tuple(int(targets[k][row, patch]) for k in ("shape", "color", "size", "cell"))
            if under:
                o = under[0]
                covered += 1
                assert got == (params.shape[row, o], params.color[row, o], params.size[row, o], params.cell[row, o])
            else:
                assert got == (4, 4, 3, 9)  # each attribute's "none" class
        assert covered >= int(params.n_objects[row])  # even a small object covers a patch centre
    assert torch.equal(targets["background"], torch.from_numpy(params.background).long())


def test_the_vision_readout_learns_a_batch(processor):
    """The pretraining objective can be learned: the readout loss of a tiny tower on one batch falls."""
    from transformers import CLIPVisionModel

    torch.manual_seed(0)
    config = world_llava_config(**TINY)
    tower = CLIPVisionModel(config.vision_config)
    readout = SceneReadout(config.vision_config.hidden_size)
    batch = generate_batch(16, 0, split="train", two_objects=0.4, with_text=False)
    pixels = processor.image_processor(list(batch.images), return_tensors="pt")["pixel_values"]
    targets = patch_targets(batch.params, 8)
    opt = torch.optim.Adam(list(tower.parameters()) + list(readout.parameters()), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = readout_loss(readout(tower_features(tower, pixels, config.vision_feature_layer)), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-vlm")
    out = root / "vlm"
    assert main(["train", "vlm", "--out", str(out), "--work-dir", str(root / "work"), "--steps", "3",
                 "--batch-size", "4", "--vision-steps", "3", "--vision-batch-size", "4", "--eval-scenes", "2",
                 "--eval-long", "2", "--model-config", json.dumps(TINY),
                 "--threads", "1", "--quiet"]) == 0
    return root, out


def test_train_vlm_writes_model_processor_record_and_card(trained):
    _, out = trained
    for part in ("config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "training.json",
                 "README.md"):
        assert (out / part).is_file(), part
    info = json.loads((out / "training.json").read_text())
    assert info["target"]["steps"] == 3 and info["target"]["model_config"] == TINY
    short, long = info["eval"]["short"], info["eval"]["long"]
    assert short["n"] == sum(v["n"] for v in short["per_kind"].values()) >= 12
    assert {"color", "shape", "count", "background"} <= set(short["per_kind"])
    assert long["n"] == 2 and 0 <= long["contains_short"] <= 1 and long["mean_tokens"] > 0
    card = (out / "README.md").read_text()
    assert "mmspec train vlm --out" in card and "--model-config" in card and "exact-match accuracy" in card
    assert "--vision-steps 3" in card and "vision tower (pretraining)" in card and "frozen while" in card
    assert info["vision"]["steps"] == 3 and set(info["vision"]["readout_accuracy"]) == {
        "shape", "color", "size", "cell", "empty_patches", "background"}
    model = LlavaForConditionalGeneration.from_pretrained(out, local_files_only=True)
    # the target stage kept the pretrained tower as it was (frozen, as in LLaVA)
    pretrained = torch.load(trained[0] / "work" / vlm_train.VISION_FILE, weights_only=True)["state"]
    for name, value in model.model.vision_tower.state_dict().items():
        assert torch.equal(value, pretrained[name]), name
    assert model.config.text_config.hidden_size == 32
    assert num_image_tokens(LlavaProcessor.from_pretrained(out, local_files_only=True)) == 64
    # a rerun skips the finished target (no --force) and only re-evaluates
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["train", "vlm", "--out", str(out), "--work-dir", str(trained[0] / "work"), "--stages", "target",
                 "--quiet", "--threads", "1"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_an_interrupted_training_resumes_from_its_state(processor, tmp_path, monkeypatch):
    kw = dict(steps=4, batch_size=2, lr=1e-3, seed=0, quiet=True, model_config=TINY, processor=processor,
              checkpoint_every=2)
    whole, _ = vlm_train.train_target(state_path=tmp_path / "a.pt", **kw)
    assert not (tmp_path / "a.pt").exists()  # removed once the run is complete

    real_step = vlm_train.optimizer_step

    def crash_at_step_3(opt, loss, step, *args):
        if step == 3:
            raise KeyboardInterrupt
        real_step(opt, loss, step, *args)

    monkeypatch.setattr(vlm_train, "optimizer_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        vlm_train.train_target(state_path=tmp_path / "b.pt", **kw)
    assert torch.load(tmp_path / "b.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(vlm_train, "optimizer_step", real_step)
    with pytest.raises(InputError, match="other settings"):
        vlm_train.train_target(state_path=tmp_path / "b.pt", **{**kw, "lr": 2e-3})
    resumed, info = vlm_train.train_target(state_path=tmp_path / "b.pt", **kw)
    assert info["resumed_from_step"] == 2
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, message", [
    (["--stages", "target,caption"], "--stages must be a subset"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--long-fraction", "1.5"], "--long-fraction"),
    (["--model-config", "{text: 1}"], "not valid JSON"),
    (["--model-config", '{"text": {"hiden_size": 32}}'], "no LlamaConfig field(s) ['hiden_size']"),
    (["--model-config", '{"text": {"hidden_size": 30}}'], "not a multiple of the number of attention heads"),
    (["--model-config", '{"vision": {"patch_size": 8}}'], "cannot change the vision image_size or patch_size"),
    (["--stages", "eval"], "run the 'target' stage first"),
    (["--stages", "target"], "run the 'vision' stage first"),
    (["--train-vision", "--vision-steps", "0"], "--train-vision fine-tunes the pretrained tower"),
    (["--vision-steps", "-1"], "--vision-steps must be >= 0"),
])
def test_bad_input_is_a_user_error(tmp_path, capsys, bad, message):
    args = ["train", "vlm", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--quiet",
            "--threads", "1", *bad]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_number_is_an_argparse_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "vlm", "--out", str(tmp_path), "--steps", "many"])
    assert exit_info.value.code == 2


def test_train_a_qwen2_vl_world_target(tmp_path):
    """`mmspec train vlm --arch qwen2_vl`: the vision stage pretrains Qwen2-VL's tower (readout on its merged
    4x4 tokens), the target stage keeps its patch embedding and blocks frozen and trains the merger with the language
    model, and the folder loads as a Qwen2-VL target of SpeculativeVLM with exact greedy answers."""
    from transformers import Qwen2VLForConditionalGeneration

    from vlm.pipeline import SpeculativeVLM

    out, work = tmp_path / "qwen", tmp_path / "work"
    tiny = {"vision": {"depth": 1, "embed_dim": 32, "num_heads": 2},
            "text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 2}}
    assert main(["train", "vlm", "--arch", "qwen2_vl", "--out", str(out), "--work-dir", str(work), "--steps", "3",
                 "--batch-size", "4", "--vision-steps", "3", "--vision-batch-size", "4", "--eval-scenes", "2",
                 "--eval-long", "2", "--model-config", json.dumps(tiny), "--threads", "1", "--quiet"]) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["target"]["arch"] == "qwen2_vl" and info["eval"]["short"]["n"] >= 12
    card = (out / "README.md").read_text()
    assert "--arch qwen2_vl" in card and "World Qwen2-VL target" in card and "the merged output" in card
    model = Qwen2VLForConditionalGeneration.from_pretrained(out, local_files_only=True)
    pretrained = torch.load(work / vlm_train.VISION_FILE, weights_only=True)["state"]
    for name, value in model.model.visual.state_dict().items():
        if not name.startswith("merger."):
            assert torch.equal(value, pretrained[name]), name
    vlm = SpeculativeVLM.from_pretrained(out)
    example = world_vqa_examples("test", 1, seed=0)[0]
    answer = vlm.generate([example.image], [example.prompt], max_new_tokens=4).token_ids[0]
    enc = vlm.processor(images=[example.image], text=[vlm.prompt_text(example.prompt)], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=4, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    assert answer == ref
    with pytest.raises(SystemExit):
        main(["train", "vlm", "--arch", "nope"])
    assert main(["train", "vlm", "--arch", "qwen2_vl", "--out", str(out), "--model-config",
                 '{"vision_feature_layer": -2}', "--quiet"]) != 0

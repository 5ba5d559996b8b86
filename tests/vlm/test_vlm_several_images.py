"""Rows of several images: `SpeculativeVLM.encode` / `generate(images, prompts)` take a list of images for a row (the
prompt gets one image marker or chat image part per image) and answer as transformers' own `generate` does on the
same processor outputs, with a drafter too; `--data` rows name several images (`images` lists, chat image parts, a
`datasets` folder's image lists), train eagle drafters, and drafters that lay out one image run a row refuse them in
one line before a model loads."""

from __future__ import annotations

import json

import PIL.Image
import pytest
import torch
from test_vlm_user_data import write_images
from vlm_dummies import save_tiny_world_llava

from mmspec.cli import main
from vlm.family import drafter_model
from vlm.tiny import tiny_vlm
from vlm.user_data import VLMData


def images(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (3, 32, 32), generator=g, dtype=torch.uint8) for _ in range(n)]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_row_of_two_images_answers_as_transformers_does(family):
    vlm = tiny_vlm(family, peak=4.0)
    pictures = images(3)
    rows, prompts = [pictures[:2], pictures[2]], ["Compare the two images.", "What is it?"]
    inputs = vlm.encode(rows, prompts)
    counts = (inputs.input_ids == vlm.lm.image_token_id).sum(-1).tolist()
    assert counts[0] == 2 * counts[1] > 0  # one marker per image, expanded by the processor
    torch.manual_seed(1)
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    spec = vlm.generate(rows, prompts, max_new_tokens=8, budget="fixed")
    for b, (row, prompt) in enumerate(zip(rows, prompts)):
        enc = vlm.encode([row], [prompt])
        ref = vlm.model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                 pixel_values=enc.pixel_values, **enc.extras, max_new_tokens=8, do_sample=False)
        answer = ref[0, enc.input_ids.shape[1]:].tolist()
        assert spec.token_ids[b] == answer[: len(spec.token_ids[b])] and len(spec.token_ids[b]) > 0
    assert spec.stats.num_drafts > 0


def test_data_rows_of_several_images_train_an_eagle_drafter(tmp_path, capsys):
    folder = save_tiny_world_llava(tmp_path / "target")
    names = write_images(tmp_path / "images", 8)
    rows = [{"image": n, "prompt": "Tell me about this picture."} for n in names[:6]]
    rows[1] = {"images": names[6:8], "prompt": "Which of the two is brighter?"}
    rows[2] = {"messages": [{"role": "user", "content": [{"type": "image", "image": names[2]},
                                                         {"type": "image", "image": names[3]},
                                                         {"type": "text", "text": "Same shapes?"}]}]}
    data_file = tmp_path / "images" / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = VLMData(data_file)
    assert data.rows_with_several_images() == 2 and data.image_count(1) == 2 and data.image_count(0) == 1
    assert [im.shape[0] for im in data.image(1)] == [3, 3] and data.image(0).shape[0] == 3
    import datasets  # (the dev extra's)

    hf = tmp_path / "hf"
    datasets.Dataset.from_dict({"images": [[PIL.Image.open(tmp_path / "images" / n) for n in names[i:i + k]]
                                           for i, k in ((0, 1), (6, 2))],
                                "prompt": ["One?", "Two?"]}).save_to_disk(str(hf))
    stored = VLMData(hf)
    assert stored.rows_with_several_images() == 1 and stored.image_count(1) == 2 and len(stored.image(1)) == 2
    common = ["train", "vlm-drafter", "--target", str(folder), "--data", str(data_file), "--eval-prompts", "2",
              "--answer-max-tokens", "6", "--batch-size", "4", "--steps", "3", "--work-dir", str(tmp_path / "work"),
              "--quiet"]
    capsys.readouterr()
    for one_run in (["--kind", "vispec"], ["--kind", "specvlm"], ["--kind", "eagle3", "--vision-adaptor"]):
        assert main([*common, *one_run]) == 2
        err = capsys.readouterr().err.strip()
        assert "2 rows hold several images" in err and "one image run a row" in err and "\n" not in err
    assert main([*common, "--kind", "eagle", "--out", str(tmp_path / "drafter")]) == 0
    info = json.loads((tmp_path / "drafter" / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True and info["drafter"]["num_train"] == 4
    train = data.split(2, seed=0)[0]
    (cache,) = (tmp_path / "work").glob("answers-*.pt")
    image_id = json.loads((folder / "config.json").read_text())["image_token_index"]
    counts = (torch.load(cache, weights_only=True)["ids"] == image_id).sum(-1).tolist()
    assert counts == [data.image_count(i) * counts[[data.image_count(j) for j in train].index(1)] for i in train]
    assert any(data.image_count(i) == 2 for i in train)  # a row of two images trained


def test_a_drafter_of_one_image_run_refuses_a_row_of_several_before_any_work():
    from mmspec.errors import InputError

    vlm = tiny_vlm("llava")
    vlm.drafter = drafter_model("vispec").for_target(vlm.lm).eval()
    pictures = images(2)
    with pytest.raises(InputError, match="row 1 holds several images") as err:
        vlm.generate([pictures[0], pictures], ["One?", "Two?"], max_new_tokens=4)
    assert "\n" not in str(err.value)
    assert len(vlm.generate([pictures[0], pictures], ["One?", "Two?"], max_new_tokens=4,
                            use_drafter=False).token_ids) == 2

"""LLaVA-NeXT and LLaVA-OneVision targets (`vlm.target.LlavaTiledCachedLM`): tiny random models with their own
processors built offline (world tokenizer, any-resolution tiles over a 32-pixel vision tower); images of three
sizes give image runs of three lengths in one ragged batch; greedy vanilla and greedy tree drafting through
`SpeculativeVLM` == transformers' own `generate(do_sample=False)` on the processor's outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm.family import drafter_model
from vlm.pipeline import SpeculativeVLM
from vlm.tiny import PINPOINTS, tiny_vlm

PROMPTS = ["What color is the object?", "How many objects are there?", "Describe the scene."]


def images_of_three_sizes() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((32, 32), (32, 64), (64, 48))]


def transformers_answers(vlm: SpeculativeVLM, images, prompts) -> list[list[int]]:
    """transformers' greedy `generate` on the processor's outputs, one row at a time (it stops at <eos>)."""
    answers = []
    for image, prompt in zip(images, prompts):
        one = vlm.processor(images=[image], text=[vlm.prompt_text(prompt)], return_tensors="pt")
        out = vlm.model.generate(**one, max_new_tokens=8, do_sample=False, pad_token_id=0)
        answers.append(out[0, one["input_ids"].shape[1]:].tolist())
    return answers


@pytest.mark.parametrize("target,kind", [("llava_next", "eagle"), ("llava_next", "vispec"), ("llava_next", "msd"),
                                         ("llava_onevision", "eagle"), ("llava_onevision", "vispec"),
                                         ("llava_onevision", "msd")])
def test_greedy_answers_equal_transformers_generate_on_images_of_three_sizes(target, kind):
    vlm = tiny_vlm(target)
    images = images_of_three_sizes()
    runs = (vlm.encode(images, PROMPTS).input_ids == vlm.lm.image_token_id).sum(-1).tolist()
    assert len(set(runs)) == 3, runs  # three image sizes, three run lengths
    reference = transformers_answers(vlm, images, PROMPTS)
    assert vlm.generate(images, PROMPTS, max_new_tokens=8, use_drafter=False).token_ids == reference
    vlm.drafter = drafter_model(kind).for_target(vlm.lm).eval()
    spec = vlm.generate(images, PROMPTS, max_new_tokens=8, tree=(3, 3, 8), budget="fixed")
    assert spec.token_ids == reference and spec.stats.num_drafts > 0


@pytest.mark.parametrize("target", ["llava_next", "llava_onevision"])
def test_image_grids_are_the_base_view_and_the_unpadded_tiles(target):
    """SpecVLM pools an image's base view (4 x 4 patches) and its tiles unpadded to the aspect, whose shape
    transformers' own `get_anyres_image_grid_shape` and `unpad_image` give; each tile line ends in a newline."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    from vlm.target import prefill_vlm

    vlm = tiny_vlm(target)
    inputs = vlm.encode(images_of_three_sizes(), PROMPTS)
    prefill_vlm(vlm.lm, inputs, 1)
    expected = []
    for h, w in inputs.extras["image_sizes"].tolist():
        tiles_h, tiles_w = get_anyres_image_grid_shape((h, w), PINPOINTS, 32)
        rows, width = unpad_image(torch.zeros(1, tiles_h * 4, tiles_w * 4), torch.tensor([h, w])).shape[1:]
        expected.append([(0, 4, 4, 4), (16, rows, width, width + 1)])
    assert vlm.lm.image_grids(inputs, vlm.lm.prompt_embeds) == expected
    assert len({g[1][1:3] for g in expected}) == 3  # three tile shapes


@pytest.mark.parametrize("target,primitive", [("llava_next", "pool"), ("llava_next", "conv"),
                                              ("llava_onevision", "prune"), ("llava_onevision", "pool")])
def test_greedy_specvlm_equals_transformers_generate_on_images_of_three_sizes(target, primitive):
    """SpecVLM on tiled images: the gate forced to one primitive, which compresses each run along its own grids."""
    from vlm.specvlm import PRIMITIVES

    vlm = tiny_vlm(target)
    images = images_of_three_sizes()
    reference = transformers_answers(vlm, images, PROMPTS)
    torch.manual_seed(1)
    vlm.drafter = drafter_model("specvlm").for_target(vlm.lm).eval()
    with torch.no_grad():
        vlm.drafter.gate[-1].bias[PRIMITIVES.index(primitive)] = 50.0
    spec = vlm.generate(images, PROMPTS, max_new_tokens=8, tree=(3, 3, 8), budget="fixed")
    assert spec.token_ids == reference and spec.stats.num_drafts > 0
    assert vlm.drafter.last_choice.tolist() == [PRIMITIVES.index(primitive)] * 3
    if primitive in ("pool", "conv"):  # base 2 x 2 + tiles ceil(rows / 2) x ceil(width / 2), 2 x 2 windows
        assert vlm.drafter.last_kept.tolist() == [4 + 4, 4 + 8, 4 + 12]


@pytest.mark.parametrize("target", ["llava_next", "llava_onevision"])
def test_sampled_second_token_follows_the_models_own_law_with_a_negative_control(target):
    """600 copies of one tiled-image prompt sample three tokens at temperature 1 with EAGLE trees (the second token
    is the first drafted one, verified by rejection sampling): its counts, grouped by the first token, fit the
    softmax of the model's own forward on the processor's outputs (pooled chi-square); the same counts against the
    law at temperature 0.7 must fail, so the test can tell."""
    from vlm_dummies import appended_token_law, stop_ids

    from mmspec.testing.distributions import assert_fits_law_not_control

    vlm = tiny_vlm(target)
    with torch.no_grad():
        vlm.model.lm_head.weight.mul_(2.0)  # x20 in all: a few first tokens, each with enough samples
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    n, image, prompt = 600, images_of_three_sizes()[1], vlm.prompt_text(PROMPTS[0])
    enc = vlm.processor(images=[image] * n, text=[prompt] * n, padding=True, return_tensors="pt")
    out = vlm.generate(**enc, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       tree=(2, 4, 8), budget="fixed", generator=torch.Generator().manual_seed(1))
    ends = stop_ids(vlm)  # a row that ends at its first token has no second one (pad): left out
    pairs = [pair for pair in out[:, enc["input_ids"].shape[1]:][:, :2].tolist() if pair[0] not in ends]
    assert vlm.last_stats.num_drafts > 0 and len(pairs) > n // 2

    assert_fits_law_not_control(pairs, lambda t: appended_token_law(vlm.model, enc, t), 0.7, min_dof=1)


def test_train_a_specvlm_drafter_for_a_llava_next_folder(tmp_path):
    """`mmspec train vlm-drafter --kind specvlm` on a saved tiny LLaVA-NeXT with its processor: world images become
    tiled runs, the compressor pools their grids in training; the drafter saves, loads and keeps answers exact."""
    import json

    from mmspec.cli import main

    vlm, folder = tiny_vlm("llava_next"), tmp_path / "next"
    vlm.model.save_pretrained(folder)
    vlm.processor.save_pretrained(folder)
    assert main(["train", "vlm-drafter", "--target", str(folder), "--work-dir", str(tmp_path / "work"), "--kind",
                 "specvlm", "--steps", "12", "--num-train", "12", "--answer-max-tokens", "8", "--batch-size", "4",
                 "--eval-prompts", "3", "--quiet"]) == 0
    info = json.loads((folder / "drafters" / "specvlm" / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert SpeculativeVLM.from_pretrained(folder, drafter="specvlm").drafter is not None

"""Gemma 3 (`vlm.gemma3.Gemma3CachedLM`): a tiny random Gemma3ForConditionalGeneration with its own processor built
offline (world tokenizer + begin/end-of-image and image tokens, SigLIP over 32-pixel images, 4 tokens per image).
The prompt's logits equal the model's own forward (which attends bidirectionally inside each image; without the
block mask they differ, so the comparison can fail); greedy vanilla and greedy drafting through `SpeculativeVLM`
== transformers' own `generate(do_sample=False)` on a ragged batch with a text-only row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm.family import drafter_model
from vlm.gemma3 import Gemma3CachedLM, image_runs
from vlm.pipeline import SpeculativeVLM
from vlm.target import cached_vlm
from vlm.tiny import GEMMA3_SPECIAL, tiny_vlm

PROMPTS = ["What color is the object?", "How many objects are there?", "Describe the scene."]


@pytest.fixture(scope="module")
def vlm() -> SpeculativeVLM:
    return tiny_vlm("gemma3")


def images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(n)]


def test_image_runs_number_each_image_of_a_row():
    is_image = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert image_runs(is_image).tolist() == [[-1, 0, 0, -1, 1, 1, 1, -1], [0, 0, -1, -1, -1, -1, -1, -1]]


def test_prompt_logits_equal_the_models_forward_with_its_bidirectional_image_attention(vlm):
    lm = cached_vlm(vlm.model)
    assert isinstance(lm, Gemma3CachedLM)
    enc = vlm.processor(images=[[image] for image in images(2)], text=[vlm.prompt_text(p) for p in PROMPTS[:2]],
                        return_tensors="pt")  # Gemma3Processor: a list of images per prompt
    with torch.no_grad():
        want = vlm.model(**enc).logits  # [B, P, V] the model's own forward (token_type_ids: bidirectional images)
        causal = vlm.model(**{k: v for k, v in enc.items() if k != "token_type_ids"}).logits  # images causal
    inputs = vlm.encode(images(2), PROMPTS[:2])
    assert torch.equal(inputs.input_ids, enc["input_ids"])
    from vlm.target import prefill_vlm

    prefill_vlm(lm, inputs, 4)
    got = lm.model.lm_head(lm.last_hidden).float()  # [B, P, V]
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    assert (got - causal.float()).abs().max() > 1e-3  # the block mask matters: the comparison can fail


def transformers_answers(vlm: SpeculativeVLM, imgs, prompts) -> list[list[int]]:
    """transformers' greedy `generate` on the processor's outputs, one row at a time (it stops at <eos>)."""
    answers = []
    for image, prompt in zip(imgs, prompts):
        text = [vlm.prompt_text(prompt, image is not None)]
        one = vlm.processor(images=None if image is None else [image], text=text, return_tensors="pt")
        out = vlm.model.generate(**one, max_new_tokens=8, do_sample=False, pad_token_id=0)
        answers.append(out[0, one["input_ids"].shape[1]:].tolist())
    return answers


@pytest.mark.parametrize("kind", ["eagle", "vispec", "msd", "specvlm", "eagle3"])
def test_greedy_answers_equal_transformers_generate_with_a_text_only_row(vlm, kind):
    imgs = [*images(2), None]
    want = transformers_answers(vlm, imgs, PROMPTS)
    vanilla = vlm.generate(imgs, PROMPTS, max_new_tokens=8)
    assert vanilla.token_ids == want
    vlm.drafter = drafter_model(kind).for_target(vlm.lm).eval()
    try:
        drafted = vlm.generate(imgs, PROMPTS, max_new_tokens=8, tree=(3, 2, 6), budget="fixed")
    finally:
        vlm.drafter = None
    assert drafted.token_ids == want and drafted.stats.num_drafts > 0


def test_a_saved_gemma3_folder_loads_through_from_pretrained_and_answers_the_same(vlm, tmp_path):
    """The folder form a real Gemma 3 checkpoint has: the tokenizer names its image tokens in tokenizer_config.json
    (extra_special_tokens), AutoModelForImageTextToText picks Gemma3ForConditionalGeneration."""
    import json

    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "extra_special_tokens": GEMMA3_SPECIAL}))
    again = SpeculativeVLM.from_pretrained(tmp_path)
    assert isinstance(again.lm, Gemma3CachedLM)
    imgs = [*images(2), None]
    assert again.generate(imgs, PROMPTS, max_new_tokens=8).token_ids == vlm.generate(imgs, PROMPTS,
                                                                                     max_new_tokens=8).token_ids


def test_sampled_second_token_follows_the_models_own_law_with_a_negative_control():
    """600 copies of one image prompt sample three tokens at temperature 1 with EAGLE trees (the second token is the
    first drafted one, verified by rejection sampling over a cache prefilled with bidirectional image attention):
    its counts, grouped by the first token, fit the softmax of the model's own forward (pooled chi-square); the
    same counts against the law at temperature 0.8 must fail, so the test can tell."""
    from vlm_dummies import appended_token_law, stop_ids

    from mmspec.testing.distributions import assert_fits_law_not_control

    vlm = tiny_vlm("gemma3")
    with torch.no_grad():
        vlm.model.lm_head.weight.mul_(2.0)  # x20 in all: a few first tokens, each with enough samples
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    n, image, prompt = 600, images(1)[0], vlm.prompt_text(PROMPTS[0])
    enc = vlm.processor(images=[[image]] * n, text=[prompt] * n, padding=True, return_tensors="pt")
    out = vlm.generate(**enc, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       tree=(2, 4, 8), budget="fixed", generator=torch.Generator().manual_seed(1))
    ends = stop_ids(vlm)  # a row that ends at its first token has no second one (pad): left out
    pairs = [pair for pair in out[:, enc["input_ids"].shape[1]:][:, :2].tolist() if pair[0] not in ends]
    assert vlm.last_stats.num_drafts > 0 and len(pairs) > n // 2

    # the random init decides how many bins there are (transformers releases initialise differently: 1 degree of
    # freedom on 5.6, more on 5.23); the negative control shows the test can tell either way
    assert_fits_law_not_control(pairs, lambda t: appended_token_law(vlm.model, enc, t), 0.8, min_dof=1)


def test_gemma3_stays_exact_past_its_sliding_window():
    """Gemma 3's local layers with a 10-token window under prompts longer than it (an image's 4 tokens stay inside
    one window): greedy vanilla and EAGLE trees == transformers' generate; with full attention the answers differ."""
    base = tiny_vlm("gemma3")
    base.model.config.text_config.sliding_window = 10
    vlm = SpeculativeVLM(base.model, base.processor)
    assert vlm.lm.window == 10
    imgs = [*images(2), None]
    want = transformers_answers(vlm, imgs, PROMPTS)
    assert vlm.generate(imgs, PROMPTS, max_new_tokens=8).token_ids == want
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    assert vlm.generate(imgs, PROMPTS, max_new_tokens=8, tree=(3, 2, 6), budget="fixed").token_ids == want
    vlm.drafter, vlm.lm.window = None, None
    assert vlm.generate(imgs, PROMPTS, max_new_tokens=8).token_ids != want


def test_train_a_specvlm_drafter_for_a_gemma3_folder(vlm, tmp_path):
    """`mmspec train vlm-drafter --kind specvlm` on a saved tiny Gemma 3: world prompts get its image marker, the
    compressor pools its 2 x 2 grid; the drafter saves, loads and keeps answers exact."""
    import json

    from mmspec.cli import main

    vlm.model.save_pretrained(tmp_path / "g3")
    vlm.processor.save_pretrained(tmp_path / "g3")
    config = json.loads((tmp_path / "g3" / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = GEMMA3_SPECIAL
    (tmp_path / "g3" / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["train", "vlm-drafter", "--target", str(tmp_path / "g3"), "--work-dir", str(tmp_path / "work"),
                 "--kind", "specvlm", "--steps", "12", "--num-train", "12", "--answer-max-tokens", "8",
                 "--batch-size", "4", "--eval-prompts", "3", "--quiet"]) == 0
    info = json.loads((tmp_path / "g3" / "drafters" / "specvlm" / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert SpeculativeVLM.from_pretrained(tmp_path / "g3", drafter="specvlm").drafter is not None

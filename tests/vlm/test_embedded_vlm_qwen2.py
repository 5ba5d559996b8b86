"""The embedded world Qwen2-VL target (assets/vlm-qwen2) as users meet it: it answers held-out questions as its card
says (on a small sample), its greedy answers equal transformers' own `generate`, every shipped drafter is lossless on
it (greedy speculative == the target alone, token for token, on ragged batches of held-out long answers) and drafts
more than one token per round, and `mmspec vlm --model` picks it."""

import json

import pytest

from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from vlm.family import drafter_kinds_in
from vlm.pipeline import SpeculativeVLM
from vlm.train import evaluate
from vlm.world import world_vqa_examples

FOLDER = ASSETS_DIR / "vlm-qwen2"


@pytest.fixture(scope="module")
def loaded():
    """(the target pipeline, 6 held-out long-answer questions, its own greedy answers to them)."""
    target = SpeculativeVLM.from_pretrained(FOLDER)
    examples = world_vqa_examples("test", 6, seed=0, long_fraction=1.0)
    answers = target.generate([ex.image for ex in examples], [ex.prompt for ex in examples], max_new_tokens=64,
                              use_drafter=False)
    return target, examples, answers


def test_it_is_a_qwen2_vl_with_eagle_and_vispec_drafters(loaded):
    target = loaded[0]
    assert type(target.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert {"eagle", "vispec"} <= set(drafter_kinds_in(FOLDER))


def test_the_target_answers_short_questions_like_transformers(loaded):
    target, examples, vanilla = loaded
    result = evaluate(target.model, target.processor, n_scenes=40, n_long=4, seed=0)
    assert result["short"]["accuracy"] >= 0.8, result["short"]
    enc = target.processor(images=[examples[0].image], text=[target.prompt_text(examples[0].prompt)],
                           return_tensors="pt")
    out = target.model.generate(**enc, max_new_tokens=64, do_sample=False)
    assert out[0, enc["input_ids"].shape[1]:].tolist() == vanilla.token_ids[0]


@pytest.mark.parametrize("kind", ["eagle", "vispec"])
def test_shipped_drafter_is_lossless_and_drafts(kind, loaded, tmp_path, monkeypatch):
    _, examples, vanilla = loaded
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm = SpeculativeVLM.from_pretrained(FOLDER, kind)
    out = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], max_new_tokens=64,
                       batch_size=3, budget="fixed")
    assert out.token_ids == vanilla.token_ids
    assert out.stats.mean_acceptance_length >= 1.5, out.stats.mean_acceptance_length


def test_mmspec_vlm_picks_it(tmp_path, capsys):
    from PIL import Image

    from mmspec.data import generate_batch

    image = tmp_path / "scene.png"
    Image.fromarray(generate_batch(1, 0, split="test").images[0].permute(1, 2, 0).numpy()).save(image)
    assert main(["vlm", "--model", str(FOLDER), "--image", str(image), "--prompt", "What color is the object?"]) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.err.strip().splitlines()[-1])
    assert captured.out.strip() in ("red", "green", "blue", "yellow") and figures

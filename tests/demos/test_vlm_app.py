"""The VLM demo app (demos/vlm_app.py) on a tiny saved world LLaVA with an EagleVLM drafter: the streamed answer
adds up to the target's own greedy answer, input checks, the served app driven by gradio_client and, marked
`browser`, headless Chromium answering an example scene."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

gr = pytest.importorskip("gradio", reason="the demo extra (pip install -e '.[demo]') is not installed")

from demo_helpers import headless_page, serve  # noqa: E402

from demos.vlm_app import VLMStore, answer_stream, build_app, example_images  # noqa: E402
from mmspec.errors import InputError  # noqa: E402
from mmspec.testing.budgets import CallScript, forced_budget  # noqa: E402

TINY = dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> VLMStore:
    from transformers import LlavaForConditionalGeneration

    from vlm.eagle import VLMEagleDrafter
    from vlm.target import LlavaCachedLM
    from vlm.world import world_llava_config, world_processor

    folder = tmp_path_factory.mktemp("vlm-app-model")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(world_llava_config(**TINY)).eval()
    model.save_pretrained(folder)
    world_processor().save_pretrained(folder)
    VLMEagleDrafter.for_target(LlavaCachedLM(model)).save_pretrained(folder / "drafters" / "eagle")
    return VLMStore(folder)


SETTINGS = dict(max_new_tokens=12, temperature=0.0, top_p=1.0, depth=3, top_k=3, total=8)


def final(stream):
    *_, last = stream
    return last


def test_streamed_answer_equals_the_target_alone(store):
    image = example_images(1)[0]
    segments, stats = final(answer_stream(store, image, "What color is the object?", "eagle", **SETTINGS))
    vanilla_segments, vanilla = final(answer_stream(store, image, "What color is the object?", "none", **SETTINGS))
    assert "".join(text for text, _ in segments).strip() == stats["answer"] == vanilla["answer"]
    assert stats["new_tokens"] == vanilla["new_tokens"] and stats["rounds"] <= vanilla["rounds"]
    assert all(label in (None, "draft (odd round)", "draft (even round)") for _, label in segments)
    assert stats["mean_acceptance_length"] is not None and vanilla["mean_acceptance_length"] is None
    assert store.drafters() == ["eagle", "pld", "sam", "recycle", "none"]  # the folder's, the training-free ones
    assert vanilla["draft_budget"] is None and vanilla["budget_note"] is None  # no drafter: no draft budget


def test_the_draft_budget_choice_reaches_the_pipeline_and_what_it_did_is_shown(store, tmp_path, monkeypatch):
    """"fixed" drafts every step (no budget counters, no note); "auto" with the budget forced to choose plain steps
    (whatever the machine's speed) gives the target's answer and a note saying so and how to draft."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    image = example_images(1)[0]
    _, fixed = final(answer_stream(store, image, "What color is the object?", "eagle", **SETTINGS, budget="fixed"))
    assert fixed["budget"] == "fixed" and fixed["draft_budget"] is None
    assert "chose" not in (fixed["budget_note"] or "")  # no budget chose plain steps (the dummy drafter may
    # accept nothing: a line of its own)
    assert fixed["drafted_steps"] > 0
    with forced_budget(CallScript(steps=("plain",))):
        _, plain = final(answer_stream(store, image, "What color is the object?", "eagle", **SETTINGS, budget="auto"))
    assert plain["answer"] == fixed["answer"] and plain["drafted_steps"] == 0
    assert plain["budget_note"].startswith(f"note: eagle drafted on 0 of {plain['verify_steps']} verify steps")
    assert 'the draft budget "fixed" drafts every step' in plain["budget_note"]
    assert plain["draft_budget"].startswith("draft budget: drafted on 0 of")


@pytest.mark.parametrize("change, message", [
    ({"image_path": None}, "upload an image"),
    ({"question": "   "}, "type a question"),
    ({"max_new_tokens": 10**6}, "max new tokens"),
    ({"temperature": -2}, "temperature"), ({"temperature": 11}, "temperature must be between 0 and 10"),
    ({"top_p": 0}, "top-p must be > 0"), ({"seed": -1}, r"seed must be a whole number in \[0, 2\^53\)"),
    ({"drafter": "medusa"}, "unknown drafter"), ({"budget": "sometimes"}, "draft budget must be one of"),
])
def test_bad_requests_are_messages(store, tmp_path, change, message):
    args = {"image_path": example_images(1)[0], "question": "What shape?", "drafter": "eagle", **SETTINGS, **change}
    with pytest.raises(InputError, match=message):
        final(answer_stream(store, **args))


def test_one_question_about_several_images(store):
    """More images make one row of several images, as `mmspec vlm --image A --image B`: greedy eagle == the target
    alone; a drafter that compresses one image run a row says so in one line."""
    first, second = example_images(2)
    question = "Which of the two shows a circle?"
    _, stats = final(answer_stream(store, first, question, "eagle", **SETTINGS, more_images=[second]))
    _, vanilla = final(answer_stream(store, first, question, "none", **SETTINGS, more_images=[second]))
    _, alone = final(answer_stream(store, first, question, "none", **SETTINGS))
    assert stats["images"] == vanilla["images"] == 2 and stats["answer"] == vanilla["answer"]
    assert alone["images"] == 1
    with pytest.raises(InputError, match="more images; ask about at most 8"):
        final(answer_stream(store, first, question, "eagle", **SETTINGS, more_images=[second] * 8))


def test_not_an_image_and_missing_model(store, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with pytest.raises(InputError, match="not an image file"):
        final(answer_stream(store, str(bad), "What shape?", "eagle", **SETTINGS))
    with pytest.raises(InputError, match="mmspec train vlm"):
        VLMStore(tmp_path / "nothing").get("none")


@pytest.fixture(scope="module")
def served(store):
    yield from serve(build_app(store))


def test_served_app_with_gradio_client(served, tmp_path):
    from gradio_client import Client, handle_file

    client = Client(served, verbose=False)
    image = example_images(1)[0]
    segments, stats = client.predict(handle_file(image), "What color is the object?", "eagle", 12, 0.0, 1.0, 3, 3, 8,
                                     api_name="/answer")
    assert stats["new_tokens"] >= 1 and stats["drafter"] == "eagle"
    text = "".join(item["token"] for item in segments) if isinstance(segments, list) else str(segments)
    assert text.strip() == stats["answer"]
    _, fixed = client.predict(handle_file(image), "What color is the object?", "eagle", 12, 0.0, 1.0, 3, 3, 8, "fixed",
                              api_name="/answer")
    assert fixed["budget"] == "fixed" and fixed["answer"] == stats["answer"]
    assert "chose" not in (fixed["budget_note"] or "")
    with pytest.raises(Exception, match="type a question"):
        client.predict(handle_file(image), "", "eagle", 12, 0.0, 1.0, 3, 3, 8, api_name="/answer")


@pytest.mark.browser
def test_real_browser_answers_an_example(served, tmp_path):
    shot = Path(os.environ.get("MMSPEC_SCREENSHOT_DIR", tmp_path)) / "vlm_app.png"
    with headless_page(1000) as (page, expect):
        page.goto(served)
        page.locator("#vlm-image input[type=file]").set_input_files(example_images(1)[0])  # an upload
        expect(page.locator("#vlm-image img")).to_be_visible(timeout=30_000)
        page.get_by_role("button", name="Answer").click()
        expect(page.locator("#vlm-stats")).to_contain_text("new_tokens", timeout=120_000)
        page.screenshot(path=str(shot), full_page=True)
        page.locator("#vlm-question textarea").fill("")
        page.get_by_role("button", name="Answer").click()
        expect(page.get_by_text("type a question", exact=False).first).to_be_visible(timeout=60_000)
    assert shot.stat().st_size > 10_000


def test_the_embedded_default_offers_its_drafters_and_highlights_drafts():
    """With no --model the app serves assets/vlm and its shipped drafters (eagle first); a real answer there shows
    accepted drafts highlighted and equals the target alone."""
    default = VLMStore()
    assert default.drafters() == ["eagle", "vispec", "msd", "specvlm", "eagle3", "pld", "sam", "recycle", "none"]
    image = example_images(1)[0]
    # a question of the kind the drafters were trained on; the budget drafts every step whatever the machine's speed
    # (on an unfamiliar question, or a busy machine, the default budget="auto" may rightly take plain steps)
    question = "What color is the object? Answer in detail."
    with forced_budget(CallScript()):
        segments, stats = final(answer_stream(default, image, question, "eagle",
                                              **{**SETTINGS, "max_new_tokens": 48}))
    _, vanilla = final(answer_stream(default, image, question, "none", **{**SETTINGS, "max_new_tokens": 48}))
    assert stats["answer"] == vanilla["answer"]
    assert any(label is not None for _, label in segments) and stats["mean_acceptance_length"] > 1.5

"""The image demo app (demos/image_app.py) on the embedded LlamaGen and VAR defaults: the comparison logic, its input
checks, the served app driven by gradio_client (result, progress updates, error messages) and, marked `browser`,
a real headless Chromium that clicks Generate and screenshots the result."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

gr = pytest.importorskip("gradio", reason="the demo extra (pip install -e '.[demo]') is not installed")

from demo_helpers import headless_page, serve  # noqa: E402

from demos.image_app import (  # noqa: E402
    ModelStore,
    build_app,
    compare,
    main,
    method_example,
    parse_method_text,
    summary_markdown,
)
from mmspec.errors import InputError  # noqa: E402
from mmspec.testing.budgets import CallScript, forced_budget  # noqa: E402


@pytest.fixture(scope="module")
def store() -> ModelStore:
    return ModelStore()


def test_greedy_speculative_equals_greedy_vanilla_side_by_side(store):
    result = compare(store, "llamagen", "sjd", "red circle", "", 2, 4.0, 0.0, 0, 1.0, 3, budget="fixed")
    stats = result["stats"]
    assert np.array_equal(np.asarray(result["vanilla"]), np.asarray(result["method"]))  # SJD is lossless
    assert result["vanilla"].size == (2 * 128, 128)  # two 32 px images, shown at 128 px
    assert stats["vanilla_target_forwards"] == 64  # one per token of the 8x8 grid (batched rows share forwards)
    assert stats["method_target_forwards"] < 64
    assert stats["step_compression"] == pytest.approx(64 / stats["method_target_forwards"], abs=1e-3)
    assert stats["mean_acceptance_length"] > 1.0
    assert len(stats["per_position_acceptance_rate"]) >= 1
    assert result["figure"].axes[0].lines  # the per-position curve is drawn
    assert stats["budget_note"] is None and stats["draft_budget"] is None  # "fixed": no draft budget chose steps
    assert stats["drafted_steps"] > 0 and "draft budget" not in summary_markdown(stats)


def test_a_budget_that_chose_plain_steps_says_so(store, tmp_path, monkeypatch):
    """The draft budget (forced, whatever the machine's speed) chooses a plain step every step: the page says the
    method drafted on none of its steps, why, and that "fixed" drafts every step, where it shows step compression
    1.0x and no acceptance figures."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    with forced_budget(CallScript(steps=("plain",))):
        result = compare(store, "llamagen", "sjd", "red circle", "", 2, 4.0, 0.0, 0, 1.0, 3, budget="auto")
    stats = result["stats"]
    assert stats["step_compression"] == 1.0 and stats["mean_acceptance_length"] is None
    assert stats["drafted_steps"] == 0 and stats["verify_steps"] > 0
    assert stats["budget_note"].startswith(f"note: sjd drafted on 0 of {stats['verify_steps']} verify steps")
    assert f"chose {stats['verify_steps']} plain steps" in stats["budget_note"]
    assert 'the draft budget "fixed" drafts every step' in stats["budget_note"]
    assert stats["budget_note"] in summary_markdown(stats)
    assert stats["draft_budget"].endswith(f"sizes chosen (steps): plain ×{stats['method_target_forwards'] - 1}")
    texts = [t.get_text() for t in result["figure"].axes[0].texts]
    assert texts == ["no drafted tokens: the draft budget chose plain steps"]


def test_the_summary_shows_what_the_budget_did_when_it_drafted():
    stats = {"method": "sjd", "method_seconds": 1.0, "vanilla_seconds": 1.5, "speedup": 1.5, "step_compression": 2.0,
             "vanilla_target_forwards": 64, "method_target_forwards": 32, "mean_acceptance_length": 2.5,
             "draft_acceptance_rate": 0.5, "budget_note": None,
             "draft_budget": "draft budget: drafted on 30 of 31 verify steps (counted per row); sizes chosen (steps): "
                             "4 ×30, plain ×1"}
    assert summary_markdown(stats).endswith("\n\n" + stats["draft_budget"])
    assert "\n" not in summary_markdown({**stats, "draft_budget": None})


def test_sampling_run_and_var_code(store):
    result = compare(store, "var", "code", "3", "draft_steps=5", 2, 4.0, 1.0, 0, 1.0, 0)
    stats = result["stats"]
    assert stats["method_kwargs"] == {"draft_steps": 5}
    assert stats["method_target_forwards"] == 5 and stats["vanilla_target_forwards"] == 7
    assert stats["mean_acceptance_length"] is None  # CoDe drafts no tokens to accept
    assert stats["vanilla_seconds"] > 0 and stats["method_seconds"] > 0


def test_the_cfg_box_starts_at_each_familys_default(store):
    """LlamaGen and VAR pipelines default to 4.0; the embedded MAR target carries its own (2.0, constant schedule)."""
    assert store.default_guidance("llamagen") == 4.0 and store.default_guidance("var") == 4.0
    assert store.default_guidance("mar") == store.pipeline("mar").target.config.default_guidance_scale == 2.0


@pytest.mark.parametrize("kwargs, message", [
    ({"class_text": "  "}, "pick a class"),
    ({"class_text": "purple elephant"}, "unknown class"),
    ({"num_images": 100000}, "number of images"),
    ({"num_images": 2.5}, "number of images"),
    ({"guidance_scale": 1e9}, "guidance scale"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -3}, "top-k"),
    ({"top_p": 0}, "top-p"),
    ({"seed": -1}, "seed"),
    ({"method": "eagle-9000"}, "unknown method"),
    ({"method_text": "gamma"}, "KEY=VALUE"),
    ({"method_text": "window=0"}, "window"),
])
def test_bad_input_is_a_clear_message(store, kwargs, message):
    args = {"family": "llamagen", "method": "sjd", "class_text": "red circle", "method_text": "", "num_images": 1,
            "guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0, **kwargs}
    with pytest.raises(InputError, match=message):
        compare(store, **args)


def test_mar_rejects_top_k_before_loading(store):
    with pytest.raises(InputError, match="mar samples continuous tokens"):
        compare(store, "mar", "cspd", "red circle", "", 1, 3.0, 1.0, 5, 1.0, 0)


def test_a_text_to_image_family_takes_a_caption(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "image_ar"))
    from llamagen_dummies import get_dummy_t2i_components

    from demos.image_app import condition_choices
    from image_ar.llamagen.pipeline import LlamaGenPipeline

    LlamaGenPipeline(**get_dummy_t2i_components()).save_pretrained(tmp_path)
    store = ModelStore({"llamagen-t2i": str(tmp_path)})
    result = compare(store, "llamagen-t2i", "sjd", "a red circle", "", 2, 4.0, 0.0, 0, 1.0, 0)
    assert np.array_equal(np.asarray(result["vanilla"]), np.asarray(result["method"]))  # greedy SJD is lossless
    assert result["stats"]["class"] == "a red circle" and condition_choices("llamagen-t2i")[1] == "caption"
    with pytest.raises(InputError, match="write a caption"):
        compare(store, "llamagen-t2i", "sjd", " ", "", 2, 4.0, 0.0, 0, 1.0, 0)


def test_method_placeholder_names_the_methods_own_parameters():
    assert method_example("llamagen", "sjd").startswith("e.g. window=")
    assert "gamma=8" in method_example("mar", "cspd") and "draft_steps=<model default>" in method_example("var", "code")


def test_method_text_and_command_line():
    assert parse_method_text("gamma=4, align=false\nprefill_ratio=0.1") == {"gamma": 4, "align": False,
                                                                            "prefill_ratio": 0.1}
    with pytest.raises(SystemExit):
        main(["--model", "nofamily=/tmp/x"])
    with pytest.raises(SystemExit):
        main(["--model", "no-equals-sign"])


@pytest.fixture(scope="module")
def served(store):
    yield from serve(build_app(store, concurrency=1))


def test_served_app_with_gradio_client(served):
    from gradio_client import Client

    client = Client(served, verbose=False)
    job = client.submit("llamagen", "sjd", "blue cross", "", 4, 4.0, 1.0, 0, 1.0, 1, api_name="/generate")
    progress = []
    while not job.done():
        update = job.status()
        if update.progress_data:
            progress.extend(update.progress_data)
        time.sleep(0.01)
    vanilla_path, method_path, summary, stats, _plot = job.result()
    assert progress, "no progress updates reached the client"
    # the pipelines' tqdm bars (64 tokens of the 8x8 grid) reach the client through gr.Progress(track_tqdm=True)
    assert any(p.length == 64 and p.index is not None for p in progress), {(p.desc, p.length) for p in progress}
    assert Path(vanilla_path).is_file() and Path(method_path).is_file()
    assert stats["family"] == "llamagen" and stats["num_images"] == 4 and stats["class"] == 14
    assert "step compression" in summary and "mean acceptance length" in summary

    # another family's method through the API (the dropdown lists llamagen's), and a draft budget
    _, _, _, stats, _ = client.predict("var", "code", "3", "draft_steps=5", 1, 4.0, 1.0, 0, 1.0, 0, "default",
                                       api_name="/generate")
    assert stats["family"] == "var" and stats["method"] == "code"
    _, _, _, stats, _ = client.predict("llamagen", "eagle", "3", "", 1, 4.0, 0.0, 0, 1.0, 0, "auto",
                                       api_name="/generate")
    assert stats["budget"] == "auto" and stats["method_target_forwards"] > 0
    with pytest.raises(Exception, match="no draft budget"):
        client.predict("var", "code", "3", "", 1, 4.0, 1.0, 0, 1.0, 0, "auto", api_name="/generate")

    with pytest.raises(Exception, match="pick a class"):
        client.predict("llamagen", "sjd", "", "", 1, 4.0, 1.0, 0, 1.0, 0, api_name="/generate")
    with pytest.raises(Exception, match="maximum value 16|number of images"):  # the slider checks first
        client.predict("llamagen", "sjd", "red circle", "", 5000, 4.0, 1.0, 0, 1.0, 0, api_name="/generate")


@pytest.mark.browser
def test_real_browser_generates_and_shows_stats(served, tmp_path):
    shot = Path(os.environ.get("MMSPEC_SCREENSHOT_DIR", tmp_path)) / "image_app.png"
    with headless_page(1100) as (page, expect):
        page.goto(served)
        page.get_by_role("button", name="Generate").click()
        expect(page.locator("#summary")).to_contain_text("step compression", timeout=120_000)
        expect(page.locator("#method-image img")).to_be_visible()
        expect(page.locator("#vanilla-image img")).to_be_visible()
        page.screenshot(path=str(shot), full_page=True)
        # a bad request shows a message in the page
        page.get_by_label("class (name or id)").fill("purple elephant")
        page.get_by_role("button", name="Generate").click()
        expect(page.get_by_text("unknown class", exact=False).first).to_be_visible(timeout=60_000)
    assert shot.stat().st_size > 10_000

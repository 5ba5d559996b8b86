"""The embedded LlamaGen default (assets/llamagen) as users meet it: the README's main job, the quality its card
claims (on a small sample), losslessness of its trained drafters on the real model, and the docs' examples."""

import json
import re
from pathlib import Path

import pytest
import torch

from image_ar.llamagen import LlamaGenPipeline
from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.testing import seeded_generators as gens
from mmspec.testing import use_sequential_lossless_walk

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/eagle_lantern.md"]  # docs/llamagen_pipeline.md runs in tests/test_docs.py


@pytest.fixture(scope="module")
def pipe():
    pipe = LlamaGenPipeline.from_pretrained(ASSETS_DIR / "llamagen")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_main_job_writes_images_grid_and_stats(tmp_path):
    out = tmp_path / "llamagen"
    assert main(["generate", "--family", "llamagen", "--classes", "all", "--num-images", "1", "--out", str(out),
                 "--quiet"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 16 and (out / "grid.png").is_file()
    stats = json.loads((out / "stats.json").read_text())
    assert stats["num_images"] == 16 and stats["model"] == "embedded default"


def test_generated_images_are_judged_as_their_class(pipe):
    """The card reports 0.939 on 512 images at the defaults; 32 images must clear 0.8 (a broken model scores
    about 1/16)."""
    from mmspec.metrics import class_accuracy

    labels = torch.arange(32) % 16
    out = pipe(class_labels=labels, generator=gens(32), output_type="pt")
    assert class_accuracy(out.images, labels) >= 0.8


@pytest.mark.parametrize("method", ["draft-model", "sjd", "eagle"])
def test_greedy_speculative_equals_greedy_vanilla_on_the_real_model(pipe, method):
    labels = [0, 3, 6, 9]
    vanilla = pipe(class_labels=labels, temperature=0.0, output_type="latent")
    fast = pipe(class_labels=labels, temperature=0.0, method=method, output_type="latent", budget="fixed")
    assert torch.equal(fast.tokens, vanilla.tokens)
    assert fast.stats.num_target_forwards < vanilla.stats.num_target_forwards
    auto = pipe(class_labels=labels, temperature=0.0, method=method, output_type="latent")  # the default budget
    assert torch.equal(auto.tokens, vanilla.tokens) and any(k.startswith("budget_") for k in auto.stats.extra)


@pytest.mark.parametrize("doc", DOCS)
def test_the_documented_examples_run(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    assert blocks, f"{doc} has no python example"
    for block in blocks:
        exec(compile(block, doc, "exec"), {"__name__": "__doc_example__"})


def test_grouped_acceptance_on_eagle_trees_with_groups_of_one_is_eagle(pipe, monkeypatch):
    """eagle with accept="gsd", group_size=1 is lossless tree verification in its sequential form (the walk, which
    `lossless` now replaces by the one-pass form of the same distribution): same generators, same images."""
    labels = [1, 7]
    grouped = pipe(class_labels=labels, generator=gens(2, 40), method="eagle",
                   method_kwargs={"accept": "gsd", "group_size": 1}, output_type="latent", budget="fixed")
    use_sequential_lossless_walk(monkeypatch)
    exact = pipe(class_labels=labels, generator=gens(2, 40), method="eagle", method_kwargs={"accept": "lossless"},
                 output_type="latent", budget="fixed")
    assert torch.equal(grouped.tokens, exact.tokens)


def test_greedy_lantern_relaxes_the_targets_softmax(pipe):
    """Greedy LANTERN (temperature 0) accepts a draft that is the argmax of its relaxed distribution, the target's
    softmax of its logits with neighbours' mass moved to it, as LANTERN's official greedy path: at delta 0 it is
    greedy EAGLE token for token; at delta 0.1 (the default) and 0.4 and with lam 2 it accepts more per step and
    changes some images (with the one-hot argmax as p it could move no mass and was greedy EAGLE at any delta).
    Trees of 16 nodes (top_k 4, depth 4) keep it quick: the relaxation does not depend on the tree's size."""
    labels = list(range(8))
    tree = {"top_k": 4, "depth": 4, "total_tokens": 16}

    def run(method_kwargs):
        out = pipe(class_labels=labels, temperature=0.0, method="lantern", method_kwargs={**tree, **method_kwargs},
                   output_type="latent", budget="fixed")
        return out.tokens, out.stats.mean_acceptance_length

    eagle = pipe(class_labels=labels, temperature=0.0, method="eagle", method_kwargs=tree, output_type="latent",
                 budget="fixed")
    exact, exact_accept = run({"delta": 0.0})
    assert torch.equal(exact, eagle.tokens) and exact_accept == eagle.stats.mean_acceptance_length
    for relaxed in ({}, {"delta": 0.4}, {"lam": 2.0}):
        tokens, accept = run(relaxed)
        assert accept > exact_accept, relaxed
        assert (tokens != eagle.tokens).any(-1).sum() >= 2, relaxed
    jacobi = pipe(class_labels=labels, temperature=0.0, method="sjd", method_kwargs={"accept": "lantern", "delta": 0.4},
                  generator=gens(8, 0), output_type="latent", budget="fixed")  # (its random inits drawn seeded)
    assert not torch.equal(jacobi.tokens, eagle.tokens)  # (the Jacobi form relaxes the same softmax)


@pytest.mark.parametrize("method", ["lantern", "gsd"])
def test_a_seeded_relaxed_method_does_not_depend_on_threads_or_load(pipe, method):
    """LANTERN's and GSD's output law depends on the drafts, so their default budget must not follow timings: a
    seeded call on the default path gives the same images with 1 and 2 threads and with another process busy
    (under budget="auto" the sizes, and so the images, would follow the measured step times)."""
    import subprocess
    import sys

    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return pipe(class_labels=[0, 5, 9], method=method, generator=gens(3, 11), output_type="latent").tokens
        finally:
            torch.set_num_threads(before)

    one, two = run(1), run(2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a busy core (a thread would hold the GIL)
    try:
        loaded = run(2)
    finally:
        busy.kill()
        busy.wait()
    assert torch.equal(one, two) and torch.equal(two, loaded)
    assert not any(k.startswith("budget_") for k in pipe(class_labels=[0], method=method, generator=gens(1, 11),
                                                         output_type="latent").stats.extra)

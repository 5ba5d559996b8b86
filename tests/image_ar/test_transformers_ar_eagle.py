"""EAGLE drafters for transformers' AR image generators (issue 26): `mmspec train image-ar-drafter` on tiny random
Janus and Emu3 folders (the target's own samples, LANTERN's loss) writes MODEL/drafters/eagle with a card; the
pipelines load it, and greedy eagle / lantern trees == greedy vanilla on ragged prompts with CFG, in fewer target
forwards; Emu3's drafts are ranked among the tokens its layout allows. A drafter made for another model is refused
in one line. (Sampled EAGLE trees follow Janus's own CFG law: tests/image_ar/test_janus.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from image_ar.transformers_ar.pipeline import Emu3Pipeline, JanusPipeline
from image_ar.transformers_ar.tiny import tiny_emu3_pipeline, tiny_janus_pipeline
from mmspec.cli import main
from mmspec.errors import InputError

PROMPTS = ["a red circle", "two small blue squares on a green background", "a cross"]  # ragged once tokenized
TINY = {"janus": (tiny_janus_pipeline, JanusPipeline, "100"), "emu3": (tiny_emu3_pipeline, Emu3Pipeline, "400")}


@pytest.fixture(scope="module", params=["janus", "emu3"])
def trained(request, tmp_path_factory):
    """(family, model folder) with a drafter trained by the CLI."""
    make, _, steps = TINY[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    make().save_pretrained(folder)
    assert main(["train", "image-ar-drafter", "--model", str(folder), "--work-dir", str(folder / "work"),
                 "--num-train", "32", "--steps", steps, "--batch-size", "8", "--eval-prompts", "4", "--quiet",
                 "--threads", "2"]) == 0
    return request.param, folder


def test_training_writes_a_drafter_that_drafts_and_stays_exact(trained):
    family, folder = trained
    out = folder / "drafters" / "eagle"
    info = json.loads((out / "training.json").read_text())
    assert info["drafter"]["final_top1_agreement"] > info["drafter"]["first_top1_agreement"] + 0.2
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["eval"]["mean_acceptance_length"] > 1.5 and info["eval"]["step_compression"] > 1.3
    card = (out / "README.md").read_text()
    assert "mmspec train image-ar-drafter --model" in card and "mean acceptance length" in card


@pytest.mark.parametrize("method, kwargs", [("eagle", {}), ("lantern", {"delta": 0.0})])
def test_greedy_trees_equal_greedy_vanilla_with_cfg_in_fewer_forwards(trained, method, kwargs):
    family, folder = trained
    pipe = TINY[family][1].from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.eagle_drafter is not None
    vanilla = pipe(PROMPTS, temperature=0.0, output_type="latent")
    out = pipe(PROMPTS, temperature=0.0, method=method, method_kwargs=kwargs, budget="fixed", output_type="latent")
    assert torch.equal(out.tokens, vanilla.tokens)
    assert out.stats.num_target_forwards < vanilla.stats.num_target_forwards


def test_greedy_lantern_relaxes_the_guided_softmax(trained):
    """Greedy LANTERN at its default delta relaxes the CFG-combined softmax (Emu3: of the tokens its layout allows):
    it accepts at least as much per step as greedy EAGLE, and its images differ from vanilla's only at visual
    tokens (the layout's end-of-line and end tokens stay where they are)."""
    family, folder = trained
    pipe = TINY[family][1].from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    vanilla = pipe(PROMPTS, temperature=0.0, output_type="latent")
    eagle = pipe(PROMPTS, temperature=0.0, method="eagle", budget="fixed", output_type="latent")
    lantern = pipe(PROMPTS, temperature=0.0, method="lantern", method_kwargs={"delta": 0.3}, budget="fixed",
                   output_type="latent")
    assert lantern.stats.mean_acceptance_length >= eagle.stats.mean_acceptance_length
    assert not torch.equal(lantern.tokens, vanilla.tokens)
    if family == "emu3":
        visual = torch.tensor(pipe.special.visual)
        same_kind = torch.isin(lantern.tokens, visual) == torch.isin(vanilla.tokens, visual)
        assert bool(same_kind.all()) and bool((lantern.tokens[~torch.isin(vanilla.tokens, visual)]
                                               == vanilla.tokens[~torch.isin(vanilla.tokens, visual)]).all())


def test_the_root_pair_alone_drafts_as_the_whole_pass_with_cfg(trained, monkeypatch):
    """The pending pairs' K/V for both CFG halves and the root's pair alone past them (`run_layer_column`, each
    half's row its own column): the same tokens and accept lengths as the whole pass over every pair."""
    import mmspec.draft_layers as draft_layers

    family, folder = trained
    pipe = TINY[family][1].from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    rows, original = [], draft_layers.run_layer_column
    monkeypatch.setattr(draft_layers, "run_layer_column", lambda *a: rows.append(a[2].shape[0]) or original(*a))
    runs = []
    for one_column in (True, False):
        pipe.eagle_drafter.runs_one_column = one_column
        out = pipe(PROMPTS, temperature=0.0, method="eagle", budget="fixed", output_type="latent")
        runs.append((out.tokens, out.stats.accept_lengths_per_row()))
        assert bool(rows) == one_column and set(rows) <= {2 * len(PROMPTS)}  # (both halves' rows)
        rows.clear()
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert max(max(row) for row in runs[0][1]) > 2  # (drafts were accepted: the drafts compared)


@pytest.mark.parametrize("trained", ["emu3"], indirect=True)
def test_emu3_drafts_are_ranked_among_the_tokens_its_layout_allows(trained):
    folder = trained[1]
    pipe = Emu3Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    with_layout = pipe(PROMPTS, temperature=0.0, method="eagle", budget="fixed", output_type="latent")
    own = pipe.eagle_tree_drafter  # the same drafter ranking over the whole vocabulary
    pipe.eagle_tree_drafter = lambda params, scale, layout=None, **tree: own(params, scale, None, **tree)
    without = pipe(PROMPTS, temperature=0.0, method="eagle", budget="fixed", output_type="latent")
    assert torch.equal(without.tokens, with_layout.tokens)  # lossless either way
    assert with_layout.stats.mean_acceptance_length > without.stats.mean_acceptance_length + 0.5


def test_a_drafter_for_another_model_is_refused_in_one_line(trained, tmp_path):
    family, folder = trained
    other = "emu3" if family == "janus" else "janus"
    pipe = TINY[other][0]()
    with pytest.raises(InputError, match="made for another target") as err:
        pipe.load_eagle_drafter(folder / "drafters" / "eagle")
    assert "\n" not in str(err.value)


def test_two_processes_sample_and_train_what_one_process_does(tmp_path):
    """`torchrun --nproc_per_node 2 -m mmspec train image-ar-drafter` (gloo on the CPU): the same samples of the
    target as one process, prompt for prompt, and a drafter within float order of one process's."""
    from safetensors.torch import load_file

    from mmspec.testing import torchrun_mmspec

    tiny_janus_pipeline().save_pretrained(tmp_path / "model")

    def arguments(name: str, seed: str = "0") -> list[str]:
        return ["train", "image-ar-drafter", "--model", str(tmp_path / "model"), "--work-dir", str(tmp_path / name),
                "--out", str(tmp_path / name / "drafter"), "--num-train", "6", "--steps", "5", "--batch-size", "4",
                "--stages", "data,drafter", "--seed", seed, "--threads", "1", "--quiet"]

    run = torchrun_mmspec(arguments("two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert main(arguments("one")) == 0
    (one_samples,), (two_samples,) = ((tmp_path / n).glob("samples-*.pt") for n in ("one", "two"))
    assert torch.equal(torch.load(one_samples)["tokens"], torch.load(two_samples)["tokens"])
    one, two = (load_file(str(tmp_path / n / "drafter" / "diffusion_pytorch_model.safetensors"))
                for n in ("one", "two"))
    scale = sum(float(v.norm() ** 2) for v in one.values()) ** 0.5
    apart = sum(float((one[k] - two[k]).norm() ** 2) for k in one) ** 0.5 / scale
    assert apart < 1e-6, apart  # (another seed lies ~1e-1 away: the VLM trainer's test holds that control)
    assert json.loads((tmp_path / "two" / "drafter" / "training.json").read_text())["drafter"]["processes"] == 2

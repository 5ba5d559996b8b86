"""`mmspec train llamagen-drafter` on a user's captions (`--prompts`: the t2i target's own samples of them) and
across processes (torchrun, gloo on the CPU): the samples are the pipeline's own, caption for caption, and two
processes train the drafter one process trains (within float order)."""

from __future__ import annotations

import json

import pytest
import torch
from llamagen_dummies import get_dummy_components, get_dummy_t2i_components
from safetensors.torch import load_file

from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.cli import main
from mmspec.testing import torchrun_mmspec

CAPTIONS = ["a red circle on a blue background", "a small green square", "the large blue cross",
            "a green circle on the red background", "a large square"]


@pytest.fixture(scope="module")
def t2i_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2i-drafter")
    components = get_dummy_t2i_components()
    components["eagle_drafter"] = None
    LlamaGenPipeline(**components).save_pretrained(folder / "pipe")
    (folder / "captions.txt").write_text("\n".join(CAPTIONS) + "\n\n")
    return folder


def arguments(folder, name: str, *extra: str) -> list[str]:
    return ["train", "llamagen-drafter", "--pipeline", str(folder / "pipe"), "--prompts", str(folder / "captions.txt"),
            "--work-dir", str(folder / f"work-{name}"), "--out", str(folder / name), "--num-train-sequences", "7",
            "--steps", "4", "--batch-size", "4", "--data-guidance", "2.0", "--seed", "3", "--threads", "1",
            "--no-compile", "--quiet", *extra]


def test_the_drafter_trains_on_the_targets_samples_of_the_users_captions(t2i_folder):
    assert main(arguments(t2i_folder, "one", "--eval-images", "2")) == 0
    (cache,) = (t2i_folder / "work-one").glob("sequences-target-*.pt")
    data = torch.load(cache, weights_only=True)
    assert data["ids"].shape == (7, 16) and data["text_ids"].shape == (7, 8)
    pipe = LlamaGenPipeline.from_pretrained(t2i_folder / "pipe")
    pipe.set_progress_bar_config(disable=True)
    for i in (0, 6):  # sample i: caption i (cycled) with its own generator, as the pipeline draws it alone
        alone = pipe(CAPTIONS[i % len(CAPTIONS)], guidance_scale=2.0, output_type="latent",
                     generator=torch.Generator().manual_seed(3 * 1_000_003 + i)).tokens
        assert torch.equal(data["ids"][i].long(), alone[0].long())
    card = (t2i_folder / "one" / "README.md").read_text()
    assert "--prompts" in card and "on your captions (--prompts)" in card and "pipeline_tag: text-to-image" in card
    info = json.loads((t2i_folder / "one" / "training.json").read_text())
    assert info["acceptance"]["conditions"].startswith("the first captions of --prompts")
    assert info["acceptance"]["runs"]["eagle, temperature 0"]["judge_accuracy"] is None  # no judge for user captions


def test_two_processes_train_the_drafter_one_process_trains(t2i_folder):
    if not (t2i_folder / "one").is_dir():
        assert main(arguments(t2i_folder, "one", "--eval-images", "2")) == 0
    run = torchrun_mmspec(arguments(t2i_folder, "two", "--eval-images", "0"))
    assert run.returncode == 0, run.stderr[-3000:]
    (one_cache,), (two_cache,) = ((t2i_folder / f"work-{n}").glob("sequences-*.pt") for n in ("one", "two"))
    for key in ("ids", "text_ids", "masks"):
        assert torch.equal(torch.load(one_cache)[key], torch.load(two_cache)[key]), key
    one, two = (load_file(str(t2i_folder / n / "diffusion_pytorch_model.safetensors")) for n in ("one", "two"))
    scale = sum(float(v.norm() ** 2) for v in one.values()) ** 0.5
    apart = sum(float((one[k] - two[k]).norm() ** 2) for k in one) ** 0.5 / scale
    assert apart < 1e-6, apart  # (the image-ar trainer's test: another seed lies far away)
    assert json.loads((t2i_folder / "two" / "training.json").read_text())["train"]["processes"] == 2


def test_bad_captions_are_refused_in_one_line_before_a_model_loads(t2i_folder, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n \n")
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(tmp_path / "c2i")
    for extra, message in ((["--prompts", str(tmp_path / "missing.txt")], "no such file"),
                           (["--prompts", str(tmp_path / "empty.txt")], "holds no prompt"),
                           (["--data", "world"], "use --data target"),
                           (["--pipeline", str(tmp_path / "c2i")], "class-conditional")):
        assert main(arguments(t2i_folder, "x") + extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err

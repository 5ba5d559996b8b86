"""`mmspec generate --family llamagen-t2i` (issue 25): captions from --prompt, a --prompts file or a JSONL job with
a 'prompt' column give the same images (one generator per image, from the row seed), file names from the
captions, the method's statistics, a rerun that only makes what is missing, and one-line errors before any model
loads where a flag does not fit the family."""

import json

import pytest
from llamagen_dummies import get_dummy_components, get_dummy_t2i_components

from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.cli import main

CAPTIONS = ["a small red circle on a blue background", "green cross"]


@pytest.fixture(scope="module")
def t2i_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("t2i")
    LlamaGenPipeline(**get_dummy_t2i_components()).save_pretrained(path)
    return path


def run(model_dir, out, *extra, family="llamagen-t2i"):
    return main(["generate", "--family", family, "--model", str(model_dir), "--out", str(out), "--quiet", *extra])


def images(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())}


def test_prompts_from_flags_file_and_job_give_the_same_images(t2i_dir, tmp_path):
    assert run(t2i_dir, tmp_path / "flags", "--prompt", CAPTIONS[0], "--prompt", CAPTIONS[1], "--num-images", "2",
               "--method", "sjd") == 0
    made = images(tmp_path / "flags")
    assert sorted(made) == ["a-small-red-circle-on-a-blue-background_000.png",
                            "a-small-red-circle-on-a-blue-background_001.png", "green-cross_000.png",
                            "green-cross_001.png"]
    (tmp_path / "captions.txt").write_text(f"{CAPTIONS[0]}\n\n{CAPTIONS[1]}\n")
    assert run(t2i_dir, tmp_path / "file", "--prompts", str(tmp_path / "captions.txt"), "--num-images", "2",
               "--method", "sjd") == 0
    assert images(tmp_path / "file") == made
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"id": name, "prompt": c, "count": 2}) + "\n" for name, c in
                           zip(["a-small-red-circle-on-a-blue-background", "green-cross"], CAPTIONS)))
    assert run(t2i_dir, tmp_path / "job", "--job", str(job), "--method", "sjd") == 0
    assert images(tmp_path / "job") == made
    stats = json.loads((tmp_path / "job" / "stats.json").read_text())
    assert stats["family"] == "llamagen-t2i" and stats["num_images"] == 4 and stats["stats"]["num_target_forwards"]
    record = json.loads((tmp_path / "job" / "manifest.jsonl").read_text().splitlines()[0])
    assert record["inputs"] == {"prompt": CAPTIONS[0]}
    (tmp_path / "job" / "images" / "green-cross_001.png").unlink()  # a rerun makes only what is missing
    lines = (tmp_path / "job" / "manifest.jsonl").read_text().splitlines()
    (tmp_path / "job" / "manifest.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert run(t2i_dir, tmp_path / "job", "--job", str(job), "--method", "sjd") == 0
    assert images(tmp_path / "job") == made


@pytest.mark.parametrize("extra, family, message", [
    (["--classes", "0"], "llamagen-t2i", "is text-to-image: pass --prompt"),
    (["--prompt", "a red circle"], "llamagen", "is class-conditional: pass --classes"),
    (["--prompt", "a red circle", "--classes", "0"], "llamagen-t2i", "not several"),
    (["--prompts", "/nonexistent/captions.txt"], "llamagen-t2i", "is not a file"),
])
def test_flags_that_do_not_fit_the_family_fail_before_loading(tmp_path, capsys, extra, family, message):
    assert run(tmp_path, tmp_path / "out", *extra, family=family) == 2  # tmp_path holds no model: none loads
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_bad_captions_and_folders_are_one_line_errors(t2i_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n \n")
    assert run(t2i_dir, tmp_path / "a", "--prompts", str(tmp_path / "empty.txt")) == 2
    assert "no captions" in capsys.readouterr().err
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"class": 3}) + "\n" + json.dumps({"prompt": "blue cross"}) + "\n")
    assert run(t2i_dir, tmp_path / "b", "--job", str(job)) == 2
    assert "line 1: a text-to-image family takes 'prompt', not 'class'" in capsys.readouterr().err
    c2i = tmp_path / "c2i"
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(c2i)
    assert run(c2i, tmp_path / "c", "--prompt", "blue cross") == 2
    assert "not a text-to-image LlamaGen" in capsys.readouterr().err

"""`mmspec vlm --job`: the default options (a drafter, no --tree, budget auto) answer a job; a resumed job gives an
uninterrupted run's answers, which at the default accept="coupled" are the target's alone for the same seeds;
bad rows are refused before the model loads or skipped with --skip-bad; a resume with other options is refused."""

from __future__ import annotations

import json

import PIL.Image
import pytest
import torch
from transformers import LlavaForConditionalGeneration

from mmspec.cli import main
from vlm.family import drafter_model
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_llava_config, world_processor

TINY = dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2))
QUESTION = "What shape is it?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny world LLaVA with an (untrained) EAGLE drafter, and five scene images beside a job's files."""
    from mmspec.data import generate_batch

    folder = tmp_path_factory.mktemp("vlm-job")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(world_llava_config(**TINY)).save_pretrained(folder / "model")
    world_processor().save_pretrained(folder / "model")
    vlm = SpeculativeVLM.from_pretrained(folder / "model")
    drafter_model("eagle").for_target(vlm.lm).save_pretrained(folder / "model" / "drafters" / "eagle")
    for i, image in enumerate(generate_batch(5, seed=0, split="test").images):
        PIL.Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"scene{i}.png")
    (folder / "broken.png").write_text("not an image")
    return folder


def write_job(folder, name: str, rows: list[dict]):
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def scenes(n: int = 5) -> list[dict]:
    return [{"id": f"q{i}", "image": f"scene{i}.png", "prompt": QUESTION} for i in range(n)]


def run_job(folder, job, out, *extra: str) -> int:
    return main(["vlm", "--model", str(folder / "model"), "--job", str(job), "--out", str(out), "--max-new-tokens",
                 "8", "--batch-size", "2", "--threads", "1", *extra])


def answers(out) -> dict[str, str]:
    return {r["id"]: r["answer"] for r in map(json.loads, (out / "answers.jsonl").read_text().splitlines())}


def test_a_sampled_job_on_the_default_options_resumes_to_the_targets_own_answers(folder, tmp_path, capsys):
    """No --tree, the eagle drafter, budget auto, temperature 1: the job runs (it crashed without --tree), every
    answer equals the target alone's for its seed (coupled), and a job cut after its first answer and a torn line
    resumes to the same answers; a rerun of the finished job keeps its stats.json."""
    job = write_job(folder, "sampled.jsonl", scenes())
    sampled = ("--temperature", "1")
    assert run_job(folder, job, tmp_path / "plain", "--drafter", "none", *sampled) == 0
    whole = tmp_path / "whole"
    assert run_job(folder, job, whole, "--drafter", "eagle", *sampled) == 0
    assert answers(whole) == answers(tmp_path / "plain") and len(answers(whole)) == 5
    stats = json.loads((whole / "stats.json").read_text())
    assert stats["budget"] == "auto" and stats["tree"] is None and stats["answered_this_run"] == 5

    cut = tmp_path / "cut"
    cut.mkdir()
    first = (whole / "answers.jsonl").read_text().splitlines()[0]
    (cut / "answers.jsonl").write_text(first + "\n" + first[:25])  # what a kill -9 mid-write leaves
    assert run_job(folder, job, cut, "--drafter", "eagle", *sampled) == 0
    assert answers(cut) == answers(whole)
    assert json.loads((cut / "stats.json").read_text())["answered_this_run"] == 4

    before = (whole / "stats.json").read_text()
    capsys.readouterr()
    assert run_job(folder, job, whole, "--drafter", "eagle", *sampled) == 0
    assert "nothing to answer" in capsys.readouterr().out
    assert (whole / "stats.json").read_text() == before


def test_a_budget_that_chose_plain_steps_says_so_in_one_line(folder, tmp_path, capsys, monkeypatch):
    """A question and a job whose draft budget is forced to choose plain steps (whatever the machine's speed) print
    one line on stderr saying so, why and how to draft every step; --budget fixed prints no such line."""
    from mmspec.testing.budgets import CallScript, forced_budget

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    question = ["vlm", "--model", str(folder / "model"), "--drafter", "eagle", "--image", str(folder / "scene0.png"),
                "--prompt", QUESTION, "--max-new-tokens", "8", "--threads", "1"]
    job = write_job(folder, "two.jsonl", scenes(2))
    with forced_budget(CallScript(steps=("plain",))):
        assert main([*question, "--budget", "auto"]) == 0
        assert run_job(folder, job, tmp_path / "job", "--drafter", "eagle", "--budget", "auto") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 2 and all(n.startswith("note: eagle drafted on 0 of ") for n in notes), notes
    assert all("plain steps" in n and "--budget fixed drafts every step" in n for n in notes)
    assert main([*question, "--budget", "fixed"]) == 0
    assert "draft budget chose" not in capsys.readouterr().err  # (this untrained drafter may accept nothing: a
    # line of its own, `mmspec.stats.budget_notice`)


def test_a_resume_with_other_options_is_refused_naming_them(folder, tmp_path, capsys):
    job = write_job(folder, "few.jsonl", scenes(2))
    out = tmp_path / "out"
    assert run_job(folder, job, out, "--drafter", "none") == 0
    for extra, named in ((("--temperature", "0.5"), "temperature"), (("--budget", "fixed"), "budget"),
                         (("--max-new-tokens", "9"), "max_new_tokens")):
        capsys.readouterr()
        assert run_job(folder, job, out, "--drafter", "none", *extra) == 2
        err = capsys.readouterr().err.strip()
        assert f"another {named}" in err and len(err.splitlines()) == 1


def test_a_job_records_the_drafter_auto_picked(folder, tmp_path, capsys):
    """--drafter auto (the default) records the kind it found, so a resume that would find another is refused."""
    job = write_job(folder, "few.jsonl", scenes(2))
    out = tmp_path / "out"
    assert run_job(folder, job, out) == 0
    assert "drafter: eagle" in capsys.readouterr().err
    assert {json.loads(line)["settings"]["drafter"] for line in (out / "answers.jsonl").read_text().splitlines()} \
        == {"eagle"}
    assert run_job(folder, job, out, "--drafter", "eagle") == 0  # the same job: nothing left to answer
    assert "nothing to answer" in capsys.readouterr().out
    assert run_job(folder, job, out, "--drafter", "none") == 2
    assert "another drafter ('eagle' there, 'none' now)" in capsys.readouterr().err


def test_a_lossless_sampled_job_drafts_its_fixed_tree_unless_told(folder, tmp_path, capsys):
    """accept=lossless at temperature > 0: the answers depend on the shapes drafted, so the job's default budget is
    fixed (said in one line) and a given --budget auto is honoured with a note."""
    job = write_job(folder, "lossless.jsonl", scenes(2))
    assert run_job(folder, job, tmp_path / "a", "--drafter", "eagle", "--accept", "lossless",
                   "--temperature", "1") == 0
    assert "budget: fixed" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "stats.json").read_text())["budget"] == "fixed"
    assert run_job(folder, job, tmp_path / "b", "--drafter", "eagle", "--accept", "lossless", "--temperature", "1",
                   "--budget", "auto") == 0
    assert "note:" in capsys.readouterr().err


def test_bad_rows_stop_the_job_before_the_model_loads_or_are_skipped(folder, tmp_path, capsys, monkeypatch):
    rows = [*scenes(2), {"id": "broken", "image": "broken.png", "prompt": QUESTION},
            {"id": "missing", "image": "nowhere.png", "prompt": QUESTION}, {"id": "q9", "image": "scene0.png"},
            {"id": "folder", "image": ".", "prompt": QUESTION},
            {"id": "long", "image": "scene1.png", "prompt": "describe the scene " * 200}]
    job = write_job(folder, "bad.jsonl", rows)
    out = tmp_path / "out"
    loads = []
    real = SpeculativeVLM.from_pretrained.__func__
    monkeypatch.setattr(SpeculativeVLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or real(cls, *a, **k)))
    assert run_job(folder, job, out, "--drafter", "none") == 2
    err = capsys.readouterr().err.strip()
    assert "--skip-bad" in err and len(err.splitlines()) == 1
    assert loads == [] and not out.exists()

    assert run_job(folder, job, out, "--drafter", "none", "--skip-bad") == 0
    assert sorted(answers(out)) == ["q0", "q1"]
    skipped = json.loads((out / "stats.json").read_text())["skipped_bad_rows"]
    assert len(skipped) == 5 and any(line.startswith("long:") and "positions" in line for line in skipped)
    assert any("not an image file" in line for line in skipped)
    assert any("is a folder, not a file" in line for line in skipped) and any("nowhere.png does not exist" in line
                                                                              for line in skipped)


def test_a_bad_tree_is_refused_before_the_model_loads(folder, capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(SpeculativeVLM, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a)))
    for tree, message in (("0,8,30", "depth must be an integer >= 1"), ("4,0,30", "top_k must be an integer >= 1"),
                          ("4,8,1", "total_tokens must be an integer >= 2"), ("2,2,30", "total_tokens=30 exceeds")):
        assert main(["vlm", "--model", str(folder / "model"), "--tree", tree, "--image", str(folder / "scene0.png"),
                     "--prompt", QUESTION]) == 2
        assert message in capsys.readouterr().err
    assert loads == []


def test_a_single_question_longer_than_the_models_positions_is_refused(folder, tmp_path, capsys):
    assert main(["vlm", "--model", str(folder / "model"), "--drafter", "none", "--image",
                 str(folder / "scene0.png"), "--prompt", "describe the scene " * 200]) == 2
    err = capsys.readouterr().err.strip()
    assert "positions" in err and len(err.splitlines()) == 1


def test_questions_about_several_images(folder, tmp_path, capsys):
    """`--image` repeated asks about several images, and a JSON Lines job row may name a list: the answers are the
    target's own for the same images (`SpeculativeVLM.generate` with a list for the row), and the job resumes."""
    vlm = SpeculativeVLM.from_pretrained(folder / "model")
    pictures = [PIL.Image.open(folder / f"scene{i}.png").convert("RGB") for i in (0, 1)]
    want = vlm.generate([pictures], ["Which one is larger?"], max_new_tokens=8, use_drafter=False).texts[0]
    capsys.readouterr()
    assert main(["vlm", "--model", str(folder / "model"), "--image", str(folder / "scene0.png"), "--image",
                 str(folder / "scene1.png"), "--prompt", "Which one is larger?", "--max-new-tokens", "8",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    rows = scenes(3)
    rows[1]["image"] = ["scene0.png", "scene1.png"]
    job = write_job(tmp_path, "job.jsonl", rows)
    for i in range(2):
        (tmp_path / f"scene{i}.png").write_bytes((folder / f"scene{i}.png").read_bytes())
    (tmp_path / "scene2.png").write_bytes((folder / "scene2.png").read_bytes())
    assert run_job(folder, job, tmp_path / "out") == 0
    got = answers(tmp_path / "out")
    alone = vlm.generate([pictures], [QUESTION], max_new_tokens=8, use_drafter=False).texts[0]
    assert got["q1"] == alone and len(got) == 3
    assert run_job(folder, job, tmp_path / "out") == 0 and answers(tmp_path / "out") == got  # resumed: nothing new

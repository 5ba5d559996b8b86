"""`mmspec generate` at scale, on the tiny LlamaGen: job files (JSONL and CSV) with per-row seeds and counts, the
manifest written after each image, resume after an interruption (in-process and a killed process) with
byte-identical outputs, 2-process sharding (torchrun, accelerate's PartialState; every row exactly once),
malformed job files, and the out-of-memory back-off. Runs compared byte for byte use the same --max-batch (3):
the job is cut into the same chunks, see `mmspec.cli.image_job.Runner`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.family import FAMILY as LLAMAGEN
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
JOB = [{"id": "a", "class": 1, "count": 3, "seed": 5}, {"class": 0, "count": 2}, {"id": "c", "class": "3"},
       {"id": "d", "class": 2, "count": 2, "seed": 9}]
KEYS = [("a", 0), ("a", 1), ("a", 2), ("row2", 0), ("row2", 1), ("c", 0), ("d", 0), ("d", 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe")
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(path)
    return path


def write_job(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def generate(model_dir, out, job, *extra):
    return main(["generate", "--family", "llamagen", "--model", str(model_dir), "--job", str(job), "--out", str(out),
                 "--quiet", *extra])


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def images(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "images").glob("*.png"))}


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The job made in one uninterrupted single-process run."""
    root = tmp_path_factory.mktemp("reference")
    assert generate(model_dir, root / "out", write_job(root / "job.jsonl", JOB), "--max-batch", "3") == 0
    return root / "out"


def test_job_file_rows_counts_seeds_and_manifest(reference):
    assert [(r["id"], r["index"]) for r in manifest(reference)] == KEYS
    for record in manifest(reference):
        assert (reference / record["output"]).is_file() and record["settings"]["method"] == "vanilla"
    assert manifest(reference)[0]["seed"] == 5 and manifest(reference)[0]["inputs"] == {"class": 1}
    assert sorted(images(reference)) == sorted(f"{i}_{k:03d}.png" for i, k in KEYS)
    stats = json.loads((reference / "stats.json").read_text())
    assert stats["made_this_run"] == 8 and stats["rows"] == 4 and stats["skipped_bad_rows"] == []


def test_rerun_skips_done_images_and_csv_gives_the_same_bytes(model_dir, reference, tmp_path):
    out = tmp_path / "out"
    generate(model_dir, out, write_job(tmp_path / "job.jsonl", JOB), "--max-batch", "3")
    before = {p: p.stat().st_mtime_ns for p in (out / "images").iterdir()}
    stats = (out / "stats.json").read_text()
    assert generate(model_dir, out, tmp_path / "job.jsonl", "--max-batch", "3") == 0
    assert (out / "stats.json").read_text() == stats  # the figures of the run that made the images stay
    assert {p: p.stat().st_mtime_ns for p in (out / "images").iterdir()} == before
    csv = tmp_path / "job.csv"
    csv.write_text("id,class,count,seed\na,1,3,5\nrow2,0,2,\nc,3,,\nd,2,2,9\n")
    assert generate(model_dir, tmp_path / "csv", csv, "--max-batch", "3") == 0
    assert images(tmp_path / "csv") == images(reference)


def test_resuming_into_a_folder_of_another_job_is_refused(model_dir, reference, tmp_path, capsys):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.jsonl", JOB[:1])
    assert generate(model_dir, out, job) == 0
    assert generate(model_dir, out, job, "--temperature", "0") == 2
    assert "made with another temperature (1.0 there, 0.0 now)" in capsys.readouterr().err
    for option, named in ((["--budget", "fixed"], "budget ('auto' there, 'fixed' now)"),
                          (["--max-batch", "3"], "max_batch (16 there, 3 now)"),
                          (["--dtype", "bfloat16"], "dtype ('float32' there, 'bfloat16' now)")):
        assert generate(model_dir, out, job, *option) == 2
        assert named in capsys.readouterr().err
    assert generate(model_dir, out, write_job(tmp_path / "other.jsonl", [{**JOB[0], "seed": 6}])) == 2
    assert "made with another seed (5 there, 6 now)" in capsys.readouterr().err


def test_a_row_alone_makes_the_images_it_makes_in_the_job(model_dir, reference, tmp_path):
    """Row d is the job's last chunk (2 images at --max-batch 3); alone, it is one chunk of the same 2 images."""
    job = write_job(tmp_path / "job.jsonl", [{"id": "d", "class": 2, "count": 2, "seed": 9}])
    generate(model_dir, tmp_path / "out", job, "--max-batch", "3")
    assert images(tmp_path / "out") == {k: v for k, v in images(reference).items() if k.startswith("d_")}


def test_interrupted_run_resumes_to_the_same_bytes(model_dir, reference, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = LLAMAGEN.generate

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(LLAMAGEN, "generate", interrupted)
    job = write_job(tmp_path / "job.jsonl", JOB)
    assert generate(model_dir, tmp_path / "out", job, "--max-batch", "3") == 130
    assert len(manifest(tmp_path / "out")) == 6  # two chunks of three finished before Ctrl-C
    monkeypatch.setattr(LLAMAGEN, "generate", real)
    assert generate(model_dir, tmp_path / "out", job, "--max-batch", "3") == 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["made_this_run"] == 2
    assert [(r["id"], r["index"]) for r in manifest(tmp_path / "out")] == KEYS
    assert images(tmp_path / "out") == images(reference)


def run_and_stop(model_dir, job, out, stop: signal.Signals, *extra: str) -> None:
    """Start the job in another process and send it `stop` while it holds its second batch (3 images listed,
    the next 3 made but not written): the process waits there for the signal, so no timing decides where it is
    stopped."""
    holding = out.parent / f"holding-{out.name}"
    # Ctrl-C's handler as in a terminal (a process started in the background inherits SIGINT ignored)
    slow = ("import pathlib, signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from image_ar.llamagen.family import FAMILY as g\nreal = g.generate\n"
            "calls = []\n"
            "def held(*a):\n    made = real(*a)\n    calls.append(1)\n    if len(calls) == 2:\n"
            f"        pathlib.Path({str(holding)!r}).touch()\n        time.sleep(300)\n    return made\n"
            "g.generate = held\nfrom mmspec.cli import main\n"
            f"raise SystemExit(main(['generate', '--model', {str(model_dir)!r}, '--job', {str(job)!r}, '--out', "
            f"{str(out)!r}, '--quiet', '--max-batch', '3', *{list(extra)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", slow], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not holding.exists():
            time.sleep(0.05)
        assert proc.poll() is None and holding.exists(), "the run ended before its second batch"
        proc.send_signal(stop)
        assert proc.wait(timeout=120) == (130 if stop == signal.SIGINT else -stop)  # Ctrl-C: mmspec's exit 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("method, stop", [("sjd", signal.SIGKILL), ("draft-model", signal.SIGTERM),
                                          ("sjd", signal.SIGINT), ("gsd", signal.SIGKILL)])
def test_killed_process_resumes_to_the_same_bytes(model_dir, reference, tmp_path, method, stop):
    """Default settings (budget auto; the coupled rule for lossless methods, whose images are vanilla's; the fixed
    budget a relaxed rule's job takes by default): a run stopped by kill -9, SIGTERM or Ctrl-C and resumed makes an
    uninterrupted run's bytes."""
    job = write_job(tmp_path / "job.jsonl", JOB)
    method_args = ("--method", method)
    want = reference
    if method == "gsd":  # (its images are its own: relaxed acceptance)
        want = tmp_path / "whole"
        assert generate(model_dir, want, job, "--max-batch", "3", *method_args) == 0
    out = tmp_path / "out"
    run_and_stop(model_dir, job, out, stop, *method_args)
    assert generate(model_dir, out, job, "--max-batch", "3", *method_args) == 0
    assert [(r["id"], r["index"]) for r in manifest(out)] == KEYS
    assert images(out) == images(want)
    assert not list((out / "images").glob(".*.tmp"))


def test_resume_removes_images_half_written_by_a_dead_process_only(model_dir, reference, tmp_path):
    job = write_job(tmp_path / "job.jsonl", JOB)
    out = tmp_path / "out"
    (out / "images").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half_written = out / "images" / f".a_002.png.{dead.pid}.6cf65f6b.tmp"  # the name atomic_write gives
    half_written.write_bytes(b"\x89PNG half")
    live = out / "images" / f".a_001.png.{os.getppid()}.0123abcd.tmp"  # a writer still running
    live.write_bytes(b"\x89PNG")
    unrelated = out / "images" / ".notes.tmp"
    unrelated.write_text("the user's")
    assert generate(model_dir, out, job, "--max-batch", "3") == 0
    assert images(out) == images(reference)
    assert not half_written.exists()
    assert live.exists() and unrelated.exists()


def test_two_processes_cover_every_row_exactly_once(model_dir, reference, tmp_path):
    job = write_job(tmp_path / "job.jsonl", JOB)
    out = tmp_path / "out"
    # torchrun, as `accelerate launch --cpu` starts one process only (huggingface/accelerate#2741); the processes
    # still meet through accelerate's PartialState (gloo on CPU)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "-m", "mmspec", "generate", "--model", str(model_dir), "--job",
           str(job), "--out", str(out), "--quiet", "--max-batch", "3"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(r["id"], r["index"]) for r in manifest(out)] == KEYS  # merged, each image once, in job order
    assert not list(out.glob("manifest.rank*.jsonl"))
    stats = json.loads((out / "stats.json").read_text())
    assert stats["processes"] == 2 and stats["made_this_run"] == 8
    assert images(out) == images(reference)


def test_malformed_job_files_stop_before_any_work_or_are_skipped(model_dir, tmp_path, capsys):
    rows = [{"id": "ok", "class": 1}, "{not json", {"count": 2}, {"class": "purple blob"}, {"class": 1, "count": 0},
            {"id": "ok", "class": 2}, {"class": 1, "colour": "red"}, "[1, 2]", {"id": "bad id!", "class": 0}]
    job = write_job(tmp_path / "job.jsonl", rows)
    assert generate(model_dir, tmp_path / "out", job) == 2
    err = capsys.readouterr().err
    assert "8 malformed row(s); nothing was generated" in err
    for line, text in ((2, "not valid JSON"), (3, "missing 'class'"), (4, "unknown class"), (5, "'count'"),
                       (6, "id 'ok' appears twice"), (7, "unknown column"), (8, "each line must be a JSON object"),
                       (9, "id 'bad id!'")):
        assert f"line {line}: {text}" in err
    assert not list((tmp_path / "out" / "images").glob("*.png"))
    assert generate(model_dir, tmp_path / "out", job, "--skip-bad") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["made_this_run"] == 1 and len(stats["skipped_bad_rows"]) == 8
    bad_csv = tmp_path / "job.csv"
    bad_csv.write_text("class,count\n1,2\n1,2,3\n")
    assert generate(model_dir, tmp_path / "csv", bad_csv) == 2
    assert "line 3: more values than header columns" in capsys.readouterr().err
    assert generate(model_dir, tmp_path / "x", tmp_path / "missing.jsonl") == 2
    assert main(["generate", "--model", str(model_dir), "--job", str(job), "--classes", "1", "--out",
                 str(tmp_path / "y")]) == 2
    assert "pass one of --job / --classes, not several" in capsys.readouterr().err


def test_out_of_memory_batches_are_retried_smaller_without_losing_rows(model_dir, reference, tmp_path,
                                                                       monkeypatch):
    real = LLAMAGEN.generate

    def small_gpu(pipe, labels, generators, options):
        if len(labels) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(pipe, labels, generators, options)

    job = write_job(tmp_path / "job.jsonl", JOB)
    assert generate(model_dir, tmp_path / "batches-of-2", job, "--max-batch", "2") == 0
    monkeypatch.setattr(LLAMAGEN, "generate", small_gpu)
    assert generate(model_dir, tmp_path / "out", job, "--max-batch", "8") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["oom_backoffs"] == 2 and stats["made_this_run"] == 8  # 8 -> 4 -> 2
    assert [(r["id"], r["index"]) for r in manifest(tmp_path / "out")] == KEYS
    assert images(tmp_path / "out") == images(tmp_path / "batches-of-2")  # the halves are the chunks of 2


def test_a_torn_last_manifest_line_is_cut_and_its_image_made_again(model_dir, reference, tmp_path, capsys):
    """A killed process can leave half a record at the manifest's end: the resumed run cuts it (a record appended
    after it would join its line and be lost too), makes that image again, and lists every image once."""
    job = write_job(tmp_path / "job.jsonl", JOB)
    out = tmp_path / "out"
    assert generate(model_dir, out, job, "--max-batch", "3") == 0
    lines = (out / "manifest.jsonl").read_text().splitlines(keepends=True)
    torn = "".join(lines[:5]) + lines[5][: len(lines[5]) // 2]  # 5 whole records, then half of the sixth
    (out / "manifest.jsonl").write_text(torn)
    (out / "stats.json").unlink()  # (as a killed run leaves it)
    assert generate(model_dir, out, job, "--max-batch", "3") == 0
    assert "made 3 of 8 images" in capsys.readouterr().out  # the torn record's chunk: images 4-6 (3 made again)
    assert [(r["id"], r["index"]) for r in manifest(out)] == KEYS
    assert images(out) == images(reference)
    assert json.loads((out / "stats.json").read_text())["manifest_records"] == 8


@pytest.mark.parametrize("method", ["sjd", "draft-model"])
def test_default_settings_give_vanillas_images_whatever_the_run(model_dir, reference, tmp_path, method):
    """Sampled lossless methods on their default settings (the coupled rule, `budget="auto"`) make vanilla's images
    for the job's seeds: the same bytes whatever the draft budget chose, so an interrupted and resumed run, or a
    second run, gives them too."""
    job = write_job(tmp_path / "job.jsonl", JOB)
    for run in ("first", "second"):
        out = tmp_path / f"{method}-{run}"
        assert generate(model_dir, out, job, "--max-batch", "3", "--method", method) == 0
        assert images(out) == images(reference), run
        stats = json.loads((out / "stats.json").read_text())["stats"]
        assert stats["num_accepted_tokens"] > 0  # (it did draft, and keep drafts)


def test_quiet_silences_the_model_libraries_notices_for_the_run_only(caplog):
    """`--quiet`: transformers' and diffusers' notices (an image processor's backend fallback) and bars are off while
    the job runs, errors still shown, and as they were after it."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from mmspec.cli.image_job import quiet_libraries

    before = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    with quiet_libraries(True):
        transformers_logging.get_logger("transformers.models.auto").warning("a backend fallback notice")
        transformers_logging.get_logger("transformers.models.auto").error("an error")
        assert not transformers_logging.is_progress_bar_enabled()
    with quiet_libraries(False):
        transformers_logging.get_logger("transformers.models.auto").warning("shown without --quiet")
    err = " ".join(record.getMessage() for record in caplog.records)
    assert "an error" in err and "shown without --quiet" in err and "fallback" not in err
    assert (transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()) == before
    assert transformers_logging.is_progress_bar_enabled()

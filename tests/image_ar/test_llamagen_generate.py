"""`mmspec generate --family llamagen` and `mmspec train llamagen`, on tiny models."""

import json
import os
import re

import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import InputError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe")
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(path)
    return path


def run_generate(model_dir, out, *extra):
    return main(["generate", "--family", "llamagen", "--model", str(model_dir), "--out", str(out), "--quiet", *extra])


def test_generate_writes_images_grid_and_stats(model_dir, tmp_path):
    assert run_generate(model_dir, tmp_path, "--classes", "0,3", "--num-images", "2", "--method", "draft-model",
                        "--method-arg", "num_draft_tokens=2") == 0
    files = sorted(os.listdir(tmp_path / "images"))
    assert files == ["class0_000.png", "class0_001.png", "class3_000.png", "class3_001.png"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["num_images"] == 4 and stats["method"] == "draft-model"
    assert stats["method_kwargs"] == {"num_draft_tokens": 2}
    assert stats["stats"]["num_target_forwards"] > 0
    assert (tmp_path / "grid.png").stat().st_size > 0
    assert not [f for f in os.listdir(tmp_path / "images") if f.endswith(".tmp")]


def test_images_do_not_depend_on_batch_size(model_dir, tmp_path):
    run_generate(model_dir, tmp_path / "a", "--classes", "1,2", "--num-images", "2", "--batch-size", "4")
    run_generate(model_dir, tmp_path / "b", "--classes", "1,2", "--num-images", "2", "--batch-size", "1")
    for name in os.listdir(tmp_path / "a" / "images"):
        assert (tmp_path / "a" / "images" / name).read_bytes() == (tmp_path / "b" / "images" / name).read_bytes()


def test_a_budget_that_chose_plain_steps_says_so_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """With the draft budget forced to choose plain steps (whatever the machine's speed), stderr gets one line saying
    so, why and how to draft every step; --budget fixed drafts every step and says nothing."""
    from mmspec.testing.budgets import CallScript, forced_budget

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    args = ("--classes", "0", "--num-images", "2", "--method", "sjd", "--temperature", "0")
    with forced_budget(CallScript(steps=("plain",))):
        assert run_generate(model_dir, tmp_path / "auto", *args, "--budget", "auto") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: sjd drafted on 0 of ")
    assert "plain steps" in notes[0] and "--budget fixed drafts every step" in notes[0]
    stats = json.loads((tmp_path / "auto" / "stats.json").read_text())["stats"]
    assert stats["num_drafts"] == 0 and stats["num_plain_steps"] == stats["num_verify_rows"] > 0
    assert run_generate(model_dir, tmp_path / "fixed", *args, "--budget", "fixed") == 0
    assert "note:" not in capsys.readouterr().err


def test_bad_requests_are_clear_errors(model_dir, tmp_path, capsys):
    assert run_generate(model_dir, tmp_path, "--classes", "9") == 2
    assert "outside [0, 4)" in capsys.readouterr().err
    assert run_generate(model_dir, tmp_path, "--classes", "purple blob") == 2
    assert "unknown class" in capsys.readouterr().err
    assert run_generate(model_dir, tmp_path, "--method", "nope") == 2
    assert "unknown llamagen method 'nope'; available: vanilla" in capsys.readouterr().err
    assert run_generate(tmp_path / "missing", tmp_path / "o") == 2
    assert "does not exist" in capsys.readouterr().err
    assert run_generate(tmp_path, tmp_path / "o") == 2  # a folder, but no pipeline in it
    assert "model_index.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # a run that wrote nothing leaves nothing behind
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert run_generate(model_dir, blocker / "sub") == 2
    assert "is not a writable directory" in capsys.readouterr().err


def test_argument_errors_come_before_any_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    from mmspec.families import get_family

    record = get_family("llamagen")
    loads = []
    monkeypatch.setattr(record, "load", lambda *a, **k: loads.append(a))
    for args, message in ((("--num-images", "-1"), "--num-images must be a whole number from 1 to 100000"),
                          (("--num-images", "1000000000"), "--num-images must be a whole number from 1 to 100000"),
                          (("--seed", "-1"), "--seed"), (("--temperature", "-1"), "temperature"),
                          (("--prompt", ""), "--prompt"),
                          (("--job", str(tmp_path / "none.jsonl")), "is not a file"),
                          # method values that need no model (a 7B target's load takes minutes)
                          (("--method", "sjd", "--method-arg", "window=0"), "window must be an integer >= 1"),
                          (("--method", "gsd", "--method-arg", "init=zeros"), "init must be one of"),
                          (("--method", "sjd", "--method-arg", "coupling=tight"), "coupling"),
                          (("--method", "sjd", "--method-arg", "interval=[5,2]"), "interval end must be > start"),
                          (("--method", "sjd", "--method-arg", "accept=nope"), "unknown acceptance mode 'nope'"),
                          (("--method", "sjd", "--method-arg", "k=3"), "accept='coupled' takes no parameters; got k"),
                          (("--method", "sjd", "--method-arg", "accept=lantern", "--method-arg", "delta=2"),
                           "delta must be in [0, 1]"),
                          (("--method", "gsd", "--method-arg", "p_thr=-1"), "p_thr must be > 0"),
                          (("--method", "gsd", "--method-arg", "embeddings=pixels"), "embeddings must be 'target'"),
                          (("--method", "eagle", "--method-arg", "accept=capped"), "verifies chains only"),
                          (("--method", "draft-model", "--method-arg", "num_draft_tokens=0"), "num_draft_tokens"),
                          (("--method", "draft-model", "--method-arg", "accept=lantern"), "accept must be one of")):
        assert main(["generate", "--family", "llamagen", "--model", str(model_dir), *args,
                     "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert loads == [] and not (tmp_path / "out").exists()


def test_train_llamagen_smoke(tmp_path):
    """The training command end to end with a handful of steps (the real run is in assets/llamagen/README.md)."""
    out = tmp_path / "llamagen"
    assert main(["train", "llamagen", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--vq-steps", "2",
                 "--target-steps", "2", "--draft-steps", "2", "--num-train-images", "256", "--recon-eval-images", "64",
                 "--vq-batch-size", "16", "--gpt-batch-size", "8", "--eval-images-per-class", "1", "--threads", "1",
                 "--no-compile", "--quiet"]) == 0
    for part in ("model_index.json", "README.md", "vqvae", "transformer", "draft_transformer"):
        assert (out / part).exists()
    info = json.loads((out / "training.json").read_text())
    assert set(info["eval"]) == {"target", "draft"} and info["eval"]["target"]["n"] == 16
    assert info["recon"]["n"] == 64 and "--recon-eval-images 64" in (out / "README.md").read_text()
    pipe = LlamaGenPipeline.from_pretrained(out)
    assert pipe.transformer.config.block_size == 64


def test_train_llamagen_at_64_pixels_with_a_given_tokenizer(tmp_path):
    """`--image-size 64 --vq-from FOLDER`: the world at 64x64 through the embedded tokenizer (saved as it is), GPTs
    of 16x16 = 256 tokens, the card and record saying so; a --vq-from without a VQ config, or without the vq stage,
    refused up front."""
    out, vq = tmp_path / "llamagen-64", ASSETS_DIR / "llamagen" / "vqvae"
    common = ["train", "llamagen", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--image-size", "64",
              "--stages", "vq,target,eval", "--target-steps", "2", "--num-train-images", "32",
              "--recon-eval-images", "16", "--gpt-batch-size", "4", "--eval-images-per-class", "1", "--threads", "1",
              "--no-compile", "--quiet"]
    assert main([*common, "--vq-from", str(tmp_path)]) == 2 and not out.exists()
    assert main([*common, "--vq-from", str(vq), "--stages", "target"]) == 2 and not out.exists()
    assert main([*common, "--vq-from", str(vq)]) == 0
    pipe = LlamaGenPipeline.from_pretrained(out)
    assert pipe.transformer.config.block_size == 256 and pipe.draft_transformer is None
    assert torch.equal(pipe.vqvae.state_dict()["quantize.embedding.weight"],
                       LlamaGenVQ.from_pretrained(vq).state_dict()["quantize.embedding.weight"])
    info = json.loads((out / "training.json").read_text())
    assert info["vq"] == {"copied_from": str(vq), "image_size": 64} and info["recon"]["mse"] < 0.01
    card = (out / "README.md").read_text()
    assert "64x64 images, 256 VQ tokens each" in card and "--image-size 64" in card and f"copied from {vq}" in card
    assert pipe(class_labels=[3], output_type="pt", generator=torch.Generator().manual_seed(0)).images.shape[-1] == 64


def test_bench_family_runs_on_a_pipeline_folder(model_dir, tmp_path):
    """`mmspec bench --family llamagen` on the dummy pipeline: files written, vanilla, draft-model and SJD with
    grouped acceptance (a parameter its **kwargs forwards) compared."""
    out = tmp_path / "bench"
    assert main(["bench", "--family", "llamagen", "--methods", "vanilla,draft-model,sjd:accept=gsd:group_size=4",
                 "--batch-sizes", "2",
                 "--repeats", "1", "--warmup", "0", "--num-samples", "4", "--temperature", "0", "--family-option",
                 f"model={model_dir}", "--family-option", "fid_reference=64", "--no-plots", "--quiet", "--out",
                 str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    text = json.dumps(summary)
    assert "draft-model" in text and "class_accuracy" in text and "exactness" in text
    assert "pit_ks" not in text  # greedy: the target's distribution is a point mass, nothing to calibrate
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 12  # 4 samples x 3 methods x 1 repeat
    grouped = [m for m in summary["batch_sizes"][0]["methods"] if m["method"] == "sjd:accept=gsd:group_size=4"]
    assert grouped and grouped[0]["lossless"] is False


def test_bench_refuses_a_bad_method_value_before_building_models(model_dir, tmp_path, capsys):
    """The method record's value checks run as the --methods list is parsed, before the family builds a model."""
    from mmspec.bench import get_family, parse_method_list

    for config, message in (("sjd:window=0", "window must be an integer >= 1"),
                            ("sjd:budget=fixed:accept=nope", "unknown acceptance mode 'nope'"),
                            ("gsd:coupling=tight", "coupling must be one of"),
                            ("sjd:accept=lantern:k=0", "k must be an integer >= 1")):
        with pytest.raises(InputError, match=re.escape(message)):
            parse_method_list(config, get_family("llamagen"))
    assert parse_method_list("sjd:budget=fixed:window=8", get_family("llamagen"))[1].given == {"budget": "fixed",
                                                                                              "window": 8}
    assert main(["bench", "--family", "llamagen", "--methods", "sjd:window=0", "--family-option", f"model={model_dir}",
                 "--no-plots", "--quiet", "--out", str(tmp_path / "b")]) == 2
    assert "window must be an integer >= 1" in capsys.readouterr().err


def test_bench_reports_how_closely_sampled_tokens_follow_the_target(model_dir, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--family", "llamagen", "--methods", "vanilla,sjd", "--batch-sizes", "2", "--repeats", "1",
                 "--warmup", "0", "--num-samples", "4", "--temperature", "1", "--family-option", f"model={model_dir}",
                 "--family-option", "top_k=16", "--family-option", "fid_reference=64", "--no-plots", "--quiet",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for m in summary["batch_sizes"][0]["methods"]:
        q = m["quality"]
        assert q["calibration_tokens"] == 4 * 16 and q["off_support"] == 0.0  # top-k 16 respected
        assert 0 < q["pit_ks"] < 1 and 0 < q["pit_ks_pvalue"] <= 1


def test_method_parameters_are_read_from_the_constructors_they_forward_to():
    import inspect

    from image_ar.llamagen.eagle import EagleTreeDrafter
    from image_ar.llamagen.family import FAMILY
    from mmspec.verify import GSDRule, LanternRule

    def default(cls, name):
        return inspect.signature(cls).parameters[name].default

    eagle, lantern = FAMILY.methods["eagle"].params, FAMILY.methods["lantern"].params
    assert eagle["depth"] == default(EagleTreeDrafter, "depth") and eagle["accept"] == "coupled"
    assert eagle["group_size"] == default(GSDRule, "group_size") and eagle["embeddings"] == "target"
    assert lantern["top_k"] == default(EagleTreeDrafter, "top_k") and lantern["delta"] == default(LanternRule, "delta")
    assert "neighbours" not in lantern and "greedy" not in lantern and "guidance_scale" not in lantern
    assert FAMILY.methods["vanilla"].params == {}


def test_model_that_is_not_a_llamagen_pipeline_is_a_one_line_error(model_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "VARPipeline"}))
    assert run_generate(other, tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert "VARPipeline pipeline, not a LlamaGenPipeline" in err and len(err.splitlines()) == 1
    ckpt = tmp_path / "c2i_B_256.pt"
    ckpt.write_bytes(b"not really")
    assert run_generate(ckpt, tmp_path / "o") == 2
    assert "mmspec convert llamagen" in capsys.readouterr().err
    assert run_generate(model_dir, tmp_path / "o", "--num-images", "-2") == 2
    assert "--num-images" in capsys.readouterr().err


def test_convert_official_files_into_a_pipeline_folder(model_dir, tmp_path):
    import torch

    pipe = LlamaGenPipeline.from_pretrained(model_dir)
    gpt_file, vq_file = tmp_path / "c2i_X_64.pt", tmp_path / "vq_ds4_c2i.pt"
    torch.save({"model": pipe.transformer.state_dict()}, gpt_file)  # the official container and key layout
    torch.save({"model": pipe.vqvae.state_dict()}, vq_file)
    out = tmp_path / "converted"
    assert main(["convert", "llamagen", "--gpt", str(gpt_file), "--vq", str(vq_file), "--gpt-config",
                 json.dumps({"n_head": 2, "multiple_of": 16}), "--vq-config", json.dumps({"norm_num_groups": 8}),
                 "--block-size", "16", "--out", str(out)]) == 0
    assert run_generate(out, tmp_path / "imgs", "--classes", "1", "--num-images", "1") == 0
    a = (tmp_path / "imgs" / "images" / "class1_000.png").read_bytes()
    run_generate(model_dir, tmp_path / "ref", "--classes", "1", "--num-images", "1")
    assert a == (tmp_path / "ref" / "images" / "class1_000.png").read_bytes()


class TrainingState:  # an object a training script pickled next to the weights (not on the safe allow-list)
    pass


def test_convert_refuses_pickled_objects_unless_allowed(model_dir, tmp_path, capsys):
    import torch

    pipe = LlamaGenPipeline.from_pretrained(model_dir)
    gpt_file, vq_file = tmp_path / "c2i_X_64.pt", tmp_path / "vq_ds4_c2i.pt"
    torch.save({"model": pipe.transformer.state_dict(), "state": TrainingState()}, gpt_file)
    torch.save({"model": pipe.vqvae.state_dict()}, vq_file)
    args = ["convert", "llamagen", "--gpt", str(gpt_file), "--vq", str(vq_file), "--gpt-config",
            json.dumps({"n_head": 2, "multiple_of": 16}), "--vq-config", json.dumps({"norm_num_groups": 8}),
            "--block-size", "16", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "TrainingState" in err and "--allow-pickle on mmspec convert" in err and not (tmp_path / "out").exists()
    assert main([*args, "--allow-pickle"]) == 0 and (tmp_path / "out" / "model_index.json").is_file()


def test_profile_measures_the_target_and_the_draft_model(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    assert main(["profile", "--family", "llamagen", "--model", str(model_dir), "--batch-sizes", "1,3", "--widths",
                 "1,16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "transformer: ms per forward" in out and "draft_transformer: ms per forward" in out
    assert out.count("| 3 |") == 2 and len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_generate_takes_a_draft_budget(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    assert run_generate(model_dir, tmp_path / "auto", "--classes", "0", "--num-images", "2", "--method",
                        "draft-model", "--budget", "auto", "--temperature", "0") == 0
    assert run_generate(model_dir, tmp_path / "plain", "--classes", "0", "--num-images", "2",
                        "--temperature", "0") == 0
    for name in ("class0_000.png", "class0_001.png"):  # greedy: the budget changes the speed, not the image
        assert (tmp_path / "auto" / "images" / name).read_bytes() == (tmp_path / "plain" / "images" / name).read_bytes()
    stats = json.loads((tmp_path / "auto" / "stats.json").read_text())
    assert any(key.startswith("budget_") for key in json.dumps(stats).split('"'))


def test_generate_auto_compiles_only_where_the_job_earns_the_compilation_back(model_dir, tmp_path, capsys):
    """A verdict says the transformer's compiled forwards take half the time, but compiling costs more than a
    one-image job's forwards would save: `--compile auto` (the default) leaves it eager and says why."""
    import torch

    import mmspec.compile
    from mmspec.profiling import cached_json

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the verdict's key holds the thread count the run uses (--threads 1)
    try:
        transformer = LlamaGenPipeline.from_pretrained(model_dir).transformer
        verdict = {"mode": "default", "batch_sizes": [1], "widths": [1], "eager": [[2e-3]], "compiled": [[1e-3]],
                   "compile_seconds": 30.0, "ratio": 0.5}
        cached_json(mmspec.compile.verdict_key(transformer, "cpu", "default"), lambda: verdict, refresh=True)
    finally:
        torch.set_num_threads(before)
    assert run_generate(model_dir, tmp_path, "--classes", "0", "--num-images", "1", "--threads", "1") == 0
    err = capsys.readouterr().err
    assert "leaving the transformer eager" in err and "compiling them costs ~120 s" in err
    assert len(os.listdir(tmp_path / "images")) == 1
    assert run_generate(model_dir, tmp_path / "eager", "--classes", "0", "--num-images", "1", "--threads", "1",
                        "--compile", "none") == 0
    assert "compile=auto" not in capsys.readouterr().err  # none: eager, the verdicts not even read


def test_a_run_reads_only_its_own_family_record(model_dir, tmp_path, monkeypatch):
    """Listing the families that generate imports every family's record (seconds of imports: MAR's diffusers
    autoencoders, ...): only --help and the errors that print the list may do it."""
    import mmspec.cli.generate as generate_cli
    import mmspec.families as families

    read, get_family = [], families.get_family
    monkeypatch.setattr(families, "get_family", lambda name: read.append(name) or get_family(name))
    monkeypatch.setattr(generate_cli, "get_family", families.get_family)
    assert run_generate(model_dir, tmp_path, "--classes", "0", "--num-images", "1") == 0
    assert set(read) == {"llamagen"}

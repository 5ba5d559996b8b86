"""`mmspec generate --family mar` (vanilla and CSpD) and the `mar` bench family, on tiny models."""

import json
import os

import pytest
from mar_dummies import tiny_mar, tiny_vae

from continuous.mar.cspd import CSpDPipeline
from mmspec.bench import BenchSettings, run_bench
from mmspec.cli import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A CSpD folder and a single-model MAR folder, with the world's 16 classes (the bench cycles through them)."""
    pipe = CSpDPipeline(target=tiny_mar(2, num_classes=16), draft=tiny_mar(3, num_classes=16, embed_dim=16),
                        vae=tiny_vae())
    cspd_dir, mar_dir = tmp_path_factory.mktemp("cspd"), tmp_path_factory.mktemp("mar")
    pipe.save_pretrained(cspd_dir)
    pipe.as_mar_pipeline("target").save_pretrained(mar_dir)
    return cspd_dir, mar_dir


def generate(model, out, *extra):
    return main(["generate", "--family", "mar", "--model", str(model), "--out", str(out), "--quiet", "--classes",
                 "0,2", "--num-images", "2", "--method-arg", "num_sampling_steps=4", *extra])


def test_generate_vanilla_and_cspd(folders, tmp_path):
    cspd_dir, mar_dir = folders
    assert generate(cspd_dir, tmp_path / "v") == 0
    assert generate(mar_dir, tmp_path / "v2") == 0
    for name in os.listdir(tmp_path / "v" / "images"):  # the CSpD folder's vanilla == the single-model folder
        assert (tmp_path / "v" / "images" / name).read_bytes() == (tmp_path / "v2" / "images" / name).read_bytes()
    assert generate(cspd_dir, tmp_path / "c", "--method", "cspd", "--method-arg", "gamma=3",
                    "--method-arg", "criterion=reference_code") == 0
    stats = json.loads((tmp_path / "c" / "stats.json").read_text())
    assert stats["method_kwargs"] == {"num_sampling_steps": 4, "gamma": 3, "criterion": "reference_code"}
    assert stats["stats"]["num_draft_forwards"] > 0 and "residual_fallbacks" in stats["stats"]["extra"]
    assert sorted(os.listdir(tmp_path / "c" / "images")) == sorted(os.listdir(tmp_path / "v" / "images"))
    assert len(os.listdir(tmp_path / "c" / "images")) == 4


def test_cspd_criteria_are_presets_that_rule_options_refine(folders):
    """criterion picks the paper's rule or the public code's; CSpDRule's own options change it on top."""
    from continuous.mar.family import FAMILY
    from mmspec.verify.cspd import CSpDRule

    pipe = FAMILY.load(str(folders[0]), "cpu")
    cspd = FAMILY.get_method("cspd")
    _, paper = cspd.build(pipe, {"gamma": 3})
    assert paper == {"gamma": 3, "rule": paper["rule"]} and paper["rule"].config() == CSpDRule().config()
    _, code = cspd.build(pipe, {"criterion": "reference_code"})
    assert code["rule"].config() == CSpDRule.reference_code().config()
    _, mixed = cspd.build(pipe, {"criterion": "reference_code", "invert_variance_factor": False,
                                 "independent_checks": False})
    assert mixed["rule"].config() == CSpDRule(distance_scale=42.0).config()  # softened, the paper's sign and stop
    assert not cspd.is_lossless() and FAMILY.get_method("vanilla").is_lossless()


def test_generate_errors_are_clear(folders, tmp_path, capsys):
    cspd_dir, mar_dir = folders
    assert generate(mar_dir, tmp_path / "a", "--method", "cspd") == 2
    assert "needs a CSpD folder" in capsys.readouterr().err
    assert generate(cspd_dir, tmp_path / "b", "--top-k", "5") == 2
    assert "--top-k does not apply" in capsys.readouterr().err
    assert generate(cspd_dir, tmp_path / "c", "--method", "vanilla", "--method-arg", "gamma=2") == 2
    assert "mar method 'vanilla' takes num_iter, num_sampling_steps, cfg_schedule; got gamma" in capsys.readouterr().err
    assert generate(cspd_dir, tmp_path / "d", "--method", "cspd", "--method-arg", "criterion=magic") == 2
    assert "criterion must be one of" in capsys.readouterr().err
    assert generate(cspd_dir, tmp_path / "e", "--method", "cspd", "--temperature", "0") == 2
    assert "temperature must be > 0" in capsys.readouterr().err
    assert generate(cspd_dir, tmp_path / "f", "--method", "vanilla", "--budget", "auto") == 2
    assert "method 'vanilla' drafts nothing: drop --budget" in capsys.readouterr().err


def test_cspd_values_are_refused_before_the_model_loads(folders, tmp_path, capsys, monkeypatch):
    from mmspec.families import get_family

    record = get_family("mar")
    loads = []
    monkeypatch.setattr(record, "load", lambda *a, **k: loads.append(a))
    for arg, message in (("gamma=0", "gamma must be an integer >= 1"), ("prefill_ratio=2", "prefill_ratio must be"),
                         ("criterion=magic", "criterion must be one of"), ("budget=sometimes", "budget must be"),
                         ("distance_scale=-1", "distance_scale")):
        assert generate(folders[0], tmp_path / "x", "--method", "cspd", "--method-arg", arg) == 2
        assert message in capsys.readouterr().err
    assert loads == []


def test_generate_budget_reaches_cspd(folders, tmp_path, capsys):
    """--budget is CSpD's window budget: fixed drafts gamma every window (no budget counts), auto counts the windows
    it chose. The default is fixed (CSpD's rule is relaxed: its images depend on the draft sizes), and the job
    records it."""
    cspd_dir, _ = folders
    assert generate(cspd_dir, tmp_path / "default", "--method", "cspd") == 0
    assert "timing" not in capsys.readouterr().err  # no budget times windows (an untrained draft may accept nothing:
    # a line of its own, `mmspec.stats.budget_notice`)
    assert json.loads((tmp_path / "default" / "manifest.jsonl").read_text().splitlines()[0])["settings"]["budget"] == \
        "fixed"
    assert generate(cspd_dir, tmp_path / "fixed", "--method", "cspd", "--budget", "fixed") == 0
    assert generate(cspd_dir, tmp_path / "auto", "--method", "cspd", "--budget", "auto") == 0
    names = ("default", "fixed", "auto")
    extras = [json.loads((tmp_path / name / "stats.json").read_text())["stats"]["extra"] for name in names]
    counted = [any(k.startswith("budget_") for k in extra) for extra in extras]
    assert counted == [False, False, True]


def test_bench_family_mar(folders):
    cspd_dir, _ = folders
    settings = BenchSettings(num_samples=4, temperature=1.0,
                             options={"model": str(cspd_dir), "fid_reference": "64", "num_sampling_steps": "4"})
    methods = ["vanilla", "vanilla:num_iter=4", "cspd:gamma=2", "cspd:gamma=2:align=false"]
    result = run_bench("mar", methods, batch_sizes=[2], repeats=1, warmup=0, settings=settings)
    rows = {r.config.label: r for r in result.runs}
    seq, batches = 16, 2
    assert rows["vanilla"].nfe == batches * seq and rows["vanilla:num_iter=4"].nfe == batches * 4
    assert rows["cspd:gamma=2"].stats.num_draft_forwards > 0
    assert rows["cspd:gamma=2"].nfe <= batches * seq
    assert 0.0 <= rows["cspd:gamma=2"].quality["class_accuracy"] <= 1.0 and "world_fid" in rows["vanilla"].quality


def test_generate_and_bench_use_the_models_own_guidance(tmp_path):
    """A folder whose target carries default_guidance_scale / default_cfg_schedule: `mmspec generate` and the bench
    sample with them unless told otherwise, and stats.json records the scale used."""
    tuned = tiny_mar(2, num_classes=16, default_guidance_scale=2.0, default_cfg_schedule="constant")
    folder = tmp_path / "tuned"
    CSpDPipeline(target=tuned, draft=tiny_mar(3, num_classes=16, embed_dim=16), vae=tiny_vae()).save_pretrained(folder)
    assert generate(folder, tmp_path / "own") == 0
    assert json.loads((tmp_path / "own" / "stats.json").read_text())["sampling"]["guidance_scale"] == 2.0
    assert generate(folder, tmp_path / "set", "--guidance-scale", "2.0", "--method-arg", "cfg_schedule=constant") == 0
    assert generate(folder, tmp_path / "official", "--guidance-scale", "3.0", "--method-arg",
                    "cfg_schedule=linear") == 0
    images = sorted(os.listdir(tmp_path / "own" / "images"))
    read = lambda run, name: (tmp_path / run / "images" / name).read_bytes()  # noqa: E731
    assert all(read("own", name) == read("set", name) for name in images)
    assert any(read("own", name) != read("official", name) for name in images)
    def bench_fid(**options):  # world-FID of 4 vanilla images: equal iff the images are
        settings = BenchSettings(num_samples=4, temperature=1.0, options={
            "model": str(folder), "fid_reference": "64", "num_sampling_steps": "4", **options})
        return run_bench("mar", ["vanilla"], batch_sizes=[4], repeats=1, warmup=0,
                         settings=settings).runs[0].quality["world_fid"]

    assert bench_fid() == bench_fid(guidance_scale="2.0") != bench_fid(guidance_scale="3.0")


def test_profile_times_the_windows_of_the_target_and_the_draft(folders, tmp_path, monkeypatch, capsys):
    """`mmspec profile --family mar`: a window's forward and head per batch size and width, for both models of a
    CSpD folder (the target alone in a single-model folder); a window wider than the token grid is a clear error."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    cspd_dir, mar_dir = folders
    args = ["profile", "--family", "mar", "--batch-sizes", "1,2", "--repeats", "1"]
    assert main([*args, "--model", str(cspd_dir), "--widths", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "target: ms per forward" in out and "draft: ms per forward" in out and out.count("| 2 |") == 2
    assert main([*args, "--model", str(mar_dir), "--widths", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "target: ms per forward" in out and "draft:" not in out
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2  # the target's table is the same model's in both
    assert main([*args, "--model", str(mar_dir), "--widths", "1,17"]) == 2
    assert "exceeds" in capsys.readouterr().err


def test_window_costs_are_timed_on_a_half_known_canvas(folders, monkeypatch):
    """`window_forward` (the window budget's and the profile's timing) runs a window over the first W tokens of the
    order with the order's later half known: a generation's average canvas, which MAR's encoder reads."""
    import torch

    import continuous.mar.cspd as cspd
    from continuous.mar.pipeline import prepare_run

    pipe = CSpDPipeline.from_pretrained(folders[0])
    run = prepare_run(pipe.target, [0, 1], None, None, 1.0, 2, 1, torch.Generator().manual_seed(0), "latent")
    seen = []
    monkeypatch.setattr(cspd, "sample_at", lambda model, run, tokens, known, positions, cfg: seen.append(
        (known.sum(1).tolist(), bool(known.gather(1, positions).any()))))
    cspd.window_forward(pipe.target, run)(3)
    seq = pipe.target.seq_len
    assert seen == [([seq - seq // 2] * 2, False)]

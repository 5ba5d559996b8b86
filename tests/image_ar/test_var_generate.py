"""`mmspec generate --family var` (vanilla and CoDe) and the `var` bench family, on tiny models; the drafter's
cache holds only its scales."""

import json
import os

import pytest
import torch
from var_dummies import PNS, get_dummy_components

from image_ar.var import VARPipeline, VARTransformer
from image_ar.var.code import CoDePipeline
from image_ar.var.pipeline import forward_stats
from mmspec.bench import BenchSettings, run_bench
from mmspec.cli import main


def small_refiner(num_classes: int = 3) -> VARTransformer:
    torch.manual_seed(5)
    return VARTransformer(vocab_size=16, cvae=4, num_classes=num_classes, depth=1, embed_dim=8, num_heads=2,
                          patch_nums=PNS).eval()


@pytest.fixture(scope="module")
def world_code_dir(tmp_path_factory):
    """A CoDe folder whose models have the world's 16 classes (the bench cycles through them)."""
    c = get_dummy_components()
    torch.manual_seed(1)
    large = VARTransformer(vocab_size=16, cvae=4, num_classes=16, depth=2, embed_dim=16, num_heads=2,
                           patch_nums=PNS).eval()
    with torch.no_grad():
        large.head.weight.mul_(20)
    path = tmp_path_factory.mktemp("world-code")
    CoDePipeline(drafter=large, refiner=small_refiner(16), vqvae=c["vqvae"]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    c = get_dummy_components()
    code_dir, var_dir = tmp_path_factory.mktemp("code"), tmp_path_factory.mktemp("var")
    CoDePipeline(drafter=c["transformer"], refiner=small_refiner(), vqvae=c["vqvae"]).save_pretrained(code_dir)
    VARPipeline(**c).save_pretrained(var_dir)
    return code_dir, var_dir


def generate(model, out, *extra):
    return main(["generate", "--family", "var", "--model", str(model), "--out", str(out), "--quiet",
                 "--classes", "0,2", "--num-images", "2", *extra])


def test_generate_vanilla_is_the_large_model_alone_and_code_splits(folders, tmp_path):
    code_dir, var_dir = folders
    assert generate(code_dir, tmp_path / "v") == 0
    assert generate(var_dir, tmp_path / "v2") == 0
    for name in os.listdir(tmp_path / "v" / "images"):  # CoDe folder's vanilla == the single-model folder
        assert (tmp_path / "v" / "images" / name).read_bytes() == (tmp_path / "v2" / "images" / name).read_bytes()
    assert generate(code_dir, tmp_path / "c", "--method", "code", "--method-arg", "draft_steps=1") == 0
    stats = json.loads((tmp_path / "c" / "stats.json").read_text())
    assert stats["method_kwargs"] == {"draft_steps": 1}
    # 4 images in one batch: the large model made 1 scale, the small one 2 plus its hand-over prefill
    assert stats["stats"]["num_target_forwards"] == 1 and stats["stats"]["num_draft_forwards"] == 3
    assert sorted(os.listdir(tmp_path / "c" / "images")) == ["class0_000.png", "class0_001.png", "class2_000.png",
                                                             "class2_001.png"]
    # the full split is the large model alone
    assert generate(code_dir, tmp_path / "c3", "--method", "code", "--method-arg", f"draft_steps={len(PNS)}") == 0
    for name in os.listdir(tmp_path / "v" / "images"):
        assert (tmp_path / "v" / "images" / name).read_bytes() == (tmp_path / "c3" / "images" / name).read_bytes()


def test_generate_errors_are_clear(folders, tmp_path, capsys):
    code_dir, var_dir = folders
    assert generate(var_dir, tmp_path / "a", "--method", "code") == 2
    assert "needs a CoDe folder" in capsys.readouterr().err
    assert generate(code_dir, tmp_path / "b", "--method", "vanilla", "--method-arg", "draft_steps=1") == 2
    assert "var method 'vanilla' takes no parameters; got draft_steps" in capsys.readouterr().err
    assert generate(code_dir, tmp_path / "c", "--method", "code", "--method-arg", "draft_steps=9") == 2
    assert "draft_steps must be an integer in [0, 3]" in capsys.readouterr().err
    assert generate(code_dir, tmp_path / "f", "--method", "code", "--method-arg", "draft_steps=-1") == 2
    assert "draft_steps must be an integer >= 0" in capsys.readouterr().err  # before the load (`check_code`)
    assert generate(code_dir, tmp_path / "d", "--method", "code", "--method-arg", "depth=2") == 2
    assert "var method 'code' takes draft_steps; got depth" in capsys.readouterr().err
    assert main(["generate", "--family", "llamagen", "--model", str(code_dir), "--out", str(tmp_path / "e"),
                 "--quiet"]) == 2
    assert "holds a CoDePipeline pipeline, not a LlamaGenPipeline" in capsys.readouterr().err


def test_forward_stats_count_both_models():
    assert (forward_stats(7, None).num_target_forwards, forward_stats(7, None).num_draft_forwards) == (7, 0)
    assert (forward_stats(7, 5).num_target_forwards, forward_stats(7, 5).num_draft_forwards) == (5, 3)
    assert (forward_stats(7, 0).num_target_forwards, forward_stats(7, 0).num_draft_forwards) == (0, 7)


def test_drafter_cache_holds_only_the_drafted_scales():
    c = get_dummy_components()
    model = c["transformer"]
    assert model.new_cache(2, num_scales=2).capacity == 1 + 4
    assert model.new_cache(2).capacity == model.num_tokens
    with pytest.raises(Exception, match="num_scales must be an integer"):
        model.new_cache(2, num_scales=0)


def test_bench_family_var_table_over_splits(world_code_dir):
    code_dir = world_code_dir
    settings = BenchSettings(num_samples=6, temperature=0.0, options={"model": str(code_dir), "fid_reference": "64"})
    methods = ["vanilla", "code:draft_steps=0", "code:draft_steps=2", f"code:draft_steps={len(PNS)}"]
    result = run_bench("var", methods, batch_sizes=[3], repeats=1, warmup=0, settings=settings)
    rows = {r.config.label: r for r in result.runs}
    assert rows[f"code:draft_steps={len(PNS)}"].quality["exactness"] == 1.0  # the large model alone, greedy
    assert rows["code:draft_steps=0"].quality["exactness"] < 1.0  # the small model alone differs
    assert rows["vanilla"].nfe == 2 * len(PNS) and rows["code:draft_steps=2"].nfe == 2 * 2
    assert rows["code:draft_steps=2"].stats.num_draft_forwards == 2 * 2  # 1 scale + prefill, 2 batches
    assert 0.0 <= rows["vanilla"].quality["class_accuracy"] <= 1.0 and "world_fid" in rows["vanilla"].quality


def test_bench_tensor_memory_shows_code_frees_the_large_cache(world_code_dir):
    code_dir = world_code_dir
    settings = BenchSettings(num_samples=4, temperature=1.0, options={"model": str(code_dir), "fid_reference": "64"})
    result = run_bench("var", ["vanilla", "code:draft_steps=1"], batch_sizes=[4], repeats=1, warmup=0,
                       settings=settings, tensor_memory=True)
    assert result.memory_kind == "tensor_peak"
    peak = {r.config.label: max(r.peak_memory_bytes) for r in result.runs}
    assert 0 < peak["code:draft_steps=1"] < peak["vanilla"]

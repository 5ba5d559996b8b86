"""The world judge and its metrics: shipped judge accuracy, Frechet distance, world-FID sanity, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmspec.cli import main
from mmspec.data import generate_batch
from mmspec.errors import CheckpointError, InputError
from mmspec.metrics import (
    DEFAULT_JUDGE_PATH,
    FIDResult,
    class_accuracy,
    frechet_distance,
    gaussian_stats,
    judge_features,
    judge_predictions,
    load_judge,
    world_fid,
    world_reference_stats,
)


@pytest.fixture(scope="module")
def judge():
    return load_judge()


@pytest.fixture(scope="module")
def reference(judge):
    return world_reference_stats(n=1000, seed=0, judge=judge)


def _noisy(images: torch.Tensor, sigma: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = images.float() / 255
    return (x + sigma * torch.randn(x.shape, generator=gen)).clamp(0, 1)


# --------------------------------------------------------------------------------------------- the judge
def test_shipped_judge_is_tiny():
    files = {p.name: p.stat().st_size for p in DEFAULT_JUDGE_PATH.iterdir()}
    assert {"model.safetensors", "config.json", "README.md"} <= set(files)
    assert files["model.safetensors"] < 1_000_000
    training = json.loads((DEFAULT_JUDGE_PATH / "config.json").read_text())["training"]
    assert training["eval"]["class_accuracy"] >= 0.98


def test_shipped_judge_accuracy_on_fresh_held_out_batch(judge):
    batch = generate_batch(2000, seed=2024, split="test")
    assert class_accuracy(batch.images, batch.labels, judge) >= 0.98


def test_judge_reads_float_64px_and_mildly_noisy_images(judge):
    batch = generate_batch(300, seed=5, split="val")
    assert torch.equal(judge_predictions(batch.images, judge), judge_predictions(batch.float_images(), judge))
    big = generate_batch(300, seed=5, split="val", image_size=64)
    assert class_accuracy(big.images, big.labels, judge) >= 0.97
    assert class_accuracy(_noisy(batch.images, 0.05), batch.labels, judge) >= 0.97


def test_default_judge_is_the_shipped_one(judge):
    batch = generate_batch(50, seed=1, split="val")
    assert load_judge() is judge  # cached
    assert class_accuracy(batch.images, batch.labels) == class_accuracy(batch.images, batch.labels, judge)


def test_features_are_the_penultimate_layer(judge):
    batch = generate_batch(10, seed=0, split="val")
    feats = judge_features(batch.images, judge)
    assert feats.shape == (10, judge.config.feature_dim) == (10, 64)
    logits = judge.classifier(feats)
    assert torch.allclose(logits, judge(batch.images), atol=1e-5)


# --------------------------------------------------------------------------------------------- Frechet
def test_frechet_distance_closed_forms():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 6))
    s = a @ a.T
    mu = rng.normal(size=6)
    assert frechet_distance(mu, s, mu, s) < 1e-8
    # diagonal covariances: sum (m1 - m2)^2 + (sqrt(v1) - sqrt(v2))^2
    v1, v2 = rng.uniform(0.1, 2, size=6), rng.uniform(0.1, 2, size=6)
    m1, m2 = rng.normal(size=6), rng.normal(size=6)
    expected = ((m1 - m2) ** 2).sum() + ((np.sqrt(v1) - np.sqrt(v2)) ** 2).sum()
    assert frechet_distance(m1, np.diag(v1), m2, np.diag(v2)) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_matches_scipy_and_handles_singular():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 8)), rng.normal(size=(40, 8)) * 1.5 + 0.3
    sx, sy = gaussian_stats(x), gaussian_stats(y)
    covmean = scipy_linalg.sqrtm(sx.sigma @ sy.sigma).real
    diff = sx.mu - sy.mu
    expected = diff @ diff + np.trace(sx.sigma) + np.trace(sy.sigma) - 2 * np.trace(covmean)
    assert frechet_distance(sx.mu, sx.sigma, sy.mu, sy.sigma) == pytest.approx(expected, rel=1e-6)
    low_rank = gaussian_stats(rng.normal(size=(5, 8)))  # rank-4 covariance
    value = frechet_distance(low_rank.mu, low_rank.sigma, sy.mu, sy.sigma)
    assert np.isfinite(value) and value > 0


# --------------------------------------------------------------------------------------------- world-FID
def test_world_fid_real_vs_real_is_small_and_grows_with_noise(judge, reference):
    real = generate_batch(1000, seed=0, split="test", start=1000)  # disjoint from the reference's samples
    base = world_fid(real.images, reference, judge)
    assert isinstance(base, FIDResult) and (base.n_generated, base.n_reference) == (1000, 1000)
    noisy = [world_fid(_noisy(real.images, s), reference, judge).fid for s in (0.1, 0.2, 0.3, 0.4)]
    assert all(a < b for a, b in zip(noisy, noisy[1:])), noisy
    assert base.fid < noisy[0]
    assert base.fid < 0.1 * noisy[-1], (base.fid, noisy)


def test_world_fid_sees_mode_collapse(judge, reference):
    real = generate_batch(1000, seed=1, split="val")
    one_class = real.images[real.labels == 0]
    collapsed = one_class[torch.arange(500) % one_class.shape[0]]
    base = world_fid(real.images, reference, judge).fid
    assert world_fid(collapsed, reference, judge).fid > 5 * base
    large_only = real.images[torch.from_numpy(real.params.size[:, 0] == 2)]  # every class, one size
    assert world_fid(large_only, reference, judge).fid > 5 * base


def test_world_fid_with_image_reference(judge):
    a = generate_batch(300, seed=0, split="val").images
    b = generate_batch(200, seed=1, split="val").images
    res = world_fid(a, b, judge)
    assert (res.n_generated, res.n_reference) == (300, 200) and res.fid >= 0
    assert "n_generated=300" in str(res)


# --------------------------------------------------------------------------------------------- errors
def test_bad_inputs_are_input_errors(judge):
    batch = generate_batch(4, seed=0, split="val")
    with pytest.raises(InputError, match=r"\(images \+ 1\) / 2"):
        class_accuracy(batch.float_images() * 2 - 1, batch.labels, judge)
    with pytest.raises(InputError, match="channels first"):
        class_accuracy(batch.images.permute(0, 2, 3, 1), batch.labels, judge)
    with pytest.raises(InputError, match="labels"):
        class_accuracy(batch.images, batch.labels[:3], judge)
    with pytest.raises(InputError, match="uint8"):
        class_accuracy(batch.images.float() * 255, batch.labels, judge)
    with pytest.raises(InputError, match="at least 2"):
        world_fid(batch.images[:1], batch.images, judge)
    with pytest.raises(InputError, match="held-out"):
        world_reference_stats(n=10, split="train", judge=judge)


def test_load_judge_errors(tmp_path, judge):
    with pytest.raises(InputError, match="mmspec train judge"):
        load_judge(tmp_path)
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text((DEFAULT_JUDGE_PATH / "config.json").read_text())
    save_file({"embed.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys"):
        load_judge(tmp_path)


def test_train_judge_command_runs(tmp_path, capsys):
    out = tmp_path / "judge"
    args = ["train", "judge", "--out", str(out), "--steps", "15", "--batch-size", "32", "--eval-size", "100"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    model = load_judge(out)
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["steps"] == 15 and 0 <= config["training"]["eval"]["class_accuracy"] <= 1
    card = (out / "README.md").read_text()
    assert "mmspec train judge --out" in card and "class_accuracy" in card
    assert model(generate_batch(2, seed=0).images).shape == (2, 16)

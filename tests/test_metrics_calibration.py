"""Token calibration (randomised PIT under the target): uniform for exact samples, detects bent distributions."""

from __future__ import annotations

import pytest
import torch

from mmspec.errors import InputError
from mmspec.metrics.calibration import (
    TokenCalibration,
    calibration_figures,
    kolmogorov_pvalue,
    ks_uniform,
    pit_values,
)
from mmspec.sampling import sample


def _contexts(n: int = 4000, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    """n different peaky target distributions [n, V] (as many prefixes would give)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * 2.0).softmax(-1)


def _figures(p: torch.Tensor, tokens: torch.Tensor) -> dict:
    cal = TokenCalibration()
    half = p.shape[0] // 2  # two batches: the accumulator pools them
    cal.add(p[:half], tokens[:half], torch.Generator().manual_seed(1))
    cal.add(p[half:], tokens[half:], torch.Generator().manual_seed(2))
    return cal.figures()


def test_exact_samples_are_uniform():
    p = _contexts()
    tokens = sample(p, torch.Generator().manual_seed(3))
    f = _figures(p, tokens)
    assert f["calibration_tokens"] == 4000 and f["off_support"] == 0.0
    assert f["pit_ks_pvalue"] > 0.01 and f["pit_ks"] < 0.03
    assert f["pit_ks_stratified_null"] > 0.87 / 4000**0.5  # smaller strata: a larger null than the pooled one
    assert f["pit_ks_stratified"] < 1.5 * f["pit_ks_stratified_null"]
    assert abs(f["pit_mean_shift"]) < 0.015 and abs(f["excess_surprisal"]) < 0.05


@pytest.mark.parametrize("temperature, direction", [(0.6, -1), (1.6, 1)])
def test_sharpened_or_flattened_samplers_are_detected(temperature, direction):
    """Negative control: tokens drawn from p^(1/t) (renormalised), scored against p."""
    p = _contexts()
    bent = (p.log() / temperature).softmax(-1)
    tokens = sample(bent, torch.Generator().manual_seed(3))
    f = _figures(p, tokens)
    assert f["pit_ks_pvalue"] < 1e-6 and f["pit_ks"] > 0.05
    assert f["pit_mean_shift"] * direction > 0.03  # sharper: likely tokens too often; flatter: unlikely ones
    assert f["excess_surprisal"] * direction > 0.05


def test_ks_distance_is_a_lower_bound_on_the_mean_total_variation():
    p = _contexts(n=6000)
    q = 0.8 * p + 0.2 * torch.roll(p, 1, dims=-1)  # mass moved to the neighbour id: TV(q, p) known per row
    tv = 0.5 * (q - p).abs().sum(-1).mean()
    f = _figures(p, sample(q, torch.Generator().manual_seed(5)))
    assert 0.01 < f["pit_ks"] <= float(tv) + 0.02


def test_stratified_distance_sees_distortions_that_cancel_when_pooled():
    """Flattening peaked distributions and sharpening flat ones push the pooled u opposite ways; within strata of
    similar top probability they do not cancel, and the average is still below the mean total variation."""
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(8000, 50, generator=g) * torch.linspace(0.5, 4.0, 8000).unsqueeze(-1)).softmax(-1)
    bent = (p.log() / torch.where(p.amax(-1, keepdim=True) > 0.7, 1.5, 0.75)).softmax(-1)
    tv = float(0.5 * (bent - p).abs().sum(-1).mean())
    f = _figures(p, sample(bent, torch.Generator().manual_seed(1)))
    assert f["pit_ks_stratified"] > f["pit_ks"] + 0.03 and f["pit_ks_stratified"] <= tv + 0.02
    exact = _figures(p, sample(p, torch.Generator().manual_seed(1)))
    assert exact["pit_ks_stratified"] < 1.5 * exact["pit_ks_stratified_null"]


def test_pit_of_each_token_and_off_support_tokens():
    p = torch.tensor([[0.5, 0.0, 0.2, 0.3]])
    v = torch.tensor([0.5])
    # ranked 0 (0.5), 3 (0.3), 2 (0.2), 1 (0.0)
    for token, u in ((0, 0.25), (3, 0.65), (2, 0.9), (1, 1.0)):
        assert pit_values(p, torch.tensor([token]), v).item() == pytest.approx(u)
    cal = TokenCalibration()
    cal.add(p.expand(4, 4), torch.tensor([0, 1, 2, 3]))
    assert cal.figures()["off_support"] == 0.25


def test_kolmogorov_pvalue_and_distance():
    assert kolmogorov_pvalue(1.36 / 10_000 ** 0.5, 10_000) == pytest.approx(0.05, abs=0.003)
    assert kolmogorov_pvalue(1.63 / 10_000 ** 0.5, 10_000) == pytest.approx(0.01, abs=0.001)
    assert kolmogorov_pvalue(0.0, 100) == 1.0
    grid = (torch.arange(100, dtype=torch.float64) + 0.5) / 100
    assert ks_uniform(grid) == pytest.approx(0.005)
    assert ks_uniform(torch.zeros(10)) == pytest.approx(1.0)


def test_mismatched_shapes_and_unfinished_tokens_are_clear_errors():
    cal = TokenCalibration()
    with pytest.raises(InputError, match="p must be"):
        cal.add(torch.ones(2, 3, 5) / 5, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(InputError, match="finished generation"):
        cal.add(torch.ones(2, 5) / 5, torch.tensor([0, -1]))
    with pytest.raises(InputError, match="no tokens"):
        cal.figures()
    assert calibration_figures([]) == {}  # the bench helper: nothing scored, no figures


def test_figures_over_batches_equal_figures_over_one_batch_drawn_in_the_same_order():
    p = _contexts(n=600)
    tokens = sample(p, torch.Generator().manual_seed(3))
    pooled = calibration_figures([(p.view(3, 200, -1), tokens.view(3, 200))], seed=7)
    batched = calibration_figures([(p[:200], tokens[:200]), (p[200:400], tokens[200:400]),
                                   (p[400:], tokens[400:])], seed=7)
    assert pooled == pytest.approx(batched)

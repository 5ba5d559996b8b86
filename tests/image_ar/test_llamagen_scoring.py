"""Teacher-forced target distributions of LlamaGen token sequences, and the token calibration they feed."""

import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.llamagen.scoring import target_probs
from mmspec.errors import InputError
from mmspec.metrics.calibration import TokenCalibration

LABELS = [0, 1, 2, 3] * 8


@pytest.fixture(scope="module")
def pipe():
    p = LlamaGenPipeline(**get_dummy_components())
    p.set_progress_bar_config(disable=True)
    return p


def _calibration(pipe, method: str, seeds: range, temperature: float = 1.0, score_temperature: float = 1.0) -> dict:
    cal = TokenCalibration()
    for s in seeds:
        gens = [torch.Generator().manual_seed(100 * s + i) for i in range(len(LABELS))]
        out = pipe(class_labels=LABELS, guidance_scale=3.0, temperature=temperature, top_k=16, generator=gens,
                   method=method, output_type="latent")
        p = target_probs(pipe, LABELS, out.tokens, guidance_scale=3.0, temperature=score_temperature, top_k=16)
        cal.add(p, out.tokens, torch.Generator().manual_seed(s))
    return cal.figures()


def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_distributions(pipe):
    out = pipe(class_labels=LABELS, guidance_scale=3.0, temperature=0, output_type="latent")
    p = target_probs(pipe, LABELS, out.tokens, guidance_scale=3.0, temperature=0)
    assert p.shape == (32, 16, 64)
    assert torch.equal(p.argmax(-1), out.tokens)
    # a row's distributions do not depend on its batch, and a prefix scores like the whole sequence's start
    single = target_probs(pipe, LABELS[3:4], out.tokens[3:4, :5], guidance_scale=3.0, temperature=0)
    assert torch.allclose(single, p[3:4, :5], atol=1e-5)


@pytest.mark.parametrize("method", ["vanilla", "sjd", "draft-model"])
def test_lossless_methods_pass_the_calibration_test(pipe, method):
    f = _calibration(pipe, method, range(4))
    assert f["calibration_tokens"] == 4 * 32 * 16 and f["off_support"] == 0.0
    assert f["pit_ks_pvalue"] > 0.001


def test_tokens_sampled_colder_than_they_are_scored_fail_it(pipe):
    """Negative control end to end: vanilla at temperature 0.5 scored as if it sampled at temperature 1."""
    f = _calibration(pipe, "vanilla", range(4), temperature=0.5)
    assert f["pit_ks_pvalue"] < 1e-6 and f["pit_mean_shift"] < -0.05


def test_bad_shapes_are_clear_errors(pipe):
    with pytest.raises(InputError, match="block_size"):
        target_probs(pipe, [0], torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(InputError, match="conditions for"):
        target_probs(pipe, [0, 1], torch.zeros(1, 4, dtype=torch.long))

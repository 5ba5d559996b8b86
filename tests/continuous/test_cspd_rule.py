"""CSpD's continuous acceptance rule: the accept + residual scheme samples the target's Gaussian when the step
factor is 1, identical paths are always accepted, tokens after the first rejection are discarded, a token is never
left unset (fallback to the target's own token), the reference code's variants, and no host synchronisation."""

import math

import pytest
import torch
from scipy import stats

from mmspec.errors import InputError
from mmspec.verify.cspd import ContinuousRandomness, CSpDRule, GaussianPath, gaussian_log_density


def path(x0, mean, log_var, log_det=None):
    b, k, _ = x0.shape
    return GaussianPath(x0=x0, log_det_steps=torch.zeros(b, k, dtype=x0.dtype) if log_det is None else log_det,
                        last_mean=mean, last_log_variance=log_var)


def test_gaussian_log_density_matches_scipy():
    x, mean, log_var = torch.tensor([[0.3, -1.0]]), torch.tensor([[0.1, 0.5]]), torch.tensor([[0.2, -0.7]])
    expected = sum(stats.norm.logpdf(x[0, i].item(), mean[0, i].item(), math.exp(0.5 * log_var[0, i].item()))
                   for i in range(2))
    assert gaussian_log_density(x, mean, log_var).item() == pytest.approx(expected, rel=1e-5)


def test_accept_or_residual_samples_the_target_gaussian_when_the_step_factor_is_one():
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    mu_q, sd_q, mu_p, sd_p = 0.6, 1.2, 0.0, 0.8
    x0 = (mu_q + sd_q * torch.randn(n, 1, 1, generator=gen, dtype=torch.float64))
    ones = torch.ones(n, 1, 1, dtype=torch.float64)
    q = path(x0, mu_q * ones, math.log(sd_q ** 2) * ones)
    p = path(x0, mu_p * ones, math.log(sd_p ** 2) * ones)  # p.x0 is only the fallback
    rand = ContinuousRandomness.draw(n, 1, 100, 1, gen)
    result = CSpDRule().verify(q, p, torch.ones(n, dtype=torch.long), rand)
    out = result.output_tokens[:, 0, 0].numpy()
    assert result.fallback.sum() == 0
    assert stats.kstest(out, stats.norm(mu_p, sd_p).cdf).pvalue > 1e-3
    # without the residual the accepted tokens alone are not the target distribution
    accepted = result.accepted_flags[:, 0].numpy()
    assert 0.4 < accepted.mean() < 0.9
    assert stats.kstest(out[accepted], stats.norm(mu_p, sd_p).cdf).pvalue < 1e-3


def test_identical_paths_are_accepted():
    gen = torch.Generator().manual_seed(1)
    x0, mean, log_var = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen), -torch.rand(3, 4, 5)
    q = p = path(x0, mean, log_var, torch.randn(3, 4, generator=gen))
    result = CSpDRule().verify(q, p, torch.full((3,), 4), ContinuousRandomness.draw(3, 4, 10, 5, gen))
    assert result.num_accepted.tolist() == [4, 4, 4] and result.num_emitted.tolist() == [4, 4, 4]
    assert torch.equal(result.output_tokens, x0)


def rejecting_at(index: int, k: int = 5, c: int = 2):
    """One row whose window token `index` is far out of the target's Gaussian (rejected), the others exact."""
    x0 = torch.zeros(1, k, c, dtype=torch.float64)
    x0[0, index] = 50.0
    mean, log_var = torch.zeros(1, k, c, dtype=torch.float64), torch.zeros(1, k, c, dtype=torch.float64)
    return path(x0, x0.clone(), log_var), path(x0, mean, log_var)


def test_tokens_after_the_first_rejection_are_discarded():
    q, p = rejecting_at(2)
    rand = ContinuousRandomness.draw(1, 5, 100, 2, torch.Generator().manual_seed(2))
    result = CSpDRule().verify(q, p, torch.tensor([5]), rand)
    assert result.num_accepted.item() == 2 and result.num_emitted.item() == 3
    assert result.accepted_flags.tolist() == [[True, True, False, False, False]]
    assert result.residual.tolist() == [[False, False, True, False, False]]
    assert result.output_tokens[0, 2].abs().max() < 10  # a residual token from the target's Gaussian, not 50
    # a ragged window: positions past num_draft are never accepted nor emitted
    result = CSpDRule().verify(q, p, torch.tensor([2]), rand)
    assert result.num_accepted.item() == 2 and result.num_emitted.item() == 2 and not result.residual.any()


def test_independent_checks_keep_checking_after_a_rejection():
    q, p = rejecting_at(1)
    rand = ContinuousRandomness.draw(1, 5, 100, 2, torch.Generator().manual_seed(3))
    result = CSpDRule(independent_checks=True).verify(q, p, torch.tensor([5]), rand)
    assert result.accepted_flags.tolist() == [[True, False, True, True, True]]
    assert result.num_emitted.item() == 5 and result.residual.tolist() == [[False, True, False, False, False]]


def test_a_token_is_never_left_unset_the_fallback_is_the_target_token():
    k, c = 3, 2
    x0 = torch.zeros(2, k, c, dtype=torch.float64)
    target_x0 = torch.full((2, k, c), 0.25, dtype=torch.float64)
    zeros = torch.zeros(2, k, c, dtype=torch.float64)
    # a huge negative step factor: every draft token is rejected and no residual proposal can be kept
    q = path(x0, zeros, zeros, torch.full((2, k), -2000.0, dtype=torch.float64))
    p = GaussianPath(target_x0, torch.zeros(2, k, dtype=torch.float64), zeros, zeros)
    result = CSpDRule().verify(q, p, torch.tensor([3, 3]), ContinuousRandomness.draw(2, k, 20, c))
    assert result.num_accepted.tolist() == [0, 0] and result.fallback[:, 0].all()
    assert torch.equal(result.output_tokens[:, 0], target_x0[:, 0])
    assert torch.isfinite(result.output_tokens).all()


def test_reference_code_variants():
    rule = CSpDRule.reference_code()
    assert rule.config() == {"name": "cspd", "distance_scale": 42.0, "invert_variance_factor": True,
                             "independent_checks": True, "max_residual_tries": 100}
    q, p = rejecting_at(0, k=1, c=1)
    # the standardised distance is divided by 42 before squaring: log r = -(50 / 42)^2 / 2 instead of -50^2 / 2
    assert rule.log_ratio(q, p).item() == pytest.approx(-(50 / 42) ** 2 / 2)
    assert CSpDRule().log_ratio(q, p).item() == pytest.approx(-50 ** 2 / 2)
    q.log_det_steps += 2.0
    assert CSpDRule().step_factor(q, p).item() == 1.0 and rule.step_factor(q, p).item() == -1.0


def official_acceptance_and_residual(q_mean, q_std, q_log_std_steps, p_mean, p_std, p_log_std_steps, x, y,
                                     softening=42.0):
    """The public code's DistributionProcessor, computed independently in probability space (float64): x1 = draft,
    x2 = target, stds of the last step, log-stds summed over the steps before the last."""
    dim = x.shape[-1]
    fixed = torch.exp((p_log_std_steps - q_log_std_steps).sum(-1))
    q_soft = torch.exp(-0.5 * (((x - q_mean) / q_std / softening) ** 2).sum(-1))
    p_soft = torch.exp(-0.5 * (((x - p_mean) / p_std / softening) ** 2).sum(-1))
    accept = p_soft * fixed * q_std.prod(-1) / (q_soft * p_std.prod(-1))

    def pdf(v, mean, std):
        return torch.exp(-0.5 * (((v - mean) / std) ** 2).sum(-1)) / ((2 * math.pi) ** (dim / 2) * std.prod(-1))

    yq, yp = pdf(y, q_mean, q_std), pdf(y, p_mean, p_std)
    keep = (yp - yq / fixed).clamp(min=0) / yp
    return accept, keep


def test_reference_code_matches_an_independent_computation_of_the_official_formula():
    gen = torch.Generator().manual_seed(11)
    b, k, c, steps = 3, 4, 2, 6

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    log_std_q, log_std_p = rand(b, k, c, scale=0.3) - 1, rand(b, k, c, scale=0.3) - 1  # last step
    steps_q, steps_p = rand(b, k, steps, c, scale=0.1) - 1, rand(b, k, steps, c, scale=0.1) - 1  # log-stds before it
    mean_q, mean_p = rand(b, k, c), rand(b, k, c)
    x0 = mean_q + rand(b, k, c, scale=0.5)
    q = GaussianPath(x0, 2 * steps_q.sum((2, 3)), mean_q, 2 * log_std_q)
    p = GaussianPath(mean_p, 2 * steps_p.sum((2, 3)), mean_p, 2 * log_std_p)
    y = mean_p.unsqueeze(2) + torch.exp(log_std_p).unsqueeze(2) * rand(b, k, 5, c)  # [B, K, T, C] proposals
    accept, keep = official_acceptance_and_residual(
        mean_q, torch.exp(log_std_q), steps_q.sum(2), mean_p, torch.exp(log_std_p), steps_p.sum(2), x0,
        y.movedim(2, 0), 42.0)
    rule = CSpDRule.reference_code()
    torch.testing.assert_close(rule.log_ratio(q, p), torch.log(accept), rtol=1e-9, atol=1e-9)
    assert (accept > 1e-6).any() and (accept < 1).any()  # the comparison covers both sides of min(1, r)
    torch.testing.assert_close(rule.residual_keep_probability(q, p, y), keep.movedim(0, 2), rtol=1e-9, atol=1e-12)
    assert (keep > 0).any() and (keep < 1).any()
    # the paper's rule is the same arithmetic without softening and with the opposite variance factor
    paper_accept, _ = official_acceptance_and_residual(
        mean_q, torch.exp(log_std_q), steps_p.sum(2), mean_p, torch.exp(log_std_p), steps_q.sum(2), x0,
        y.movedim(2, 0), 1.0)
    torch.testing.assert_close(CSpDRule().log_ratio(q, p), torch.log(paper_accept), rtol=1e-9, atol=1e-9)


def test_the_residual_is_never_softened():
    q, p = rejecting_at(0, k=1, c=2)
    q.last_mean += 0.5
    y = torch.randn(1, 1, 7, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(CSpDRule(distance_scale=42.0).residual_keep_probability(q, p, y),
                               CSpDRule().residual_keep_probability(q, p, y))
    with pytest.raises(InputError, match="distance_scale"):
        CSpDRule(distance_scale=0)


def test_verify_compiles_without_graph_breaks():
    gen = torch.Generator().manual_seed(4)
    q = path(torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 4, generator=gen), -torch.rand(2, 3, 4))
    p = path(torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 4, generator=gen), -torch.rand(2, 3, 4))
    rand = ContinuousRandomness.draw(2, 3, 8, 4, gen)
    rule = CSpDRule()
    eager = rule.verify(q, p, torch.tensor([3, 2]), rand)
    compiled = torch.compile(rule.verify, fullgraph=True, backend="eager")(q, p, torch.tensor([3, 2]), rand)
    assert torch.equal(eager.output_tokens, compiled.output_tokens)
    assert torch.equal(eager.num_emitted, compiled.num_emitted)

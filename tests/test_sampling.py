"""Sampling: logits processing, exponential-race sampling, per-row generators, bad arguments."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.sampling import (
    SamplingParams,
    cfg_combine,
    exponential,
    filter_top_k,
    filter_top_p,
    logits_to_probs,
    process_logits,
    race,
    sample,
    uniform,
)
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance


def test_cfg_combine_is_uncond_plus_scale_times_difference():
    cond = torch.tensor([[1.0, 2.0, 3.0]])
    uncond = torch.tensor([[0.0, 1.0, 5.0]])
    assert torch.equal(cfg_combine(cond, uncond, 4.0), torch.tensor([[4.0, 5.0, -3.0]]))
    assert torch.equal(cfg_combine(cond, uncond, 1.0), cond)


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = filter_top_k(logits, 2)
    assert torch.isfinite(out).sum() == 2
    assert torch.equal(torch.isfinite(out), torch.tensor([[False, True, False, True, False]]))
    assert torch.equal(filter_top_k(logits, 0), logits)


def test_top_p_keeps_smallest_nucleus_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = torch.isfinite(filter_top_p(logits, 0.7))
    assert keep.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    keep = torch.isfinite(filter_top_p(logits, 0.1))
    assert keep.tolist() == [[True, False, False, False]]
    assert torch.equal(filter_top_p(logits, 1.0), logits)


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0]])
    assert logits_to_probs(logits, temperature=0).tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first on ties


def test_process_logits_order_temperature_then_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = process_logits(logits, temperature=2.0, top_k=2)
    assert torch.allclose(out[0, :2], torch.tensor([1.0, 0.5]))
    assert out[0, 2] == float("-inf")


def test_race_samples_proportionally_to_weights():
    weights = torch.tensor([1.0, 2.0, 0.0, 5.0, 2.0])  # unnormalised on purpose
    n = 200_000
    gen = torch.Generator().manual_seed(0)
    tokens = race(weights.expand(n, 5), exponential((n, 5), gen))
    emp = empirical_distribution(tokens, 5)
    assert emp[2] == 0  # zero weight never sampled
    assert tv_distance(emp, weights / weights.sum()) < tv_tolerance(5, n)


def test_uniforms_are_float64_and_per_row_generators_make_rows_batch_independent():
    assert uniform((3, 4)).dtype == torch.float64
    a = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    b = [torch.Generator().manual_seed(s) for s in (2,)]
    batch = sample(torch.full((3, 50), 0.02), a)
    alone = sample(torch.full((1, 50), 0.02), b)
    assert batch[1] == alone[0]


def test_one_generator_for_the_batch_is_reproducible():
    probs = torch.softmax(torch.randn(4, 30), -1)
    t1 = sample(probs, torch.Generator().manual_seed(7))
    t2 = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(t1, t2)


def test_a_cpu_generator_draws_for_tensors_on_another_device(monkeypatch):
    """A CPU generator with CUDA tensors (diffusers allows it; a GPU run found `uniform` raising torch's "Expected
    a 'cuda' device type for generator"): the numbers are drawn on the CPU and moved. Without a GPU, "meta" stands
    in for the other device, and torch.rand is made to enforce CUDA's rule, which CPU/meta torch does not."""
    real_rand = torch.rand

    def strict_rand(*size, generator=None, device=None, **kwargs):
        if generator is not None and device is not None and generator.device.type != torch.device(device).type:
            raise RuntimeError(f"Expected a '{torch.device(device).type}' device type for generator")
        return real_rand(*size, generator=generator, device=device, **kwargs)

    monkeypatch.setattr(torch, "rand", strict_rand)
    for generator in (torch.Generator().manual_seed(3), [torch.Generator().manual_seed(s) for s in (3, 4)]):
        u = uniform((2, 5), generator, device="meta")
        assert u.device.type == "meta" and u.shape == (2, 5) and u.dtype == torch.float64
    on_cpu = uniform((2, 5), torch.Generator().manual_seed(3))
    assert torch.equal(on_cpu, real_rand((2, 5), generator=torch.Generator().manual_seed(3), dtype=torch.float64))


@pytest.mark.parametrize("kwargs, word", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"),
])
def test_invalid_sampling_params_name_the_argument(kwargs, word):
    with pytest.raises(InputError, match=word):
        SamplingParams(**kwargs)


def test_wrong_number_of_generators_is_a_clear_error():
    with pytest.raises(InputError, match="one generator per row"):
        uniform((3, 2), [torch.Generator()])


def test_cfg_shape_mismatch_is_a_clear_error():
    with pytest.raises(InputError, match="same shape"):
        cfg_combine(torch.zeros(2, 3), torch.zeros(2, 4), 2.0)

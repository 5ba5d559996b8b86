"""The Gaussian-diffusion arithmetic of MAR's diffusion head: cosine betas, respaced DDPM sampling with a learned
variance range, and the training loss (eps MSE + variational bound), as the official `create_diffusion(
noise_schedule="cosine")` with `learn_sigma=True`.

The betas come from diffusers' `DDPMScheduler(beta_schedule="squaredcos_cap_v2")` (the same cosine schedule);
its `step()` is not used for sampling because MAR's sampler needs what it hides: temperature scales only the
per-step noise, the noise is passed in (CSpD's trajectory alignment shares it between two models), and CSpD reads
the mean and log-variance of every step.

    diffusion = GaussianDiffusion(num_sampling_steps=100)
    trajectory = diffusion.sample(eps_fn, x_T, step_noise, temperature=1.0)   # x0 [N, C], per-step log-variances
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import DDPMScheduler

from mmspec.errors import InputError

NUM_TRAIN_TIMESTEPS = 1000

# eps_fn(x_t [N, C], t [N] (original timesteps)) -> [N, 2C]: predicted eps, then the variance interpolation v
EpsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the sampler's eps_fn also gets the chain position s of the step (so a model can precompute per-step inputs)
StepEpsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def cosine_alphas_cumprod(num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """alpha_bar_t of the cosine schedule (betas capped at 0.999), float64 [T]."""
    scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="squaredcos_cap_v2")
    return torch.cumprod(1 - scheduler.betas.double(), 0)


TIMESTEP_SPACINGS = ("linspace", "leading")


def respaced_timesteps(num_sampling_steps: int, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
                       spacing: str = "linspace") -> torch.Tensor:
    """The kept original timesteps [S]. "linspace": evenly spaced from 0 to T - 1 and rounded (the official
    `space_timesteps(T, "100")`); "leading": 0, T/S, 2T/S, ... (diffusers' leading spacing), whose top step is not
    T - 1. With the cosine schedule alpha_bar(T - 1) = 2.4e-9, so the official first step multiplies the eps
    error by ~316 (x0 = 20291 (x_t - eps), times the posterior's 0.0156): a model must predict eps there to
    ~1e-3; "leading" starts at t = 990 (factor ~2) for models trained too briefly for that."""
    if spacing not in TIMESTEP_SPACINGS:
        raise InputError(f"timestep_spacing must be one of {TIMESTEP_SPACINGS}, got {spacing!r}.")
    if spacing == "leading":
        return torch.arange(num_sampling_steps) * (num_train_timesteps // num_sampling_steps)
    if num_sampling_steps == 1:
        return torch.tensor([num_train_timesteps - 1])
    stride = (num_train_timesteps - 1) / (num_sampling_steps - 1)
    return torch.tensor([round(i * stride) for i in range(num_sampling_steps)])


@dataclass
class Trajectory:
    """The result of denoising N tokens: x0 [N, C], the log-variance of every step [S, N, C] (index s = the step
    from respaced timestep s to s - 1; s = 0 is the last, noise-free step) and the mean of the last step [N, C]
    (== x0, since the last step adds no noise)."""

    x0: torch.Tensor
    log_variances: torch.Tensor
    last_mean: torch.Tensor


class GaussianDiffusion:
    """Cosine-schedule DDPM with `num_sampling_steps` respaced steps for sampling and the full schedule for
    training; all coefficients float64 on the CPU, cast on use."""

    def __init__(self, num_sampling_steps: int = 100, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
                 spacing: str = "linspace") -> None:
        self.num_train_timesteps = num_train_timesteps
        self.num_sampling_steps = num_sampling_steps
        full = cosine_alphas_cumprod(num_train_timesteps)
        self.training_chain = _Coefficients(full, torch.arange(num_train_timesteps))
        self.timesteps = respaced_timesteps(num_sampling_steps, num_train_timesteps, spacing)
        self.sampling = _Coefficients(full[self.timesteps], self.timesteps)

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self, eps_fn: StepEpsFn, x_t: torch.Tensor, step_noise: torch.Tensor,
               temperature: float = 1.0) -> Trajectory:
        """Denoise x_T [N, C] through every respaced step; step_noise [S, N, C] is the noise of each step (index
        s as in `Trajectory`; step 0's is unused); temperature scales that noise only."""
        coef = self.sampling
        log_variances = []
        mean = x_t
        for s in reversed(range(self.num_sampling_steps)):
            t = torch.full((x_t.shape[0],), int(coef.timesteps[s]), device=x_t.device, dtype=torch.long)
            mean, log_variance = coef.p_mean_log_variance(eps_fn(x_t, t, s), x_t, s)
            log_variances.append(log_variance)
            x_t = mean if s == 0 else mean + torch.exp(0.5 * log_variance) * step_noise[s] * temperature
        return Trajectory(x0=x_t, log_variances=torch.stack(log_variances[::-1]), last_mean=mean)

    # ------------------------------------------------------------------------------------------ training
    def training_loss(self, eps_fn: EpsFn, x0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-token loss [N]: eps MSE + the variational-bound term for the learned variance (the mean is
        stop-gradiented in that term), at a uniform timestep per token (the official `training_losses`)."""
        n, c = x0.shape
        t = torch.randint(0, self.num_train_timesteps, (n,), generator=generator).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device, x0.dtype)
        coef = self.training_chain
        ab = coef.alphas_cumprod.to(x0.device, x0.dtype)[t].unsqueeze(-1)
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        out = eps_fn(x_t, t)
        eps, v = out[:, :c], out[:, c:]
        mse = ((noise - eps) ** 2).mean(-1)
        mean, log_variance = coef.p_mean_log_variance(torch.cat([eps.detach(), v], -1), x_t, t)
        true_mean, true_log_variance = coef.posterior(x0, x_t, t)
        kl = normal_kl(true_mean, true_log_variance, mean, log_variance).mean(-1) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_variance).mean(-1) / math.log(2.0)
        return mse + torch.where(t == 0, nll, kl)


class _Coefficients:
    """Posterior and model-mean coefficients of one (possibly respaced) chain with cumulative alphas [S] at
    original timesteps [S]; index with chain positions (ints or [N] tensors)."""

    def __init__(self, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> None:
        prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        betas = 1 - alphas_cumprod / prev
        self.timesteps, self.alphas_cumprod = timesteps, alphas_cumprod
        variance = betas * (1 - prev) / (1 - alphas_cumprod)
        self.log_variance_clipped = torch.log(torch.cat([variance[1:2], variance[1:]]))  # min of the learned range
        self.log_betas = torch.log(betas)  # max of the learned range
        self.coef_x0 = betas * prev.sqrt() / (1 - alphas_cumprod)
        self.coef_xt = (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod)
        self.recip = (1 / alphas_cumprod).sqrt()
        self.recipm1 = (1 / alphas_cumprod - 1).sqrt()

    def _at(self, values: torch.Tensor, index, like: torch.Tensor) -> torch.Tensor:
        picked = values[index] if isinstance(index, int) else values.to(like.device)[index].unsqueeze(-1)
        return picked.to(like.device, like.dtype) if isinstance(index, int) else picked.to(like.dtype)

    def posterior(self, x0: torch.Tensor, x_t: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
        """q(x_{t-1} | x_t, x0): mean and clipped log-variance."""
        mean = self._at(self.coef_x0, index, x0) * x0 + self._at(self.coef_xt, index, x0) * x_t
        return mean, self._at(self.log_variance_clipped, index, x0).expand_as(x0)

    def p_mean_log_variance(self, model_out: torch.Tensor, x_t: torch.Tensor,
                            index) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's p(x_{t-1} | x_t) from its output [N, 2C] = (eps, v): x0 from eps (not clipped), the
        posterior mean, and log-variance v' log(beta) + (1 - v') log(posterior variance) with v' = (v + 1) / 2."""
        c = x_t.shape[-1]
        eps, v = model_out[:, :c], model_out[:, c:]
        x0 = self._at(self.recip, index, x_t) * x_t - self._at(self.recipm1, index, x_t) * eps
        frac = (v + 1) / 2
        log_variance = frac * self._at(self.log_betas, index, x_t) + (1 - frac) * self._at(
            self.log_variance_clipped, index, x_t)
        mean, _ = self.posterior(x0, x_t, index)
        return mean, log_variance


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N1 || N2) elementwise for diagonal Gaussians given by means and log-variances."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_std_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Log-likelihood of x under a Gaussian discretised into 255 bins of [-1, 1] (the official t = 0 term)."""
    centred = x - mean
    inv_stdv = torch.exp(-log_scale)
    cdf_plus = _approx_std_normal_cdf(inv_stdv * (centred + 1.0 / 255.0))
    cdf_min = _approx_std_normal_cdf(inv_stdv * (centred - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_probs = torch.where(x < -0.999, log_cdf_plus, torch.where(
        x > 0.999, log_one_minus_cdf_min, torch.log((cdf_plus - cdf_min).clamp(min=1e-12))))
    return log_probs

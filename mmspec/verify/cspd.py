"""CSpD's continuous acceptance rule (continuous speculative decoding for diffusion-head AR models), batched.

Draft (q) and target (p) heads denoise each window token from the SAME x_T with the SAME per-step noise
(trajectory alignment); the Gaussian exponents of the steps before the last cancel, which leaves (the CSpD
paper, arXiv 2411.11925), per token with diagonal covariances:
```
log r = F + log N(x0; mu_p, Sigma_p) - log N(x0; mu_q, Sigma_q)       (last step's Gaussians)
F     = sum over the other steps of 0.5 (log |Sigma_q| - log |Sigma_p|)   (the variance-ratio "step factor")
accept the draft token x0 if U < min(1, r); tokens after the first rejection are discarded
residual: y ~ N(mu_p, Sigma_p), kept with probability max(0, 1 - N_q(y) / (e^F N_p(y)))  (acceptance-rejection)
```
It is an approximation (the paper shows FID parity empirically), not an exact guarantee. The public reference code
(MarkXCloud/CSpD, `spec_decode/spec_decode_runner.py`) departs from the paper in three ways, each a named option here
(`CSpDRule.reference_code()` sets all three):
- `distance_scale=42`: its acceptance ratio divides each standardised distance (x - mu) / sigma by 42 BEFORE squaring,
  so the Gaussians' squared-distance terms are divided by 42^2 = 1764 (the normalising constants are not softened).
  Its residual sampler uses the UNsoftened densities, and so does this rule's residual, whatever the option;
- `invert_variance_factor`: it multiplies by prod sigma_p / sigma_q over the steps before the last, i.e. uses -F;
- `independent_checks`: it verifies every window token on its own (a rejected token gets a residual sample, later
  tokens are still checked).
The code leaves a zero token when its residual sampler gives up after 100 tries; this rule never does: it falls back
to the target's own token (the target's exact sample on the shared trajectory) and counts it.

Glossary: *accepted* = draft tokens kept; *residual* = the token sampled in place of the first rejected one;
*fallback* = a residual that fell back to the target's own token. No bonus token: when every window token is
accepted the row emits the window.

    rule = CSpDRule()
    rand = ContinuousRandomness.draw(B, K, max_tries, C, generator)
    result = rule.verify(draft, target, num_draft, rand)    # tokens [B, K, C], num_accepted [B], fallback [B, K]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmspec.errors import check, check_positive_int
from mmspec.sampling import Generators, uniform
from mmspec.verify.base import VerifyResult


@dataclass
class GaussianPath:
    """One model's denoising of a window: tokens x0 [B, K, C], the summed log-determinant of its steps before the
    last, sum_t sum_c log sigma^2 [B, K], and the last step's Gaussian: mean [B, K, C], log-variance [B, K, C]."""

    x0: torch.Tensor
    log_det_steps: torch.Tensor
    last_mean: torch.Tensor
    last_log_variance: torch.Tensor


@dataclass
class ContinuousRandomness:
    """Pre-drawn randomness of one verify call: acceptance uniforms [B, K], residual proposals' standard normals
    [B, K, T, C] and their uniforms [B, K, T] (T = max residual tries)."""

    uniforms: torch.Tensor
    residual_normals: torch.Tensor
    residual_uniforms: torch.Tensor

    @staticmethod
    def draw(batch: int, positions: int, max_tries: int, channels: int, generator: Generators = None,
             device: torch.device | str = "cpu") -> ContinuousRandomness:
        """Row b's numbers come from generator b when a list is given (batch-independent)."""
        u = uniform((batch, positions), generator, device)
        normals = torch.erfinv(2 * uniform((batch, positions, max_tries, channels), generator, device) - 1)
        return ContinuousRandomness(u, (normals * math.sqrt(2)).clamp(-12, 12),
                                    uniform((batch, positions, max_tries), generator, device))


@dataclass
class ContinuousVerifyResult(VerifyResult):
    """VerifyResult with continuous tokens: output_tokens [B, K, C] (the first `num_emitted` of each row count),
    emitted [B] (accepted + 1 residual, or the whole window when all were accepted; the window with independent
    checks), fallback [B, K] (residual positions that fell back to the target's token), residual [B, K]."""

    emitted: torch.Tensor | None = None
    fallback: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.emitted


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, log_variance: torch.Tensor,
                         distance_scale: float = 1.0) -> torch.Tensor:
    """log N(x; mean, diag(exp(log_variance))) over the last dim; with distance_scale s the standardised distance
    (x - mean) / sigma is divided by s before squaring (the squared term by s^2; normalising constant unchanged)."""
    squared = ((x - mean) ** 2 * torch.exp(-log_variance)).sum(-1)
    return -0.5 * (squared / distance_scale ** 2 + log_variance.sum(-1) + x.shape[-1] * math.log(2 * math.pi))


class CSpDRule:
    """The paper's criterion by default; the reference code's variants as options (see the module docstring)."""

    name = "cspd"

    def __init__(self, distance_scale: float = 1.0, invert_variance_factor: bool = False,
                 independent_checks: bool = False, max_residual_tries: int = 100) -> None:
        check(isinstance(distance_scale, (int, float)) and distance_scale > 0,
              f"distance_scale must be a number > 0 (1 = the paper's criterion), got {distance_scale!r}.")
        check_positive_int("max_residual_tries", max_residual_tries)
        self.distance_scale = float(distance_scale)
        self.invert_variance_factor = bool(invert_variance_factor)
        self.independent_checks = bool(independent_checks)
        self.max_residual_tries = int(max_residual_tries)

    @classmethod
    def reference_code(cls) -> CSpDRule:
        """The public code's criterion: standardised distances / 42 (squared terms / 1764) in the acceptance ratio,
        inverted variance factor, independent window checks."""
        return cls(distance_scale=42.0, invert_variance_factor=True, independent_checks=True)

    def config(self) -> dict:
        return {"name": self.name, "distance_scale": self.distance_scale,
                "invert_variance_factor": self.invert_variance_factor, "independent_checks": self.independent_checks,
                "max_residual_tries": self.max_residual_tries}

    def step_factor(self, draft: GaussianPath, target: GaussianPath) -> torch.Tensor:
        """F [B, K] in log space."""
        factor = 0.5 * (draft.log_det_steps - target.log_det_steps)
        return -factor if self.invert_variance_factor else factor

    def log_ratio(self, draft: GaussianPath, target: GaussianPath) -> torch.Tensor:
        """log r [B, K] of the draft tokens."""
        s = self.distance_scale
        return (self.step_factor(draft, target)
                + gaussian_log_density(draft.x0, target.last_mean, target.last_log_variance, s)
                - gaussian_log_density(draft.x0, draft.last_mean, draft.last_log_variance, s))

    def residual_keep_probability(self, draft: GaussianPath, target: GaussianPath, y: torch.Tensor) -> torch.Tensor:
        """max(0, 1 - N_q(y) / (e^F N_p(y))) [B, K, T] for proposals y [B, K, T, C] of every window position, with
        the unsoftened last-step densities (the paper; the public code's residual sampler too)."""
        log_q = gaussian_log_density(y, draft.last_mean.unsqueeze(2), draft.last_log_variance.unsqueeze(2))
        log_p = gaussian_log_density(y, target.last_mean.unsqueeze(2), target.last_log_variance.unsqueeze(2))
        excess = log_q - self.step_factor(draft, target).unsqueeze(-1) - log_p  # log(N_q / (e^F N_p)) [B, K, T]
        return -torch.expm1(excess.clamp_max(0))

    def residual(self, draft: GaussianPath, target: GaussianPath,
                 rand: ContinuousRandomness) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual token for every window position [B, K, C] and whether it fell back [B, K]: proposals
        y ~ N(mu_p, Sigma_p), the first one kept (acceptance-rejection), else the target's own token."""
        std = torch.exp(0.5 * target.last_log_variance).unsqueeze(2)  # [B, K, 1, C]
        y = target.last_mean.unsqueeze(2) + std * rand.residual_normals.to(std.dtype)  # [B, K, T, C]
        keep_prob = self.residual_keep_probability(draft, target, y)  # [B, K, T]
        kept = rand.residual_uniforms.to(keep_prob.dtype) < keep_prob  # [B, K, T]
        found = kept.any(-1)  # [B, K]
        first = kept.to(torch.int8).argmax(-1)  # [B, K]
        picked = y.gather(2, first[..., None, None].expand(-1, -1, 1, y.shape[-1])).squeeze(2)  # [B, K, C]
        return torch.where(found.unsqueeze(-1), picked, target.x0), ~found

    def verify(self, draft: GaussianPath, target: GaussianPath, num_draft: torch.Tensor,
               rand: ContinuousRandomness) -> ContinuousVerifyResult:
        """Accept or replace the window tokens of every row (ragged windows: num_draft [B] <= K). Pure tensor
        code: no host synchronisation."""
        b, k = draft.log_det_steps.shape
        in_window = torch.arange(k, device=num_draft.device) < num_draft.unsqueeze(-1)  # [B, K]
        log_r = self.log_ratio(draft, target)  # [B, K]
        ok = (torch.log(rand.uniforms.to(log_r.dtype).clamp_min(1e-300)) < log_r.clamp_max(0)) & in_window
        residual, gave_up = self.residual(draft, target, rand)
        if self.independent_checks:
            flags = ok
            replaced = in_window & ~ok  # [B, K]
            emitted = num_draft
        else:
            flags = torch.cumprod(ok.long(), -1).bool()  # accepted prefix
            accepted = flags.sum(-1)
            replaced = torch.arange(k, device=num_draft.device) == accepted.unsqueeze(-1)
            replaced = replaced & in_window
            emitted = torch.minimum(accepted + 1, num_draft)
        tokens = torch.where(replaced.unsqueeze(-1), residual, draft.x0)  # [B, K, C]
        return ContinuousVerifyResult(output_tokens=tokens, num_accepted=flags.sum(-1), accepted_flags=flags,
                                      num_drafted=num_draft, emitted=emitted, fallback=replaced & gave_up,
                                      residual=replaced)

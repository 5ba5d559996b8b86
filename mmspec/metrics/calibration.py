"""How closely sampled tokens follow the target model's distribution, measured from the tokens alone.

Image judges and FID see whole images; they cannot tell a sampler that is exact from one that bends each token's
distribution a little (relaxed acceptance: LANTERN, GSD). This measure works per token. For every generated token
x_t, let p_t be the distribution the target would have sampled it from given the same prefix (what a
teacher-forced target pass over the finished sequence gives: CFG, temperature, top-k/p applied). Its randomised
probability integral transform (PIT) is

    u_t = p_t(tokens ranked before x_t) + V_t p_t(x_t),   V_t ~ U(0, 1),

with the vocabulary ranked by p_t, most likely first (ties by token id). For an exact sampler every u_t is U(0, 1)
given its prefix, so the u of all tokens of all images are i.i.d. uniform whatever the prompts: a test with a known
null distribution, which lossless methods must pass at any temperature > 0.

Figures (`TokenCalibration.figures`):
- `pit_ks`: Kolmogorov-Smirnov distance of the pooled u from U(0, 1). It is a lower bound on the mean per-token
  total variation between the sampler's and the target's distributions (each token's CDF gap is the mass of a
  set of tokens). An exact sampler gives about 0.87 / sqrt(n) on average.
- `pit_ks_pvalue`: the asymptotic p-value of that distance under exactness.
- `pit_ks_stratified`: the same distance within strata of tokens whose target distributions have similar top
  probabilities (`STRATA_EDGES`), averaged with the strata's token shares. Pooling lets opposite distortions
  cancel (a rule that sharpens peaked distributions and flattens flat ones can keep the pooled u uniform); within
  a stratum they cannot, and the average is still a lower bound on the mean per-token total variation.
  `pit_ks_stratified_null` is its expected value for an exact sampler with the same strata sizes (it is larger
  than the pooled null, so compare the two).
- `pit_mean_shift`: mean u - 0.5; below 0 the sampler favours the target's likely tokens, above 0 unlikely ones.
- `excess_surprisal`: mean of -log p_t(x_t) - H(p_t) in nats over tokens inside the target's support; 0 in
  expectation for an exact sampler (equal to KL(r || p) + H(r) - H(p) for a sampler r).
- `off_support`: fraction of tokens the target gives probability 0 (outside its top-k / top-p set).
- `calibration_tokens`: n, the number of tokens measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from mmspec.errors import check
from mmspec.sampling import Generators, uniform


def pit_values(p: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Randomised PIT of `tokens` [...] under p [..., V] with the vocabulary ranked most likely first; v [...] are
    the U(0, 1) draws that spread each token's mass. Returns u [...] in [0, 1]."""
    p = p.float()
    p_x = p.gather(-1, tokens.unsqueeze(-1))  # [..., 1]
    ids = torch.arange(p.shape[-1], device=p.device)
    before = (p > p_x) | ((p == p_x) & (ids < tokens.unsqueeze(-1)))  # [..., V] ranked ahead of x
    return ((p * before).sum(-1) + v * p_x.squeeze(-1)).clamp(0.0, 1.0)


def kolmogorov_pvalue(distance: float, n: int) -> float:
    """Asymptotic P(D_n >= distance) for the one-sample Kolmogorov-Smirnov distance of n i.i.d. draws (with the
    usual small-sample correction of the scale)."""
    if n <= 0:
        return float("nan")
    root = math.sqrt(n)
    lam = (root + 0.12 + 0.11 / root) * distance
    if lam < 0.2:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return float(min(1.0, max(0.0, 2.0 * total)))


# strata of the target's top probability max_y p_t(y) for `pit_ks_stratified`
STRATA_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9)
KS_NULL_MEAN = 0.8687  # E[sqrt(n) D_n] for large n: sqrt(pi / 2) ln 2


def ks_uniform(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the empirical distribution of u (1-D) and U(0, 1)."""
    n = u.numel()
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64, device=u.device)
    return float(torch.maximum(i / n - s, s - (i - 1) / n).max())


class TokenCalibration:
    """Accumulates PIT values and surprisals over batches of (target distributions, sampled tokens).

        cal = TokenCalibration()
        cal.add(p, tokens, generator)   # p [B, T, V] teacher-forced target distributions, tokens [B, T]
        cal.figures()                   # {"pit_ks": ..., "pit_ks_pvalue": ..., ...}
    """

    def __init__(self) -> None:
        self.u: list[torch.Tensor] = []
        self.top: list[torch.Tensor] = []  # the target's top probability at each token
        self.excess: list[torch.Tensor] = []
        self.off_support = 0

    def add(self, p: torch.Tensor, tokens: torch.Tensor, generator: Generators = None) -> None:
        check(p.dim() == tokens.dim() + 1 and p.shape[:-1] == tokens.shape,
              f"p must be [..., V] over tokens [...]; got p {tuple(p.shape)} and tokens {tuple(tokens.shape)}.")
        check(bool(((tokens >= 0) & (tokens < p.shape[-1])).all()),
              f"tokens must be ids in [0, {p.shape[-1]}) (a finished generation).")
        p = p.float()
        v = uniform(tokens.shape, generator, device=p.device)  # [...]
        self.u.append(pit_values(p, tokens, v).flatten().cpu())
        self.top.append(p.amax(-1).flatten().cpu())
        p_x = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [...]
        inside = p_x > 0
        self.off_support += int((~inside).sum())
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [...]
        self.excess.append((-p_x[inside].log() - entropy[inside]).cpu())

    @property
    def num_tokens(self) -> int:
        return sum(u.numel() for u in self.u)

    def figures(self) -> dict[str, float]:
        n = self.num_tokens
        check(n > 0, "no tokens were added to the calibration measure.")
        u = torch.cat(self.u)
        excess = torch.cat(self.excess)
        ks = ks_uniform(u)
        stratum = torch.bucketize(torch.cat(self.top), torch.tensor(STRATA_EDGES[1:]), right=True)  # [n]
        stratified = null = 0.0
        for index in stratum.unique():
            members = u[stratum == index]
            share = members.numel() / n
            stratified += share * ks_uniform(members)
            null += share * KS_NULL_MEAN / members.numel() ** 0.5
        return {"pit_ks": ks, "pit_ks_pvalue": kolmogorov_pvalue(ks, n), "pit_ks_stratified": stratified,
                "pit_ks_stratified_null": null, "pit_mean_shift": float(u.mean()) - 0.5,
                "excess_surprisal": float(excess.mean()) if excess.numel() else float("nan"),
                "off_support": self.off_support / n, "calibration_tokens": float(n)}


def calibration_figures(scored: Iterable[tuple[torch.Tensor, torch.Tensor]], seed: int = 0) -> dict[str, float]:
    """`TokenCalibration.figures` over (p [..., V], tokens [...]) pairs, e.g. one per batch of finished sequences;
    the PIT's spreading draws come from one CPU generator seeded by `seed` (a bench uses the same for every
    method). Returns {} when no tokens were given."""
    cal = TokenCalibration()
    gen = torch.Generator().manual_seed(seed)
    for p, tokens in scored:
        cal.add(p.cpu(), tokens.cpu(), gen)
    return cal.figures() if cal.num_tokens else {}

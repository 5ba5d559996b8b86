"""Distribution checks for acceptance rules (used by the tests; handy for testing a custom rule).

The lossless property is checked the way vLLM does: sample many times in one batched call and compare the
empirical distribution of emitted tokens to the target with the total-variation distance.
"""

from __future__ import annotations

import torch


def empirical_distribution(tokens: torch.Tensor, vocab_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram of `tokens` (any shape) over [0, vocab_size), normalised; `mask` selects which to count."""
    flat = tokens.reshape(-1)
    if mask is not None:
        flat = flat[mask.reshape(-1)]
    counts = torch.bincount(flat[flat >= 0], minlength=vocab_size).double()
    return counts / counts.sum().clamp_min(1)


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total-variation distance 0.5 * sum |p - q| between two distributions over the last axis."""
    return float(0.5 * (p.double() - q.double()).abs().sum(-1).max())


def tv_tolerance(vocab_size: int, samples: int, sigmas: float = 6.0) -> float:
    """A generous bound on the TV between an exact-sampler's histogram and its distribution.

    E[TV] <= 0.5 * sqrt(V / n); the bound adds `sigmas` standard deviations of slack so a correct rule
    essentially never fails, while typical bugs (wrong residual, missing renormalisation) overshoot it.
    """
    return 0.5 * (vocab_size / samples) ** 0.5 * (1 + sigmas / vocab_size ** 0.5)


def prefix_pairs(rows: list[list[int]], positions: range | list[int]) -> list[list]:
    """[prefix, next] pairs for `pooled_chi_square` from sampled token rows: for each row and each position j, the
    tuple of its first j tokens and its token j (the law of a later token, given everything before it)."""
    return [[tuple(row[:j]), row[j]] for row in rows for j in positions if j < len(row)]


def pooled_chi_square(pairs: list[list], next_probs) -> tuple[float, int]:
    """Chi-square of sampled second tokens against the target's conditional law, pooled over first tokens:
    pairs = [first, second] per row (first may be any sortable key, e.g. a prefix tuple from `prefix_pairs`);
    next_probs(first) -> the target's probabilities [V] of the second token.
    First tokens with < 20 samples are skipped; bins expecting < 5 are merged. Returns (chi2, degrees of freedom)."""
    import numpy as np

    chi2, dof = 0.0, 0
    for first in sorted({p[0] for p in pairs}):
        seconds = [p[1] for p in pairs if p[0] == first]
        if len(seconds) < 20:
            continue
        probs = np.asarray(next_probs(first), dtype=np.float64)
        counts = np.bincount(seconds, minlength=probs.shape[0])
        expected = probs * len(seconds)
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        chi2 += float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    return chi2, dof


def assert_fits_law_not_control(pairs: list[list[int]], law, control_temperature: float, min_dof: int = 1,
                                alpha: float = 1e-3) -> None:
    """AssertionError unless sampled (first, second) token pairs fit `law(1.0)` (pooled chi-square p > alpha with
    at least `min_dof` degrees of freedom) and do not fit `law(control_temperature)` (p < alpha): the negative
    control shows the test could tell. law(temperature) -> next_probs(first) as `pooled_chi_square` takes."""
    from scipy import stats

    chi2, dof = pooled_chi_square(pairs, law(1.0))
    assert dof >= min_dof and stats.chi2.sf(chi2, dof) > alpha, (chi2, dof)
    chi2, dof = pooled_chi_square(pairs, law(control_temperature))
    assert stats.chi2.sf(chi2, dof) < alpha, ("the negative control passed", chi2, dof)

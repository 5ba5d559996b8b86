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

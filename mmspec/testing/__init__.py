"""Small models and helpers for tests and examples: a toy causal transformer target, toy drafters, and
distribution checks for acceptance rules, seeded generators. Nothing here is needed at inference time."""

import torch


def seeded_generators(n: int, offset: int = 0) -> list[torch.Generator]:
    """One CPU generator per row, seeded offset, offset + 1, ...: row i's randomness does not depend on the batch
    it is generated in, so a row alone (`offset=i`) reproduces that row of a batch."""
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]

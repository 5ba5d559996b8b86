"""Small models and helpers for tests and examples: a toy causal transformer target, toy drafters, and
distribution checks for acceptance rules. Nothing here is needed at inference time."""

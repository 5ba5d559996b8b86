"""A draft budget for tests: it walks through fixed sizes (plain steps `0`, chain sizes or `TreeShape`s) in turn, so
a test exercises every path of the loop's variable draft sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CyclingBudget:
    """Chooses sizes[0], sizes[1], .. in a cycle; learns nothing."""

    def __init__(self, sizes: Sequence[Any]) -> None:
        self.sizes, self.step = list(sizes), 0

    def choose(self, batch: int) -> Any:
        self.step += 1
        return self.sizes[(self.step - 1) % len(self.sizes)]

    def observe(self, result, active, draft=None) -> None:
        pass

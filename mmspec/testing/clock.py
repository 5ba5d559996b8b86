"""A modelled clock for tests of the draft budget: inside `modelled_clock`, `time.perf_counter` reads the seconds
that the given modules' forwards would take under a fixed cost model and nothing else takes time, so a budget that
times its steps decides from the work done, never from the machine's speed or load (the same decisions on a quiet
and a busy machine, run after run).

    blocks = {block: (1e-4, 1e-6) for block in pipe.transformer.layers}   # 0.1 ms + 1 us per position
    with modelled_clock(blocks):
        pipe(class_labels=[1, 2], method="sjd")                             # budget="auto" decides on this clock

A forward of a module costs `fixed + per_position x positions`, its positions being the elements of its first
tensor input without the last dimension (a block's hidden states [B, S, D]: B x S).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

import torch
from torch import nn


def input_positions(args: tuple, kwargs: dict) -> int:
    """B x S of the first tensor among a forward's inputs ([B, S, D] hidden states; a 1-d tensor counts as one row)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.numel() // max(1, value.shape[-1])) if value.dim() > 1 else 1
    return 1


@contextlib.contextmanager
def modelled_clock(costs: Mapping[nn.Module, tuple[float, float]]) -> Iterator[list[float]]:
    """Replace `time.perf_counter` by the modelled clock of `costs` (module -> (fixed, per_position) seconds) while
    the block runs; yields the one-element list holding the clock's reading (tests may read or advance it)."""
    now = [0.0]

    def charge(cost: tuple[float, float]):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            now[0] += cost[0] + cost[1] * input_positions(args, kwargs)
        return hook

    handles = [module.register_forward_pre_hook(charge(cost), with_kwargs=True) for module, cost in costs.items()]
    real = time.perf_counter
    time.perf_counter = lambda: now[0]
    try:
        yield now
    finally:
        time.perf_counter = real
        for handle in handles:
            handle.remove()

"""Profile runners of mmspec's cached models (`mmspec profile`, the families' profile hooks): `run_forward(batch,
width)` callables that `mmspec.profiling.measure_forward_times` times, built the way the loop runs each model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmspec.lm import GuidedRunner, prefill_prompt
from mmspec.profiling import RunForward, feature_pairs_step, runner_per_batch


def lm_forward_runner(model, make_inputs: Callable[[int], object], guidance_scale: float | None = None,
                      prefill_fn=None, max_width: int = 64) -> RunForward:
    """`run_forward` of a `mmspec.lm.CachedLM` the way the loop runs it: per batch size, one prefill of
    `make_inputs(batch)` (with `prefill_fn`, default a token prompt; CFG as one 2B batch when `guidance_scale` is
    set), then each timed call scores `width` new tokens after that prefix without committing them."""
    def start(batch: int) -> GuidedRunner:
        runner = GuidedRunner(model, guidance_scale, prefill_fn or prefill_prompt)
        runner.prefill(make_inputs(batch), max_width + 1)
        return runner

    def step(runner: GuidedRunner, width: int) -> None:
        slots = runner.slots(width)  # [B, W]
        runner.forward(torch.zeros_like(slots), slots, slots)

    return runner_per_batch(start, step, max_width)


def feature_forward_runner(model, feature_dim: int, prefix: int, guidance_scale: float | None = None,
                           max_width: int = 64) -> RunForward:
    """`run_forward` of an EAGLE-style drafter (a CachedLM whose `forward_cached` also takes `features=` [R, W,
    feature_dim], the target's) the way its tree drafter runs it: per batch size, a cache of `prefix` committed
    entries (an image or answer part drafted; CFG as 2B rows when `guidance_scale` is set) and room for `max_width`
    more, then each timed call scores `width` new (token, feature) pairs after it, uncommitted. The features are
    zeros: a forward's cost does not depend on their values."""
    def start(batch: int) -> GuidedRunner:
        runner = GuidedRunner(model, guidance_scale)
        rows = batch * (2 if runner.uses_cfg else 1)
        runner.cache = model.new_cache(rows, prefix + max_width + 1)
        runner.cache.lengths += prefix
        return runner

    return runner_per_batch(start, feature_pairs_step(feature_dim), max_width)

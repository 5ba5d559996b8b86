"""Paired call-by-call timing of the embedded LlamaGen (class-conditional, or `--t2i` on five captions): vanilla and
each configuration alternated call by call in a seeded shuffled order, in one process, after two warm-up rounds.
Prints each configuration's time against vanilla's over all its calls (with a bootstrap 95% interval over rounds),
and apart over the calls its draft budget ran without the drafter (the call gate) and those that drafted: what a
default-path call costs where drafting does not pay, which a bench cell of a few calls cannot separate from the
machine's noise.

A configuration is `METHOD`, `METHOD@BUDGET` or `METHOD@BUDGET:KEY=VALUE:..`: with `fixed` the keys are the method's
(`eagle@fixed:top_k=1:depth=2:total_tokens=3`, a chain of 2), with `auto` they are `BudgetConfig` fields
(`eagle@auto:decay=0.97`: the budget with one constant changed). `METHOD@forced:STEP` runs the default budget made to
draft STEP at every step (`mmspec.testing.budgets.forced_budget`: `eagle@forced:chain2`; its own work runs as usual),
so that against `@fixed` of the same size it times what the budget itself costs.

    python scripts/paired_calls.py --batch-size 8 --rounds 60 --methods sjd,eagle,draft-model --threads 2
    python scripts/paired_calls.py --t2i --batch-size 1 --rounds 40 --threads 2 \
        --methods eagle,eagle@fixed:top_k=1:depth=2:total_tokens=3,eagle@auto:decay=0.97,eagle@forced:chain2
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch

from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.bench.configs import parse_value
from mmspec.budget import BudgetConfig
from mmspec.testing.budgets import CallScript, forced_budget

CAPTIONS = ("a small red circle in the center on a black background", "two blue squares",
            "a green triangle on the left", "a yellow circle and a red square", "three small white dots")


def call_options(config: str) -> tuple[dict, str | None]:
    """(the pipeline arguments of a configuration, the step `@forced:STEP` forces or None; see the module
    docstring)."""
    method, _, budget = config.partition("@")
    mode, *pairs = budget.split(":") if budget else [None]
    if mode == "forced":
        return {"method": method}, pairs[0]
    values = {k: parse_value(v) for k, v in (pair.split("=") for pair in pairs)}
    if mode == "auto" and values:
        return {"method": method, "budget": BudgetConfig(**values)}, None
    return {"method": method, "budget": mode, "method_kwargs": values or None}, None


def ratio(vanilla: list[float], method: list[float], calls: list[int]) -> float:
    return sum(vanilla[i] for i in calls) / sum(method[i] for i in calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--methods", default="sjd,eagle,draft-model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: assets/llamagen, or assets/llamagen-t2i with --t2i")
    parser.add_argument("--t2i", action="store_true", help="text-to-image LlamaGen on five captions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = LlamaGenPipeline.from_pretrained(args.model or f"assets/llamagen{'-t2i' if args.t2i else ''}")
    pipe.set_progress_bar_config(disable=True)
    configs = ["vanilla", *args.methods.split(",")]
    options = {config: call_options(config) for config in configs}  # (a bad configuration fails before any call)
    times: dict[str, list[float]] = {c: [] for c in configs}
    gated: dict[str, list[bool]] = {c: [] for c in configs}
    rng, b = random.Random(0), args.batch_size
    for r in range(args.rounds + 2):  # two warm-up rounds
        order = configs[:]
        rng.shuffle(order)
        for config in order:
            generators = [torch.Generator().manual_seed(1000 * r + i) for i in range(b)]
            condition = ({"prompt": [CAPTIONS[(r * b + i) % len(CAPTIONS)] for i in range(b)]} if args.t2i
                         else {"class_labels": [(r * b + i) % 10 for i in range(b)]})
            arguments, forced = options[config]
            with forced_budget(CallScript(steps=(forced,))) if forced else contextlib.nullcontext():
                start = time.perf_counter()
                out = pipe(**condition, temperature=1.0, top_k=64, generator=generators, output_type="latent",
                           **arguments)
                seconds = time.perf_counter() - start
            if r >= 2:
                times[config].append(seconds)
                gated[config].append(bool(out.stats.extra.get("calls_without_drafter", 0)))
    vanilla = times["vanilla"]
    boot = random.Random(1)
    samples = [[boot.randrange(args.rounds) for _ in range(args.rounds)] for _ in range(2000)]
    for config in configs[1:]:
        spread = sorted(ratio(vanilla, times[config], s) for s in samples)
        line = (f"{config}: {ratio(vanilla, times[config], list(range(args.rounds))):.3f}x of vanilla "
                f"(95% {spread[50]:.3f}-{spread[1950]:.3f}) over {args.rounds} calls")
        for name, want in (("without the drafter", True), ("drafting", False)):
            calls = [i for i, g in enumerate(gated[config]) if g == want]
            if calls:
                line += f"; {len(calls)} {name}: {ratio(vanilla, times[config], calls):.3f}x"
        print(line)


if __name__ == "__main__":
    main()

"""The draft budget on a simulated device: real EAGLE-2 draft trees (`mmspec.tree.expand_eagle2`), the real greedy
rule, and a clock that advances by a table of step costs instead of the machine's time. How the budget's model is
checked on devices this machine is not (a GPU, where a verify costs about the same at any width), whatever the
machine's speed or load.

The drafter ranks the tokens the same way at every node (token r is its rank-r candidate); at each tree node the
target's greedy next token is the drafter's rank-r candidate with probability `rank_rates[r]`, else a token the
drafter never proposes. A chain accepts position j with rate rank_rates[0]; a tree also keeps the paths through
lower-ranked children, which only a device where wide verifies are cheap pays for.

    full, rates = TreeShape(10, 6, 60), (0.55, 0.2, 0.1)
    auto, chosen = simulate(full, gpu_like, rates, tokens=256, calls=6)   # tokens per plain step's time, steps
    fixed, _ = simulate(full, gpu_like, rates, tokens=256, calls=3, fixed=TreeShape(10, 3, 16))
    noisy = SimulatedClock(step_noise=0.3, call_load=0.15)                 # the budget times its steps on it
    auto, chosen = simulate(full, cpu_like, rates, tokens=64, calls=40, clock=noisy)

    python -m mmspec.testing.simulated_device    # auto against the best fixed shape on each device
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace

import torch

from mmspec.budget import BudgetCall, BudgetConfig, ThroughputBudget, menu_of
from mmspec.loop import DecodeState
from mmspec.stats import SpecStats
from mmspec.testing.clock import modelled_clock
from mmspec.tree import PLAIN, DraftTree, TreeShape, expand_eagle2
from mmspec.verify import VerifyResult, accept

VOCAB = 32  # the simulated vocabulary; the last token is never a candidate
RankRates = Sequence[float] | Callable[[float], Sequence[float]]  # fixed, or by the call's progress in [0, 1)


def gpu_like(shape: TreeShape) -> float:
    """Plain steps a step costs where the verify is launch-bound: its width nearly free, each draft level a
    drafter forward."""
    return 1.0 if shape == PLAIN else 1.0 + 0.004 * shape.total + 0.05 * shape.depth


def cpu_like(shape: TreeShape) -> float:
    """Where the verify is compute-bound: every node costs (the world models on a 2-core CPU)."""
    return 1.0 if shape == PLAIN else 1.0 + 0.12 * (shape.total - 1) + 0.1 * shape.depth


def cpu_narrow(shape: TreeShape) -> float:
    """Where only a chain of 2 pays, and a little: 1.15x plain decoding at batch 1 under `NARROW_RATES` (the world
    LlamaGen-t2i EAGLE's standing on a 2-core CPU)."""
    return 1.0 if shape == PLAIN else 1.2 + 0.04 * (shape.total - 1) + 0.1 * shape.depth


def cpu_narrow_in_the_loop(shape: TreeShape) -> float:
    """`cpu_narrow` as the loop runs it: its trees take 1.6x their timed table (as the world t2i's did), chains not."""
    return cpu_narrow(shape) * (1.6 if shape.top_k > 1 else 1.0)


NARROW_FULL, NARROW_RATES = TreeShape(10, 5, 59), (0.5, 0.08, 0.04)  # the world t2i EAGLE's tree; rates near its own


def rank_scores(tokens: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
    """[B, F, V] the drafter's log-probs at every frontier node: token r ranked r-th, the same at every node."""
    return torch.linspace(1.0, 0.01, VOCAB).log().expand(*tokens.shape, VOCAB)


@cache
def rank_tree(shape: TreeShape) -> DraftTree:
    """The drafter's tree of `shape` (the same at every step: the scores do not depend on the context; read only)."""
    return expand_eagle2(torch.zeros(1, dtype=torch.long), rank_scores, top_k=shape.top_k, depth=shape.depth,
                         total_tokens=shape.total)


def simulated_step(shape: TreeShape, rates: Sequence[float],
                   generator: torch.Generator) -> tuple[int, DraftTree | None, VerifyResult | None]:
    """(tokens emitted, the draft, its verdict) of one batch-1 greedy step drafting `shape` (PLAIN: 1, None, None)."""
    if shape == PLAIN:
        return 1, None, None
    tree = rank_tree(shape)
    n = tree.tokens.shape[1]
    law = torch.tensor([*rates, max(0.0, 1.0 - sum(rates))])  # [R + 1] each rank, then "none of them"
    rank = torch.multinomial(law, n, replacement=True, generator=generator)  # [N] the target's token at each node
    truth = torch.where(rank == len(rates), VOCAB - 1, rank)  # [N]
    p = torch.nn.functional.one_hot(truth, VOCAB).float().unsqueeze(0)  # [1, N, V] greedy: one-hot argmax
    result = accept("greedy", tree, p)
    return int(result.num_accepted[0]) + 1, tree, result


def simulate(full: TreeShape, step_cost: Callable[[TreeShape], float], rank_rates: RankRates, tokens: int,
             calls: int, fixed: TreeShape | None = None, config: BudgetConfig | None = None,
             seed: int = 0, clock: SimulatedClock | None = None) -> tuple[float, dict[TreeShape, int]]:
    """(tokens per plain step's time, steps per option) over `calls` batch-1 calls of `tokens` tokens, a drafter of
    shape `full` under `budget="auto"` (one budget across the calls, its costs the table `step_cost` gives in
    plain steps, no timing of the machine) or one shape every step (`fixed`). With a `clock` the budget also times
    its steps (`BudgetConfig()`), on that clock; the speed returned is still tokens per unit of the steps' true cost."""
    generator = torch.Generator().manual_seed(seed)
    config = config or BudgetConfig(timing=clock is not None)
    options, keys, _ = menu_of(SimpleNamespace(full_shape=full), config)
    budget = None if fixed is not None else ThroughputBudget(options, keys, config,
                                                             costs=[step_cost(o) for o in options], full_key=full)
    steering = BudgetCall(budget, SpecStats())  # the loop's side of the budget, as `mmspec.loop.generate` has it
    work, chosen = 0.0, {}
    true_cost = clock.true if clock is not None and clock.true is not None else step_cost
    active = torch.ones(1, dtype=torch.bool)
    with clock.reading(seed) if clock is not None else contextlib.nullcontext():
        for _ in range(calls):
            steering.begin(None, None, DecodeState.new(1, tokens, "cpu"), "greedy")
            if clock is not None:
                clock.new_call()
            done = 0
            while done < tokens:
                rates = rank_rates(done / tokens) if callable(rank_rates) else rank_rates
                key = steering.choose(1, lambda done=done: torch.tensor([tokens - done]))  # None: `fixed`; 0: plain
                shape = fixed if key is None else PLAIN if key == 0 else key
                emitted, tree, result = simulated_step(shape, rates, generator)
                steering.observe(key, result, active, tree)
                done += min(emitted, tokens - done)
                cost = true_cost(shape)
                work += cost
                if clock is not None:
                    clock.advance(cost)
                chosen[shape] = chosen.get(shape, 0) + 1
            steering.end()
    return calls * tokens / work, chosen


@dataclass
class SimulatedClock:
    """The time a budget that times its steps reads in `simulate`: a step of shape s takes `true(s)` plain steps
    (its table's, `step_cost`, where None), times the call's load (log-normal, sd `call_load`, drawn per call)
    and a log-normal step noise (sd `step_noise`), as a shared machine's steps move (the world LlamaGen on a 2-core
    CPU: +-30% between runs minutes apart; its trees ran at 1.6-2x their timed table in the loop, chains near it)."""

    step_noise: float = 0.0
    call_load: float = 0.0
    true: Callable[[TreeShape], float] | None = None
    load: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    now: list[float] = field(default_factory=lambda: [0.0])  # the reading (`modelled_clock`'s)

    def new_call(self) -> None:
        self.load = math.exp(self.rng.gauss(0.0, self.call_load))

    def advance(self, cost: float) -> None:
        self.now[0] += cost * self.load * math.exp(self.rng.gauss(0.0, self.step_noise))

    @contextlib.contextmanager
    def reading(self, seed: int) -> Iterator[None]:
        """Inside the block `time.perf_counter` reads this clock (`mmspec.testing.clock.modelled_clock` with no
        module charged: from 0, its noise seeded by `seed`)."""
        self.rng = random.Random(seed)
        with modelled_clock({}) as self.now:
            yield


# fixed shapes the budget is compared with: chains and trees of EAGLE-2's top_k up to its full tree (10, 6, 60)
FIXED_SHAPES = ([TreeShape(1, d, d + 1) for d in (1, 2, 4, 8)]
                + [TreeShape(10, d, n) for d, n in ((2, 8), (3, 16), (4, 32), (6, 60))])


def best_fixed(full: TreeShape, step_cost: Callable[[TreeShape], float], rank_rates: RankRates,
               shapes: Sequence[TreeShape] = FIXED_SHAPES) -> tuple[float, TreeShape]:
    """(tokens per simulated second, shape) of the best of `shapes` drafted every step (3 calls of 256 tokens)."""
    return max((simulate(full, step_cost, rank_rates, tokens=256, calls=3, fixed=shape, seed=1)[0], shape)
               for shape in shapes)


def mean_nodes(chosen: dict[TreeShape, int]) -> float:
    """The mean node count of the drafting steps among `chosen` (steps per option, as `simulate` returns them)."""
    drafting = {shape: n for shape, n in chosen.items() if shape != PLAIN}
    return sum(shape.total * n for shape, n in drafting.items()) / max(1, sum(drafting.values()))


if __name__ == "__main__":
    full, rates = TreeShape(10, 6, 60), (0.55, 0.2, 0.1)
    for device in (gpu_like, cpu_like):
        auto, chosen = simulate(full, device, rates, tokens=256, calls=6)
        best, shape = best_fixed(full, device, rates)
        chains, _ = best_fixed(full, device, rates, [s for s in FIXED_SHAPES if s.top_k == 1])
        print(f"{device.__name__}: auto {auto:.3f} tokens a plain step's time, {auto / best:.0%} of the best fixed "
              f"shape ({shape}, {best:.3f}); chains alone {chains / best:.0%}; auto's drafting steps "
              f"{mean_nodes(chosen):.1f} nodes on average")
    for clock in (None, SimulatedClock(step_noise=0.3, call_load=0.15, true=cpu_narrow_in_the_loop)):
        best, shape = best_fixed(NARROW_FULL, cpu_narrow if clock is None else clock.true, NARROW_RATES)
        ratios = [simulate(NARROW_FULL, cpu_narrow, NARROW_RATES, tokens=64, calls=40, seed=seed, clock=clock)[0] / best
                  for seed in range(8)]
        print(f"cpu_narrow{' timed on a noisy clock' if clock else ''}: auto {sum(ratios) / 8:.0%} of the best fixed "
              f"shape ({shape}) over seeds 0-7 ({min(ratios):.0%}-{max(ratios):.0%}), 40 calls of 64 tokens each")

"""How much a tree drafter drafts each step: the draft budget of EAGLE-2 style feature drafters (LlamaGen's EAGLE /
LANTERN drafter, the VLM drafters). The chain and Jacobi budget is `mmspec.budget.AutoBudget`; facts:
../shared/reference/budgets.md (Sequoia's hardware-aware size, DySpec's score-ranked nodes).

A step drafts one `TreeShape` (top_k children per expanded node, depth drafted levels, total nodes with the root)
or nothing (`PLAIN`, a one-token step). The menu (`tree_menu`) holds the plain step, the drafter's greedy chains
of every depth (top_k 1) and its trees at smaller depths and node counts. Before every draft `TreeBudget` picks

    shape* = argmax_s E[tokens | s] / seconds(s)        seconds(s) = draft(top_k, depth) + step(total)

with draft() the drafter's `propose` and step() the target's verify plus the acceptance rule, both timed on this
device, at this batch size, on the call's own prefix (`TreeBudget.begin`, once per model pair, device, dtype,
threads, batch size and prefix length; cached by `mmspec.cost.cached_json`). Once a shape has run, its steps' own
measured seconds (the median of its last steps, from one choice to the next) replace the table, and shapes not run
yet (or not for STALE_AFTER choices: `MeasuredSteps.fresh_seen`) are scaled by how the run ones compare with the
table: neither a table timed under another load nor steps timed in a passing slow spell decide for ever.

E[tokens | s] comes from what earlier steps of the call accepted, counted again for every smaller shape the step's
tree contains (`counterfactual_accepts`): EAGLE-2 keeps the nodes of highest cumulative draft log-prob and builds
the levels the same way whatever the depth, so the tree of (top_k, d, n) is the first n - 1 nodes, by score, of the
drafted nodes at depth <= d, and a chain of depth d is the path of first children. Greedy verification walks the
target's argmax path, so the accepted length under the smaller shape is the leading part of the accepted path that
lies in it (exact at temperature 0; an estimate when sampling). A shape never contained in a recent step keeps its
older estimate. Chains are valued with a position model instead (`chain_rates`: per-depth acceptance given the
earlier depths, unseen depths at the deepest seen rate), so chains deeper than the drafter's own depth
(`max_chain_depth`) can be chosen and then measured. The first `warmup` steps and refresh steps (after
`refresh_every` steps, then at doubling intervals) draft the exploration shape: the shape containing the most trees
among those that cost at most `explore_cost` plain steps (the drafter's full shape where drafting is cheap), so
estimates are refreshed without paying for a shape the device cannot afford; shapes it does not contain count 1
token (a plain step) until chosen. A refresh while chains are being chosen drafts the deepest chain instead: a
chain of depth d says nothing about position d + 1, so without it one early miss at a deep position (the end of
an answer) would keep every deeper chain undervalued for the rest of the run. Older steps weigh `decay` times less
per step (acceptance drifts along a sequence). At batch > 1, with the tokens left noted by the loop, shapes are
compared by the expected time until every active row is done, as the chain budget does (`mmspec.budget.batch_steps`,
from each shape's mean and variance of accepted tokens): drafting makes rows diverge and a batch lasts as long as
its slowest row.

Lossless: the shape is chosen from the measured costs and earlier steps' verdicts only, before this step drafts;
the drafted set is a deterministic function of the drafter and every drafted node is verified. The draft length is
a stopping time of the draft-side process (reference budgets.md), so the output law is the target's (tested).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch

from mmspec.budget import MeasuredSteps, chain_moments, position_rates, table_reading
from mmspec.errors import check
from mmspec.tree import DraftTree, pool_size
from mmspec.verify import ChainDraft, VerifyResult, accept


class TreeShape(NamedTuple):
    """top_k children per expanded node, `depth` drafted levels, `total` nodes with the root (a chain: top_k 1,
    total depth + 1). A named tuple: a budget looks shapes up in dicts ~140 times a choice, and a tuple hashes in C
    (a frozen dataclass's hash is a Python call)."""

    top_k: int
    depth: int
    total: int

    def __str__(self) -> str:
        if self.total == 1:
            return "0"
        return f"chain{self.depth}" if self.top_k == 1 else f"tree{self.top_k}x{self.depth}n{self.total}"

    def contains(self, other: TreeShape) -> bool:
        """Whether a step drafted with this shape shows what `other` would have accepted."""
        if other.total == 1:
            return True
        if other.top_k == 1:
            return other.depth <= self.depth
        return other.top_k == self.top_k and other.depth <= self.depth and other.total <= self.total


PLAIN = TreeShape(0, 0, 1)  # no drafts: the loop's plain step
TREE_DEPTHS = (2, 3, 4, 6, 8, 12, 16)  # tree depths offered below the drafter's own
TREE_TOTALS = (4, 8, 16, 24, 32, 48, 64, 96, 128)  # node counts offered below the drafter's own


MAX_CHAIN_DEPTH = 16  # the deepest chain a budget may draft, whatever the drafter's own tree depth


def max_chain_depth(full: TreeShape) -> int:
    """The deepest chain a drafter of shape `full` may draft: MAX_CHAIN_DEPTH within its node count (its own depth
    if that is deeper). A paper tree's depth says what fits a wide tree, not how far a greedy chain stays accepted:
    ViSpec's (depth 4, 30 nodes) capped at twice its depth drafted chains of 8 at 1.43x of vanilla where chains of
    16 ran at 1.60x (docs/benchmarks.md)."""
    return max(full.depth, min(MAX_CHAIN_DEPTH, full.total - 1))


def tree_menu(full: TreeShape) -> list[TreeShape]:
    """The plain step, the greedy chains of depth 1..max_chain_depth(full), and trees of full.top_k at smaller
    depths and totals (and the full shape itself)."""
    chains = [TreeShape(1, d, d + 1) for d in range(1, max_chain_depth(full) + 1)]
    trees = []
    if full.top_k > 1:
        depths = sorted({d for d in TREE_DEPTHS if d < full.depth} | {full.depth})
        totals = sorted({n for n in TREE_TOTALS if n < full.total} | {full.total})
        trees = [TreeShape(full.top_k, d, n) for d in depths for n in totals if d + 1 < n <= pool_size(full.top_k, d)]
    return [PLAIN, *chains, *trees]


@lru_cache(maxsize=256)
def constant_on(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small constant vector made once per device and kept (read only): on a GPU, a host list copied in every
    step waits for the device like a read of it."""
    return torch.tensor(values, device=device)


def counterfactual_accepts(tree: DraftTree, path: torch.Tensor, shapes: list[TreeShape]) -> torch.Tensor:
    """Drafts each row would have accepted under each shape: the leading nodes of the accepted path (path [B, W]
    node indices, root first, -1 padded) that the shape's tree holds. Needs `tree.scores`. Returns [B, S] long."""
    b, n = tree.tokens.shape
    device = tree.tokens.device
    if tree.is_chain:  # a chain shows chains only (its tree columns are never counted): its accepted drafts
        accepted = (path[:, 1:] >= 0).sum(-1, keepdim=True)  # [B, 1]
        depths = constant_on(tuple(shape.depth if shape.top_k == 1 else 0 for shape in shapes), device)  # [S]
        return torch.minimum(accepted, depths)  # [B, S]
    nodes = path[:, 1:]  # [B, W-1] u_1..u_k
    on_path = nodes >= 0
    at = nodes.clamp_min(0)
    valid = tree.valid.clone()
    valid[:, 0] = False  # the root is not a draft
    index = torch.arange(n, device=device)
    earlier = index.view(1, 1, n) < index.view(1, n, 1)  # [1, N(i), N(j)] j before i
    # first children: no valid sibling before them (siblings are ordered by descending score)
    siblings = (tree.parents.unsqueeze(-1) == tree.parents.unsqueeze(1)) & valid.unsqueeze(1) & earlier  # [B, N, N]
    first = valid & ~siblings.any(-1)  # [B, N]
    scores = tree.scores.float()
    beats = valid.unsqueeze(1) & ((scores.unsqueeze(1) > scores.unsqueeze(-1))
                                  | ((scores.unsqueeze(1) == scores.unsqueeze(-1)) & earlier))  # [B, N(i), N(j)]
    depth_on_path = tree.depths.gather(1, at)  # [B, W-1]
    out = torch.zeros(b, len(shapes), dtype=torch.long, device=device)
    chain = (on_path & first.gather(1, at)).long().cumprod(-1).sum(-1)  # [B] leading first children on the path
    for s, shape in enumerate(shapes):
        if shape.top_k == 1:
            out[:, s] = chain.clamp_max(shape.depth)
    for depth in sorted({shape.depth for shape in shapes if shape.top_k > 1}):
        columns = [s for s, shape in enumerate(shapes) if shape.top_k > 1 and shape.depth == depth]
        shallow = (tree.depths <= depth).unsqueeze(1)  # [B, 1, N(j)]
        rank = (beats & shallow).sum(-1).gather(1, at)  # [B, W-1] rank among the drafted nodes of depth <= d
        rank = torch.where(on_path & (depth_on_path <= depth), rank, n)  # off the path or too deep: never inside
        worst = rank.cummax(-1).values  # [B, W-1] the worst rank of each leading part of the path
        kept = constant_on(tuple(shapes[s].total - 1 for s in columns), device)  # [C] drafted nodes kept
        out[:, columns] = (worst.unsqueeze(-1) < kept).sum(1)  # [B, C] leading path nodes inside each tree
    return out


PLAIN_ROOM = 64  # pending tokens a tree drafter keeps for plain steps before it runs them


class PendingRoom:
    """Plain steps' tokens wait with a drafter's pending tokens instead of running its model every step. The drafter
    has `runner`, `pending` (a `mmspec.lm.PendingTokens`) and `run_pending()`, which runs the first
    `pending_columns` pending tokens (not committed); `pending_columns` is a host-side bound on every row's pending
    count (no device sync)."""

    pending_columns: int = 1

    def room_for_plain_token(self, active: torch.Tensor) -> None:
        """Before a plain step's token joins the pending tokens: when the room is full, run and commit the pending
        tokens of every active row, leaving none pending."""
        pending = self.pending
        if self.pending_columns >= pending.tokens.shape[1]:
            self.run_pending()
            self.runner.commit_chain(pending.count * active)
            pending.count = torch.where(active, 0, pending.count)
            self.pending_columns = 0
        self.pending_columns += 1


class ShapedTreeDrafter(PendingRoom):
    """What a tree drafter needs for a `TreeBudget`: its `full_shape` (set at construction), `set_draft_size`, and
    the pending tokens of plain steps (`PendingRoom`). The drafter has `top_k`, `depth`, `total`, `runner`,
    `pending` (room for `pending_width()` tokens) and `run_pending()`."""

    full_shape: TreeShape
    steered_by_budget = False  # set by `make_budget`: a budget sets each step's shape (`set_draft_size`)

    def pending_width(self) -> int:
        """Pending tokens a row can hold: the longest accepted path (the deepest chain) plus the final token, plus
        PLAIN_ROOM plain steps' tokens (run together at the next proposal, or when the room is full)."""
        return max_chain_depth(self.full_shape) + 1 + PLAIN_ROOM

    def set_draft_size(self, shape: TreeShape) -> None:
        """Draft `shape` from the next proposal on (a draft budget's choice: a tree inside the full shape, or a
        chain up to `max_chain_depth`; either fits in the full shape's node count)."""
        full = self.full_shape
        deepest = max_chain_depth(full) if getattr(shape, "top_k", 0) == 1 else full.depth
        check(isinstance(shape, TreeShape) and 1 <= shape.depth <= deepest and 1 <= shape.top_k <= full.top_k
              and 2 <= shape.total <= min(full.total, pool_size(shape.top_k, shape.depth)),
              f"a draft shape must fit in the drafter's {full}, got {shape}.")
        self.top_k, self.depth, self.total = shape.top_k, shape.depth, shape.total


WARMUP_STEPS = 4  # a budget's first steps draft the exploration shape: one step's acceptance and time do not decide
# (on an H200 LlamaGen's EAGLE tree accepted nothing in its one warm-up step, at an image's first token, and that
# step took 23.5 ms where the tree's steps average 16.3: every shape read 1.00 token, the budget ran plain steps
# and the call gate turned drafting off, 0.98x of vanilla where the fixed tree gave 1.22x; runs/gpu-s27b)


class TreeBudget(MeasuredSteps):
    """The expected-throughput shape policy for tree drafters (see the module docstring). `costs` maps each shape
    of the menu to its seconds (set by `begin`, or given for tests)."""

    plain_size = PLAIN

    def __init__(self, full: TreeShape, shapes: list[TreeShape] | None = None, *, warmup: int = WARMUP_STEPS,
                 refresh_every: int = 16, decay: float = 0.9, explore_cost: float = 3.0,
                 costs: dict[TreeShape, float] | None = None, timing: bool = True, settle_after: int = 8,
                 settle_margin: float = 0.8) -> None:
        check(0.0 < decay <= 1.0, f"decay must be in (0, 1], got {decay}.")
        check(explore_cost >= 1.0, f"explore_cost must be >= 1 (in plain steps), got {explore_cost}.")
        self.full = full
        self.shapes = shapes or tree_menu(full)
        check(self.shapes[0] == PLAIN and full in self.shapes, "a menu starts with PLAIN and holds the full shape.")
        self.warmup, self.refresh_every, self.decay, self.explore_cost = warmup, refresh_every, decay, explore_cost
        self.costs = costs
        self.accepted = torch.zeros(len(self.shapes), dtype=torch.float64)  # [S] decayed accepted drafts
        self.rows = torch.zeros(len(self.shapes), dtype=torch.float64)  # [S] decayed rows behind them
        self.accepted_sq = torch.zeros(len(self.shapes), dtype=torch.float64)  # [S] .. sum of squared accepts
        # per shape drafted: the shapes a step of it shows [S] bool (the plain step shows none)
        self.shows = {s: torch.tensor([s.contains(o) and o != PLAIN for o in self.shapes]) for s in self.shapes}
        self.chains = {s.depth: i for i, s in enumerate(self.shapes) if s.top_k == 1}  # chain depth -> menu index
        depth = max(self.chains, default=0)
        self.chain_reached = torch.zeros(depth, dtype=torch.float64)  # [D] decayed rows whose chain reached j
        self.chain_accepted = torch.zeros(depth, dtype=torch.float64)  # [D] .. and accepted position j
        self.chosen: dict[str, int] = {}
        self.refreshes = 0
        self._refresh_at = refresh_every
        self._last = full
        self._init_steps(timing, settle_after, settle_margin)
        # rows held -> shape seconds and measured steps (`hold_rows`); the call's models while it runs (`begin`)
        self._tables: dict[int, dict[TreeShape, float]] = {}
        self._steps_at: dict[int, tuple[dict, dict, dict]] = {}
        self._level: int | None = None
        self._live: tuple | None = None
        self._call_rows = 1  # the running call's batch size
        self._timing_seconds = 0.0  # seconds the running call spent timing shapes (`hold_rows`)
        self._prefix_bucket = 1  # the running call's prompt length, rounded up to a power of two
        self._given_costs = costs  # (tests: the same costs at every level)
        self._held_next: int | None = None  # rows held after a drop, priced at the next choice (`select_rows`)

    # ------------------------------------------------------------------------------------------ estimates
    def expected_tokens(self) -> torch.Tensor:
        """E[tokens per row | shape] [S]: trees from their counted acceptance (1 for shapes never seen), chains from
        the position model (`chain_rates`), so a chain deeper than any drafted yet is valued too."""
        return self.emitted_moments(with_variance=False)[0]

    def emitted_moments(self, with_variance: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(E, Var)[tokens per row | shape] [S] each (`expected_tokens`, `emitted_variance`), the chains' position
        rates computed once; Var None without `with_variance`."""
        # on the host, in floats: the [S] statistics are a few dozen numbers, and each tensor operation costs
        # microseconds before every step (51 -> 39 us for the VLM drafters' 47 shapes, isolated)
        rows = [max(r, 1e-9) for r in self.rows.tolist()]
        mean_acc = [a / r for a, r in zip(self.accepted.tolist(), rows)]  # [S]
        expected = [1.0 + m for m in mean_acc]
        var = None
        if with_variance:
            var = [max(q / r - m * m, 0.0) for q, r, m in zip(self.accepted_sq.tolist(), rows, mean_acc)]
        if self.chains and max(self.chain_reached.tolist()) > 0:
            firsts, seconds = chain_moments(self.chain_rates().tolist())  # [D] each: E[tokens | chain], E[tokens^2]
            for depth, index in self.chains.items():
                expected[index] = chain = firsts[depth - 1]
                if var is not None:
                    var[index] = max(seconds[depth - 1] - chain * chain, 0.0)
        return (torch.tensor(expected, dtype=torch.float64),
                None if var is None else torch.tensor(var, dtype=torch.float64))

    def chain_rates(self, prior: float = 2.0) -> torch.Tensor:
        """a_j [D]: P(chain position j accepted | 1..j-1 accepted), shrunk towards the pooled rate with `prior`
        pseudo-rows; positions never reached take the deepest reached position's rate (`position_rates`)."""
        pooled = float(self.chain_accepted.sum()) / max(float(self.chain_reached.sum()), 1e-9)
        return position_rates(self.chain_accepted, self.chain_reached, pooled, prior)

    def step_seconds(self) -> torch.Tensor:
        """seconds(s) [S]: the steps of this shape as they ran (an average that follows the machine's load), else
        the timed cost read by how the shapes that ran compare with their timed costs (`table_reading`: the drafting
        shapes' line once three ran, else a ratio); the plain step at most vanilla's (`plain_choice_seconds`)."""
        check(self.costs is not None, "TreeBudget has no costs; call begin(...) or pass costs=.")
        seen = self.fresh_seen()  # (a shape not run for a while takes its scaled table time again)
        pairs = {s: (self.costs[s], seen[s]) for s in self.shapes if s in seen}
        read_drafting = table_reading(list(pairs.values()), [pair for s, pair in pairs.items() if s != PLAIN])
        seconds = [seen[s] if s in seen else read_drafting(self.costs[s]) for s in self.shapes]
        if PLAIN not in seen:  # a plain step's table reads like the measured sizes' ratio, not the drafted steps' line
            seconds[0] = table_reading(list(pairs.values()), [])(self.costs[PLAIN])
        seconds[0] = self.plain_choice_seconds(seconds[0])  # the menu starts with PLAIN
        return torch.tensor(seconds, dtype=torch.float64)

    def plain_table_seconds(self, batch: int) -> float:
        return self.costs[PLAIN] if self.costs is not None else math.inf  # (timed at the first drafted call)

    def plain_estimate_seconds(self, batch: int) -> float:
        return float(self.step_seconds()[0]) if self.costs is not None else math.inf

    def describe(self, batch: int) -> str:
        """The plain step, the shapes chosen and the three fastest by estimate (see `MeasuredSteps.describe`)."""
        seconds, expected = self.step_seconds(), self.expected_tokens()  # [S], [S]
        fastest = (expected / seconds.clamp_min(1e-12)).argsort(descending=True)[:3].tolist()
        shown = [(i, s) for i, s in enumerate(self.shapes) if i == 0 or str(s) in self.chosen or i in fastest]
        return ", ".join(f"{s}: {self.chosen.get(str(s), 0)}x {1e3 * float(seconds[i]):.2f} ms (table "
                         f"{1e3 * self.costs[s]:.2f}) {float(expected[i]):.2f} tok" for i, s in shown)

    def throughput(self) -> torch.Tensor:
        return self.expected_tokens() / self.step_seconds().clamp_min(1e-12)

    def emitted_variance(self) -> torch.Tensor:
        """Var[tokens per row | shape] [S]: from the counted accepts' squares (0 for shapes never seen, the plain
        step), chains from the position model (as `expected_tokens`)."""
        return self.emitted_moments()[1]

    def speeds(self) -> torch.Tensor:
        """[S] tokens per second per row, or at batch > 1 with the tokens left noted, the batch-tail speed
        (`MeasuredSteps.tail_speeds`)."""
        if self.batch_tail() is None:
            return self.throughput()
        return self.tail_speeds(self.step_seconds(), *self.emitted_moments())

    def _plain_and_best_speeds(self) -> tuple[float, float]:
        if self.costs is None:  # not timed yet: no estimate
            return 0.0, 1.0
        return plain_and_best_shape(self.speeds())

    def explore_shape(self) -> TreeShape:
        """The shape of warm-up and refresh steps: of the shapes costing at most `explore_cost` plain steps, the one
        that contains the most trees, then the deepest (the full shape where drafting is cheap, e.g. a GPU at batch
        1; a chain or a small tree where a wide verify costs several steps; the cheapest drafting shape when none is
        that cheap, so a table timed under a passing load is corrected by real steps). Trees it does not contain are
        learnt only if chosen."""
        seconds = dict(zip(self.shapes, self.step_seconds().tolist()))
        drafting = [s for s in self.shapes if s != PLAIN]  # never plain: a draft keeps the costs and rates measured
        affordable = ([s for s in drafting if seconds[s] <= self.explore_cost * seconds[PLAIN]]
                      or [min(drafting, key=lambda s: seconds[s])])
        trees = [o for o in self.shapes if o.top_k > 1]  # chains are valued by the position model, fed by any shape
        return max(affordable, key=lambda s: (sum(s.contains(o) for o in trees), s.depth, -seconds[s]))

    def choose(self, batch: int) -> TreeShape | int:
        """The next step's shape (0 = a plain step)."""
        if self._held_next is not None:  # (rows were dropped since the last choice)
            self.hold_rows(self._held_next)
            self._held_next = None
        self._time_last_step()
        refresh = self.refresh_every and self._choices == self._refresh_at
        if refresh:  # at steps 16, 32, 64, 128, ..
            self._refresh_at += self.refresh_every * 2 ** self.refreshes
            self.refreshes += 1
        if refresh and self._last.top_k == 1:  # chains are chosen: learn the positions past them
            shape = self.shapes[max(self.chains.values(), key=lambda i: self.shapes[i].depth)]
        elif self._choices < self.warmup or refresh or self._exploring():
            shape = self.explore_shape()
        elif self._plain_probe():
            shape = PLAIN
        else:
            speed = self.speeds()  # [S]
            shape = self.shapes[int(speed.argmax())]
            self._note_plain_margin(*plain_and_best_shape(speed))
            if shape == PLAIN and len(self.shapes) > 1 and self._drafting_probe():  # (read from one slow step?)
                shape = self.shapes[1 + int(speed[1:].argmax())]
        self._count_choice()
        self._last = shape
        self.chosen[str(shape)] = self.chosen.get(str(shape), 0) + 1
        return 0 if shape == PLAIN else shape

    def observe(self, result: VerifyResult, active: torch.Tensor, draft=None) -> None:
        """Count what the step accepted under every shape its tree (or chain) contains."""
        if self._last == PLAIN or not isinstance(draft, DraftTree) or draft.scores is None:
            return
        self.note_row_accepts(result.num_accepted, active)
        covered = self.shows[self._last]  # [S]
        counts = counterfactual_accepts(draft, result.accepted_nodes, self.shapes)  # [B, S]
        rows = active.unsqueeze(-1)  # [B, 1]
        parts = [(counts * rows).sum(0).double(), (counts * counts * rows).sum(0).double(),
                 active.sum().double().view(1)]  # [S], [S], [1]
        depth = self._last.depth  # the deepest chain the step contains: its positions 1..depth
        chain = depth in self.chains
        if chain:
            accepted = counts[:, self.chains[depth]].unsqueeze(-1)  # [B, 1]
            positions = torch.arange(1, depth + 1, device=accepted.device)  # [depth]
            parts += [((accepted >= positions - 1) & rows).sum(0).double(),
                      ((accepted >= positions) & rows).sum(0).double()]  # [depth] reached, [depth] accepted
        sums = torch.cat(parts).cpu()  # the step's one read of the device
        n = len(self.shapes)
        self.accepted = torch.where(covered, self.accepted * self.decay + sums[:n], self.accepted)
        self.rows = torch.where(covered, self.rows * self.decay + sums[2 * n], self.rows)
        self.accepted_sq = torch.where(covered, self.accepted_sq * self.decay + sums[n: 2 * n], self.accepted_sq)
        if chain:
            reached, accepted = sums[2 * n + 1: 2 * n + 1 + depth], sums[2 * n + 1 + depth:]
            self.chain_reached[:depth] = self.chain_reached[:depth] * self.decay + reached
            self.chain_accepted[:depth] = self.chain_accepted[:depth] * self.decay + accepted

    # ---------------------------------------------------------------------------------------------- costs
    def begin(self, target, drafter, state, rule) -> None:
        """Time every menu shape on this call's own target, drafter and prefix (or read the cached times), and price
        the call's steps for its whole batch (`hold_rows`) until the loop drops rows."""
        self._new_call()
        self._held_next = None
        if state is not None:  # (None: a budget given its costs, in tests)
            self._live, self._call_rows = (target, drafter, state, rule), state.batch_size
            prefix = int(target.runner.lengths.max())  # the prompts' (a bucket of the timings' key)
            self._prefix_bucket = 1 << max(prefix - 1, 0).bit_length()
            self.hold_rows(state.batch_size)
        # the call's clock starts after `begin` (`mmspec.loop.generate`): timing the call's own level here is not in
        # its seconds, and only the levels timed later in the call are taken out of them (`end_call`)
        self._timing_seconds = 0.0

    def time_shapes(self, level: int) -> dict[TreeShape, float]:
        """Every menu shape's seconds for `level` rows held, timed on the live call (`begin`'s target, drafter, state
        and rule, with the rows it holds) or read from the cache of earlier timings. Below the call's own batch only
        the chains and the plain step are timed (a third of the menu: the timing runs inside a call), and each tree
        is priced at its call-level seconds times the chains' mean ratio between the two levels."""
        from mmspec.cost import cached_json, profile_key

        target, drafter, state, rule = self._live
        runner = target.runner
        models = [getattr(m, "model", m) if not isinstance(m, torch.nn.Module) else m
                  for m in (runner.model, drafter.runner.model)]
        call_level = level == self._call_rows
        shapes = self.shapes if call_level else [s for s in self.shapes if s == PLAIN or s.top_k == 1]
        # v3: a feature drafter's pending pairs run past their K/V for the root alone (`run_layer_column`), so its
        # steps cost less than the v2 tables timed them (a chain of 8's drafting at batch 32 here: 18% less)
        extra = (f"tree-budget-v3|B={level}|prefix<={self._prefix_bucket}|{getattr(rule, 'name', rule)}|"
                 f"{target.params}|cfg={runner.guidance_scale is not None}|{type(drafter).__name__}|"
                 f"{profile_key(models[1], 'cpu')}|{[str(s) for s in shapes]}")
        key = profile_key(models[0], runner.cache.device, extra)
        times = cached_json(key, lambda: measure_shapes(target, drafter, state, rule, shapes))
        costs = {s: times["draft"].get(f"{s.top_k},{s.depth}", 0.0) + times["step"][step_key(s)] for s in shapes}
        if not call_level:
            full = self._tables[self._call_rows]
            ratio = sum(costs[s] / full[s] for s in shapes) / len(shapes)
            costs.update({s: full[s] * ratio for s in self.shapes if s not in costs})
        return costs

    def select_rows(self, rows: torch.Tensor) -> None:
        """The loop dropped the call's finished rows and holds rows [B']: the steps are priced for that many rows
        from the next choice on (`hold_rows`; a call settled on plain steps makes no more choices, and times
        nothing)."""
        super().select_rows(rows)
        self._held_next = rows.shape[0]

    def hold_rows(self, rows: int) -> None:
        """Price steps for `rows` rows held, rounded up to a power of four (at most the call's batch): each such
        level has its own shape times (timed on the live call the first time, `time_shapes`, then cached) and its
        own measured step seconds, while the acceptance estimates are shared (a row's acceptance does not depend on
        the rows beside it). At batch 32 on a CPU a chain of 9 costs 6.4 plain steps and at 8 about 4.4, so the
        sizes worth drafting change as a batch's finished rows leave it."""
        level = 1
        while level < rows:  # 1, 4, 16, 64, ..
            level *= 4
        level = min(level, self._call_rows)
        if level == self._level or self._live is None:
            return
        if self._level is not None:
            self._steps_at[self._level] = (self.seen, self._samples, self._sampled_at)
        self.seen, self._samples, self._sampled_at = self._steps_at.get(level, ({}, {}, {}))
        if level not in self._tables:
            start = time.perf_counter()
            self._tables[level] = self._given_costs or self.time_shapes(level)
            self._timing_seconds += time.perf_counter() - start  # (not the call's: `end_call`)
        self.costs, self._level = self._tables[level], level
        self._chosen_at = None  # the step that ran across the change is not timed

    def end_call(self, batch: int, seconds: float, plain_steps: int, drafted: bool, begin_seconds: float = 0.0,
                 held_rows: list[int] | None = None) -> None:
        """`MeasuredSteps.end_call`, the call's seconds without those it spent timing shapes for fewer rows."""
        self._live, self._held_next = None, None  # (the call's models and state are not kept past it)
        seconds, self._timing_seconds = seconds - self._timing_seconds, 0.0
        super().end_call(batch, seconds, plain_steps, drafted, begin_seconds=begin_seconds, held_rows=held_rows)

    def rows_cost(self) -> Callable[[int], float] | None:
        """A plain step's seconds by rows held: the least-squares line a + b x rows through the levels' timed plain
        steps (two levels or more), None before."""
        points = [(level, table[PLAIN]) for level, table in self._tables.items()]
        if len(points) < 2:
            return None
        n = len(points)
        mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread > 0 else 0.0
        if slope <= 0:
            return None
        intercept = max(mean_y - slope * mean_x, 0.0)
        return lambda rows: intercept + slope * rows


def plain_and_best_shape(speed: torch.Tensor) -> tuple[float, float]:
    """(the plain step's speed, the best drafting shape's) from speed [S] over a menu that starts with PLAIN."""
    return float(speed[0]), float(speed[1:].max()) if speed.shape[0] > 1 else 0.0


def step_key(shape: TreeShape) -> str:
    """The step table's key of a shape: its node count, "c" first for a chain (a chain's verify takes the causal
    mask and the rule's chain form, cheaper than a tree's of as many nodes)."""
    return f"c{shape.total}" if shape.top_k == 1 else str(shape.total)


def measure_shapes(target, drafter, state, rule, shapes: list[TreeShape], repeats: int = 3) -> dict:
    """Median seconds of the drafter's `propose` per (top_k, depth) and of a target step (verify + acceptance rule)
    per node count, chains and trees apart (`step_key`), on the live target and drafter (nothing committed;
    `mmspec.cost.measure_forward_times`, so a deeper draft or a wider step never reads cheaper than a shallower or
    narrower one). {"draft": {"k,d": s}, "step": {step_key: s}}."""
    from mmspec.cost import measure_forward_times

    print("mmspec: timing draft shapes on this device for budget='auto' (once per model, batch size and device; "
          "cached)", file=sys.stderr, flush=True)
    device = state.output.device
    generator = torch.Generator(device=device).manual_seed(0)
    drafts: dict[str, object] = {}  # step_key -> the draft its step is timed with
    for shape in shapes:
        key = step_key(shape)
        if key in drafts:
            continue
        if shape == PLAIN:
            drafts[key] = ChainDraft(torch.empty(state.batch_size, 0, dtype=torch.long, device=device))
            continue
        drafter.set_draft_size(shape)
        drafts[key] = drafter.propose(state)
    keys = sorted(drafts, key=lambda k: (k.startswith("c"), int(k.lstrip("c"))))
    chains = [k for k in keys if k.startswith("c")]
    trees = [k for k in keys if not k.startswith("c")]

    def draft(top_k: int, depth: int) -> None:  # the table's "batch" is top_k, its "width" the depth
        drafter.set_draft_size(TreeShape(top_k, depth, depth + 1 if top_k == 1 else min(depth + 2,
                                                                                         pool_size(top_k, depth))))
        drafter.propose(state)

    timed: dict = {"step": {}, "draft": {}}
    for group in (trees, chains):  # apart: a chain's step is not a tree's of as many nodes
        widths = [int(k.lstrip("c")) for k in group]
        prefix = "c" if group is chains else ""

        def step(batch: int, total: int, prefix: str = prefix) -> None:
            draft = drafts[f"{prefix}{total}"]
            accept(rule, draft, target.verify(state, draft), generator, validate=False)

        if widths:
            steps = measure_forward_times(step, [state.batch_size], widths, repeats, warmup=1, device=device)
            timed["step"].update({f"{prefix}{n}": seconds for n, seconds in zip(widths, steps.seconds[0])})
    for top_k in sorted({s.top_k for s in shapes if s.total > 1}):
        depths = sorted({s.depth for s in shapes if s.top_k == top_k})
        proposals = measure_forward_times(draft, [top_k], depths, repeats, warmup=1, device=device)
        timed["draft"].update({f"{top_k},{d}": seconds for d, seconds in zip(depths, proposals.seconds[0])})
    drafter.set_draft_size(drafter.full_shape)
    return timed

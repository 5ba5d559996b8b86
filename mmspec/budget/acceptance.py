"""The acceptance model: the tokens each option of a budget's menu is expected to emit per row and step.

Options are `TreeShape`s (`PLAIN` first; a chain of d drafts is TreeShape(1, d, d + 1)). Per step X = 1 + the
accepted drafts of a row:
- chains, by position: a_j = P(draft j accepted | drafts 1..j-1 accepted) from decayed counts of rows that reached
  position j and accepted it, shrunk towards the pooled rate by `prior_rows` pseudo-rows; positions never reached
  take the deepest reached one's rate. P(X > i) = prod_{j<=i} a_j, E[X] = 1 + sum_i P(X > i) (vLLM's E_acc).
- trees: the drafts each row would have accepted under every smaller shape the step's tree contains
  (`counterfactual_accepts`: EAGLE-2 keeps the nodes of highest score, so a smaller tree is the leading part of a
  larger one), decayed; a tree never shown emits 1, as a plain step does, until it is explored. Its path of first
  children counts for the chain positions: a tree drafter's chain is its tree's first children (the drafter's
  top-1 at each level), accepted with the same probability under every rule.
- per size (`valued_per_size` drafters: Jacobi windows, whose acceptance depends on the window): an option that has
  run is valued by its own steps alone; its counts decay by `window_decay` (a longer memory than `decay`: a window's
  few bad steps must not read it below a smaller one).
`batch_steps_of` turns (mean, variance) into the expected steps until the last of a batch's rows is done.

Glossary: B rows, S options, D chain positions, N tree nodes, W path length, L tree depths, C tree options.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from mmspec.budget.config import BudgetConfig
from mmspec.tree import PLAIN, DraftTree, TreeShape
from mmspec.verify import Draft, VerifyResult


class AcceptanceModel:
    """Decayed acceptance counts over a menu of options (see the module docstring), kept as host floats: a step's
    verdicts are read from the device once, and every choice reads the model without touching it."""

    def __init__(self, options: Sequence[TreeShape], config: BudgetConfig, per_size: bool = False) -> None:
        self.options, self.config, self.per_size = list(options), config, per_size
        n, depth = len(self.options), max((o.depth for o in self.options if o.is_chain), default=0)
        self.sums, self.squares, self.rows = [0.0] * n, [0.0] * n, [0.0] * n  # [S] each option's own decayed
        # accepted drafts, squared accepted drafts, and the rows behind them
        self.reached, self.accepted = [0.0] * depth, [0.0] * depth  # [D] decayed rows that reached position j, and
        # accepted it
        self.decay = config.window_decay if per_size else config.decay
        # per option drafted: the options a step of it shows (the plain step shows none; per size: itself)
        self.shows = {o: [s for s, p in enumerate(self.options)
                          if p != PLAIN and (o == p if per_size else o.contains(p))] for o in self.options}
        self.chain_depths = [o.depth if o.is_chain else 0 for o in self.options]  # [S] a chain step's reach (trees 0)

    def observe(self, shape: TreeShape, draft: Draft, result: VerifyResult, active: torch.Tensor) -> None:
        """Count a step drafted with `shape`: its rows' verdicts by chain position and under every option it shows."""
        if shape == PLAIN:
            return
        b, shown, tree = active.shape[0], self.shows[shape], isinstance(draft, DraftTree) and not draft.is_chain
        if tree:  # the drafts each row would have accepted under each shown option, summed on the device
            counts, chain = counterfactual_accepts(draft, result.accepted_nodes, self.options)  # [B, S], [B]
            counts = counts[:, shown]  # [B, s]
            counted = counts * active.unsqueeze(-1)  # [B, s]
            parts = [chain, torch.full_like(chain, draft.max_depth), active, counted.sum(0),
                     (counted * counts).sum(0)]  # [B] [B] [B] [s] [s]
        else:  # a chain step (a CSpD window, a one-branch tree): an option of depth d reads min(accepted, d)
            drafted = draft.valid[:, 1:].sum(-1) if isinstance(draft, DraftTree) else result.num_drafted  # [B]
            parts = [result.num_accepted, drafted, active]  # [B] [B] [B]
        read = torch.cat([part.long() for part in parts]).tolist()  # the step's one read of the device
        # [B'] each active row's (accepted, drafted)
        verdicts = [(a, d) for a, d, on in zip(read[:b], read[b:2 * b], read[2 * b:3 * b]) if on]
        own = read[3 * b:] if tree else [sum(min(a, self.chain_depths[s]) ** p for a, _ in verdicts)
                                         for p in (1, 2) for s in shown]  # [2s]
        for s, total, square in zip(shown, own, own[len(shown):]):
            self.sums[s] = self.sums[s] * self.decay + total
            self.squares[s] = self.squares[s] * self.decay + square
            self.rows[s] = self.rows[s] * self.decay + len(verdicts)
        depth = min(int(shape.depth), len(self.reached))
        reached, accepted = [0] * depth, [0] * depth  # [d] rows that reached position j, and accepted it
        for a, d in verdicts:
            for j in range(min(depth, d, a + 1)):
                reached[j] += 1
                accepted[j] += a > j
        self.reached[:depth] = [r * self.decay + n for r, n in zip(self.reached, reached)]
        self.accepted[:depth] = [r * self.decay + n for r, n in zip(self.accepted, accepted)]

    def position_rates(self) -> list[float]:
        """a_j for j = 1..D, shrunk towards the pooled rate; unreached positions take the deepest reached one's."""
        total, prior = sum(self.reached), self.config.prior_rows
        pooled = sum(self.accepted) / total if total > 0 else 0.5
        rates = [(a + prior * pooled) / (r + prior) for r, a in zip(self.reached, self.accepted)]
        seen = [j for j, r in enumerate(self.reached) if r > 0]
        if seen:
            rates[seen[-1] + 1:] = [rates[seen[-1]]] * (len(rates) - seen[-1] - 1)
        return rates

    def moments(self) -> tuple[list[float], list[float]]:
        """(E[X], Var[X]) [S] of the tokens a row emits per step under each option."""
        firsts, seconds = chain_moments(self.position_rates())
        first, second = [1.0, *firsts], [1.0, *seconds]  # [D+1] E[X], E[X^2] of a chain of depth d
        mean, var = [1.0] * len(self.options), [0.0] * len(self.options)  # [S] (plain, or never shown: 1 token)
        for s, (option, depth, sums, squares, rows) in enumerate(zip(self.options, self.chain_depths, self.sums,
                                                                      self.squares, self.rows)):
            if depth and not (rows > 0 and self.per_size):  # a chain, by chain position
                d = min(depth, len(firsts))
                mean[s], var[s] = first[d], second[d] - first[d] * first[d]
            elif option.depth and rows > 0:  # valued by its own steps
                n = max(rows, 1e-12)
                m = sums / n
                mean[s], var[s] = 1.0 + m, max(squares / n - m * m, 0.0)
        return mean, var


def chain_moments(rates: Sequence[float]) -> tuple[list[float], list[float]]:
    """(E[X], E[X^2]) for X = the tokens a chain of depth d = 1..k emits under per-position rates a_j (host floats,
    one pass): P(X > i) = prod_{j<=i} a_j, E[X] = 1 + sum_{i<=d} P(X > i), E[X^2] = 1 + sum_{i<=d} (2i + 1) P(X > i)."""
    tail, first, second, firsts, seconds = 1.0, 0.0, 0.0, [], []
    for i, rate in enumerate(rates, 1):
        tail *= rate  # P(X > i)
        first += tail
        second += (2 * i + 1) * tail
        firsts.append(1.0 + first)
        seconds.append(1.0 + second)
    return firsts, seconds


def batch_steps_of(tokens_left: float, rows: int, mean: Sequence[float] | torch.Tensor,
                   var: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Expected steps [S] until the last of `rows` rows has emitted `tokens_left` (r) more tokens, for S options whose
    rows emit mean [S] tokens a step with variance var [S]: E[max_rows N] = sum_{n >= 0} 1 - (1 - P(N > n))^rows,
    P(N > n) = P(S_n < r) ~ Phi((r - 1/2 - n mean) / sqrt(n var)) (N a row's step count, S_n its tokens after n steps,
    normal with a continuity correction). It counts the last step whole: a row that needs 4.3 steps takes 5. Plain
    steps (mean 1, var 0) take exactly r. Only the n within 6 sd of r / mean are summed."""
    m = torch.as_tensor(mean, dtype=torch.float64).clamp_min(1e-9)  # [S]
    v = torch.as_tensor(var, dtype=torch.float64).clamp_min(0.0)  # [S]
    r = tokens_left - 0.5
    centre = r / m  # [S]
    width = 6.0 * (centre * v).sqrt() / m + 2.0  # [S] 6 sd of a row's step count, and 2 steps
    low = (centre - width).floor().clamp_min(0.0)  # [S] every n below: P(N > n) = 1
    n = low[:, None] + torch.arange(int((2.0 * width).ceil().max()) + 3, dtype=torch.float64)  # [S, K]
    sd = (n * v[:, None]).sqrt()  # [S, K]
    gap = r - n * m[:, None]  # [S, K]
    more = torch.where(sd > 0, torch.special.ndtr(gap / sd.clamp_min(1e-12)), (gap > 0).double())  # [S, K]
    return low + (1.0 - (1.0 - more) ** rows).sum(1)


@lru_cache(maxsize=256)
def constant_on(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small constant vector made once per device (read only): a host list copied to a GPU every step waits."""
    return torch.tensor(values, device=device)


def counterfactual_accepts(tree: DraftTree, path: torch.Tensor,
                           shapes: Sequence[TreeShape]) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts each row would have accepted under each shape [B, S], along the tree's first-children chain [B]): the
    leading nodes of the accepted path (path [B, W] node indices, root first, -1 padded) that the shape's tree holds
    (the first n - 1 nodes by score among those of depth <= d; a chain: the leading first children). Exact under
    greedy verification (the accepted path is the target's argmax path), an estimate when sampling. Every node is
    compared with the path's nodes only, every tree depth at once: a fixed number of tensor operations a step."""
    n = tree.tokens.shape[1]
    device = tree.tokens.device
    nodes = path[:, 1:]  # [B, W-1] u_1..u_k
    on_path, at = nodes >= 0, nodes.clamp_min(0)  # [B, W-1]
    index = constant_on(tuple(range(n)), device)  # [N]
    valid = tree.valid & (index > 0)  # [B, N] drafted nodes (the root is not a draft)
    before = index < at.unsqueeze(-1)  # [B, W-1, N] node j comes before the path node
    # a first child has no valid sibling before it (siblings are ordered by descending score)
    siblings = (tree.parents.unsqueeze(1) == tree.parents.gather(1, at).unsqueeze(-1)) & valid.unsqueeze(1) & before
    first = valid.gather(1, at) & ~siblings.any(-1)  # [B, W-1]
    chain = (on_path & first).long().cumprod(-1).sum(-1)  # [B] leading first children on the path
    chain_depths = constant_on(tuple(s.depth if s.is_chain else 0 for s in shapes), device)  # [S] (trees: 0)
    out = torch.minimum(chain.unsqueeze(-1), chain_depths)  # [B, S]
    columns = [s for s, shape in enumerate(shapes) if shape.top_k > 1]  # [C] the trees
    if tree.is_chain or not columns or tree.scores is None:  # a chain shows chains only
        return out, chain
    scores = tree.scores.float()  # [B, N]
    on_score = scores.gather(1, at).unsqueeze(-1)  # [B, W-1, 1]
    beaten_by = valid.unsqueeze(1) & ((scores.unsqueeze(1) > on_score) | ((scores.unsqueeze(1) == on_score) & before))
    levels = sorted({shapes[s].depth for s in columns})  # [L] the trees' depths
    level = constant_on(tuple(levels), device).view(-1, 1, 1)  # [L, 1, 1]
    shallow = (tree.depths.unsqueeze(0) <= level).unsqueeze(2)  # [L, B, 1, N] nodes of depth <= d
    rank = (beaten_by.unsqueeze(0) & shallow).sum(-1)  # [L, B, W-1] rank among the drafted nodes of depth <= d
    inside = on_path & (tree.depths.gather(1, at).unsqueeze(0) <= level)  # [L, B, W-1] (else never inside)
    worst = torch.where(inside, rank, n).cummax(-1).values  # [L, B, W-1] the worst rank of each leading part
    of_column = constant_on(tuple(levels.index(shapes[s].depth) for s in columns), device)  # [C]
    kept = constant_on(tuple(shapes[s].total - 1 for s in columns), device).view(-1, 1, 1)  # [C, 1, 1]
    out[:, columns] = (worst[of_column] < kept).sum(-1).T  # [B, C] leading path nodes inside each tree
    return out, chain

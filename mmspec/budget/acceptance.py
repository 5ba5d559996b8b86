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

Glossary: B rows, S options, D chain positions, N tree nodes, W path length.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from mmspec.budget.config import BudgetConfig
from mmspec.tree import PLAIN, DraftTree, TreeShape
from mmspec.verify import Draft, VerifyResult


class AcceptanceModel:
    """Decayed acceptance counts over a menu of options (see the module docstring)."""

    def __init__(self, options: Sequence[TreeShape], config: BudgetConfig, per_size: bool = False) -> None:
        self.options, self.config, self.per_size = list(options), config, per_size
        # [3, S] each option's own decayed accepted drafts, squared accepted drafts, and the rows behind them
        self.own = torch.zeros(3, len(self.options), dtype=torch.float64)
        self.sums, self.squares, self.rows = self.own  # [S] each (views)
        depth = max((o.depth for o in self.options if o.is_chain), default=0)
        self.positions = torch.zeros(2, depth, dtype=torch.float64)  # [2, D] decayed rows that reached position j,
        self.reached, self.accepted = self.positions  # and accepted it: [D] each (views)
        self.decay = config.window_decay if per_size else config.decay
        # per option drafted: the options a step of it shows [S] (the plain step shows none; per size: itself)
        self.shows = {o: torch.tensor([(o == p if per_size else o.contains(p)) and p != PLAIN for p in self.options],
                                      dtype=torch.float64) for o in self.options}
        self.keeps = {o: 1.0 - (1.0 - self.decay) * shown for o, shown in self.shows.items()}  # [S] decay where shown
        self._moments: tuple = (None, None)  # (the counts' versions, the moments read from them)

    def observe(self, shape: TreeShape, draft: Draft, result: VerifyResult, active: torch.Tensor) -> None:
        """Count a step drafted with `shape`: its rows' verdicts by chain position and under every option it shows."""
        if shape == PLAIN:
            return
        counts, chain_accepted, chain_drafted = accepted_under(self.options, draft, result)  # [B, S], [B], [B]
        n, depth = len(self.options), min(int(shape.depth), self.positions.shape[1])
        on = active.unsqueeze(-1)  # [B, 1]
        positions = constant_on(tuple(range(1, depth + 1)), counts.device)  # [d]
        reached = (chain_accepted.unsqueeze(-1) >= positions - 1) & (chain_drafted.unsqueeze(-1) >= positions) & on
        counted = counts * on  # [B, S]
        parts = [counted.sum(0), (counted * counts).sum(0), active.sum().expand(n), reached.sum(0),
                 (reached & (chain_accepted.unsqueeze(-1) >= positions)).sum(0)]  # [S] [S] [S] [d] [d]
        sums = torch.cat(parts).cpu().double()  # the step's one read of the device
        self.own.mul_(self.keeps[shape]).addcmul_(sums[:3 * n].view(3, n), self.shows[shape])  # [3, S]
        self.positions[:, :depth].mul_(self.decay).add_(sums[3 * n:].view(2, depth))  # [2, d]

    def position_rates(self) -> list[float]:
        """a_j for j = 1..D (host floats), shrunk towards the pooled rate; unreached positions take the deepest
        reached one's."""
        reached, accepted = self.reached, self.accepted
        total = float(reached.sum())
        pooled = float(accepted.sum()) / total if total > 0 else 0.5
        rates = ((accepted + self.config.prior_rows * pooled) / (reached + self.config.prior_rows)).tolist()
        seen = [j for j, r in enumerate(reached.tolist()) if r > 0]
        if seen:
            rates[seen[-1] + 1:] = [rates[seen[-1]]] * (len(rates) - seen[-1] - 1)
        return rates

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E[X], Var[X]) [S] of the tokens a row emits per step under each option (kept until the counts change)."""
        if self._moments[0] == (versions := (self.own._version, self.positions._version)):
            return self._moments[1]
        firsts, seconds = chain_moments(self.position_rates())
        first, second = [1.0, *firsts], [1.0, *seconds]  # [D+1] E[X], E[X^2] of a chain of depth d
        mean, var = [1.0] * len(self.options), [0.0] * len(self.options)  # [S] (plain, or never shown: 1 token)
        for s, (option, sums, squares, rows) in enumerate(zip(self.options, *self.own.tolist())):  # (host floats)
            if option.is_chain and option.depth and not (rows > 0 and self.per_size):  # by chain position
                d = min(option.depth, len(firsts))
                mean[s], var[s] = first[d], second[d] - first[d] * first[d]
            elif option.depth and rows > 0:  # valued by its own steps
                m = sums / max(rows, 1e-12)
                mean[s], var[s] = 1.0 + m, max(squares / max(rows, 1e-12) - m * m, 0.0)
        self._moments = (versions, (torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64)))
        return self._moments[1]


def accepted_under(options: Sequence[TreeShape], draft: Draft,
                   result: VerifyResult) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafts each row would have accepted under each option [B, S], its accepted drafts along the step's greedy
    chain [B], the chain's drafted length [B]). A chain step (a CSpD window, a one-branch tree) shows chains only."""
    if not isinstance(draft, DraftTree) or draft.is_chain:
        accepted = result.num_accepted  # [B]
        drafted = draft.valid[:, 1:].sum(-1) if isinstance(draft, DraftTree) else result.num_drafted  # [B]
        depths = constant_on(tuple(o.depth if o.is_chain else 0 for o in options), accepted.device)  # [S]
        return torch.minimum(accepted.unsqueeze(-1), depths), accepted, drafted
    counts, chain = counterfactual_accepts(draft, result.accepted_nodes, options)
    return counts, chain, torch.full_like(chain, draft.max_depth)


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


def batch_steps_of(tokens_left: float, rows: int, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Expected steps [S] until the last of `rows` rows has emitted `tokens_left` (r) more tokens, for S options whose
    rows emit mean [S] tokens a step with variance var [S]: E[max_rows N] = sum_{n >= 0} 1 - (1 - P(N > n))^rows,
    P(N > n) = P(S_n < r) ~ Phi((r - 1/2 - n mean) / sqrt(n var)) (N a row's step count, S_n its tokens after n steps,
    normal with a continuity correction). It counts the last step whole: a row that needs 4.3 steps takes 5. Plain
    steps (mean 1, var 0) take exactly r. Only the n within 6 sd of r / mean are summed."""
    m = mean.double().clamp_min(1e-9)  # [S]
    v = var.double().clamp_min(0.0)  # [S]
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
    greedy verification (the accepted path is the target's argmax path), an estimate when sampling."""
    b, n = tree.tokens.shape
    device = tree.tokens.device
    nodes = path[:, 1:]  # [B, W-1] u_1..u_k
    on_path, at = nodes >= 0, nodes.clamp_min(0)  # [B, W-1]
    valid = tree.valid.clone()
    valid[:, 0] = False  # the root is not a draft
    index = torch.arange(n, device=device)
    earlier = index.view(1, 1, n) < index.view(1, n, 1)  # [1, N(i), N(j)] j before i
    # first children: no valid sibling before them (siblings are ordered by descending score)
    siblings = (tree.parents.unsqueeze(-1) == tree.parents.unsqueeze(1)) & valid.unsqueeze(1) & earlier  # [B, N, N]
    first = valid & ~siblings.any(-1)  # [B, N]
    chain = (on_path & first.gather(1, at)).long().cumprod(-1).sum(-1)  # [B] leading first children on the path
    out = torch.zeros(b, len(shapes), dtype=torch.long, device=device)  # [B, S]
    for s, shape in enumerate(shapes):
        if shape.is_chain:
            out[:, s] = chain.clamp_max(shape.depth)
    tree_depths = sorted({shape.depth for shape in shapes if shape.top_k > 1})
    if tree.is_chain or not tree_depths or tree.scores is None:  # a chain shows chains only
        return out, chain
    scores = tree.scores.float()
    beats = valid.unsqueeze(1) & ((scores.unsqueeze(1) > scores.unsqueeze(-1))
                                  | ((scores.unsqueeze(1) == scores.unsqueeze(-1)) & earlier))  # [B, N(i), N(j)]
    depth_on_path = tree.depths.gather(1, at)  # [B, W-1]
    for depth in tree_depths:
        columns = [s for s, shape in enumerate(shapes) if shape.top_k > 1 and shape.depth == depth]
        shallow = (tree.depths <= depth).unsqueeze(1)  # [B, 1, N(j)]
        rank = (beats & shallow).sum(-1).gather(1, at)  # [B, W-1] rank among the drafted nodes of depth <= d
        rank = torch.where(on_path & (depth_on_path <= depth), rank, n)  # off the path or too deep: never inside
        worst = rank.cummax(-1).values  # [B, W-1] the worst rank of each leading part of the path
        kept = constant_on(tuple(shapes[s].total - 1 for s in columns), device)  # [C] drafted nodes kept
        out[:, columns] = (worst.unsqueeze(-1) < kept).sum(1)  # [B, C] leading path nodes inside each tree
    return out, chain

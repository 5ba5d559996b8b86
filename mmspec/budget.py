"""How much to draft each step: the loop's draft budget (docs/architecture.md; facts: ../shared/reference/budgets.md).

Speculation pays only when the tokens it saves cost more than the drafting and the wider verify it adds, and that
depends on the device, the batch and the acceptance seen so far. `AutoBudget` picks, before every draft, the draft
size k (chain drafts or Jacobi window drafts; 0 = a plain one-token step) that maximises expected tokens per second:

    E[tokens | k] = 1 + sum_{i=1..k} prod_{j<=i} a_j        a_j = P(draft j accepted | drafts 1..j-1 accepted)
    seconds(k)    = draft_seconds(B, k) + T_verify(B, k + 1)      T_verify from the measured table (mmspec.cost)
    k*            = argmax_k E[tokens | k] / seconds(k)           k = 0 (no drafts) is always a candidate

a_j is estimated from the verdicts of earlier steps of this run (all rows pooled), shrunk towards the pooled rate of
every position (a Beta prior of strength `prior_strength`), and positions never reached yet take the rate of the
deepest one reached, so the policy keeps exploring longer drafts while they pay.

Why it stays lossless: k is chosen from past verdicts and the measured costs only, before any token of this step is
drafted; a drafted token is never dropped because of its own value, and the verifier's randomness is fresh. The
draft length is then a stopping time of the draft-side process, which changes the speed, not the law (SpecDec++,
DISCO; reference budgets.md; tested with a distribution test). The costs come from the cached table, so the choices
are a deterministic function of the run's own history: a seeded run repeats exactly.

    budget = AutoBudget(sizes=range(0, 17), verify_seconds=lambda b, n: table.seconds_at(b, n))
    k = budget.choose(batch=4); ...; budget.observe(result, active)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mmspec.errors import check
from mmspec.verify import VerifyResult

# (batch, drafts k) -> seconds the drafter spends producing k drafts (0 for model-free drafters such as Jacobi)
DraftSeconds = Callable[[int, int], float]
# (batch, tokens per row) -> seconds of one target forward
VerifySeconds = Callable[[int, int], float]


class AutoBudget:
    """The expected-throughput draft budget (see the module docstring). sizes: the draft counts the drafter can
    make (0 included or not: it is always added); verify_seconds(B, n): the target's forward time; draft_seconds(B,
    k): the drafter's. `chosen` counts how often each size was picked (the bench's histogram)."""

    def __init__(self, sizes: Iterable[int], verify_seconds: VerifySeconds, draft_seconds: DraftSeconds | None = None,
                 prior_rate: float = 0.5, prior_strength: float = 4.0) -> None:
        self.sizes = sorted({0, *(int(k) for k in sizes)})
        check(self.sizes[0] >= 0, f"draft sizes must be >= 0, got {self.sizes}.")
        check(0.0 < prior_rate < 1.0 and prior_strength > 0, "prior_rate must be in (0, 1), prior_strength > 0.")
        self.verify_seconds, self.draft_seconds = verify_seconds, draft_seconds or (lambda b, k: 0.0)
        self.prior_rate, self.prior_strength = prior_rate, prior_strength
        depth = self.sizes[-1]
        self.reached = torch.zeros(depth, dtype=torch.float64)  # [K] rows that drafted position j after j-1 accepts
        self.accepted = torch.zeros(depth, dtype=torch.float64)  # [K] of those, accepted at position j
        self.chosen: dict[int, int] = {}

    # ------------------------------------------------------------------------------------------ estimates
    def rates(self) -> torch.Tensor:
        """a_j [K]: per-position acceptance given the earlier positions were accepted."""
        total_reached, total_accepted = float(self.reached.sum()), float(self.accepted.sum())
        pooled = (total_accepted + self.prior_strength * self.prior_rate) / (total_reached + self.prior_strength)
        rates = (self.accepted + self.prior_strength * pooled) / (self.reached + self.prior_strength)  # [K]
        seen = (self.reached > 0).nonzero()
        if seen.numel():  # positions never reached take the deepest reached position's rate
            deepest = int(seen[-1])
            rates[deepest + 1:] = rates[deepest]
        return rates

    def expected_tokens(self, k: int, rates: torch.Tensor | None = None) -> float:
        """E[tokens emitted per row | k drafts] = 1 + sum_i prod_{j<=i} a_j."""
        if k == 0:
            return 1.0
        rates = self.rates() if rates is None else rates
        return 1.0 + float(torch.cumprod(rates[:k], 0).sum())

    def throughput(self, batch: int, k: int, rates: torch.Tensor | None = None) -> float:
        """Expected tokens per second per row with k drafts at this batch size."""
        seconds = self.draft_seconds(batch, k) + self.verify_seconds(batch, k + 1)
        return self.expected_tokens(k, rates) / max(seconds, 1e-12)

    # ------------------------------------------------------------------------------------------- the loop
    def choose(self, batch: int) -> int:
        """The draft size for the next step (0 = a plain step)."""
        rates = self.rates()
        best = max(self.sizes, key=lambda k: (self.throughput(batch, k, rates), -k))
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def observe(self, result: VerifyResult, active: torch.Tensor) -> None:
        """Record a chain step's verdicts: position j (1-based) was reached by rows that drafted >= j and accepted
        j - 1, and accepted by those that accepted >= j."""
        k = min(result.accepted_flags.shape[1], self.reached.shape[0])
        if k == 0:
            return
        positions = torch.arange(k, device=result.num_accepted.device)  # [k] 0-based j - 1
        acc, drafted = result.num_accepted.unsqueeze(-1), result.num_drafted.unsqueeze(-1)  # [B, 1]
        reached = (acc >= positions) & (drafted > positions) & active.unsqueeze(-1)  # [B, k]
        self.reached[:k] += reached.sum(0).double().cpu()
        self.accepted[:k] += (reached & (acc > positions)).sum(0).double().cpu()

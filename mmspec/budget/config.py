"""Every constant of the draft budget, one frozen config; each value says why it is what it is.

    BudgetConfig()                        # the defaults every pipeline uses
    BudgetConfig(warmup=0, timing=False)  # a budget that decides from the table and acceptance alone (tests)
"""

from __future__ import annotations

from dataclasses import dataclass

from mmspec.errors import check


@dataclass(frozen=True)
class BudgetConfig:
    # -- acceptance model
    decay: float = 0.9  # weight of a step's verdicts after each later step: acceptance drifts along an image or
    # answer (an image's first rows draft worse than its middle), and ten steps of a batch are enough to follow it
    window_decay: float = 0.97  # the same for a drafter valued per size (Jacobi windows): with ten
    # steps a bad stretch read the best window below a smaller one and kept it off (SJD b1 89% of the fixed window of
    # 16 over 19 passes, 58% in the worst; 96% over 24 with this)
    segments: int = 4  # acceptance is learnt apart in each quarter of the tokens a call generates: an image's first
    # rows draft worse than its later ones (world LlamaGen's EAGLE chain of 2 accepts 0.27 tokens a step over an
    # image's first 4 steps, 1.1-1.2 after its 20th; SJD's windows on a 256-token world image accept almost nothing
    # over its first 16-30 tokens), and one model fed by a call's first steps under-reads the rest
    prior_rows: float = 2.0  # pseudo-rows at the pooled rate behind each position's rate: one verdict of a deep
    # position decides nothing
    # -- cost model
    step_samples: int = 9  # a step's measured seconds are the median of its last this many: a step the machine
    # paused reads 2-5x its usual time, which a mean would carry for several steps
    timing_repeats: int = 3  # timed repeats of each option when its table is measured (median; after one warm-up)
    # -- policy
    tree_depths: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16)  # tree depths offered below a drafter's own: a few, since
    tree_totals: tuple[int, ...] = (4, 8, 16, 24, 32, 48, 64, 96, 128)  # each shape is timed once per device
    warmup: int = 4  # a segment's first choices draft the exploration option until this many rows' verdicts (one
    # step at batch >= 4): one row's acceptance decides nothing
    refresh_every: int = 16  # then again at choices 16, 48, 112, ..: options not chosen learn nothing otherwise;
    # per call for drafters valued per size (a window learns nothing from others' steps: 256-token c2i SJD 96% / 86%)
    explore_cost: float = 3.0  # the exploration option costs at most this many plain steps (the full tree where
    # drafting is cheap, a chain where a wide verify costs several steps)
    hold: int = 5  # drafters valued per size (Jacobi windows) keep a window this many steps: a window's tail
    # converges over the steps it stays in the window, and its first steps after a change under-read it
    settle_after: int = 8  # this many plain choices in a row settle the segment on plain steps (no estimate until the
    # next segment); in the last segment they end the call's drafting (the loop stops asking the budget and the
    # drafter: vanilla's cost for the rest of a call where no drafting pays)
    plain_probe: int = 3  # plain steps measured when the estimate drafts and no plain step ran yet: a drafting
    # step's cost past its timed propose + verify (the loop's commit and bookkeeping) shows only against a measured
    # plain step (prompt lookup on the world LLaVA at batch 1: auto 0.73x of vanilla without, drafting every step)
    # -- call gate
    call_backoff: int = 4  # calls run without the drafter after a call whose choices by estimate never drafted
    # (its drafter's prompt pass bought nothing); doubled after each such call, reset after one that drafted
    # -- switches (True in every pipeline; off to isolate a part in tests and A/B runs)
    timing: bool = True  # correct the table by the call's own step times (the load, the loop's own work)
    batch_tail: bool = True  # at batch > 1 compare options by the time until the last row is done
    gate: bool = True  # run whole calls without the drafter after a call that never drafted by estimate
    retime: bool = True  # a probe after calls without the drafter times its steps afresh (the load may have moved)
    resume: bool = True  # a refresh ends a segment's settling on plain steps (else what it shows is never read)

    def __post_init__(self) -> None:
        for name in ("decay", "window_decay"):
            check(0.0 < getattr(self, name) <= 1.0, f"{name} must be in (0, 1], got {getattr(self, name)}.")
        check(self.explore_cost >= 1.0, f"explore_cost must be >= 1 (plain steps), got {self.explore_cost}.")
        check(self.plain_probe >= 0, f"plain_probe must be >= 0, got {self.plain_probe}.")
        for name in ("segments", "step_samples", "timing_repeats", "hold", "settle_after", "call_backoff"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}.")

"""Speculative-decoding statistics with vLLM's metric names, mergeable across batches, JSON-serialisable.

`SpecStats.record(result, active)` keeps each step's result tensors (no tensor work in the loop); they are folded
into the counters in one batched pass when first read, by `to_dict()` / the properties. Definitions (one verify call
of one row = one row-iteration; vLLM's, which count a "draft" only where tokens were drafted):

- num_target_forwards (NFE): target forward passes (prefill included).
- num_verify_rows: row-iterations verified = num_drafts + num_plain_steps.
- num_drafts: row-iterations that verified >= 1 draft token; num_plain_steps: row-iterations that verified none
  (a plain step: a draft budget's choice, a draft capped at the end of a row, every step of vanilla decoding).
- num_draft_tokens: positions that could be accepted; num_accepted_tokens: drafts accepted; num_emitted_tokens:
  accepted + recovered/bonus tokens, plain steps included.
- mean_acceptance_length = 1 + num_accepted_tokens / num_drafts (includes the bonus token, vLLM / EAGLE
  convention; ViSpec's tau excludes it): over drafting row-iterations only; 1.0 when rows were verified but none
  drafted (vanilla), 0.0 when nothing was recorded. Computed as the tokens the drafting row-iterations emitted /
  num_drafts, the same for every discrete rule, and true for CSpD's windows, which emit the whole window (no bonus)
  when every draft is accepted. `tokens_per_verify_row`: emitted tokens per row-iteration over all of them, plain
  steps included.
- draft_acceptance_rate = num_accepted_tokens / num_draft_tokens.
- per_position_acceptance_rate[i] = drafts accepted at position i / drafts that had a position i.
- acceptance_histogram[n] = drafting row-iterations that accepted exactly n drafts (plain steps are not counted).
- extra: method- and budget-specific counters: `budget_<size>` the steps a draft budget ran at each draft size or
  tree shape (`budget_0`: the plain steps it chose), `calls_without_drafter` the calls it ran wholly without the
  drafter (`budget_notice` turns them into one line for the user).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from mmspec.verify.base import VerifyResult


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.shape[0] >= size:
        return t
    return torch.cat([t, t.new_zeros(size - t.shape[0])])


def _add_grown(total: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """total + new, the shorter one padded with zeros (None: nothing yet)."""
    if total is None:
        return new
    return _grow(total, new.shape[0]) + _grow(new, total.shape[0])


FOLD_EVERY = 256  # steps kept before they are folded into the counters


# count names of stats files written before 2026-11-24 -> their names now
OLD_NAMES = {"_verify_rows": "num_verify_rows", "_accepted_per_position": "accepted_per_position",
             "_drafted_per_position": "drafted_per_position"}


@dataclass
class SpecStats:
    """Counters of one generation run (or of many, merged with `+`)."""

    num_target_forwards: int = 0
    num_draft_forwards: int = 0
    wall_time: float = 0.0
    extra: dict = field(default_factory=dict)  # method-specific counters (e.g. fallback counts)
    _counts: dict = field(default_factory=dict, repr=False)  # device tensors until read
    _accepted_pos: torch.Tensor | None = field(default=None, repr=False)
    _drafted_pos: torch.Tensor | None = field(default=None, repr=False)
    _hist: torch.Tensor | None = field(default=None, repr=False)
    _per_row: list = field(default_factory=list, repr=False)  # (result, [B] active, [B] rows or None) a step
    # the rows' accept lengths of runs added with `+`, one part per run (rows [R_i] of lists): a job that merges a
    # batch at a time copies its parts' references at each merge, not every row's (K batches: K^2 / 2, not K^2 B / 2)
    _row_parts: list = field(default_factory=list, repr=False)
    _steps: list = field(default_factory=list, repr=False)  # recorded steps not yet folded into the counters

    # ------------------------------------------------------------------------------------------ record
    def record(self, result: VerifyResult, active: torch.Tensor | None = None, *, keep_per_row: bool = True,
               rows: torch.Tensor | None = None) -> None:
        """Keep one verify call's outcome; `active` [B] bool masks rows that are already finished; `rows` [B] the
        call's own index of each row, once the loop has dropped finished rows (None: row b is the call's row b).
        No tensor work here (the loop calls this every step): the counters are folded in when first read, all steps
        at once."""
        if active is None:
            active = torch.ones_like(result.num_accepted, dtype=torch.bool)
        self._steps.append((result, active))
        if keep_per_row:
            self._per_row.append((result, active, rows))
        if len(self._steps) >= FOLD_EVERY:  # bound what is held on long runs
            self._fold()

    def _fold(self) -> None:
        """Fold the kept steps into the counters (one batched pass per shape: grouped by draft width and rows, which
        change when the loop drops finished rows; none kept: nothing)."""
        steps, self._steps = self._steps, []
        for shape in sorted({tuple(result.accepted_flags.shape) for result, _ in steps}):  # [B, K] each
            group = [(result, active) for result, active in steps if tuple(result.accepted_flags.shape) == shape]
            k = shape[1]
            acc, drafted, emitted = (torch.stack([getattr(result, name) for result, _ in group])  # [S, B] each
                                     for name in ("num_accepted", "num_drafted", "num_emitted"))
            flags = torch.stack([result.accepted_flags for result, _ in group])  # [S, B, K]
            active = torch.stack([active for _, active in group])  # [S, B]
            a = active.long()
            drafting = a * (drafted > 0)  # [S, B] 1 where an active row verified >= 1 draft token
            counts = {
                "num_drafts": drafting.sum(),
                "num_plain_steps": (a - drafting).sum(),
                "num_draft_tokens": (drafted * a).sum(),
                "num_accepted_tokens": (acc * a).sum(),
                "num_emitted_tokens": (emitted * a).sum(),
                "num_verify_rows": a.sum(),
            }
            for key, value in counts.items():
                self._counts[key] = self._counts.get(key, 0) + value
            positions = torch.arange(k, device=acc.device)
            had_position = (positions < drafted.unsqueeze(-1)) & active.unsqueeze(-1)  # [S, B, K]
            accepted_pos = (flags & had_position).long().sum((0, 1))  # [K]
            drafted_pos = had_position.long().sum((0, 1))
            hist = torch.zeros(k + 1, dtype=torch.long, device=acc.device).scatter_add_(
                0, acc.clamp_max(k).flatten(), drafting.flatten())  # [K+1] drafting row-iterations only
            self._accepted_pos = _add_grown(self._accepted_pos, accepted_pos)
            self._drafted_pos = _add_grown(self._drafted_pos, drafted_pos)
            self._hist = _add_grown(self._hist, hist)

    def add_extra(self, key: str, value: float) -> None:
        self.extra[key] = self.extra.get(key, 0) + value

    # ------------------------------------------------------------------------------------------- read
    def _count(self, key: str) -> int:
        self._fold()
        value = self._counts.get(key, 0)
        return int(value) if not isinstance(value, torch.Tensor) else int(value.item())

    @property
    def num_drafts(self) -> int:
        """Row-iterations that verified >= 1 draft token."""
        return self._count("num_drafts")

    @property
    def num_plain_steps(self) -> int:
        """Row-iterations that verified no draft token (plain steps; every step of vanilla decoding)."""
        return self._count("num_plain_steps")

    @property
    def num_verify_rows(self) -> int:
        """Row-iterations verified: num_drafts + num_plain_steps."""
        return self._count("num_verify_rows")

    @property
    def num_draft_tokens(self) -> int:
        return self._count("num_draft_tokens")

    @property
    def num_accepted_tokens(self) -> int:
        return self._count("num_accepted_tokens")

    @property
    def num_emitted_tokens(self) -> int:
        return self._count("num_emitted_tokens")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafting row-iteration (the bonus token included, plain steps left out: vLLM's), which
        is 1 + accepted tokens / num_drafts for every discrete rule; 1.0 when rows were verified but none drafted
        (vanilla), 0.0 when nothing was recorded. A plain step emits one token, so its tokens are taken out."""
        drafts = self.num_drafts
        if drafts:
            return (self.num_emitted_tokens - self.num_plain_steps) / drafts
        return 1.0 if self.num_verify_rows else 0.0

    @property
    def tokens_per_verify_row(self) -> float:
        """Emitted tokens per verified row-iteration, plain steps included (1.0 for vanilla; 0.0 when nothing was
        recorded): what each row's verify step yielded on average, whatever the budget drafted."""
        rows = self.num_verify_rows
        return self.num_emitted_tokens / rows if rows else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        drafted = self.num_draft_tokens
        return self.num_accepted_tokens / drafted if drafted else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        self._fold()
        if self._drafted_pos is None:
            return []
        acc, dr = self._accepted_pos.tolist(), self._drafted_pos.tolist()
        return [a / d if d else 0.0 for a, d in zip(acc, dr)]

    @property
    def acceptance_histogram(self) -> list[int]:
        """[n] = drafting row-iterations that accepted exactly n drafts; [] when none drafted."""
        self._fold()
        return [] if self._hist is None or not int(self._hist.sum()) else self._hist.tolist()

    def accept_lengths_per_row(self) -> list[list[int]]:
        """Spec-Bench's `accept_lengths`: per row, the emitted tokens of each verify call it took part in (the rows
        of runs merged with `+` first, in their order)."""
        return [row for part in self._parts_of_rows() for row in part]

    def _parts_of_rows(self) -> list[list[list[int]]]:
        """The rows' accept lengths, one part per run merged (`_row_parts`), then this run's own rows, if any."""
        if not self._per_row:
            return list(self._row_parts)
        batch = self._per_row[0][1].shape[0]  # the call's rows (its first steps have them all)
        emitted, active = [], []  # per iteration: [B] each, dropped rows inactive
        for result, on, rows in self._per_row:
            if rows is None:
                emitted.append(result.num_emitted)
                active.append(on)
            else:
                emitted.append(result.num_emitted.new_zeros(batch).index_copy(0, rows, result.num_emitted))
                active.append(on.new_zeros(batch).index_copy(0, rows, on))
        emitted, active = torch.stack(emitted, 1).tolist(), torch.stack(active, 1).tolist()  # [B, iterations]
        return self._row_parts + [[[e for e, m in zip(er, ar) if m] for er, ar in zip(emitted, active)]]

    def to_dict(self) -> dict:
        self._fold()
        return {
            "num_target_forwards": self.num_target_forwards,
            "num_draft_forwards": self.num_draft_forwards,
            "num_drafts": self.num_drafts,
            "num_plain_steps": self.num_plain_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_verify_row": self.tokens_per_verify_row,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "wall_time": self.wall_time,
            "extra": dict(self.extra),
            "num_verify_rows": self.num_verify_rows,
            "accepted_per_position": [] if self._accepted_pos is None else self._accepted_pos.tolist(),
            "drafted_per_position": [] if self._drafted_pos is None else self._drafted_pos.tolist(),
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> SpecStats:
        """The inverse of `to_dict`. Also reads older files: the underscored count names of files written before
        2026-11-24, and files without `num_plain_steps` (derived as num_verify_rows - num_drafts; their histogram
        counted plain steps at 0 accepted, taken out here)."""
        data = {OLD_NAMES.get(k, k): v for k, v in data.items()}
        out = cls(num_target_forwards=data["num_target_forwards"], num_draft_forwards=data["num_draft_forwards"],
                  wall_time=data["wall_time"], extra=dict(data.get("extra", {})))
        out._counts = {k: data[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                            "num_emitted_tokens")}
        out._counts["num_verify_rows"] = data.get("num_verify_rows", data["num_drafts"])
        plain = data.get("num_plain_steps")
        out._counts["num_plain_steps"] = out._counts["num_verify_rows"] - data["num_drafts"] if plain is None else plain
        if data.get("drafted_per_position"):
            out._accepted_pos = torch.tensor(data["accepted_per_position"])
            out._drafted_pos = torch.tensor(data["drafted_per_position"])
        hist = list(data.get("acceptance_histogram") or [])
        if hist and plain is None:  # an older file: its bin 0 held the plain steps too
            hist[0] = max(0, hist[0] - out._counts["num_plain_steps"])
        if hist:
            out._hist = torch.tensor(hist)
        return out

    def __add__(self, other: SpecStats) -> SpecStats:
        """Merge two runs' counters; the merged run's `accept_lengths_per_row` lists this run's rows, then
        `other`'s (a pipeline's batches, in order)."""
        a, b = self.to_dict(), other.to_dict()
        merged = {k: a[k] + b[k] for k in ("num_target_forwards", "num_draft_forwards", "num_drafts",
                                           "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                                           "wall_time", "num_verify_rows", "num_plain_steps")}
        for key in ("accepted_per_position", "drafted_per_position", "acceptance_histogram"):
            n = max(len(a[key]), len(b[key]))
            merged[key] = [x + y for x, y in zip(a[key] + [0] * (n - len(a[key])), b[key] + [0] * (n - len(b[key])))]
        merged["extra"] = {k: a["extra"].get(k, 0) + b["extra"].get(k, 0) for k in set(a["extra"]) | set(b["extra"])}
        out = SpecStats.from_dict(merged)
        out._row_parts = self._parts_of_rows() + other._parts_of_rows()
        return out


# ------------------------------------------------------------------------------------------ the budget, for users
def budget_ran(stats: SpecStats) -> bool:
    """Whether a draft budget chose the run's steps: it counts them in `extra` (`budget_<size>`,
    `calls_without_drafter`); a run without one (vanilla, `budget="fixed"`) has neither."""
    return any(key.startswith("budget_") or key == "calls_without_drafter" for key in stats.extra)


NOTICE_MIN_DRAFTS = 8  # drafting steps before "accepted none" is said: a short answer's one or two say little


def budget_notice(stats: SpecStats, method: str, hint: str = "--budget fixed") -> str | None:
    """One line for the user when a draft budget kept `method` from drafting on most of its verify steps (drafting
    row-iterations fewer than half of those verified) by choosing plain steps or running calls without the drafter:
    the counts, why, and how to draft every step (`hint`: "--budget fixed" on a command line, 'budget="fixed"' in
    library use). Else, with or without a budget, one line when the method drafted but accepted none of its drafts
    (on at least `NOTICE_MIN_DRAFTS` drafting steps: each paid for nothing, the drafter does not match the target
    under the rule). None otherwise."""
    rows, drafts = stats.num_verify_rows, stats.num_drafts
    without = int(stats.extra.get("calls_without_drafter", 0))
    chose_plain = stats.extra.get("budget_0", 0) > 0 or without > 0
    if not budget_ran(stats) or not chose_plain or 2 * drafts >= rows:
        if drafts >= NOTICE_MIN_DRAFTS and stats.num_accepted_tokens == 0:
            return (f"note: {method} accepted none of the {stats.num_draft_tokens} tokens it drafted on {drafts} of "
                    f"{rows} verify steps: each of those steps cost more than a plain one and saved nothing (the "
                    f"drafts do not match the target under this acceptance rule); {hint.replace('fixed', 'auto')} "
                    f"runs plain steps where drafting does not pay.")
        return None
    calls = f" and ran {without} call{'' if without == 1 else 's'} wholly without the drafter" if without else ""
    return (f"note: {method} drafted on {drafts} of {rows} verify steps (counted per row): the draft budget chose "
            f"{stats.num_plain_steps} plain steps{calls}, as on this device drafting was predicted slower than plain "
            f"steps; {hint} drafts every step.")


def budget_sizes(stats: SpecStats) -> dict[str, int]:
    """The draft sizes (tree shapes) a draft budget chose and its steps at each, most used first ("plain" for
    `budget_0`); empty without a budget."""
    sizes = {key[len("budget_"):]: int(value) for key, value in stats.extra.items() if key.startswith("budget_")}
    named = {("plain" if size == "0" else size): count for size, count in sizes.items()}
    return dict(sorted(named.items(), key=lambda item: -item[1]))


def budget_summary(stats: SpecStats) -> str | None:
    """A short line of what a draft budget did: the verify steps drafted, the sizes it chose (steps at each) and the
    calls it ran without the drafter; None for a run without a budget."""
    if not budget_ran(stats):
        return None
    sizes = ", ".join(f"{size} ×{count}" for size, count in budget_sizes(stats).items()) or "none"
    without = int(stats.extra.get("calls_without_drafter", 0))
    calls = f"; {without} call{'' if without == 1 else 's'} without the drafter" if without else ""
    return (f"draft budget: drafted on {stats.num_drafts} of {stats.num_verify_rows} verify steps (counted per row); "
            f"sizes chosen (steps): {sizes}{calls}")

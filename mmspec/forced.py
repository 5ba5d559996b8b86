"""Acceptance-controlled runs: every operation of a method at its real cost, acceptance set by a profile.

A model's forward costs the same whatever its weights; only acceptance needs trained ones. To measure a method at a
size whose trained weights are not here (an official LlamaGen-XL with random weights), the bench
(`mmspec bench --force-acceptance PROFILE`) runs the method for real (the drafter's forwards, the verify at its
real width, the rule, the commit and rollback, the budget) and only rewrites the TOKENS of each draft after the
drafter proposed them, so that the target accepts them at the profile's rates:

    reference = vanilla's tokens for the same inputs and generators      # a recorded, untimed vanilla call
    for each draft position i (depth i of the path to a tree's deepest node):
        token = reference[next index + i]   with probability alpha_i     # the profile's conditional rate
              = a token != reference          otherwise (every other tree node too)

Greedy and coupled rules accept a draft token exactly when it equals the target's own token at that index
(`mmspec.verify.coupled`), so with a reference from the same device, dtype and generators the output stays
vanilla's (the bench's exactness figure checks it) and the accepted length follows the profile; other rules
(speculative sampling with the drafter's q, LANTERN, GSD) decide with their own tests, so their acceptance only
approximates the profile and their outputs are timing-only. Where the target's numerics differ between a one-token
step and a wide verify (bf16 near-ties), a row can leave the reference; from then on its drafts are rejected: the
measured step compression shows it. The mode is reachable only through `forcing(...)`, never from a pipeline
call.

Glossary: alpha_i = P(draft position i accepted | positions < i accepted) (1-based); tau = the mean tokens a
drafting step emits, 1 + sum_{i<=D} prod_{j<=i} alpha_j for drafts of depth D.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.errors import InputError, check
from mmspec.tree import DraftTree
from mmspec.verify import ChainDraft, Draft, VerifyResult

EXACT_RULES = ("greedy", "coupled")  # rules that accept a draft exactly when it is the target's own token
PROFILE_FORMS = ("alpha=A", "rates=A1,A2,...", "tau=T:depth=D", "SUMMARY.json:method=LABEL[:batch=B]",
                 "SUMMARY.json[:batch=B] (each method its own row: same label, else same method)")


@dataclass(frozen=True)
class AcceptanceProfile:
    """Conditional acceptance rates per draft position (`rates[i]` for position i + 1; the last one repeats)."""

    rates: tuple[float, ...]
    source: str = ""

    def __post_init__(self) -> None:
        check(len(self.rates) > 0 and all(0.0 <= a <= 1.0 for a in self.rates),
              f"acceptance rates must be one or more numbers in [0, 1], got {list(self.rates)}.")

    def rate_table(self, depth: int, device: torch.device) -> torch.Tensor:
        """[depth] alpha at positions 1..depth (the last rate repeated)."""
        rates = list(self.rates[:depth]) + [self.rates[-1]] * max(0, depth - len(self.rates))
        return torch.tensor(rates, dtype=torch.float32, device=device)

    def mean_accepted_length(self, depth: int) -> float:
        """tau: 1 + the expected accepted drafts of a depth-`depth` draft."""
        total, alive = 1.0, 1.0
        for a in self.rate_table(depth, torch.device("cpu")).tolist():
            alive *= a
            total += alive
        return total


def constant_rate_for(tau: float, depth: int) -> float:
    """The alpha with 1 + alpha + ... + alpha^depth = tau (bisection): a paper's mean acceptance length at its
    draft depth as one rate per position."""
    check(1.0 <= tau <= depth + 1, f"tau must lie in [1, depth + 1] = [1, {depth + 1}], got {tau}.")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid ** i for i in range(depth + 1)) < tau else (low, mid)
    return (low + high) / 2


def conditional_rates(unconditional: Sequence[float]) -> tuple[float, ...]:
    """alpha_i = r_i / r_(i-1) from r_i = P(accepted >= i) (a bench row's `per_position_acceptance_rate`)."""
    rates, previous = [], 1.0
    for r in unconditional:
        rates.append(min(1.0, r / previous) if previous > 0 else 0.0)
        previous = r
    return tuple(rates)


def summary_profiles(path: Path, batch: int | None) -> dict[tuple[str, str], AcceptanceProfile]:
    """{(label, method): profile} of every drafting row of a bench summary.json at `batch` (None: its first
    batch size)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read the bench summary {str(path)!r} ({err}); pass the summary.json a "
                         "`mmspec bench` run wrote.") from None
    tables = summary.get("batch_sizes", []) if isinstance(summary, dict) else []
    tables = [t for t in tables if batch is None or t.get("batch_size") == batch][:1]
    check(bool(tables), f"{str(path)!r} has no table at batch size {batch}.")
    return {(r["method"], r.get("base_method", r["method"])):
            AcceptanceProfile(conditional_rates(r["per_position_acceptance_rate"]), f"{path}:method={r['method']}")
            for r in tables[0]["methods"] if r.get("per_position_acceptance_rate")}


def rates_from_summary(path: Path, method: str, batch: int | None) -> tuple[float, ...]:
    """The conditional rates of one row (by label) of a bench summary.json."""
    profiles = summary_profiles(path, batch)
    found = [profile for (label, _), profile in profiles.items() if label == method]
    where = f"batch size {batch}" if batch is not None else "its first batch size"
    check(bool(found), f"{str(path)!r} has no drafting row {method!r} at {where}; its drafting rows: "
                       f"{', '.join(label for label, _ in profiles) or 'none'}.")
    return found[0].rates


def parse_profile(text: str) -> AcceptanceProfile:
    """An AcceptanceProfile from one of PROFILE_FORMS; InputError naming the forms otherwise."""
    head, _, tail = text.strip().partition(":")
    forms = "; ".join(PROFILE_FORMS)
    try:
        if head.endswith(".json"):  # (a label may hold colons itself: "eagle:budget=fixed")
            check(tail.startswith("method="), f"profile {text!r} must name the row: {head}:method=LABEL.")
            label, _, batch = tail.removeprefix("method=").partition(":batch=")
            return AcceptanceProfile(rates_from_summary(Path(head), label, int(batch) if batch else None), text)
        options = dict(item.partition("=")[::2] for item in tail.split(":") if item)
        key, _, value = head.partition("=")
        if key == "alpha":
            return AcceptanceProfile((float(value),), text)
        if key == "rates":
            return AcceptanceProfile(tuple(float(v) for v in value.split(",")), text)
        if key == "tau":
            check("depth" in options, f"profile {text!r} must give the depth its tau was measured at: "
                                      f"tau={value}:depth=D.")
            return AcceptanceProfile((constant_rate_for(float(value), int(options["depth"])),), text)
    except InputError:
        raise
    except ValueError:
        raise InputError(f"cannot read the acceptance profile {text!r}; forms: {forms}.") from None
    raise InputError(f"unknown acceptance profile {text!r}; forms: {forms}.")


# ------------------------------------------------------------------------------------------------ rewriting
def other_token(reference: torch.Tensor) -> torch.Tensor:
    """A token id != reference inside [0, max(reference, 1)] (so inside any vocabulary that holds reference)."""
    return torch.where(reference > 0, reference - 1, reference + 1)


def deepest_path(tree: DraftTree) -> torch.Tensor:
    """[B, D+1] the node indices (root first, -1 past its end) of the root's path to its deepest node (the lowest
    index among the deepest), so that a profile can reach every depth the tree drafts."""
    n = tree.num_nodes
    index = torch.arange(n, device=tree.tokens.device)
    rank = torch.where(tree.valid, tree.depths * n + (n - 1 - index), -1)  # [B, N] deepest first, then lowest index
    deepest = rank.argmax(-1)  # [B]
    return tree.paths().gather(1, deepest.view(-1, 1, 1).expand(-1, 1, tree.max_depth + 1)).squeeze(1)


def on_path(tree: DraftTree, path: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: whether each node lies on `path` [B, D+1]."""
    n = tree.num_nodes
    marks = torch.zeros(tree.batch_size, n + 1, dtype=torch.bool, device=tree.tokens.device)
    marks.scatter_(1, path.masked_fill(path < 0, n), True)  # -1 entries land in the spare column n
    return marks[:, :n]


def forced_result(result: VerifyResult, wanted: torch.Tensor, accepted: torch.Tensor,
                  path: torch.Tensor | None) -> VerifyResult:
    """The decision the profile made, in `result`'s shapes: each row accepts its first `accepted` [B] drafts (the
    reference's tokens) and emits the reference's next token; `wanted` [B, W] the reference from the draft's first
    index, `path` [B, W] a tree's forced path (None for a chain)."""
    width = result.output_tokens.shape[1]  # K + 1 (tree: D + 1)
    column = torch.arange(width, device=accepted.device)
    output = torch.where(column <= accepted.unsqueeze(-1), wanted[:, :width], -1)  # [B, W]
    flags = column[: width - 1] < accepted.unsqueeze(-1)  # [B, W-1]
    nodes = None if path is None else torch.where(column <= accepted.unsqueeze(-1), path, -1)  # [B, W]
    return VerifyResult(output_tokens=output, num_accepted=accepted, accepted_flags=flags,
                        num_drafted=result.num_drafted, accepted_nodes=nodes)


@dataclass
class ForcedCall:
    """One pipeline call under a profile: the reference tokens of its rows (None while recording), its draws."""

    profile: AcceptanceProfile
    reference: torch.Tensor | None  # [B0, T] the call's rows' vanilla tokens
    seed: int = 0  # of the draws (the bench's: from the rows' keys, so each call draws its own)
    generator: torch.Generator | None = None
    rewrites: int = 0  # drafts rewritten in this call
    decisions: int = 0  # verify results replaced by the profile's decision (rules other than EXACT_RULES)
    decision: tuple | None = None  # (wanted [B, W], accepted [B], tree path [B, W] or None) of the last rewrite
    recorded: torch.Tensor | None = None  # what a recording call generated [B0, T]
    rates: dict = field(default_factory=dict)  # (depth, device) -> [depth] alpha, made once per call

    def _reference_at(self, rows: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, K] token indices -> the reference tokens [B, K] of the rows held."""
        reference = self.reference.to(positions.device)
        if rows is not None:
            reference = reference.index_select(0, rows)
        index = positions.clamp(0, reference.shape[1] - 1)
        return reference.gather(1, index).clamp_min(0)  # (-1 padding after a row's end: any token)

    def _accepts(self, batch: int, depth: int, device: torch.device) -> torch.Tensor:
        """[B, depth] bool: whether each position's draft is the reference token (alpha_i each, independent)."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        draws = torch.rand(batch, depth, generator=self.generator, device=device)  # [B, D]
        if (depth, device) not in self.rates:  # (one copy to the device per draft depth, not one a step)
            self.rates[(depth, device)] = self.profile.rate_table(depth, device)
        return draws < self.rates[(depth, device)]

    def rewrite(self, draft: Draft, num_generated: torch.Tensor, rows: torch.Tensor | None) -> Draft:
        """The draft with its tokens set by the profile (shapes, probabilities and structure unchanged); what it
        decided stays for `decide`."""
        self.decision = None
        if self.reference is None or (isinstance(draft, ChainDraft) and draft.tokens.shape[1] == 0):
            return draft
        self.rewrites += 1
        device = num_generated.device
        depth = draft.tokens.shape[1] if isinstance(draft, ChainDraft) else max(1, draft.max_depth)
        wanted = self._reference_at(rows, num_generated.unsqueeze(-1) + torch.arange(depth + 1, device=device))
        accepts = self._accepts(draft.tokens.shape[0], depth, device)  # [B, D] the profile's draws
        if isinstance(draft, ChainDraft):  # wanted [B, K+1]: the reference from the draft's first index on
            tokens = torch.where(accepts, wanted[:, :depth], other_token(wanted[:, :depth]))
            drafted = torch.arange(depth, device=device) < draft.resolved_num_draft().unsqueeze(-1)  # [B, K]
            self.decision = (wanted, (accepts & drafted).cumprod(-1).sum(-1), None)
            return ChainDraft(torch.where(draft.tokens >= 0, tokens, draft.tokens), draft.probs, draft.num_draft)
        path = deepest_path(draft)  # [B, D+1]
        level = (draft.depths - 1).clamp(0, depth - 1)  # [B, N] the node's draft position
        forced = on_path(draft, path) & accepts.gather(1, level)
        tokens = torch.where(forced, wanted.gather(1, level), other_token(wanted.gather(1, level)))
        keep = ~draft.valid | (draft.depths == 0)  # the root and padding stay
        self.decision = (wanted, (accepts & (path[:, 1:] >= 0)).cumprod(-1).sum(-1), path)
        return DraftTree(tokens=torch.where(keep, draft.tokens, tokens), parents=draft.parents,
                         depths=draft.depths, valid=draft.valid, max_depth=draft.max_depth,
                         max_children=draft.max_children, child_probs=draft.child_probs, sampled=draft.sampled,
                         scores=draft.scores)

    def decide(self, result: VerifyResult, rule_name: str) -> VerifyResult:
        """The rule's result where the rule accepts exactly the target's own tokens (greedy, coupled); else the
        profile's decision (`forced_result`: the outputs stay the reference's; the timing is the rule's)."""
        if self.decision is None or rule_name in EXACT_RULES:
            return result
        self.decisions += 1
        return forced_result(result, *self.decision)

    def finish(self, tokens: torch.Tensor) -> None:
        """End of the call: a recording call keeps its tokens [B0, T] (the reference of the calls to come)."""
        if self.reference is None:
            self.recorded = tokens.detach().clone()


_CURRENT: ContextVar[ForcedCall | None] = ContextVar("mmspec_forced_call", default=None)


def current_call() -> ForcedCall | None:
    """The forced call the loop is inside (None in every normal call)."""
    return _CURRENT.get()


@dataclass
class Forcing:
    """The profile of a run (one for every method, or one per method from a bench summary) and the reference
    tokens recorded so far, per sample key (the bench's question ids)."""

    profile: AcceptanceProfile | None = None  # every method's
    per_method: dict[tuple[str, str], AcceptanceProfile] | None = None  # {(label, method): profile}
    source: str = ""
    references: dict = field(default_factory=dict)  # key -> [T] tokens

    def profile_for(self, label: str, method: str) -> AcceptanceProfile | None:
        """The profile of a configuration: the run's, else its own label's row, else its method's first row."""
        if self.profile is not None or not self.per_method:
            return self.profile
        by_label = [p for (row, _), p in self.per_method.items() if row == label]
        by_method = [p for (_, base), p in self.per_method.items() if base == method]
        return (by_label or by_method or [None])[0]

    def unprofiled(self, methods: Sequence[tuple[str, str]], reference: str = "vanilla") -> list[str]:
        """The labels of the (label, method)s to run that get no profile (they run with their drafters' own
        acceptance, e.g. transformers' peers); InputError before any model is built when none of them gets one."""
        missing = [label for label, method in methods if method != reference and self.profile_for(label, method)
                   is None]
        check(len(missing) < sum(method != reference for _, method in methods),
              f"the acceptance profile {self.source!r} has no row for any method run ({', '.join(missing)}); its "
              f"rows: {', '.join(label for label, _ in self.per_method or {})}.")
        return missing

    @contextmanager
    def call(self, keys: Sequence, label: str = "", method: str = "", record: bool = False
             ) -> Iterator[ForcedCall]:
        """Run one pipeline call of rows `keys` as configuration (`label`, `method`) under its profile (`record`:
        a vanilla call whose tokens become the rows' reference). A call whose rows have no reference, or a method
        without a profile (vanilla), drafts as the method would (`rewrites` stays 0)."""
        profile = self.profile_for(label, method)
        reference = None
        if not record and profile is not None and all(k in self.references for k in keys):
            reference = torch.nn.utils.rnn.pad_sequence([self.references[k] for k in keys], batch_first=True,
                                                        padding_value=-1)
        forced = ForcedCall(profile or AcceptanceProfile((0.0,)), reference, seed=zlib.crc32(repr(list(keys)).encode()))
        token = _CURRENT.set(forced)
        try:
            yield forced
        finally:
            _CURRENT.reset(token)
        if record and forced.recorded is not None:
            check(forced.recorded.shape[0] == len(keys), f"a recording call generated {forced.recorded.shape[0]} "
                  f"rows for {len(keys)} samples.")
            self.references.update({k: row.cpu() for k, row in zip(keys, forced.recorded)})


def parse_forcing(text: str) -> Forcing:
    """A Forcing from one of PROFILE_FORMS (InputError naming them otherwise)."""
    head, _, tail = text.strip().partition(":")
    if head.endswith(".json") and not tail.startswith("method="):
        check(tail == "" or tail.startswith("batch="), f"profile {text!r}: after the summary, give method=LABEL "
                                                       "or batch=B.")
        try:
            batch = int(tail.removeprefix("batch=")) if tail else None
        except ValueError:
            raise InputError(f"profile {text!r}: batch must be an integer.") from None
        return Forcing(per_method=summary_profiles(Path(head), batch), source=text)
    return Forcing(profile=parse_profile(text), source=text)

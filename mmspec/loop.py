"""The one loop: draft -> verify -> accept -> commit -> observe, generic over drafter, target and rule.

    first = target.prefill(inputs)                  # p for the first new token, [B, 1, V]
    state = DecodeState(...) + the first token      # sampled by the rule from a zero-length draft
    while not state.done.all():                     # the one host sync per iteration
        draft  = drafter.propose(state)             # ChainDraft or DraftTree
        p      = target.verify(state, draft)        # ONE target forward over all draft positions
        result = accept(rule, draft, p, state.noise, ...)  # per-row accepted length + recovered/bonus token
        target.commit(state, draft, result, active) # KV cache keeps only the accepted path
        drafter.observe(state, draft, result, active, p)
        stats.record(result, active); state.append(result, active)

With `drop_finished` (the VLM pipeline's default) a batch whose rows end at different steps (EOS) drops its finished
rows, so later steps compute only the rows still generating; the outputs keep the call's row order.

Vanilla decoding is the same loop with `NoDrafter` (zero-length drafts: every iteration emits the bonus token),
so a benchmark compares methods through one code path. Targets and drafters are small adapters around a model
(see `mmspec.lm` for causal LMs with a static KV cache); the loop knows nothing about images or text. Its phases
(prefill, draft, verify, accept, commit, observe) are timed inside `mmspec.phases.record_phases()`. Inside the
bench's acceptance-controlled calls (`mmspec.forced`, never a pipeline call) each draft's tokens are rewritten after
`propose` to follow a profile, and a rule that is not exact has its decision replaced by the profile's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mmspec.budget import Budget, BudgetCall
from mmspec.errors import check, check_positive_int
from mmspec.forced import current_call
from mmspec.noise import KeyedNoise
from mmspec.phases import phase, synchronize
from mmspec.sampling import Generators
from mmspec.stats import SpecStats
from mmspec.tree import DraftTree
from mmspec.verify import AcceptanceRule, ChainDraft, Draft, VerifyResult, accept, get_rule

DROP_AT = 0.75  # drop_finished: the finished rows go once at most this share of the rows held are still generating


def drops_rows(live: int, held: int) -> bool:
    """Whether a call dropping its finished rows drops them now: `live` of the `held` rows are still generating."""
    return live <= DROP_AT * held


@dataclass
class DecodeState:
    """Per-row progress of a batched generation."""

    output: torch.Tensor  # [B, max_new_tokens + 1] generated tokens, -1 padded (last column is scratch)
    num_generated: torch.Tensor  # [B]
    last_token: torch.Tensor  # [B] the newest token; the target has not processed it yet
    done: torch.Tensor  # [B] bool
    max_new_tokens: int
    eos_token_id: int | Sequence[int] | None = None  # one stop id or several (e.g. Qwen2-VL's two)
    iteration: int = 0
    stop_ids: torch.Tensor | None = field(init=False, default=None)  # [E] eos_token_id on the device, made once
    # once finished rows were dropped (`select_rows`): the call's own index of each row [B], and the call's output
    # and counts [B0, ...] as of the last drop (`full_output`, `full_num_generated` bring them up to date)
    row_ids: torch.Tensor | None = field(init=False, default=None)
    noise: KeyedNoise | None = field(init=False, default=None)  # the call's position-keyed randomness (rows held;
    # `new` gives keys 0, `mmspec.loop.generate` the keys drawn from the call's generators)
    _book: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.eos_token_id is not None:
            self.stop_ids = torch.as_tensor(self.eos_token_id, device=self.done.device).view(-1)

    @classmethod
    def new(cls, batch_size: int, max_new_tokens: int, device: torch.device | str,
            eos_token_id: int | Sequence[int] | None = None) -> DecodeState:
        check_positive_int("max_new_tokens", max_new_tokens)
        state = cls(output=torch.full((batch_size, max_new_tokens + 1), -1, dtype=torch.long, device=device),
                    num_generated=torch.zeros(batch_size, dtype=torch.long, device=device),
                    last_token=torch.zeros(batch_size, dtype=torch.long, device=device),
                    done=torch.zeros(batch_size, dtype=torch.bool, device=device),
                    max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        state.noise = KeyedNoise(torch.zeros(batch_size, dtype=torch.long, device=device))
        return state

    @property
    def batch_size(self) -> int:
        return self.done.shape[0]

    @property
    def tokens(self) -> torch.Tensor:
        """[B, max_new_tokens] generated tokens of the rows still kept, -1 padded (`full_tokens`: the call's)."""
        return self.output[:, : self.max_new_tokens]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows [B'] (indices into the current B, in that order; the loop drops finished rows so a step
        computes only the rows still generating). The dropped rows' tokens stay in the call's book."""
        self._write_book()
        self.row_ids = rows if self.row_ids is None else self.row_ids.index_select(0, rows)
        if self.noise is not None:
            self.noise = self.noise.select_rows(rows)
        self.output, self.num_generated, self.last_token, self.done = (
            t.index_select(0, rows) for t in (self.output, self.num_generated, self.last_token, self.done))

    def _write_book(self, output: bool = True) -> None:
        """Bring the call's book up to date with the kept rows (`output`: their tokens too, not only their counts)."""
        if self.row_ids is None:
            self._book = (self.output.clone(), self.num_generated.clone())
            return
        if output:
            self._book[0].index_copy_(0, self.row_ids, self.output)
        self._book[1].index_copy_(0, self.row_ids, self.num_generated)

    def full_output(self) -> torch.Tensor:
        """[B0, max_new_tokens + 1] the call's output, every row at its own index (dropped rows included)."""
        if self.row_ids is None:
            return self.output
        self._write_book()
        return self._book[0]

    def full_num_generated(self) -> torch.Tensor:
        """[B0] the call's tokens generated per row, every row at its own index."""
        if self.row_ids is None:
            return self.num_generated
        self._write_book(output=False)  # (the VLM pipeline reads the counts every step)
        return self._book[1]

    def full_tokens(self) -> torch.Tensor:
        """[B0, max_new_tokens] the call's generated tokens, -1 padded."""
        return self.full_output()[:, : self.max_new_tokens]

    def append(self, result: VerifyResult, active: torch.Tensor, all_active: bool = False) -> torch.Tensor:
        """Append each active row's emitted tokens, stopping at max_new_tokens and after EOS (`all_active`: the
        caller knows every row is active).

        Returns [B] the number of tokens actually appended per row.
        """
        tokens = result.output_tokens  # [B, K+1]
        if tokens.shape[1] == 1:
            return self.append_one(tokens[:, 0], active, all_active)
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        valid = (columns < (result.num_emitted * active).unsqueeze(-1))  # [B, K+1]
        finished = torch.zeros_like(self.done)
        if self.stop_ids is not None:
            is_eos = valid & torch.isin(tokens, self.stop_ids)
            first_eos = torch.where(is_eos, columns, tokens.shape[1]).min(-1).values  # [B]
            valid = valid & (columns <= first_eos.unsqueeze(-1))
            finished = is_eos.any(-1)
        dst = self.num_generated.unsqueeze(-1) + columns  # [B, K+1]
        valid = valid & (dst < self.max_new_tokens)
        dst = torch.where(valid, dst, self.max_new_tokens)  # invalid writes go to the scratch column
        self.output.scatter_(1, dst, torch.where(valid, tokens, -1))
        self.output[:, self.max_new_tokens] = -1
        added = valid.sum(-1)
        self.num_generated = self.num_generated + added
        self.last_token = torch.where(active, result.final_tokens, self.last_token)
        self.done = self.done | finished | (self.num_generated >= self.max_new_tokens)
        return added

    def end_rows(self, ends: torch.Tensor) -> None:
        """End rows early: a row with ends[r] >= 0 keeps its first ends[r] tokens and is done (a stopping criterion
        held after its token ends[r] - 1); rows with -1 are unchanged."""
        cut = ends >= 0  # [B]
        columns = torch.arange(self.output.shape[1], device=ends.device)
        self.output.masked_fill_(cut.unsqueeze(-1) & (columns >= ends.unsqueeze(-1)), -1)
        self.num_generated = torch.where(cut, ends, self.num_generated)
        self.done = self.done | cut

    def append_one(self, token: torch.Tensor, active: torch.Tensor, all_active: bool = False) -> torch.Tensor:
        """`append` for steps without drafts: each active row adds its token [B] (an active row has room for
        one). Returns [B] the number appended (active rows: 1). `all_active`: the caller knows every row is active
        (the loop at batch 1), which saves the inactive rows' seven operations."""
        if all_active:
            self.output.scatter_(1, self.num_generated.unsqueeze(-1), token.unsqueeze(-1))
            self.num_generated = self.num_generated + 1
            self.last_token = token
            self.done = self.num_generated >= self.max_new_tokens
            if self.stop_ids is not None:
                self.done = self.done | torch.isin(token, self.stop_ids)
            return active.long()
        added = active.long()  # [B]
        dst = torch.where(active, self.num_generated, self.max_new_tokens)  # inactive rows: the scratch column
        self.output.scatter_(1, dst.unsqueeze(-1), token.unsqueeze(-1))
        self.output[:, self.max_new_tokens] = -1
        self.num_generated = self.num_generated + added
        self.last_token = torch.where(active, token, self.last_token)
        self.done = self.done | (self.num_generated >= self.max_new_tokens)
        if self.stop_ids is not None:
            self.done = self.done | (active & torch.isin(token, self.stop_ids))
        return added


class Target(Protocol):
    """A model wrapped for the loop. It owns its KV cache and returns sampling distributions p."""

    def prefill(self, inputs: Any) -> torch.Tensor:
        """Run the condition / prompt; return p for the first new token, [B, 1, V]."""

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """ONE forward over the last token and the draft; p [B, K+1, V] (chain) or [B, N, V] (tree)."""

    def commit(self, state: DecodeState, draft: Draft, result: VerifyResult, active: torch.Tensor) -> None:
        """Keep the accepted path in the cache (rows not `active` keep nothing)."""


class Drafter(Protocol):
    """Proposes drafts; may keep its own cache. `forwards` counts its model calls (for stats). A drafter that a
    draft budget can steer also has `draft_sizes` (the sizes it can draft, 0 = a plain step), `set_draft_size(k)`
    and `skip(state, result, active, target_probs)` (learn a plain step's token instead of `observe`)."""

    forwards: int

    def begin(self, inputs: Any, state: DecodeState) -> None:
        """Called after prefill, with the first token in `state.last_token`."""

    def propose(self, state: DecodeState) -> Draft:
        """A ChainDraft (tokens after state.last_token) or a DraftTree rooted at state.last_token."""

    def observe(self, state: DecodeState, draft: Draft, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        """Learn what was accepted (called before `state.append`). `target_probs` is what the target's verify
        returned ([B, K+1, V] or [B, N, V]): Jacobi drafters resample their unaccepted tail from it."""


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [B, max_new_tokens] -1 padded
    num_generated: torch.Tensor  # [B]
    stats: SpecStats


# callback(state, draft, result) after each iteration; return False to stop early
StepCallback = Callable[[DecodeState, Draft, VerifyResult], Any]
# after_append(state, counts_before [B], draft, result) after every append (draft None: the prefill's token); it
# may end rows after one of their new tokens (`DecodeState.end_rows`)
AppendHook = Callable[[DecodeState, torch.Tensor, Draft | None, VerifyResult], None]


def plain_draft(batch_size: int, device: torch.device | str) -> ChainDraft:
    """The empty draft of a plain step (vanilla's every step), with its zero draft counts made once."""
    return ChainDraft(torch.empty(batch_size, 0, dtype=torch.long, device=device),
                      num_draft=torch.zeros(batch_size, dtype=torch.long, device=device))


def is_plain(draft: Draft) -> bool:
    """Whether `draft` drafts nothing (a chain of length 0): the target runs one plain step."""
    return isinstance(draft, ChainDraft) and draft.tokens.shape[1] == 0


def cap_draft(draft: Draft, room: torch.Tensor) -> Draft:
    """Limit each row's draft to `room` [B] tokens (a row can emit at most room + 1 more tokens): chains get a
    shorter num_draft, trees lose the nodes deeper than room. Padding stays in place, so shapes are static."""
    room = room.clamp_min(0)
    if isinstance(draft, ChainDraft):
        k = draft.tokens.shape[1]
        num = torch.minimum(draft.resolved_num_draft(), room)
        keep = torch.arange(k, device=room.device) < num.unsqueeze(-1)
        return ChainDraft(torch.where(keep, draft.tokens, -1), draft.probs, num)
    keep = draft.valid & (draft.depths <= room.unsqueeze(-1))
    return DraftTree(tokens=torch.where(keep, draft.tokens, -1), parents=torch.where(keep, draft.parents, -1),
                     depths=torch.where(keep, draft.depths, 0), valid=keep, max_depth=draft.max_depth,
                     max_children=draft.max_children, child_probs=draft.child_probs, sampled=draft.sampled,
                     scores=draft.scores)


def generate(target: Target, drafter: Drafter, rule: str | AcceptanceRule, inputs: Any, *, batch_size: int,
             max_new_tokens: int, generator: Generators = None, eos_token_id: int | Sequence[int] | None = None,
             device: torch.device | str = "cpu", callback: StepCallback | None = None,
             validate: str = "first", budget: Budget | None = None, drop_finished: bool = False,
             after_append: AppendHook | None = None) -> GenerationOutput:
    """Generate up to `max_new_tokens` per row with speculative decoding (vanilla with `NoDrafter`).

    validate: "first" checks the rule's inputs on the first iteration only (cheap), "always" on every one,
    "never" skips the checks. budget: a draft budget (`mmspec.budget.make_budget`) that may run the call without
    the drafter and picks each step's draft size (`drafter.set_draft_size(k)`; 0 = a plain step, after which
    `drafter.skip(...)` replaces `observe`); None = the drafter's own size every step. drop_finished: once at most
    DROP_AT of the rows held are still generating, the finished ones are dropped (`select_rows` of the state and its
    noise, the target, the drafter while it drafts), so later steps compute only the live rows; the outputs keep
    the call's row order, and a callback reads the whole call through `state.full_output()` /
    `full_num_generated()` (`state.row_ids` maps the rows held to the call's). Each row's tokens are those it gets
    without dropping (rows do not interact). after_append: called after every append (the prefill's token, with
    draft None, included) with the counts before it; it may end rows after any of their new tokens
    (`DecodeState.end_rows`: transformers' stopping criteria, `mmspec.prefixes.first_stops`), before the callback
    sees the step.

    Randomness: one key per row is drawn from `generator` (one, a list with one per row, or None) when the call
    starts, and every number after it is position-keyed (`state.noise`, `mmspec.noise`): a seeded call gives the
    same tokens whatever the budget's choices, the rows dropped or the machine's load; under a coupled rule
    (`mmspec.verify.coupled`) the same tokens as vanilla decoding with those generators.
    """
    check(validate in ("first", "always", "never"), f"validate must be first/always/never, got {validate!r}.")
    rule = get_rule(rule)
    if hasattr(target, "soft_greedy"):  # a relaxed greedy rule reads the softmax of the logits, not the argmax
        target.soft_greedy = rule.greedy_reads_softmax
    device = torch.device(device)
    stats = SpecStats()
    draft_forwards_before = getattr(drafter, "forwards", 0)
    synchronize(device)
    start = time.perf_counter()

    state = DecodeState.new(batch_size, max_new_tokens, device, eos_token_id)
    state.noise = KeyedNoise.from_generators(generator, batch_size, device)
    state.noise.coupled = rule.couples_drafts  # (its drafters draw with the target's own noise)
    # a call the budget runs without the drafter (or vanilla's drafter) keeps no room for draft nodes in a target
    # that keeps room (`draft_room`: LlamaGen's vanilla at batch 32 took 4.7% longer with a window's room)
    steering = BudgetCall(budget, stats)
    forced = current_call()  # None unless the bench forces acceptance (`mmspec.forced`)
    drafting = steering.begin(target, drafter, state, rule)
    if hasattr(target, "draft_room"):
        target.draft_room = drafting and not drafts_nothing(drafter)
    with phase("prefill"):
        first_p = target.prefill(inputs)  # [B, 1, V]
    stats.num_target_forwards += 1
    no_draft = plain_draft(batch_size, device)
    first = accept(rule, no_draft, first_p, validate=validate != "never", noise=state.noise,
                   positions=state.num_generated)
    active = ~state.done
    before = state.num_generated
    state.append(first, active)
    if after_append is not None:
        after_append(state, before, None, first)
    drop_finished = (drop_finished and batch_size > 1 and hasattr(target, "select_rows")
                     and (not drafting or hasattr(drafter, "select_rows")))
    if drafting:
        drafter.begin(inputs, state)
    while True:
        active = ~state.done
        if not drop_finished:
            if not bool(active.any()):  # the one host sync per iteration
                break
        else:
            live = int(active.sum())  # the one host sync per iteration
            if live == 0:
                break
            if drops_rows(live, state.batch_size):
                drop_finished_rows(state, target, drafter, active, drafts=drafting)
                active = ~state.done
                no_draft = plain_draft(state.batch_size, device)
        size = steering.choose(state.batch_size,
                               lambda active=active: (state.max_new_tokens - state.num_generated) * active)
        with phase("draft"):
            if size == 0:  # a plain step: the drafter is not asked
                draft = no_draft
            else:
                if size is not None:
                    drafter.set_draft_size(size)
                draft = drafter.propose(state)
                if not is_plain(draft):  # never draft past the end: a row with r tokens left accepts <= r - 1
                    draft = cap_draft(draft, state.max_new_tokens - state.num_generated - 1)
                if forced is not None:
                    draft = forced.rewrite(draft, state.num_generated, state.row_ids)
        with phase("verify"):
            target_probs = target.verify(state, draft)
        stats.num_target_forwards += 1
        check_now = validate == "always" or (validate == "first" and state.iteration == 0)
        with phase("accept"):
            result = accept(rule, draft, target_probs, validate=check_now, noise=state.noise,
                            positions=state.num_generated)
            if forced is not None:  # (a rule that is not exact decides as the profile did)
                result = forced.decide(result, rule.name)
        with phase("commit"):
            target.commit(state, draft, result, active)
        with phase("observe"):
            if size != 0:
                drafter.observe(state, draft, result, active, target_probs)
            elif not steering.plain_for_good:  # (a call without the drafter is plain for good)
                drafter.skip(state, result, active, target_probs)
        steering.observe(size, result, active, draft)
        stats.record(result, active, rows=state.row_ids)
        before = state.num_generated
        state.append(result, active, all_active=state.batch_size == 1)  # one row: active, or the loop had ended
        if after_append is not None:
            after_append(state, before, draft, result)
        state.iteration += 1
        if callback is not None and callback(state, draft, result) is False:
            break

    synchronize(device)
    steering.end()
    if forced is not None:
        forced.finish(state.full_tokens())
    stats.wall_time = time.perf_counter() - start
    stats.num_draft_forwards = getattr(drafter, "forwards", 0) - draft_forwards_before
    return GenerationOutput(tokens=state.full_tokens(), num_generated=state.full_num_generated(), stats=stats)


def drafts_nothing(drafter: Drafter) -> bool:
    """Whether the drafter can only take plain steps (its `draft_sizes` are 0 alone: vanilla's `NoDrafter`): its
    calls keep no room for drafts."""
    sizes = getattr(drafter, "draft_sizes", None)
    return sizes is not None and max(sizes) == 0


def drop_finished_rows(state: DecodeState, target: Target, drafter: Drafter, active: torch.Tensor,
                       drafts: bool) -> None:
    """Keep only the active [B] rows in the state (its keyed noise included), the target and the drafter (`drafts`:
    it was begun in this call). Invariant: every part that holds per-row state and may run again in this call holds
    the state's rows, so a begun drafter follows them even in a call settled on plain steps (a budget may still run
    it, e.g. to time its options at the rows held)."""
    rows = active.nonzero().squeeze(-1)  # [B'] (a device read, once per drop)
    state.select_rows(rows)
    target.select_rows(rows)
    if drafts:  # (a call without the drafter never began it: it holds nothing of this call)
        drafter.select_rows(rows)

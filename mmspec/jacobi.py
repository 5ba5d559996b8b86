"""Speculative Jacobi decoding (SJD): a training-free, model-agnostic drafter for the shared loop.

SJD (Teng et al., 2024) keeps a window of L positions after the accepted prefix: the last token and L - 1 drafts.
Every iteration the target scores the whole window in ONE forward (the loop's verify over a `ChainDraft`), the
acceptance rule judges the drafts, and the drafts that were not accepted are replaced by FRESH samples from the
distributions the target just gave at their positions (a Jacobi fixed-point iteration: each draft is re-sampled
given the previous iteration's, partly wrong, prefix). New positions at the end of the window are initialised
without the model. The drafter needs nothing but the target's distributions, which the loop hands to `observe`:

    drafter = JacobiDrafter(vocab_size=V, window=16, init="random")
    out = generate(target, drafter, "lossless", inputs, batch_size=B, max_new_tokens=N, generator=gen)

Bookkeeping (B rows, K = L - 1 drafts, V vocabulary). The verify over [last, d_1..d_K] returns P_0..P_K, where
P_j is the target's distribution for the token after window index j. d_i is judged against P_{i-1} with its draft
distribution q_i. If a row accepts n drafts and emits the recovered/bonus token y (from P_n), the next window
starts at y, and its drafts are, in order:

    d'_i = y_{n+i} ~ P_{n+i},  q'_i = P_{n+i}      for i = 1 .. m - n   (the carried tail; m = the row's drafts)
    d'_i = init(...),          q'_i = one-hot      for the rest          (new positions)

So the draft right after the recovered token is a fresh sample from P_{n+1}, the distribution the target gave
for that position given the REJECTED draft d_{n+1} in place of y (the official code does the same: its
"unmatched" samples start right after the recovered token). When every draft was accepted there is no tail.

Initialisation of new positions (one-hot q, so the lossless rule accepts x with p(x) and recovers from p
without x, which is exact for any x chosen without looking at the rule's randomness):
- "random": uniform over the vocabulary.
- "repeat_horizon": the nearest known token on the left (the last tail draft, or the last emitted token); the
  official code copies the left neighbour with its index clamped to the known tokens, which is the same. With
  `row_width` (image rows in raster order) positions in the first column of a row are random instead, as in the
  official code (they have no left neighbour in their row).
- "sample_horizon": the mode (argmax) of the left neighbour's distribution: the official code draws from that
  distribution restricted to its top-1 entry, i.e. takes its argmax. The left neighbour's distribution is
  P_m of the last verify (the q of the last tail draft, or the distribution the bonus was drawn from); before
  the first verify it is the last token itself. Same `row_width` rule.

Randomness is the call's position-keyed noise (`state.noise`, `mmspec.noise`): a random initialisation at token
index t from its "init" uniform, a fresh sample for index t by the exponential race under its draft noise
(`redraft_exponentials`: "draft" noise fresh every step and independent of the rule's, as SJD resamples, or with
`coupling` the same at an index in every step, MC-SJD's Gumbel coupling: a position whose distribution barely
changed keeps its token; under the coupled rule that noise is the target's own "sample" noise, its default), or
MC-SJD's maximal coupling with the previous draft (`maximally_coupled`). Lossless: each
draft's law given the past is what its q says (P for the tail, a point mass for initialised positions) and does not
depend on the rule's numbers, so the lossless rule keeps the target's distribution exactly. Jacobi drafts only
inside `interval` (token indices of the generated sequence); outside it the row drafts nothing and the loop makes a
vanilla step.

No host synchronisation in `propose` / `observe`: everything is batched over rows with per-row state tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.errors import InputError, check, check_positive_int
from mmspec.loop import DecodeState
from mmspec.noise import KeyedNoise
from mmspec.sampling import race
from mmspec.verify import ChainDraft, VerifyResult

INIT_SCHEMES = ("random", "repeat_horizon", "sample_horizon")
COUPLINGS = ("none", "gumbel", "maximal")  # how a re-drafted position's new draft relates to its previous one


# ------------------------------------------------------------------------------------------------ checks
def check_interval(interval: Any) -> tuple[int, int | None]:
    """`interval` -> (start, end): None is (0, None) (no restriction); end None means no end."""
    if interval is None:
        return 0, None
    ok = isinstance(interval, (tuple, list)) and len(interval) == 2
    ok = ok and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in interval)
    check(ok, f"interval must be (start, end) token indices (ints; end may be None), got {interval!r}.")
    start, end = interval
    start = 0 if start is None else start
    check(start >= 0, f"interval start must be >= 0, got interval={interval!r}.")
    check(end is None or end > start, f"interval end must be > start, got interval={interval!r}.")
    return start, end


def check_init(init: Any) -> str:
    check(init in INIT_SCHEMES, f"init must be one of {', '.join(INIT_SCHEMES)}, got {init!r}.")
    return init


# ------------------------------------------------------------------------------------------ tensor helpers
def random_tokens(noise: KeyedNoise, index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform tokens [B, K] in [0, vocab_size) at token indices [B, K], from the "init" noise."""
    return (noise.uniforms(index, "init") * vocab_size).long().clamp_max(vocab_size - 1)


def draft_counts(num_generated: torch.Tensor, k: int, start: int, end: int | None) -> torch.Tensor:
    """[B] drafts per row: the drafts are token indices g .. g+K-1 (g = num_generated); a row drafts only when
    g >= start, and only indices < end."""
    room = torch.full_like(num_generated, k) if end is None else (end - num_generated).clamp(0, k)  # [B]
    return torch.where(num_generated >= start, room, torch.zeros_like(room))


def first_column(num_generated: torch.Tensor, k: int, row_width: int | None) -> torch.Tensor:
    """[B, K] bool: draft i of each row (token index g + i) is in the first column of an image row."""
    if row_width is None:
        return torch.zeros(num_generated.shape[0], k, dtype=torch.bool, device=num_generated.device)
    index = num_generated.unsqueeze(-1) + torch.arange(k, device=num_generated.device)  # [B, K]
    return index % row_width == 0


def last_tail_token(tail_tokens: torch.Tensor, tail_len: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """[B] the nearest known token left of the new positions: the last carried draft, else the last token."""
    idx = (tail_len - 1).clamp_min(0).unsqueeze(-1)  # [B, 1]
    last_draft = tail_tokens.gather(1, idx).squeeze(-1)  # [B]
    return torch.where(tail_len > 0, last_draft, last_token)


def with_one_hot_rows(probs: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """q [B, K, V]: rows where `keep` [B, K] stay `probs`; the others become one-hot at `tokens` [B, K]."""
    q = probs.masked_fill(~keep.unsqueeze(-1), 0.0)  # [B, K, V]
    at_token = q.gather(-1, tokens.unsqueeze(-1))  # [B, K, 1]
    value = torch.where(keep.unsqueeze(-1), at_token, torch.ones_like(at_token))
    return q.scatter(-1, tokens.unsqueeze(-1), value)


def carry_tail(fresh: torch.Tensor, next_probs: torch.Tensor, num_accepted: torch.Tensor,
               num_drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next window's carried drafts after a verify.

    fresh [B, K]: y_j ~ P_j for j = 1..K (column j - 1); next_probs [B, K, V]: P_1..P_K. A row that drafted m
    and accepted n keeps y_{n+1}..y_m with q = P_{n+1}..P_m at its first m - n draft slots.
    Returns (tokens [B, K], probs [B, K, V], length [B]); slots past `length` hold junk.
    """
    k, v = next_probs.shape[1], next_probs.shape[2]
    idx = (num_accepted.unsqueeze(-1) + torch.arange(k, device=fresh.device)).clamp_max(k - 1)  # [B, K]: j - 1
    tokens = fresh.gather(1, idx)  # [B, K]
    probs = next_probs.gather(1, idx.unsqueeze(-1).expand(-1, -1, v))  # [B, K, V]
    return tokens, probs, (num_drafted - num_accepted).clamp_min(0)


def horizon_tokens(rand: torch.Tensor, known: torch.Tensor, first_col: torch.Tensor) -> torch.Tensor:
    """[B, K] tokens for new positions under a horizon scheme: the known token [B] (the left token, or the mode of
    the left distribution), `rand` [B, K] in the first image column ("random" init takes `rand` everywhere)."""
    return torch.where(first_col, rand, known.unsqueeze(-1).expand_as(rand))


def jacobi_draft(tail_tokens: torch.Tensor, tail_probs: torch.Tensor, tail_len: torch.Tensor,
                 init: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's drafts: the carried tail (q = its P), then initialised tokens (one-hot q).

    tail_tokens [B, K], tail_probs [B, K, V], tail_len [B], init [B, K], num_draft [B] ->
    (tokens [B, K] -1 past num_draft, q [B, K, V]).
    """
    k = tail_tokens.shape[1]
    from_tail = torch.arange(k, device=tail_tokens.device) < tail_len.unsqueeze(-1)  # [B, K]
    tokens = torch.where(from_tail, tail_tokens, init)  # [B, K]
    probs = with_one_hot_rows(tail_probs, tokens, from_tail)  # [B, K, V]
    drafted = torch.arange(k, device=tail_tokens.device) < num_draft.unsqueeze(-1)  # [B, K]
    return torch.where(drafted, tokens, -1), probs


def maximally_coupled(fresh: torch.Tensor, probs: torch.Tensor, previous: torch.Tensor, previous_q: torch.Tensor,
                      keep_uniforms: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """New drafts ~ `probs` maximally coupled with the previous drafts at the same token indices: keep the previous
    draft x (drawn from previous_q) with probability min(1, P(x) / q(x)), else draw from the residual
    norm(max(P - q, 0)) (the maximal coupling: P(new == x) = 1 - TV(P, q), the most any coupling gives, and the new
    draft's law is P). Positions without a previous draft (-1) take `fresh`.

    fresh [B, K] (samples of P), probs [B, K, V] P, previous [B, K] (-1: none), previous_q [B, K, V],
    keep_uniforms [B, K] float64, exponentials [B, K, V] Exp(1) -> [B, K].
    """
    has = previous >= 0  # [B, K]
    x = previous.clamp_min(0).unsqueeze(-1)  # [B, K, 1]
    p_x = probs.gather(-1, x).squeeze(-1).double()  # [B, K]
    q_x = previous_q.gather(-1, x).squeeze(-1).double()  # [B, K]
    keep = has & (keep_uniforms * q_x < p_x)  # u < P(x) / q(x)
    residual = race((probs.double() - previous_q.double()).clamp_min(0), exponentials)  # [B, K]
    return torch.where(keep, previous, torch.where(has, residual, fresh))


def jacobi_update(target_probs: torch.Tensor, num_accepted: torch.Tensor, num_drafted: torch.Tensor,
                  exponentials: torch.Tensor | None,
                  previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """After a verify: the fresh samples y_j ~ P_j by the exponential race (argmax when `exponentials` is None,
    i.e. greedy), maximally coupled with `previous` = (drafts [B, K], their q [B, K, V], keep uniforms [B, K]) at
    the same token indices where given, and the carried tail.

    target_probs [B, K+1, V] (P_0..P_K), num_accepted [B], num_drafted [B], exponentials [B, K, V] float64 Exp(1)
    or None -> (tail tokens [B, K], tail q [B, K, V], tail length [B], mode of P_m [B]).
    """
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    mode = target_probs[rows, num_drafted].argmax(-1)  # [B] the last known token's distribution P_m
    next_probs = target_probs[:, 1:]  # [B, K, V] P_1..P_K
    fresh = next_probs.argmax(-1) if exponentials is None else race(next_probs, exponentials)  # [B, K]
    if previous is not None and exponentials is not None:
        fresh = maximally_coupled(fresh, next_probs, *previous, exponentials)
    tokens, probs, length = carry_tail(fresh, next_probs, num_accepted, num_drafted)
    return tokens, probs, length, mode


def check_coupling(coupling: Any) -> str | None:
    check(coupling is None or coupling in COUPLINGS,
          f"coupling must be one of {', '.join(COUPLINGS)} or None (the rule's own), got {coupling!r}.")
    return coupling


def redraft_exponentials(noise: KeyedNoise, index: torch.Tensor, vocab: int, step: int,
                         coupling: str) -> torch.Tensor:
    """Exp(1) draws [B, K, V] for the re-drafts at token indices [B, K] in loop step `step`: "gumbel" the same at an
    index in every step (under a coupled rule the target's own "sample" noise, so a draft is also the target's
    sample where their laws agree), else "draft" noise fresh at every step (independent of the rule's numbers)."""
    if coupling == "gumbel":
        return noise.exponentials(index, "sample" if noise.coupled else "draft", vocab)
    return noise.exponentials(index, "draft", vocab, sub=step)


# ---------------------------------------------------------------------------------------------- drafter
class JacobiDrafter:
    """Speculative Jacobi decoding as a loop drafter (see the module docstring for the exact bookkeeping).

    vocab_size: the target's vocabulary V (random initialisation and one-hot q rows).
    window: L, the positions scored per target forward (the last token plus L - 1 drafts); 1 = vanilla.
    init: "random" | "repeat_horizon" | "sample_horizon" for new positions.
    interval: (start, end) token indices (0-based, of the generated sequence) where Jacobi runs: a row drafts
        only when its next token index is >= start, and never a token index >= end; None = everywhere.
    greedy: take the argmax of P for the tail instead of sampling (temperature 0: classic Jacobi decoding).
    row_width: image row length for the horizon inits (first-column positions are random); None = no rows.
    init_tokens: [N] the token ids a random initialisation draws from, uniformly (a model whose vocabulary holds
        text and image tokens: its image tokens, as the official SJD code draws Lumina-mGPT's); None = all V.
    coupling: how a re-drafted position's new sample relates to its previous draft (MC-SJD, So et al. 2025): "none"
        (SJD: independent), "gumbel" (the same Gumbel noise at a token index in every iteration; under the coupled
        rule the target's own sample noise) or "maximal" (keep the previous draft with probability min(1, P(x) /
        q(x)), else the residual); None = the rule's own: "gumbel" under the coupled rule, "none" otherwise. Each
        draft's law stays P, so every rule keeps its guarantees.
    """

    forwards = 0  # no model of its own
    # a window's acceptance depends on its size (its tail converges over the steps it stays in the window): a draft
    # budget values each size by what its own steps emitted and keeps a choice for a few steps (`mmspec.budget`)
    valued_per_size = True

    def __init__(self, vocab_size: int, window: int = 16, init: str = "random", *,
                 interval: tuple[int, int | None] | None = None, greedy: bool = False,
                 row_width: int | None = None,
                 init_tokens: torch.Tensor | None = None, coupling: str | None = None) -> None:
        check_positive_int("vocab_size", vocab_size)
        check(init_tokens is None or (init_tokens.dim() == 1 and init_tokens.numel() >= 1
                                      and 0 <= int(init_tokens.min()) and int(init_tokens.max()) < vocab_size),
              f"init_tokens must be a non-empty 1-D tensor of token ids below vocab_size {vocab_size}.")
        self.init_tokens = init_tokens
        check_positive_int("window", window)
        if row_width is not None:
            check_positive_int("row_width", row_width)
        self.vocab_size, self.window, self.k = vocab_size, window, window - 1
        self.step_k = self.k  # drafts of the next window (a draft budget may ask for fewer)
        self.init = check_init(init)
        self.coupling = check_coupling(coupling)
        self.start, self.end = check_interval(interval)
        self.greedy, self.row_width = bool(greedy), row_width
        self.tail_tokens: torch.Tensor | None = None  # [B, K] carried drafts
        self.tail_probs: torch.Tensor | None = None  # [B, K, V] their q (the P they were sampled from)
        self.tail_len: torch.Tensor | None = None  # [B] carried drafts per row
        self.tail_bound = 0  # rows never hold more carried drafts than this (active rows; known without a sync)
        self.last_mode: torch.Tensor | None = None  # [B] argmax of the last known token's distribution

    def config(self) -> dict:
        return {"window": self.window, "init": self.init, "interval": [self.start, self.end],
                "greedy": self.greedy, "row_width": self.row_width, "coupling": self.coupling}

    # ------------------------------------------------------------------------------------------- protocol
    @property
    def max_draft_nodes(self) -> int:
        """The most positions a verify scores: the window (the target keeps that much cache room)."""
        return self.window

    @property
    def draft_sizes(self) -> list[int]:
        """Window drafts a budget chooses from: 0 (a plain step), 2^i - 1 and window - 1 (a window of 1, 2, 4, 8,
        .. and the configured one: few sizes, since each must run a few steps to show what it accepts)."""
        return sorted({0, self.k, *(2 ** i - 1 for i in range(1, self.k.bit_length() + 1) if 2 ** i - 1 <= self.k)})

    def set_draft_size(self, k: int) -> None:
        check(0 < k <= self.k, f"draft size must be in [1, {self.k}], got {k}.")
        self.step_k = k

    def begin(self, inputs: Any, state: DecodeState) -> None:
        b, k, device = state.batch_size, self.k, state.done.device
        self.tail_tokens = torch.zeros(b, k, dtype=torch.long, device=device)  # [B, K]
        self.tail_probs = torch.zeros(b, k, self.vocab_size, device=device)  # [B, K, V]
        self.tail_len = torch.zeros(b, dtype=torch.long, device=device)  # [B]
        self.tail_bound = 0  # a bound on tail_len known without a host sync
        self.last_mode = state.last_token.clone()  # [B]

    def propose(self, state: DecodeState) -> ChainDraft:
        check(self.tail_len is not None, "JacobiDrafter.propose called before begin(); run it through "
                                         "mmspec.loop.generate.")
        b, k, device = state.batch_size, self.step_k, state.done.device
        if k == 0:
            return ChainDraft(torch.empty(b, 0, dtype=torch.long, device=device))
        init = self._init_tokens(state, k)  # [B, k]
        num = draft_counts(state.num_generated, k, self.start, self.end)  # [B]
        tokens, probs = jacobi_draft(self.tail_tokens[:, :k], self.tail_probs[:, :k], self.tail_len.clamp_max(k),
                                     init, num)
        return ChainDraft(tokens, probs, num)

    def observe(self, state: DecodeState, draft: ChainDraft, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        if target_probs.shape[-1] != self.vocab_size or target_probs.dim() != 3:
            raise InputError(f"JacobiDrafter(vocab_size={self.vocab_size}) got target distributions of shape "
                             f"{list(target_probs.shape)}; expected [B, K+1, {self.vocab_size}].")
        k = target_probs.shape[1] - 1  # this window's drafts
        if k == 0:
            rows = torch.arange(target_probs.shape[0], device=target_probs.device)
            self.last_mode = torch.where(active, target_probs[rows, 0].argmax(-1), self.last_mode)
            return
        exps, previous = None, None  # greedy: the argmax
        if not self.greedy:  # P_j predicts token index g + j (g = the tokens before this step)
            index = state.num_generated.unsqueeze(-1) + torch.arange(1, k + 1, device=target_probs.device)  # [B, k]
            coupling = self.coupling or ("gumbel" if state.noise.coupled else "none")
            exps = redraft_exponentials(state.noise, index, self.vocab_size, state.iteration, coupling)  # [B, k, V]
            if coupling == "maximal":
                previous = self._previous_drafts(draft, index, state)
        tokens, probs, length, mode = jacobi_update(target_probs, result.num_accepted,
                                                    draft.resolved_num_draft(), exps, previous)
        self.last_mode = torch.where(active, mode, self.last_mode)
        self._set_tail(tokens, probs, length, active)
        self.tail_bound = max(self.tail_bound, k)

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor,
             target_probs: torch.Tensor) -> None:
        """The loop made a plain step: its token takes the first carried draft's place, so the tail moves left by
        one (each draft keeps the q it was sampled from); with no tail the new left neighbour's distribution is P_0."""
        rows = torch.arange(target_probs.shape[0], device=target_probs.device)
        self.last_mode = torch.where(active & (self.tail_len == 0), target_probs[rows, 0].argmax(-1), self.last_mode)
        if self.tail_bound == 0:  # no row has a tail left: nothing to move (no [B, K, V] copy per plain step)
            return
        self._set_tail(self.tail_tokens[:, 1:], self.tail_probs[:, 1:], (self.tail_len - 1).clamp_min(0), active)
        self.tail_bound -= 1

    # -------------------------------------------------------------------------------------------- helpers
    def _previous_drafts(self, draft: ChainDraft, index: torch.Tensor, state: DecodeState) -> tuple:
        """The drafts this step verified at the token indices of P_1..P_k (draft i + 1 sits at P_i's index), their q
        and the "couple" uniforms there: (tokens [B, k] with -1 where none, q [B, k, V], uniforms [B, k])."""
        b, k = index.shape
        tokens = torch.full((b, k), -1, dtype=torch.long, device=index.device)  # [B, k]
        tokens[:, : k - 1] = draft.tokens[:, 1:k]
        q = torch.zeros(b, k, self.vocab_size, device=index.device)  # [B, k, V]
        if draft.probs is not None:
            q[:, : k - 1] = draft.probs[:, 1:k]
        else:  # drafts without a distribution are point masses
            q[:, : k - 1] = torch.nn.functional.one_hot(tokens[:, : k - 1].clamp_min(0), self.vocab_size).float()
        return tokens, q, state.noise.uniforms(index, "couple", state.iteration)

    def _set_tail(self, tokens: torch.Tensor, probs: torch.Tensor, length: torch.Tensor, active: torch.Tensor) -> None:
        """Rows `active` [B] take the carried drafts tokens [B, k], probs [B, k, V] (k <= K; the rest is padding)
        and their count [B]."""
        k = tokens.shape[1]
        keep = active.unsqueeze(-1)
        self.tail_tokens = torch.cat([torch.where(keep, tokens, self.tail_tokens[:, :k]), self.tail_tokens[:, k:]], 1)
        self.tail_probs = torch.cat([torch.where(keep.unsqueeze(-1), probs, self.tail_probs[:, :k]),
                                     self.tail_probs[:, k:]], 1)
        self.tail_len = torch.where(active, length, self.tail_len)

    def _init_tokens(self, state: DecodeState, k: int) -> torch.Tensor:
        """[B, k] tokens for new positions (only the slots past each row's tail are used)."""
        index = state.num_generated.unsqueeze(-1) + torch.arange(k, device=state.done.device)  # [B, K] draft i at g + i
        if self.init_tokens is None:
            rand = random_tokens(state.noise, index, self.vocab_size)  # [B, K], drawn in every mode
        else:
            pool = self.init_tokens.to(state.done.device)
            rand = pool[random_tokens(state.noise, index, pool.numel())]  # [B, K] from the pool
        if self.init == "random":
            return rand
        if self.init == "repeat_horizon":
            known = last_tail_token(self.tail_tokens, self.tail_len, state.last_token)  # [B]
        else:  # sample_horizon
            known = self.last_mode
        return horizon_tokens(rand, known, first_column(state.num_generated, k, self.row_width))

"""Prompt lookup decoding (PLD): a training-free chain drafter for any LM target of the shared loop.

PLD (Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's n-gram proposer) drafts by copying: take the
last n tokens of a row (the prompt and the answer so far, n from `max_ngram` down to `min_ngram`), find their most
recent earlier occurrence in the same row, and propose the up to K tokens that followed it. Answers that quote the
question, repeat a phrase or list items hit often; when no n-gram recurs the row drafts nothing that step.

    drafter = PromptLookupDrafter(num_draft_tokens=10, max_ngram=3, banned_tokens=[image_token_id])
    out = generate(target, drafter, "lossless", inputs, batch_size=B, max_new_tokens=N)

Batched over ragged rows: each row has its own prompt (`prompt_rows`: the real tokens of right-padded input_ids),
its own matches and its own draft count (`ChainDraft.num_draft`). A draft stops before any `banned_tokens` (a VLM's
image placeholders: a copied run of them is no answer). Drafts are deterministic functions of the row's tokens,
verified as point masses, so every exact rule keeps the target's law and greedy output (the lookup never sees the
rule's random numbers). The lookup runs on the host over each row's tokens (numpy, one copy of the new tokens per
step), as vLLM's proposer does; the target verify dominates a step's cost. A draft budget may ask for fewer
drafts (`draft_sizes`: 0, 1, 2, 4, .., K).

`SuffixLookupDrafter` finds the match with a suffix automaton per row (SAM decoding, Hu et al. 2024): the longest
repeated suffix of any length, in O(1) amortised per token rather than a scan of the row.

Glossary: B rows, P prompt length, K drafts, n the n-gram length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmspec.errors import check, check_positive_int
from mmspec.loop import DecodeState
from mmspec.verify import ChainDraft, VerifyResult


def prompt_rows(inputs: Any) -> list[np.ndarray]:
    """The prompt tokens of each row: `inputs.input_ids` [B, P] with its right-padding `attention_mask` (a VLM's
    inputs), or a [B, P] tensor of prompts without padding."""
    ids = getattr(inputs, "input_ids", inputs)
    check(isinstance(ids, torch.Tensor) and ids.dim() == 2,
          f"prompt lookup needs [B, P] prompt ids, got {type(ids).__name__}.")
    mask = getattr(inputs, "attention_mask", None)
    ids = ids.cpu().numpy()
    if mask is None:
        return [row for row in ids]
    lengths = mask.sum(-1).tolist()
    return [row[: int(n)] for row, n in zip(ids, lengths)]


def lookup_continuation(context: np.ndarray, max_ngram: int, min_ngram: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram of `context`
    (n from max_ngram down to min_ngram); empty when none recurs."""
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)  # [L - n, n]: starts < L - n
        hits = np.flatnonzero((windows == suffix).all(-1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent earlier occurrence
            return context[start: start + k]
    return context[:0]


def cut_at_banned(tokens: np.ndarray, banned: np.ndarray) -> np.ndarray:
    """`tokens` up to (not including) the first banned token."""
    if banned.size == 0 or tokens.size == 0:
        return tokens
    bad = np.flatnonzero(np.isin(tokens, banned))
    return tokens[: int(bad[0])] if bad.size else tokens


class PromptLookupDrafter:
    """Prompt lookup as a loop drafter (see the module docstring).

    num_draft_tokens: K, the most drafts a step proposes (PLD's and transformers' default: 10).
    max_ngram, min_ngram: the n-gram lengths matched, longest first (PLD: 3 and 1).
    banned_tokens: ids never proposed (a draft stops before the first).
    """

    forwards = 0  # no model of its own

    def __init__(self, num_draft_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1,
                 banned_tokens: Sequence[int] = ()) -> None:
        check_positive_int("num_draft_tokens", num_draft_tokens)
        check_positive_int("max_ngram", max_ngram)
        check_positive_int("min_ngram", min_ngram)
        check(min_ngram <= max_ngram, f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram}).")
        self.k, self.step_k = num_draft_tokens, num_draft_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.banned = np.asarray(sorted({int(t) for t in banned_tokens}), dtype=np.int64)
        self.prompts: list[np.ndarray] = []

    def config(self) -> dict:
        return {"num_draft_tokens": self.k, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram,
                "banned_tokens": self.banned.tolist()}

    @property
    def max_draft_nodes(self) -> int:
        """Positions the widest verify scores (the last token and K drafts): the target's cache room."""
        return self.k + 1

    @property
    def draft_sizes(self) -> list[int]:
        """0 (a plain step), 1, 2, 4, .. and K."""
        return sorted({0, self.k, *(2 ** i for i in range(self.k.bit_length()) if 2 ** i <= self.k)})

    def set_draft_size(self, k: int) -> None:
        check(0 < k <= self.k, f"draft size must be in [1, {self.k}], got {k}.")
        self.step_k = k

    def begin(self, inputs: Any, state: DecodeState) -> None:
        self.prompts = prompt_rows(inputs)
        check(len(self.prompts) == state.batch_size,
              f"{len(self.prompts)} prompts for a batch of {state.batch_size} rows.")

    def propose(self, state: DecodeState) -> ChainDraft:
        b, k, device = state.batch_size, self.step_k, state.done.device
        rows = range(b) if state.row_ids is None else state.row_ids.tolist()  # the call's row of each kept row
        counts = state.num_generated.tolist()
        generated = state.tokens.cpu().numpy()  # [B, max_new_tokens], -1 past each row's count
        tokens = np.full((b, k), -1, dtype=np.int64)  # [B, K]
        num = np.zeros(b, dtype=np.int64)  # [B]
        for i, row in enumerate(rows):
            found = cut_at_banned(self.continuation(row, generated[i, : counts[i]], k), self.banned)
            tokens[i, : found.size], num[i] = found, found.size
        width = int(num.max(initial=0))  # no verify wider than the longest match (0: a plain step)
        return ChainDraft(torch.from_numpy(tokens[:, :width]).to(device), None, torch.from_numpy(num).to(device))

    def continuation(self, row: int, generated: np.ndarray, k: int) -> np.ndarray:
        """Up to k tokens to draft for the call's row `row`, whose generated tokens so far are `generated`."""
        context = np.concatenate([self.prompts[row], generated])
        return lookup_continuation(context, self.max_ngram, self.min_ngram, k)

    def timing_propose(self, state: DecodeState) -> ChainDraft:
        """The lookup, then every row's draft filled to the step's size with its last token: what a step costs
        when the rows draft (the draft budget times its sizes with it; `mmspec.budget.cost`)."""
        draft = self.propose(state)
        b, k = state.batch_size, self.step_k
        tokens = state.last_token.unsqueeze(-1).expand(b, k).clone()  # [B, k]
        found = draft.tokens.shape[1]
        tokens[:, :found] = torch.where(draft.tokens >= 0, draft.tokens, tokens[:, :found])
        return ChainDraft(tokens, None, torch.full((b,), k, dtype=torch.long, device=tokens.device))

    def observe(self, state: DecodeState, draft: ChainDraft, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        """Nothing to learn: the next lookup reads the row's tokens as the loop appended them."""

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor, target_probs: torch.Tensor) -> None:
        """A plain step: nothing to learn either."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """The loop dropped finished rows: the prompts stay indexed by the call's rows (`state.row_ids`)."""


class SuffixAutomaton:
    """A suffix automaton of one growing token sequence (Blumer et al. 1985), extended a token at a time in O(1)
    amortised: `repeat()` is the first earlier end of the longest suffix that occurred before (SAM decoding,
    Hu et al. 2024), -1 when none."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.first_end = [-1], [0], [-1]
        self.last = 0
        self.tokens: list[int] = []

    def extend(self, token: int) -> None:
        cur = len(self.length)
        self.next.append({})
        self.link.append(0)
        self.length.append(self.length[self.last] + 1)
        self.first_end.append(len(self.tokens))
        self.tokens.append(token)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # split q: a clone keeps q's first end and transitions, at the shorter length
                clone = len(self.length)
                self.next.append(dict(self.next[q]))
                self.link.append(self.link[q])
                self.length.append(self.length[p] + 1)
                self.first_end.append(self.first_end[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def repeat(self, min_length: int) -> int:
        """The end index of the first occurrence of the longest suffix (of at least min_length tokens) that
        occurred before the sequence's end, or -1."""
        state = self.link[self.last]
        return self.first_end[state] if state > 0 and self.length[state] >= min_length else -1


class SuffixLookupDrafter(PromptLookupDrafter):
    """Prompt lookup through a suffix automaton per row (SAM decoding's dynamic automaton): the draft continues
    the first earlier occurrence of the row's longest repeated suffix, of any length >= min_ngram, found in O(1)
    per token instead of a scan of the row (`max_ngram` is not used). Same chains, budget sizes and banned tokens
    as `PromptLookupDrafter`."""

    def begin(self, inputs: Any, state: DecodeState) -> None:
        super().begin(inputs, state)
        self.automata = []
        for prompt in self.prompts:
            automaton = SuffixAutomaton()
            for token in prompt.tolist():
                automaton.extend(token)
            self.automata.append(automaton)
        self.fed = [0] * len(self.prompts)  # generated tokens each automaton has read

    def continuation(self, row: int, generated: np.ndarray, k: int) -> np.ndarray:
        """The row's automaton reads the tokens generated since it last read, then gives what followed the first
        earlier occurrence of its longest repeated suffix."""
        automaton = self.automata[row]
        for token in generated[self.fed[row]:].tolist():
            automaton.extend(token)
        self.fed[row] = generated.shape[0]
        end = automaton.repeat(self.min_ngram)
        return np.asarray(automaton.tokens[end + 1: end + 1 + k] if end >= 0 else [], dtype=np.int64)

"""Per-sequence functions (transformers' logits processors and stopping criteria) called on every candidate's own
prefix, as `generate` calls them on the one sequence it grows, so a speculative call stays exact under them.

Glossary
- call row: a row of the call (its index in the user's batch); held row: a row the loop still computes
  (`DecodeState.row_ids` maps held rows to call rows once finished rows were dropped).
- entry: a position the target verified for a held row: the chain's last token and each draft, or a tree's node.
  Entry e of row r gives the law of the token after `prompt[r] + generated[r] + path(e)`, path(e) being the drafts
  from the root down to e (e included; the root, the row's newest token, is already in generated[r]).
- prefix: what a per-sequence function reads for an entry: the row's prompt as the user gave it (its padding
  included, as `generate` sees it), then the row's generated tokens, then the entry's path. Prefixes of one length
  are stacked into one call: ids [G, P + L], with their call rows [G] (a row may appear several times: a tree's
  nodes at one depth).

Invariant: an entry's scores are exactly what the processors return on its own prefix (`PrefixLogits`), so the
target's law at every verified position is the processed law `generate` samples there, and every acceptance rule
that is exact for the target's law stays exact. Why: the processors turn the model's conditionals p(x_t | x_<t)
into new conditionals p'(x_t | x_<t) = softmax(processors(x_<t, logits)), an autoregressive law of its own; the
exactness proofs of greedy verification, coupled acceptance and speculative sampling use nothing but the target's
conditional at each verified position given that position's own prefix, which is what the verify call now
returns (a tree node's prefix is its own path, not its siblings'). A row ends at the first committed token after
which a stopping criterion holds on its prefix (`first_stops`), the tokens after it dropped, as `generate` stops
there.

Functions are called on groups of one prefix length, with each member's call row passed along; they must be pure
functions of their inputs (as transformers' assisted generation also requires: it calls processors on candidate
prefixes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec.tree import DraftTree
from mmspec.verify import Draft

# per_prefix(call_rows [G], ids [G, P + L], scores [G, V]) -> processed scores [G, V]
PrefixFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# rowwise(scores [M, V]) -> [M, V]: a function of each row of scores alone (temperature, top-k, top-p, ...)
RowwiseFn = Callable[[torch.Tensor], torch.Tensor]
# stops(call_rows [G], ids [G, P + L]) -> [G] bool: whether generation ends after the prefix's last token
StopFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Entries:
    """The valid entries of one verify call, flattened: M entries."""

    held_rows: torch.Tensor  # [M] held row of each entry
    call_rows: torch.Tensor  # [M] its call row
    index: torch.Tensor  # [M] its index on the verify output's entry axis S
    tokens: torch.Tensor  # [M, T + D] generated tokens, then the path, -1 padded
    lengths: torch.Tensor  # [M] generated + path tokens before the entry's prediction


def entry_paths(draft: Draft | None, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(path tokens [B, S, D] -1 padded, valid [B, S]) of every entry of `draft` (None: the prefill, one entry per
    row with an empty path)."""
    if draft is None:
        return (torch.empty(batch, 1, 0, dtype=torch.long, device=device),
                torch.ones(batch, 1, dtype=torch.bool, device=device))
    if isinstance(draft, DraftTree):
        ancestors = draft.paths()[..., 1:]  # [B, N, D] the node's ancestors below the root, itself included
        tokens = draft.tokens.unsqueeze(1).expand(-1, ancestors.shape[1], -1)  # [B, N, N]
        path = torch.where(ancestors >= 0, tokens.gather(2, ancestors.clamp_min(0)), -1)
        return path, draft.valid
    k = draft.tokens.shape[1]
    columns = torch.arange(k, device=device)
    before = columns.unsqueeze(0) < torch.arange(k + 1, device=device).unsqueeze(1)  # [K+1, K] draft i before entry j
    path = torch.where(before.unsqueeze(0), draft.tokens.unsqueeze(1), -1)  # [B, K+1, K]
    valid = torch.arange(k + 1, device=device).unsqueeze(0) <= draft.resolved_num_draft().unsqueeze(-1)
    return path, valid


def verified_entries(generated: torch.Tensor, counts: torch.Tensor, draft: Draft | None,
                     row_ids: torch.Tensor | None) -> Entries:
    """The valid entries of a verify call over held rows with `generated` [B, T] tokens (-1 past `counts` [B]) and
    `draft` (None: the prefill); `row_ids` [B] maps held rows to call rows (None: the same)."""
    b, device = generated.shape[0], generated.device
    path, valid = entry_paths(draft, b, device)  # [B, S, D], [B, S]
    s, d = path.shape[1], path.shape[2]
    tokens = torch.cat([generated.unsqueeze(1).expand(-1, s, -1), torch.full((b, s, d), -1, dtype=torch.long,
                                                                             device=device)], dim=2)
    spots = counts.view(b, 1, 1) + torch.arange(d, device=device)  # [B, 1, D] where the path goes
    tokens = tokens.scatter(2, spots.expand(-1, s, -1), path)  # (path entries past its depth are -1 already)
    depth = (path >= 0).sum(-1)  # [B, S]
    held, index = valid.nonzero(as_tuple=True)  # [M], [M]
    call = held if row_ids is None else row_ids[held]
    return Entries(held, call, index, tokens[held, index], counts[held] + depth[held, index])


def groups(lengths: torch.Tensor):
    """Yield (length, member indices [G]) for the groups of entries with one prefix length, shortest first."""
    for length in torch.unique(lengths).tolist():
        yield int(length), (lengths == length).nonzero().squeeze(-1)


def prefix_ids(prompts: torch.Tensor, call_rows: torch.Tensor, tokens: torch.Tensor, length: int) -> torch.Tensor:
    """ids [G, P + length]: each member's prompt, then its first `length` generated-and-path tokens."""
    return torch.cat([prompts[call_rows], tokens[:, :length].to(prompts.device)], dim=1)


class PrefixLogits:
    """The target's logits hook (`mmspec.lm.LMTarget.logits_hook`): each verified entry's logits [V] become
    `rowwise(per_prefix(call rows, prefix ids, logits))` (float32), `per_prefix` called on groups of one prefix
    length, `rowwise` on all entries at once. Entries that are padding keep their logits (float32).

    `prompts` [B0, P]: the call rows' prompts as the functions read them. With `record`, `last_raw` and
    `last_processed` keep the last call's logits [B, S, V] before and after (for `output_logits` / `output_scores`).
    """

    def __init__(self, prompts: torch.Tensor, per_prefix: PrefixFn | None = None, rowwise: RowwiseFn | None = None,
                 record: bool = False) -> None:
        self.prompts = prompts
        self.per_prefix = per_prefix
        self.rowwise = rowwise
        self.record = record
        self.last_raw: torch.Tensor | None = None
        self.last_processed: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor, counts: torch.Tensor, draft: Draft | None,
                 row_ids: torch.Tensor | None) -> torch.Tensor:
        """logits [B, S, V] of the entries of `draft` over held rows with `generated` [B, T] / `counts` [B] ->
        processed float32 logits [B, S, V]."""
        out = logits.float()
        if self.per_prefix is not None:
            out = out.clone()
            entries = verified_entries(generated, counts, draft, row_ids)
            for length, members in groups(entries.lengths):
                held, index, call = entries.held_rows[members], entries.index[members], entries.call_rows[members]
                ids = prefix_ids(self.prompts, call, entries.tokens[members], length)
                out[held, index] = self.per_prefix(call, ids, out[held, index]).to(out.dtype)
        if self.rowwise is not None:
            out = self.rowwise(out.reshape(-1, out.shape[-1])).view(out.shape)
        if self.record:
            self.last_raw, self.last_processed = logits.float(), out
        return out


def first_stops(stops: StopFn, prompts: torch.Tensor, generated: torch.Tensor, before: torch.Tensor,
                after: torch.Tensor, row_ids: torch.Tensor | None) -> torch.Tensor:
    """[B] for each held row, the count it ends at: the first committed token j in [before, after) whose prefix
    (prompt + generated[:j + 1]) `stops` holds on, j + 1; -1 where none does."""
    b, device = generated.shape[0], generated.device
    first = torch.full((b,), -1, dtype=torch.long, device=device)
    new = after - before  # [B]
    if not bool((new > 0).any()):
        return first
    width = int(new.max())
    offsets = torch.arange(width, device=device)
    held, offset = (offsets.unsqueeze(0) < new.unsqueeze(-1)).nonzero(as_tuple=True)  # [M] each new token
    lengths = before[held] + offset + 1  # [M] prefix lengths
    call = held if row_ids is None else row_ids[held]
    hit = torch.zeros_like(lengths, dtype=torch.bool)
    for length, members in groups(lengths):
        ids = prefix_ids(prompts, call[members], generated[held[members]], length)
        hit[members] = stops(call[members].to(prompts.device), ids).to(device).bool()
    for i in hit.nonzero().squeeze(-1).tolist():  # (few hits: a row's first one wins)
        row, end = int(held[i]), int(lengths[i])
        if first[row] < 0 or end < first[row]:
            first[row] = end
    return first

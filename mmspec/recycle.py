"""Token Recycling: a training-free tree drafter that recycles the target's own candidate tokens.

Token Recycling (Luo et al. 2024, "Turning Trash into Treasure") keeps an adjacency table: for every token x, the
top `candidates` tokens the target ranked next after x the last time it scored a position holding x. Every verify
scores each draft node's next token anyway; those rankings, discarded by plain decoding, refresh the table (and a
plain step's too). A step drafts a tree from the table alone: the root is the row's last token, a node's children
are its token's ranked candidates, kept by rank as EAGLE-2 keeps its most probable nodes (`expand_eagle2` with the
rank's score -log(rank + 1)), so the tree has the shape the tree budget asks for (`full_shape`, `set_draft_size`).
A level reads each frontier node's candidates and a few filler ids (`AdjacencyTable.children`), never a [B, F, V]
tensor: the vocabulary's size costs nothing.

    table = AdjacencyTable(vocab_size=V, candidates=8)             # kept by the caller between calls
    drafter = TokenRecyclingDrafter(table, top_k=8, depth=6, total_tokens=48, banned_tokens=[image_token_id])
    out = generate(target, drafter, "lossless", inputs, batch_size=B, max_new_tokens=N)

A token the table has not seen yet has no candidates (its children score far below any known one, so a tree takes
them last). `banned_tokens` (a VLM's image placeholders) are never drafted. The drafts are deterministic functions
of the table, which holds only what earlier verifies computed, so tree verification keeps the target's law (and its
greedy output). Glossary: V vocabulary, C candidates per token, B rows, N tree nodes, F a level's frontier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mmspec.errors import check, check_positive_int
from mmspec.loop import DecodeState
from mmspec.tree import Children, DraftTree, SteeredTree, TreeShape, expand_eagle2, pool_size
from mmspec.verify import VerifyResult

UNSEEN = -1.0e4  # the score of an unseen token's children: below every known candidate's


class Fillers(NamedTuple):
    """`AdjacencyTable.fillers`: made once per call from the banned ids, so `children` reads them from here."""

    rank_lp: torch.Tensor  # [C] -log(rank + 1)
    pool: torch.Tensor  # [M] filler ids, the lowest first
    pool_lp: torch.Tensor  # [M] UNSEEN, a little lower each id; banned ones -inf
    banned: torch.Tensor  # [X] ids no draft may hold


class AdjacencyTable:
    """[V, C] the target's top-C next tokens after each token (-1: not seen yet)."""

    def __init__(self, vocab_size: int, candidates: int = 8, device: torch.device | str = "cpu") -> None:
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("candidates", candidates)
        self.next_tokens = torch.full((vocab_size, candidates), -1, dtype=torch.long, device=device)  # [V, C]

    @property
    def candidates(self) -> int:
        return self.next_tokens.shape[1]

    def to(self, device: torch.device | str) -> AdjacencyTable:
        """The table on `device` (kept between calls, it moves with the rows: the drafter's `begin` moves it)."""
        self.next_tokens = self.next_tokens.to(device)
        return self

    def update(self, tokens: torch.Tensor, next_probs: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Row x of the table <- the top-C of the target's next-token distribution after x, for tokens [...] and
        next_probs [..., V] where `keep` [...] (None: everywhere; a kept token is >= 0; a token scored twice keeps one
        of its rankings). The top-C is read in place: no copy of the kept rows' [V] distributions. The table is on
        tokens' device (`to`)."""
        table = self.next_tokens
        ranked = next_probs.topk(self.candidates, dim=-1).indices  # [..., C]
        if keep is None:
            table[tokens] = ranked
        else:
            table[tokens[keep]] = ranked[keep]  # [M, C]

    def children(self, tokens: torch.Tensor, fill: Fillers) -> Children:
        """The candidates of each of tokens [B, F] for a tree's top-k children, without a [B, F, V] tensor: its
        ranked next tokens at log-score -log(rank + 1) (fill's banned ones -inf), then the lowest other token ids at
        UNSEEN (an unseen token's children: below every known candidate), enough of them that k remain (`fill`: what
        `fillers(k, banned)` made)."""
        rank_lp, pool, pool_lp, banned = fill  # [C], [M], [M], [X]
        ranked = self.next_tokens[tokens]  # [B, F, C] (-1: not seen)
        usable = ranked >= 0 if banned.numel() == 0 else (ranked >= 0) & ~torch.isin(ranked, banned)  # [B, F, C]
        taken = (pool == ranked.unsqueeze(-1)).any(-2)  # [B, F, M] fillers that are candidates already
        logp = torch.cat([rank_lp.masked_fill(~usable, float("-inf")), pool_lp.masked_fill(taken, float("-inf"))], -1)
        return Children(logp, torch.cat([ranked, pool.expand(*tokens.shape, -1)], -1))  # [B, F, C + M] each

    def fillers(self, k: int, banned: torch.Tensor) -> Fillers:
        """What `children` needs beside the table for up to k children a node, on banned's device: rank log-scores,
        filler ids (the lowest first) at UNSEEN, banned ones -inf, and the banned ids themselves."""
        device = banned.device
        pool = torch.arange(min(k + self.candidates + banned.numel(), self.next_tokens.shape[0]), device=device)
        pool_lp = (UNSEEN - 1e-2 * pool.float()).masked_fill(torch.isin(pool, banned), float("-inf"))
        return Fillers(-torch.log1p(torch.arange(self.candidates, dtype=torch.float32, device=device)), pool, pool_lp,
                       banned)


class TokenRecyclingDrafter(SteeredTree):
    """Token Recycling as a loop tree drafter over a shared `AdjacencyTable` (see the module docstring); top_k
    children per frontier node, depth levels, total_tokens nodes with the root; a budget steers it (`SteeredTree`)."""

    forwards = 0  # no model of its own

    def __init__(self, table: AdjacencyTable, top_k: int = 8, depth: int = 6, total_tokens: int = 48,
                 banned_tokens: Sequence[int] = ()) -> None:
        for name, value in (("top_k", top_k), ("depth", depth)):
            check_positive_int(name, value)
        check_positive_int("total_tokens", total_tokens, minimum=2)
        check(top_k <= table.candidates, f"top_k ({top_k}) must be <= the table's candidates ({table.candidates}).")
        check(total_tokens <= pool_size(top_k, depth),
              f"total_tokens={total_tokens} exceeds what depth={depth}, top_k={top_k} can hold.")
        self.table = table
        self.full_shape = TreeShape(top_k, depth, total_tokens)
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.banned = torch.tensor(sorted({int(t) for t in banned_tokens}), dtype=torch.long)
        self.fill = table.fillers(top_k, self.banned)  # (`begin` remakes it on the rows' device)

    @property
    def max_draft_nodes(self) -> int:
        return self.full_shape.total

    def begin(self, inputs: object, state: DecodeState) -> None:
        """The table, the banned ids and the fillers move to the rows' device (a step may draft before any update)."""
        device = state.done.device
        self.table.to(device)
        self.banned = self.banned.to(device)
        self.fill = self.table.fillers(self.full_shape.top_k, self.banned)

    def propose(self, state: DecodeState) -> DraftTree:
        def score(tokens: torch.Tensor, ids: torch.Tensor, parent_ids: torch.Tensor, depth: int) -> Children:
            return self.table.children(tokens, self.fill)  # [B, F, C + M]

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)

    def observe(self, state: DecodeState, draft: DraftTree, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        """Recycle the verify's rankings: each scored node's token gets its next-token distribution's top-C."""
        keep = draft.valid & active.unsqueeze(-1)  # [B, N]
        self.table.update(draft.tokens, target_probs, keep)  # [B, N], [B, N, V], [B, N]

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor, target_probs: torch.Tensor) -> None:
        """A plain step scored the last token: recycle its ranking too."""
        self.table.update(state.last_token, target_probs[:, 0], active)  # [B], [B, V], [B]

    def select_rows(self, rows: torch.Tensor) -> None:
        """The loop dropped finished rows: nothing per row to drop (the table is the model's)."""

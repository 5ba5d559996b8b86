"""Token Recycling: a training-free tree drafter that recycles the target's own candidate tokens.

Token Recycling (Luo et al. 2024, "Turning Trash into Treasure") keeps an adjacency table: for every token x, the
top `candidates` tokens the target ranked next after x the last time it scored a position holding x. Every verify
scores each draft node's next token anyway; those rankings, discarded by plain decoding, refresh the table (and a
plain step's too). A step drafts a tree from the table alone: the root is the row's last token, a node's children
are its token's ranked candidates, kept by rank as EAGLE-2 keeps its most probable nodes (`expand_eagle2` with the
rank's score -log(rank + 1)), so the tree has the shape the tree budget asks for (`full_shape`, `set_draft_size`).

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

import torch

from mmspec.errors import check, check_positive_int
from mmspec.loop import DecodeState
from mmspec.tree import DraftTree, SteeredTree, TreeShape, expand_eagle2, pool_size
from mmspec.verify import VerifyResult

UNSEEN = -1.0e4  # the score of an unseen token's children: below every known candidate's


class AdjacencyTable:
    """[V, C] the target's top-C next tokens after each token (-1: not seen yet)."""

    def __init__(self, vocab_size: int, candidates: int = 8, device: torch.device | str = "cpu") -> None:
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("candidates", candidates)
        self.next_tokens = torch.full((vocab_size, candidates), -1, dtype=torch.long, device=device)  # [V, C]

    @property
    def candidates(self) -> int:
        return self.next_tokens.shape[1]

    def update(self, tokens: torch.Tensor, next_probs: torch.Tensor) -> None:
        """Row x of the table <- the top-C of the target's next-token distribution after x, for tokens [M] (>= 0)
        and next_probs [M, V] (a token scored twice keeps one of its rankings)."""
        table = self.next_tokens
        if table.device != tokens.device:
            self.next_tokens = table = table.to(tokens.device)
        table[tokens] = next_probs.topk(self.candidates, dim=-1).indices  # [M, C]

    def scores(self, tokens: torch.Tensor, vocab_size: int, banned: torch.Tensor) -> torch.Tensor:
        """[..., V] log-scores of each token's children: -log(rank + 1) for its candidates, UNSEEN elsewhere, -inf
        for banned tokens; tokens [...]."""
        ranked = self.next_tokens[tokens.clamp_min(0)]  # [..., C]
        rank_scores = -torch.log1p(torch.arange(self.candidates, dtype=torch.float32, device=tokens.device))  # [C]
        out = torch.full((*tokens.shape, vocab_size), UNSEEN, device=tokens.device)  # [..., V]
        known = ranked >= 0  # [..., C]
        out.scatter_(-1, ranked.clamp_min(0), torch.where(known, rank_scores, UNSEEN))
        if banned.numel():
            out[..., banned] = float("-inf")
        return out


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
        self.vocab_size = table.next_tokens.shape[0]

    @property
    def max_draft_nodes(self) -> int:
        return self.full_shape.total

    def begin(self, inputs: object, state: DecodeState) -> None:
        self.banned = self.banned.to(state.done.device)

    def propose(self, state: DecodeState) -> DraftTree:
        def score(tokens: torch.Tensor, ids: torch.Tensor, parent_ids: torch.Tensor, depth: int) -> torch.Tensor:
            return self.table.scores(tokens, self.vocab_size, self.banned)  # [B, F, V]

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)

    def observe(self, state: DecodeState, draft: DraftTree, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        """Recycle the verify's rankings: each scored node's token gets its next-token distribution's top-C."""
        keep = draft.valid & active.unsqueeze(-1)  # [B, N]
        self.table.update(draft.tokens[keep], target_probs[keep])

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor, target_probs: torch.Tensor) -> None:
        """A plain step scored the last token: recycle its ranking too."""
        self.table.update(state.last_token[active], target_probs[:, 0][active])

    def select_rows(self, rows: torch.Tensor) -> None:
        """The loop dropped finished rows: nothing per row to drop (the table is the model's)."""
